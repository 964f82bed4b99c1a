"""Qwen3-Next and Qwen3.5/3.6-MoE (Gated DeltaNet + gated attention hybrids) end to end against transformers.

Tiny models saved by transformers, with every layer kind: linear (Gated DeltaNet) and full attention with its output
gate and partial rotary, zero-centred norms with random weights, a shared expert with its gate, a dense layer
(Qwen3-Next's mlp_only_layers). The Qwen3.5 wrapper is the text model's checkpoint rewritten as the Hub ships
Qwen3.6-35B-A3B: config.json nests it under `text_config` beside a `vision_config`, tensors under
`model.language_model.`, a vision tower and an MTP layer the engine must skip. Also: cached at several slot
counts == resident, a chat's prefix reuse == a fresh prefill token for token, and a missing recurrent tensor or a
recurrent tensor of the wrong size is one typed line.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moechat.engine.cache.provider import CacheConfig
from moechat.engine.errors import CheckpointError
from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, do_sample=False)
LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, initializer_range=0.2, max_position_embeddings=512, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            layer_types=LAYERS, partial_rotary_factor=0.5)
VARIANTS = {
    "qwen3_next": ("qwen3_next", dict(intermediate_size=48, mlp_only_layers=[2], norm_topk_prob=True)),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", {}),
    "qwen3_5_moe": ("qwen3_5_moe_text", {}),  # rewritten into the multimodal wrapper's spelling
}


def _wrap(path, text_config: dict) -> None:
    """The text checkpoint as the Hub's Qwen3.6 is: nested config, model.language_model.*, a vision tower, MTP."""
    tensors = load_file(str(path / "model.safetensors"))
    out = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): t
           for n, t in tensors.items()}
    out["model.visual.patch_embed.proj.weight"] = torch.randn(16, 3, 2, 4, 4)
    out["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(48, 16)
    out["mtp.fc.weight"] = torch.randn(64, 128)
    out["mtp.layers.0.input_layernorm.weight"] = torch.randn(64)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    text = {**text_config, "model_type": "qwen3_5_moe_text", "mtp_num_hidden_layers": 1,
            "rope_parameters": {**text_config["rope_parameters"], "mrope_interleaved": True,
                                "mrope_section": [2, 1, 1]}}
    wrapper = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
               "text_config": text, "tie_word_embeddings": False, "image_token_id": 250,
               "vision_config": {"depth": 1, "hidden_size": 16, "model_type": "qwen3_5_moe", "out_hidden_size": 64}}
    (path / "config.json").write_text(json.dumps(wrapper, indent=2))


def build_variant(path, name: str, seed: int):
    import transformers

    model_type, overrides = VARIANTS[name]
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers starts the norms at 0 (1 + w) and dt_bias at 1: make every weight count
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) * 0.3)
            elif n.endswith("A_log"):
                p.copy_(torch.rand_like(p) * 2 - 1)
    model.save_pretrained(path)
    if name == "qwen3_5_moe":
        _wrap(path, json.loads((path / "config.json").read_text()))
    return model


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            built[name] = (path, build_variant(path, name, seed=list(VARIANTS).index(name)))
        return built[name]

    return get


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def _greedy(engine, ids, n=24, sequence=None):
    return [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=n, sequence=sequence) for t in c.token_ids]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers_prefill_and_decode(variants, name):
    path, ref = variants(name)
    engine = Engine.load(path, dtype="float32", prefill_chunk=32)  # 70 tokens: chunks of 32, 32, 6
    for n in (1, 5, 63, 70):
        ids = _prompt(n, seed=n)
        with torch.inference_mode():
            ours = engine._forward(engine.new_sequence(), ids)
            theirs = ref(torch.tensor([ids])).logits[0, -1]
        err = (ours - theirs).abs().max().item()
        assert err < 1e-4, f"{name}, {n} tokens: max |logit diff| {err:.2e}"
    seq = engine.new_sequence()
    with torch.inference_mode():
        logits = engine._forward(seq, _prompt(5, seed=7))
        for step in range(6):
            theirs = ref(torch.tensor([seq.tokens])).logits[0, -1]
            err = (logits - theirs).abs().max().item()
            assert err < 1e-4, f"{name}, decode step {step}: {err:.2e}"
            logits = engine._forward(seq, [int(logits.argmax())])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_tokens_match_transformers_generate(variants, name):
    path, ref = variants(name)
    engine = Engine.load(path, dtype="float32", prefill_chunk=16)
    ids = _prompt(21, seed=121)
    ours = _greedy(engine, ids, 24)
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24, min_new_tokens=0, pad_token_id=0)
    assert ours == out[0, len(ids):].tolist()


