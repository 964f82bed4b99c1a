"""Nemotron-H (Mamba-2 + attention + ungated relu^2 MoE) end to end against transformers.

A tiny model built by transformers' NemotronHConfig with every layer kind (M Mamba-2, * attention, E MoE, - MLP),
grouped sigmoid routing with a correction bias and a scaling factor, saved with save_pretrained and its config.json
rewritten in the Hub's spelling (`hybrid_override_pattern`, as nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B ships it).
Also: cached at several slot counts == resident; int8/int4 experts (w13 = up alone, [I, H]) against the slow
reference over their dequantized weights; the ungated model never takes the fused native decode; prefix reuse ==
fresh prefill; a missing Mamba tensor is one typed line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moechat.engine.cache.provider import CacheConfig
from moechat.engine.errors import CheckpointError, ConfigError
from moechat.engine.layers import experts
from moechat.engine.layers.moe import RELU2, SWIGLU, ExpertBatch, moe_reference
from moechat.engine.quant.registry import get_format
from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, do_sample=False)
PATTERN = "M*EM-EM"
TINY = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=48, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4,
            chunk_size=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1, routed_scaling_factor=2.5,
            initializer_range=0.2, max_position_embeddings=512)


def build(path, seed: int = 0, **overrides):
    import transformers

    config = transformers.NemotronHConfig(hybrid_override_pattern=PATTERN, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms at 1, D at 1, the correction bias at 0: random, so every weight counts
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(".D"):
                p.copy_(1 + torch.randn_like(p) * 0.3)
            elif n.endswith("A_log"):
                p.copy_(torch.rand_like(p) * 2 - 1)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    model.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw.pop("layers_block_type")  # the Hub's config: the pattern string and the layer count
    raw.pop("time_step_limit", None)
    raw.update(hybrid_override_pattern=PATTERN, num_hidden_layers=len(PATTERN))
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return model


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotron_h")
    return path, build(path)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def _greedy(engine, ids, n=16, sequence=None):
    return [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=n, sequence=sequence) for t in c.token_ids]


def test_logits_match_transformers_prefill_and_decode(tiny):
    path, ref = tiny
    engine = Engine.load(path, dtype="float32", prefill_chunk=32)  # 41 tokens: chunks of 32 and 9
    for n in (1, 5, 17, 41):
        ids = _prompt(n, seed=n)
        with torch.inference_mode():
            ours = engine._forward(engine.new_sequence(), ids)
            theirs = ref(torch.tensor([ids])).logits[0, -1]
        err = (ours - theirs).abs().max().item()
        assert err < 1e-4, f"{n} tokens: max |logit diff| {err:.2e}"
    seq = engine.new_sequence()
    with torch.inference_mode():
        logits = engine._forward(seq, _prompt(6, seed=7))
        for step in range(5):
            theirs = ref(torch.tensor([seq.tokens])).logits[0, -1]
            err = (logits - theirs).abs().max().item()
            assert err < 1e-4, f"decode step {step}: {err:.2e}"
            logits = engine._forward(seq, [int(logits.argmax())])


def test_a_time_step_limit_in_the_config_clamps_dt_as_transformers_prefill_does(tmp_path):
    """time_step_limit = [lo, hi] in config.json clamps every token's dt: transformers' chunked scan (a prompt) applies
    it too, so prefill logits agree; without the clamp they would not (the limit is set inside dt's range here)."""
    import transformers

    path = tmp_path / "limited"
    ref = build(path, seed=3, time_step_limit=(0.5, 1.5))
    raw = json.loads((path / "config.json").read_text())
    raw["time_step_limit"] = [0.5, 1.5]
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    ids = _prompt(9, seed=9)
    engine = Engine.load(path, dtype="float32")
    with torch.inference_mode():
        ours = engine._forward(engine.new_sequence(), ids)
        theirs = ref(torch.tensor([ids])).logits[0, -1]
        unclamped = transformers.AutoModelForCausalLM.from_pretrained(path, time_step_limit=(0.0, float("inf")))
        loose = unclamped.eval()(torch.tensor([ids])).logits[0, -1]
    assert (ours - theirs).abs().max().item() < 1e-4
    assert (ours - loose).abs().max().item() > 1e-3  # the clamp changed something
    for bad in ([1.0], [0.2, 0.1], ["a", 1.0], -1):
        raw["time_step_limit"] = bad
        (path / "config.json").write_text(json.dumps(raw, indent=2))
        with pytest.raises(ConfigError, match="time_step_limit"):
            Engine.load(path, dtype="float32")


def test_greedy_tokens_match_transformers_generate(tiny):
    path, ref = tiny
    engine = Engine.load(path, dtype="float32", prefill_chunk=16)
    ids = _prompt(19, seed=121)
    ours = _greedy(engine, ids, 16)
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16, min_new_tokens=0, pad_token_id=0)
    assert ours == out[0, len(ids):].tolist()


@pytest.mark.parametrize("slots,prefetch,on_miss,host_layers", [(2, "off", "load", 0), (3, "both", "load", 0),
                                                              (8, "off", "load", 0), (2, "off", "host", 1),
                                                              (3, "off", "auto", 0)])
def test_cached_matches_resident(tiny, slots, prefetch, on_miss, host_layers):
    """The slot cache, prefetch and hybrid execution (misses computed from the RAM tier, the first MoE layer kept on
    the host) change no token, and only the E layers ever ask for experts."""
    path, _ = tiny
    ids = _prompt(13, seed=5)
    resident = _greedy(Engine.load(path, dtype="float32"), ids, 10)
    ram = 0 if on_miss == "load" else None  # hybrid computes misses from a RAM tier that holds every expert
    engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=slots, ram_cache_bytes=ram,
                                                                  prefetch=prefetch, on_miss=on_miss,
                                                                  host_layers=host_layers))
    assert _greedy(engine, ids, 10) == resident
    snap = engine.cache_snapshot()
    asked = [h + m for h, m in zip(snap.hits, snap.misses, strict=True)]
    moe = [i for i, c in enumerate(PATTERN) if c == "E"]
    assert [i for i, n in enumerate(asked) if n] == moe, asked  # only the E layers ever ask for experts