def test_wrapper_runs_text_only_with_one_line(variants):
    path, _ = variants("qwen3_5_moe")
    engine = Engine.load(path, dtype="float32")
    lines = [n for n in engine.notices if "text-only" in n]
    assert len(lines) == 1 and "2 tensors" in lines[0], engine.notices


@pytest.mark.parametrize("name,slots,prefetch", [("qwen3_next", 2, "off"), ("qwen3_next", 5, "both"),
                                                  ("qwen3_5_moe", 3, "both"), ("qwen3_5_moe", 8, "off")])
def test_cached_matches_resident(variants, name, slots, prefetch):
    path, _ = variants(name)
    ids = _prompt(19, seed=5)
    resident = _greedy(Engine.load(path, dtype="float32"), ids, 12)
    engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=slots, ram_cache_bytes=0,
                                                                  prefetch=prefetch))
    assert _greedy(engine, ids, 12) == resident
    snap = engine.cache_snapshot()
    asked = [h + m for h, m in zip(snap.hits, snap.misses, strict=True)]
    dense = [2] if name == "qwen3_next" else []  # qwen3_next's mlp_only layer has no routed experts: never asked
    assert [i for i, n in enumerate(asked) if n == 0] == dense, asked


def test_prefix_reuse_equals_fresh_prefill(variants):
    """Turn 2 of a chat reuses turn 1's state (the end state, or the snapshot 8 tokens before the prompt's end); its
    tokens == a fresh prefill of the whole prompt, for a prefix that extends the state, one that ends between the
    snapshot and the state, and one that ends before any snapshot."""
    path, _ = variants("qwen3_next")
    engine = Engine.load(path, dtype="float32", prefill_chunk=16)
    first = _prompt(23, seed=1)
    seq = engine.new_sequence()
    reply = _greedy(engine, first, 8, sequence=seq)
    history = first + reply[:-1]  # what the state holds: the last sampled token was never fed
    assert seq.tokens == history
    cases = {
        "extends the end state": history + _prompt(9, seed=2),
        "diverges in the reply (back to the prompt's snapshot)": first + reply[:3] + _prompt(6, seed=3),
        "diverges at the prompt's end (a re-rendered opening)": first[:-2] + _prompt(6, seed=5),
        "diverges in the prompt (fresh prefill)": first[:10] + _prompt(12, seed=4),
    }
    expected_keep = {"extends the end state": len(history),
                     "diverges in the reply (back to the prompt's snapshot)": len(first) - 8,
                     "diverges at the prompt's end (a re-rendered opening)": len(first) - 8,
                     "diverges in the prompt (fresh prefill)": 0}
    for what, ids in cases.items():
        fresh = _greedy(engine, ids, 10)
        s = engine.new_sequence()
        _greedy(engine, first, 8, sequence=s)
        common = next((i for i, (a, b) in enumerate(zip(s.tokens, ids, strict=False)) if a != b),
                      min(len(s.tokens), len(ids)))
        keep = s.truncate(min(common, len(ids) - 1))
        assert keep == expected_keep[what], what
        assert _greedy(engine, ids[keep:], 10, sequence=s) == fresh, what