def test_ungated_experts_are_stored_up_only(tiny):
    path, _ = tiny
    engine = Engine.load(path, dtype="float32")
    w = engine.loaded.provider._tensors[2]
    assert w["w13"].shape == (8, 32, 64) and w["w2"].shape == (8, 64, 32)  # [E, I, H]: no gate rows
    assert get_format("int4").expert_bytes(64, 32, torch.float32, False, gated=False) == \
        2 * (32 * 64 // 2 + 32 * 64 // 32 * 2)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_experts_match_their_dequantized_reference(tiny, fmt, monkeypatch):
    """Every projection through the format's own compute (one token and a chunk) == moe_reference over the format's
    dequantized weights; a whole generation in that format takes the general path, never the fused decode, and
    cached (3 slots over the repacked file) == resident."""
    path, _ = tiny
    engine = Engine.load(path, dtype="float32", expert_format=fmt)
    provider = engine.loaded.provider
    assert provider.format.name == fmt
    f = provider.format
    ts = provider._tensors[5]
    assert ts["w13_q"].shape[1] == 32  # I rows of up, not 2I
    E = ts["w2_q"].shape[0]
    w13 = torch.stack([f.weight({k: v[e] for k, v in ts.items()}, "w13", torch.float32) for e in range(E)])
    w2 = torch.stack([f.weight({k: v[e] for k, v in ts.items()}, "w2", torch.float32) for e in range(E)])
    g = torch.Generator().manual_seed(3)
    for T in (1, 7):
        x = torch.randn(T, 64, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])  # [T, 2]
        w = torch.rand(T, 2, generator=g)
        batch = ExpertBatch(ts, ids, ids, format=f)
        contrib = torch.zeros(T * 2, 64)
        experts.expert_compute(x, w, batch, act=RELU2, contrib=contrib)
        got = contrib.view(T, 2, 64).sum(1)
        want = moe_reference(x, w, ids, w13, w2, act=RELU2)
        assert (got - want).abs().max().item() < 2e-4, (fmt, T)
    calls = []
    real = experts.native.moe_decode
    monkeypatch.setattr(experts.native, "moe_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = _prompt(9, seed=9)
    want = _greedy(engine, ids, 6)
    assert calls == []  # ungated: the general path, every step
    # the condition is the activation: the same one-token batch with a gated kind does reach the fused kernel
    x, w, pair = torch.randn(1, 64), torch.rand(1, 2), torch.tensor([[0, 3]])
    batch = ExpertBatch(ts, pair, pair, format=f)
    contrib = torch.zeros(2, 64)
    assert not experts._native_moe(x, w, batch, RELU2, contrib, [0, 3], range(2))
    if experts.native.library() is not None:
        assert experts._native_moe(x, w, batch, SWIGLU, contrib, [0, 3], range(2)) and calls
    cached = Engine.load(path, dtype="float32", expert_format=fmt, cache=CacheConfig(expert_slots=3, ram_cache_bytes=0))
    assert _greedy(cached, ids, 6) == want


def test_prefix_reuse_equals_fresh_prefill(tiny):
    """Turn 2 reuses turn 1's Mamba states (the end state, or the snapshot 8 tokens before the prompt's end); its
    tokens == a fresh prefill, for a prefix that extends the state, one that diverges in the reply, and one that
    diverges in the prompt."""
    path, _ = tiny
    engine = Engine.load(path, dtype="float32", prefill_chunk=16)
    first = _prompt(21, seed=1)
    seq = engine.new_sequence()
    reply = _greedy(engine, first, 6, sequence=seq)
    history = first + reply[:-1]
    cases = {"extends": (history + _prompt(7, seed=2), len(history)),
             "diverges in the reply": (first + reply[:2] + _prompt(5, seed=3), len(first) - 8),
             "diverges in the prompt": (first[:9] + _prompt(10, seed=4), 0)}
    for what, (ids, expected) in cases.items():
        fresh = _greedy(engine, ids, 8)
        s = engine.new_sequence()
        _greedy(engine, first, 6, sequence=s)
        common = next((i for i, (a, b) in enumerate(zip(s.tokens, ids, strict=False)) if a != b),
                      min(len(s.tokens), len(ids)))
        keep = s.truncate(min(common, len(ids) - 1))
        assert keep == expected, what
        assert _greedy(engine, ids[keep:], 8, sequence=s) == fresh, what


def test_state_is_mamba_only_and_kv_is_attention_only(tiny):
    path, _ = tiny
    engine = Engine.load(path, dtype="float32")
    kv = engine.new_sequence().kv
    assert kv.recurrent_layers == [i for i, c in enumerate(PATTERN) if c == "M"]
    assert kv.state[0]["ssm"].shape == (8, 8, 16) and kv.state[0]["conv"].shape == (8 * 8 + 2 * 2 * 16, 3)
    assert [i for i, k in enumerate(kv.k) if k.numel()] == [1]  # the one attention layer caches K/V


@pytest.mark.parametrize("damage", ["missing", "wrong size"])
def test_damaged_mamba_tensor_is_one_typed_line(tiny, damage, tmp_path):
    path, _ = tiny
    tensors = load_file(str(path / "model.safetensors"))
    target = "backbone.layers.3." + ("mixer.A_log" if damage == "missing" else "mixer.conv1d.weight")
    if damage == "missing":
        del tensors[target]
    else:
        tensors[target] = tensors[target][..., :3].contiguous()  # a conv window of 3, not 4
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError) as e:
        Engine.load(tmp_path, dtype="float32")
    assert target in str(e.value) and "\n" not in str(e.value)


# -- fit: the plan from config.json alone ------------------------------------------------------------------------

REAL = Path(__file__).resolve().parents[2].parent / "shared" / "model-configs" / \
    "nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B" / "config.json"


@pytest.mark.skipif(not REAL.is_file(), reason="../shared/model-configs has no Nemotron-3-Nano config")
def test_fit_counts_mamba_state_attention_kv_and_e_layers_only():
    """The real config's plan: K/V for the 6 attention layers only, the 23 Mamba layers' fp32 states (+ conv windows)
    times the copies the sequence state keeps, experts (up + down) in the 23 E layers, and dense bytes equal to the
    model's own tensors (a meta-device build)."""
    from moechat.engine.layers.kv_cache import MAX_SNAPSHOTS
    from moechat.engine.models.nemotron_h import NemotronHForCausalLM
    from moechat.engine.plan.spec_config import spec_from_config

    raw = json.loads(REAL.read_text())
    spec = spec_from_config(raw)
    pattern = raw["hybrid_override_pattern"]
    assert spec.moe_layers == tuple(i for i, c in enumerate(pattern) if c == "E") and len(spec.moe_layers) == 23
    assert spec.kv_elems_full == 6 * 2 * 2 * 128 and spec.kv_elems_window == 0  # 6 KiB a token in bf16
    one = 23 * (64 * 64 * 128 * 4 + (64 * 64 + 2 * 8 * 128) * 3 * 2)
    assert spec.recurrent_state_bytes == one * (1 + MAX_SNAPSHOTS)
    assert [t.name for t in spec.expert_tensors] == ["up_proj.weight", "down_proj.weight"]
    assert spec.stored_expert_bytes == 2 * 2688 * 1856 * 2 and spec.expert_params == 2 * 2688 * 1856
    args = NemotronHForCausalLM.args_class.from_dict(raw)
    fp32 = NemotronHForCausalLM.fp32_weights
    model = sum(math.prod(s) * (4 if n.endswith(fp32) else 2)
                for n, s in NemotronHForCausalLM.dense_weight_names(args).items())
    assert sum(b for _, b in spec.dense_parts) == model


def test_fit_of_the_tiny_model_matches_its_sequence_state(tiny):
    """transformers 5's own spelling (layers_block_type, no num_hidden_layers) plans the same layers, and the
    state bytes of one copy are what the engine's sequence state allocates."""
    from moechat.engine.layers.kv_cache import MAX_SNAPSHOTS
    from moechat.engine.plan.spec_config import spec_from_config

    path, ref = tiny
    raw = json.loads((path / "config.json").read_text())
    blocks = ref.config.to_dict()["layers_block_type"]
    spelled = {k: v for k, v in raw.items() if k not in ("hybrid_override_pattern", "num_hidden_layers")}
    spec, spec5 = spec_from_config(raw), spec_from_config({**spelled, "layers_block_type": blocks})
    assert spec.moe_layers == spec5.moe_layers == (2, 5)
    assert spec.recurrent_state_bytes == spec5.recurrent_state_bytes
    kv = Engine.load(path, dtype="float32").new_sequence().kv
    assert spec.recurrent_state_bytes == kv.state_nbytes() * (1 + MAX_SNAPSHOTS)
    assert spec.kv_elems_full * 4 * kv.max_tokens == sum(t.numel() * 4 for t in kv.k + kv.v)


# -- the chat template: byte-identical to transformers, its reasoning switch included ------------------------------

TEMPLATE = Path(__file__).resolve().parents[2].parent / "shared" / "chat-templates" / \
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja"
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Calling.", "reasoning_content": "Need the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                      "arguments": {"city": "Paris", "days": [1, 2]}}}]},
    {"role": "tool", "content": "21C"},
    {"role": "assistant", "content": "<think>hot?</think>21C."},
    {"role": "user", "content": "Thanks ☀️"},
]


@pytest.mark.skipif(not TEMPLATE.is_file(), reason="../shared/chat-templates has no Nemotron template")
@pytest.mark.parametrize("switch", [{}, {"enable_thinking": True}, {"enable_thinking": False},
                                    {"enable_thinking": False, "truncate_history_thinking": False}])