def test_turns_reuse_and_match_fresh(variants):
    """Three turns over raw token ids, each truncated to its shared prefix as Conversation.send and the server's
    --prefix-cache do (the tiny model has no chat template): each prefills only past the reused state, and its
    reply is the one a fresh sequence gives."""
    path, _ = variants("qwen3_5_moe")
    engine = Engine.load(path, dtype="float32", prefill_chunk=16)
    seq = engine.new_sequence()
    turns = [_prompt(17, seed=10), _prompt(5, seed=11), _prompt(7, seed=12)]
    ids: list[int] = []
    for turn in turns:
        ids = ids + turn
        keep = seq.truncate(min(len(seq.tokens), len(ids) - 1))
        got = _greedy(engine, ids[keep:], 6, sequence=seq)
        assert got == _greedy(engine, ids, 6)
        ids = ids + got
        assert keep > 0 or turn is turns[0]


def test_state_rewinds_after_a_failed_forward(variants):
    """An error between the first and last layer leaves the recurrent states ahead of kv.length: the next truncate
    goes back to a snapshot, never continues from the half-moved state."""
    path, _ = variants("qwen3_next")
    engine = Engine.load(path, dtype="float32")
    seq = engine.new_sequence()
    prompt = _prompt(12, seed=20)
    with torch.inference_mode():
        engine._forward(seq, prompt)
        seq.kv.consistent = False  # as a forward that raised in its middle leaves it
        keep = seq.truncate(len(seq.tokens))
    assert keep == len(prompt) - 8  # the prompt's snapshot, 8 tokens before its end: states restored there
    assert _greedy(engine, prompt[keep:] + [5, 6], 6, sequence=seq) == _greedy(engine, prompt + [5, 6], 6)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("damage", ["missing", "wrong size"])
def test_damaged_recurrent_tensor_is_one_typed_line(variants, name, damage, tmp_path):
    path, _ = variants(name)
    tensors = load_file(str(path / "model.safetensors"))
    prefix = "model.language_model." if name == "qwen3_5_moe" else "model."
    target = prefix + ("layers.2.linear_attn.A_log" if damage == "missing" else "layers.3.linear_attn.conv1d.weight")
    if damage == "missing":
        del tensors[target]
    else:
        tensors[target] = tensors[target][..., :3].contiguous()  # a conv window of 3, not 4
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError) as e:
        Engine.load(tmp_path, dtype="float32")
    assert target in str(e.value) and "\n" not in str(e.value)


def test_bf16_cached_matches_resident(variants):
    """bf16, as the real checkpoints ship: the recurrent states stay fp32 and the cache changes no token."""
    path, _ = variants("qwen3_5_moe")
    ids = _prompt(37, seed=30)
    resident = _greedy(Engine.load(path, dtype="bfloat16", prefill_chunk=16), ids, 12)
    cached = Engine.load(path, dtype="bfloat16", prefill_chunk=16,
                         cache=CacheConfig(expert_slots=3, ram_cache_bytes=0))
    assert _greedy(cached, ids, 12) == resident
    seq = cached.new_sequence()
    assert all(seq.kv.state[i]["ssm"].dtype == torch.float32 for i in seq.kv.recurrent_layers)
    assert seq.kv.k[0].shape[1] == 0 and seq.kv.k[1].shape[1] == cached.context  # no KV for a linear layer


def test_host_embeddings_apply_and_keep_the_tokens(variants):
    """--embeddings host moves a hybrid model's table to RAM too (its own forward looks rows up by `embed`), so the
    VRAM the plan gives to slots is really freed; the tokens are the same."""
    path, _ = variants("qwen3_next")
    ids = _prompt(9, seed=7)
    want = _greedy(Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=3)), ids, 8)
    engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=3, embeddings="host"))
    assert engine.model.embed_host is not None
    assert _greedy(engine, ids, 8) == want