def test_chat_template_matches_transformers_with_its_reasoning_switch(switch):
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from moechat.engine.text.chat_template import ChatTemplate
    from moechat.engine.text.reasoning import THINK_TAGS, make_parser, reasoning_format

    source = TEMPLATE.read_text(encoding="utf-8")
    tokens = {"bos_token": "<s>", "eos_token": "<|im_end|>"}
    backend = Tokenizer(WordLevel({"<unk>": 0, "<s>": 1, "<|im_end|>": 2}, unk_token="<unk>"))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=source, **tokens)
    ours = ChatTemplate.from_string(source, tokens)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                               "parameters": {"type": "object", "required": ["city"],
                                                              "properties": {"city": {"type": "string"}}}}}]
    for gen in (True, False):
        want = hf.apply_chat_template(CHAT, tools=tools, tokenize=False, add_generation_prompt=gen, **switch)
        assert ours.render(CHAT, tools=tools, add_generation_prompt=gen, **switch) == want
    prompt = ours.render(CHAT, add_generation_prompt=True, **switch)
    thinking = switch.get("enable_thinking", True)
    assert prompt.endswith("<think>\n" if thinking else "<think></think>")
    assert reasoning_format(source) == THINK_TAGS
    parser = make_parser(THINK_TAGS, prompt[-30:])
    delta, rest = parser.feed("Hmm.</think>Welcome." if thinking else "Welcome."), parser.flush()
    assert (delta.thinking + rest.thinking, delta.answer + rest.answer) == ("Hmm." if thinking else "", "Welcome.")


# -- FP8 experts as a block-scaled checkpoint ships them, and converted ------------------------------------------

def _fp8_pair(tiny, root, block=(24, 24)):
    """The tiny checkpoint with its routed experts in FP8 (block 24 x 24: partial blocks on I = 32 and H = 64), and
    the same model with those experts dequantized (the reference)."""
    from moechat.engine.quant.fp8 import dequantize_blocks, quantize_blocks

    path, _ = tiny
    tensors = load_file(str(path / "model.safetensors"))
    fp8, deq = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if ".mixer.experts." in name:
            q, scale = quantize_blocks(w, block)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            deq[name] = dequantize_blocks(q, scale, block)
    raw = json.loads((path / "config.json").read_text())
    out = []
    for what, ts, config in (("fp8", fp8, {**raw, "quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block), "activation_scheme": "dynamic"}}),
                             ("deq", deq, raw)):
        d = root / what
        d.mkdir()
        save_file(ts, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(config))
        out.append(d)
    return out


def test_fp8_experts_match_their_dequantized_weights_and_convert(tiny, tmp_path):
    fp8, deq = _fp8_pair(tiny, tmp_path)
    ours, ref = Engine.load(fp8, dtype="float32"), Engine.load(deq, dtype="float32")
    assert ours.loaded.provider.format.name == "fp8"
    ts = ours.loaded.provider._tensors[2]
    assert ts["w13"].shape == (8, 32, 64) and ts["w13_scale"].shape == (8, 2, 3)  # up alone, its own 2 x 3 blocks
    for n in (1, 9):
        ids = _prompt(n, seed=40 + n)
        with torch.inference_mode():
            err = (ours._forward(ours.new_sequence(), ids) - ref._forward(ref.new_sequence(), ids)).abs().max().item()
        assert err < 1e-4, (n, err)
    ids = _prompt(11, seed=44)
    assert _greedy(ours, ids, 8) == _greedy(ref, ids, 8)
    # FP8 -> int4 (dequantized, then quantized as the repacked file is written) == int4 from the dequantized weights
    a = Engine.load(fp8, dtype="float32", expert_format="int4")
    b = Engine.load(deq, dtype="float32", expert_format="int4")
    assert all(torch.equal(a.loaded.provider._tensors[2][k], b.loaded.provider._tensors[2][k])
               for k in ("w13_q", "w13_scale", "w2_q", "w2_scale"))
    assert _greedy(a, ids, 8) == _greedy(b, ids, 8)


def test_reference_mamba_path_matches_the_fast_one(tiny, monkeypatch):
    """The token-by-token conv and scan (Mamba2Mixer.reference) == the chunked SSD prefill and the step, at 1, a
    chunk - 1, a chunk + 1 (mamba2.CHUNK) tokens, and over decode steps after them."""
    from moechat.engine.models import mamba2
    from moechat.engine.models.nemotron_h import Mamba2Mixer

    path, _ = tiny
    fast = Engine.load(path, dtype="float32", prefill_chunk=512)
    slow = Engine.load(path, dtype="float32", prefill_chunk=512)
    for n in (1, mamba2.CHUNK - 1, mamba2.CHUNK + 1):
        ids = _prompt(n, seed=60 + n)
        a, b = fast.new_sequence(), slow.new_sequence()
        with torch.inference_mode():
            for step in range(3):
                monkeypatch.setattr(Mamba2Mixer, "reference", False)
                got = fast._forward(a, ids)
                monkeypatch.setattr(Mamba2Mixer, "reference", True)
                want = slow._forward(b, ids)
                assert (got - want).abs().max().item() < 1e-4, (n, step)
                ids = [int(want.argmax())]


def test_bf16_cached_matches_resident_and_states_stay_fp32(tiny):
    path, _ = tiny
    ids = _prompt(23, seed=70)
    resident = Engine.load(path, dtype="bfloat16", prefill_chunk=16)
    cached = Engine.load(path, dtype="bfloat16", prefill_chunk=16, cache=CacheConfig(expert_slots=3, ram_cache_bytes=0))
    assert _greedy(cached, ids, 10) == _greedy(resident, ids, 10)
    kv = cached.new_sequence().kv
    assert all(kv.state[i]["ssm"].dtype == torch.float32 for i in kv.recurrent_layers)
    assert kv.state[0]["conv"].dtype == torch.bfloat16


@pytest.mark.skipif(not REAL.is_file(), reason="../shared/model-configs has no Nemotron-3-Nano config")
@pytest.mark.parametrize("change,error,words", [
    ({"num_hidden_layers": 50}, "ConfigError", "hybrid_override_pattern has 52 layers"),
    ({"hybrid_override_pattern": "MEM*X"}, "UnsupportedModelError", "'X'"),
    ({"moe_latent_size": 1024}, "UnsupportedModelError", "moe_latent_size"),
    ({"mlp_hidden_act": "silu"}, "UnsupportedModelError", "mlp_hidden_act"),
    ({"hybrid_override_pattern": None}, "ConfigError", "hybrid_override_pattern"),
])
def test_config_problems_are_one_typed_line(change, error, words, tmp_path):
    from moechat.engine import errors
    from moechat.engine.load.loader import read_model_config

    raw = {**json.loads(REAL.read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    with pytest.raises(getattr(errors, error)) as e:
        read_model_config(tmp_path)
    assert words in str(e.value) and "\n" not in str(e.value)
    ok = {k: v for k, v in json.loads(REAL.read_text()).items()}
    (tmp_path / "config.json").write_text(json.dumps(ok))
    cls, args, _ = read_model_config(tmp_path)  # the real config reads, remote-code auto_map and all
    assert cls.__name__ == "NemotronHForCausalLM" and args.num_hidden_layers == 52


def test_bf16_one_token_ungated_expert_matches_the_reference():
    """One bf16 CPU token through ungated dense experts (native.c's GEMV per projection) == the slow reference in
    fp32 over the same bf16 weights, to bf16's rounding; a chunk (torch's GEMMs) the same."""
    g = torch.Generator().manual_seed(8)
    E, H, I = 4, 64, 48
    w13 = (torch.randn(E, I, H, generator=g) * 0.2).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * 0.2).to(torch.bfloat16)
    batch_tensors = {"w13": w13, "w2": w2}
    for T in (1, 5):
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
        w = torch.rand(T, 2, generator=g)
        contrib = torch.zeros(T * 2, H)
        experts.expert_compute(x, w, ExpertBatch(batch_tensors, ids, ids), act=RELU2, contrib=contrib)
        got = contrib.view(T, 2, H).sum(1)
        want = moe_reference(x.float(), w, ids, w13.float(), w2.float(), act=RELU2)
        assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item(), T


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_fit_plans_converted_ungated_experts_at_their_loaded_size(tiny, fmt):
    """`fit --expert-format int8|int4` counts w13 as the up projection alone, as the loaded format holds it."""
    from moechat.engine.plan import read_model_spec

    path, _ = tiny
    planned = read_model_spec(path).in_format(fmt).expert_bytes
    engine = Engine.load(path, dtype="float32", expert_format=fmt)
    held = sum(t[0].numel() * t.element_size() for t in engine.loaded.provider._tensors[5].values())
    assert planned == held
