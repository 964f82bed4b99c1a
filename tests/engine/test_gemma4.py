"""Gemma 4's MoE (`gemma4` multimodal wrapper and `gemma4_text`) end to end against transformers.

Tiny models with every layer kind: two sliding layers (head_dim 16, 2 KV heads, a 5-token window, default RoPE)
and a full one (global_head_dim 32, 1 global KV head, attention_k_eq_v, proportional RoPE on a quarter of the
frequencies), a dense GeGLU MLP beside 8 GeGLU experts top-2 in every layer, the router's scale and per-expert
scale, layer scalars, soft-capped logits, tied embeddings. The wrapper is saved by transformers with a tiny vision
tower (its tensors are in the checkpoint and skipped) and its config rewritten in the Hub's spelling
(global_head_dim and num_global_key_value_heads, not transformers' derived per_layer_config). Norm weights, scales
and layer scalars are drawn away from 1 so each one is checked. The in-memory transformers model is the oracle:
fp32 logits to 1e-4 over prompts and decode steps past the window, greedy tokens resident and cached at 1, K, E
and L*E slots; int8 and int4 conversion; the real config (../shared/model-configs) read and planned by fit.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, do_sample=False)
ROPE = {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}
TEXT = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, global_head_dim=32, num_global_key_value_heads=1, intermediate_size=48,
            moe_intermediate_size=16, num_experts=8, top_k_experts=2, enable_moe_block=True, attention_k_eq_v=True,
            sliding_window=5, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            hidden_size_per_layer_input=0, final_logit_softcapping=30.0, max_position_embeddings=512,
            initializer_range=0.2, rope_parameters=ROPE, bos_token_id=2, eos_token_id=1, pad_token_id=0)
VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
              intermediate_size=32)


def _perturb(model) -> None:
    """Norm weights, router scales and layer scalars away from their initial 1 (0 for none), so each is tested."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(("_1.weight", "_2.weight")) or "scale" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand_like(b) + 0.5)


def hub_spelling(config: dict) -> dict:
    """transformers' saved config as the Hub's: global_head_dim / num_global_key_value_heads, no per_layer_config."""
    c = dict(config)
    text = dict(c["text_config"])
    text.pop("per_layer_config", None)
    text.update(global_head_dim=TEXT["global_head_dim"], num_global_key_value_heads=TEXT["num_global_key_value_heads"])
    c["text_config"] = text
    return c


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """models(kind) -> (directory, transformers model) for kind 'wrapper' (gemma4) or 'text' (gemma4_text)."""
    built = {}

    def get(kind: str):
        if kind not in built:
            path = tmp_path_factory.mktemp(f"gemma4_{kind}")
            torch.manual_seed({"wrapper": 0, "text": 1}[kind])
            if kind == "wrapper":
                config = transformers.AutoConfig.for_model("gemma4", text_config=TEXT, vision_config=VISION,
                                                           audio_config=None)
                model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
            else:
                config = transformers.AutoConfig.for_model("gemma4_text", **TEXT)
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            _perturb(model)
            model.save_pretrained(path)
            if kind == "wrapper":
                raw = json.loads((path / "config.json").read_text())
                (path / "config.json").write_text(json.dumps(hub_spelling(raw)))
            built[kind] = (path, model)
        return built[kind]

    return get


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(engine, ids, n=24):
    return [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=n) for t in c.token_ids]


def _reference_logits(ref, ids):
    with torch.inference_mode():
        return ref(input_ids=torch.tensor([ids])).logits[0, -1]


def _reference_greedy(ref, ids, n):
    with torch.inference_mode():
        out = ref.generate(input_ids=torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                           pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_the_wrapper_reads_text_config_and_skips_the_vision_tower(models, caplog):
    from moechat.engine.io.checkpoint import Checkpoint
    from moechat.engine.load.loader import read_model_config

    path, _ = models("wrapper")
    cls, a, raw = read_model_config(path)
    assert raw["model_type"] == "gemma4" and cls.__name__ == "Gemma4ForConditionalGeneration"
    assert a.layer_heads == [(16, 2), (16, 2), (32, 1)] and a.tie_word_embeddings
    assert [a.layer_window(i) for i in range(3)] == [5, 5, None]
    names = cls.dense_weight_names(a)
    assert "model.language_model.layers.2.router.per_expert_scale" in names
    assert "model.language_model.layers.2.self_attn.v_proj.weight" not in names  # K is V on the full layer
    assert "model.language_model.layers.0.self_attn.v_proj.weight" in names
    assert any(n.startswith("model.vision_tower.") for n in Checkpoint.open(path).tensors)
    assert not any("vision" in n for n in names)
    with caplog.at_level(logging.WARNING):
        Engine.load(path, dtype="float32")
    assert [r.getMessage() for r in caplog.records if "text-only" in r.getMessage()] == [
        "Gemma 4: the checkpoint's vision tower is not loaded; the model runs text-only"]


@pytest.mark.parametrize("kind", ["wrapper", "text"])
def test_logits_match_transformers_prefill_and_decode(models, kind):
    path, ref = models(kind)
    engine = Engine.load(path, dtype="float32", prefill_chunk=8)
    for n in (1, 6, 23):  # chunks of 8 across the 5-token window
        ids = _prompt(n, seed=n)
        with torch.inference_mode():
            ours = engine._forward(engine.new_sequence(), ids)
        theirs = _reference_logits(ref, ids)
        assert (ours - theirs).abs().max().item() < 1e-4, (kind, n)
    seq = engine.new_sequence()
    with torch.inference_mode():
        logits = engine._forward(seq, _prompt(3, seed=7))
        for step in range(8):  # decode steps past the sliding window
            theirs = _reference_logits(ref, seq.tokens)
            assert (logits - theirs).abs().max().item() < 1e-4, (kind, step)
            assert logits.abs().max().item() < 30.0  # soft-capped
            logits = engine._forward(seq, [int(logits.argmax())])


@pytest.mark.parametrize("kind", ["wrapper", "text"])
def test_greedy_tokens_match_transformers_resident_and_cached(models, kind):
    from moechat.engine.cache.provider import CacheConfig

    path, ref = models(kind)
    ids = _prompt(11, seed=121)
    expected = _reference_greedy(ref, ids, 20)
    resident = Engine.load(path, dtype="float32", prefill_chunk=8)
    got = _greedy(resident, ids, 20)
    assert got == expected[: len(got)] and (len(got) == 20 or got[-1] in resident.eos_token_ids)
    args = resident.args
    assert resident.loaded.provider.layers == [0, 1, 2]
    for slots in (1, args.top_k, args.num_experts, 3 * args.num_experts):
        engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=slots, ram_cache_bytes=0))
        assert _greedy(engine, ids, 20) == got, slots
        assert engine.provider.pool.slot_bytes == 3 * args.hidden_size * args.moe_intermediate * 4
        engine.close()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_int8_and_int4_experts_convert_and_cache_alike(models, fmt):
    from moechat.engine.cache.provider import CacheConfig

    path, _ = models("wrapper")
    ids = _prompt(12, seed=3)
    full = Engine.load(path, dtype="float32")
    quant = Engine.load(path, dtype="float32", expert_format=fmt)
    assert quant.loaded.expert_format.name == fmt
    with torch.inference_mode():
        a = torch.softmax(full._forward(full.new_sequence(), ids), -1)
        b = torch.softmax(quant._forward(quant.new_sequence(), ids), -1)
    assert 0 < (a - b).abs().max().item() < {"int8": 0.02, "int4": 0.2}[fmt]
    cached = Engine.load(path, dtype="float32", expert_format=fmt, cache=CacheConfig(expert_slots=3))
    assert _greedy(cached, ids, 12) == _greedy(quant, ids, 12)
    cached.close()


def test_dense_int8_stays_near_native(models):
    path, _ = models("wrapper")
    native, int8 = Engine.load(path, dtype="float32"), Engine.load(path, dtype="float32", dense_format="int8")
    assert int8.model.dense_format == "int8" and int8.model.layer_list[2].attn.qkv_q is not None
    ids = _prompt(12, seed=6)
    with torch.inference_mode():
        a = torch.softmax(native._forward(native.new_sequence(), ids), -1)
        b = torch.softmax(int8._forward(int8.new_sequence(), ids), -1)
    assert 0 < (a - b).abs().max().item() < 0.02


def test_native_bf16_decode_equals_the_torch_path(models, monkeypatch):
    """bf16 decode on a CPU goes through native.c (the GEMV for q/k/v and o, the decode attention, windowed on
    sliding layers); the torch matmuls are its reference, step by step past the window."""
    from moechat.engine.models import gemma4

    path, _ = models("wrapper")
    engine = Engine.load(path, dtype="bfloat16")

    def steps():  # the same tokens fed one at a time to both paths
        seq = engine.new_sequence()
        with torch.inference_mode():
            engine._forward(seq, _prompt(4, seed=8))
            return torch.stack([engine._forward(seq, [t]) for t in _prompt(8, seed=9)])

    if gemma4.native.library() is None:
        pytest.skip("the native library is not built here")
    fast = steps()
    monkeypatch.setattr(gemma4.native, "library", lambda: None)
    monkeypatch.setattr(gemma4, "_bf16_gemv_lib", lambda x, w: None)
    slow = steps()
    assert (torch.softmax(fast, -1) - torch.softmax(slow, -1)).abs().max().item() < 0.02


def test_bfloat16_stays_near_float32(models):
    path, _ = models("wrapper")
    f32, bf16 = Engine.load(path, dtype="float32"), Engine.load(path, dtype="bfloat16")
    ids = _prompt(12, seed=5)
    with torch.inference_mode():
        a = torch.softmax(f32._forward(f32.new_sequence(), ids), -1)
        b = torch.softmax(bf16._forward(bf16.new_sequence(), ids), -1)
    assert (a - b).abs().max().item() < 0.05


def test_a_multi_turn_reuses_the_cache_like_a_fresh_prefill(models):
    path, _ = models("text")
    engine = Engine.load(path, dtype="float32", prefill_chunk=4)
    first, second = _prompt(7, seed=1), _prompt(5, seed=2)
    seq = engine.new_sequence()
    reply = [t for c in engine.generate(first, sampling=GREEDY, max_tokens=6, sequence=seq) for t in c.token_ids]
    turn = [reply[-1], *second]
    again = [t for c in engine.generate(turn, sampling=GREEDY, max_tokens=6, sequence=seq) for t in c.token_ids]
    assert again == _greedy(engine, first + reply + second, 6)


def _whole_context(engine):
    """A sequence whose sliding layers keep the whole context (no ring): the layout before the rings, a reference."""
    from moechat.engine.layers.kv_cache import KVCache
    from moechat.engine.runtime.generate import SequenceState

    a = engine.args
    heads, k_dim, v_dim = a.kv_cache_layout()
    return SequenceState(KVCache(a.num_hidden_layers, heads, k_dim, engine.context, engine.loaded.dtype,
                                 layouts=a.kv_layer_layouts()))


def test_sliding_layers_hold_a_ring_of_their_window(models):
    """Sliding layers allocate `sliding_window` positions, full ones the context; a context under the window needs
    no ring."""
    from moechat.engine.layers.kv_cache import KVCache

    path, _ = models("text")
    engine = Engine.load(path, dtype="float32")
    kv = engine.new_sequence().kv
    assert kv.ring == [5, 5, None]
    assert [tuple(t.shape) for t in kv.k] == [(2, 5, 16), (2, 5, 16), (1, engine.context, 32)]
    assert [tuple(t.shape) for t in kv.v] == [(2, 5, 16), (2, 5, 16), (1, engine.context, 32)]
    short = KVCache.for_model(engine.args, 5, torch.float32, device="meta")
    assert short.ring == [None, None, None] and [t.shape[1] for t in short.k] == [5, 5, 5]


@pytest.mark.parametrize("chunk", [1, 3, 4, 5, 7, 64])
def test_the_ring_gives_the_whole_context_logits_at_every_chunk(models, chunk):
    """Prompts longer than the window, prefilled in chunks that cross the ring's wrap at every offset, then decoded
    past it: the ring's logits are transformers' (1e-4) and those of a cache of the whole context (1e-5)."""
    path, ref = models("text")
    engine = Engine.load(path, dtype="float32", prefill_chunk=chunk)
    ids = _prompt(17, seed=50 + chunk)
    with torch.inference_mode():
        seq, whole = engine.new_sequence(), _whole_context(engine)
        assert seq.kv.ring[0] == 5 and whole.kv.ring == [None] * 3
        ours, before = engine._forward(seq, ids), engine._forward(whole, ids)
        assert (ours - _reference_logits(ref, ids)).abs().max().item() < 1e-4
        assert (ours - before).abs().max().item() < 1e-5
        for step in range(7):
            token = [int(ours.argmax())]
            ours, before = engine._forward(seq, token), engine._forward(whole, token)
            assert (ours - before).abs().max().item() < 1e-5, step
        assert (ours - _reference_logits(ref, seq.tokens)).abs().max().item() < 1e-4


def test_a_rewind_past_the_ring_recomputes_and_never_continues_wrong(models):
    """truncate keeps n only where every ring still holds the window before n (one token back once it has
    wrapped; anything before it has wrapped); otherwise it goes back to 0 and the caller prefills the prompt."""
    path, _ = models("text")
    engine = Engine.load(path, dtype="float32", prefill_chunk=4)
    ids = _prompt(13, seed=60)
    with torch.inference_mode():
        fresh = {n: engine._forward(engine.new_sequence(), ids[:n]) for n in (1, 5, 11, 12, 13)}
        for n, kept in ((12, 12), (11, 11), (10, 0), (4, 0), (0, 0)):
            seq = engine.new_sequence()
            engine._forward(seq, ids[:12])
            assert seq.truncate(n) == kept, n
            logits = engine._forward(seq, ids[kept : n + 1])  # the prompt from where the cache landed
            assert (logits - fresh[n + 1]).abs().max().item() < 1e-5, n
        seq = engine.new_sequence()
        engine._forward(seq, ids[:4])  # the ring not wrapped yet: any rewind is kept
        assert seq.truncate(1) == 1
        seq.kv.consistent = False  # as a pass that failed midway leaves it: the rings may hold its keys
        assert seq.truncate(1) == 0


def test_unsupported_gemma4_variants_are_one_typed_line(tmp_path):
    from moechat.engine.errors import MoechatError
    from moechat.engine.load.loader import read_model_config

    base = {"model_type": "gemma4_text", **TEXT}
    for bad, what in (({"hidden_size_per_layer_input": 8}, "per-layer inputs"),
                      ({"num_kv_shared_layers": 1}, "shared KV"),
                      ({"enable_moe_block": False}, "enable_moe_block"),
                      ({"layer_types": ["sliding_attention", "chunked", "full_attention"]}, "layer_types")):
        (tmp_path / "config.json").write_text(json.dumps({**base, **bad}))
        with pytest.raises(MoechatError) as e:
            read_model_config(tmp_path)
        assert "\n" not in str(e.value) and what in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4", "vision_config": {}}))
    with pytest.raises(MoechatError, match="text_config"):
        read_model_config(tmp_path)


def test_hybrid_execution_and_prefetch_keep_the_output(models):
    """Misses computed on the host (in place, by the cost model, a whole layer there) and next-layer prefetch never
    change what is computed."""
    from moechat.engine.cache.provider import CacheConfig

    path, _ = models("wrapper")
    ids = _prompt(9, seed=9)
    resident = _greedy(Engine.load(path, dtype="float32"), ids, 10)
    for on_miss, host_layers in (("host", 0), ("auto", 0), ("load", 1)):
        engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=3, on_miss=on_miss,
                                                                      host_layers=host_layers))
        assert _greedy(engine, ids, 10) == resident, (on_miss, host_layers)
        assert sum(engine.provider.snapshot().host_computed) > 0
        engine.close()
    engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=6, prefetch="both"))
    assert _greedy(engine, ids, 10) == resident
    assert sum(engine.provider.snapshot().prefetch_issued) > 0
    engine.close()


# -- the real config (../shared/model-configs), read in place ----------------------------------------------------

REAL = (Path(__file__).resolve().parents[3] / "shared" / "model-configs" / "google--gemma-4-26B-A4B-it"
        / "config.nvfp4-derivative.json")


@pytest.fixture
def real(tmp_path):
    if not REAL.exists():
        pytest.skip(f"{REAL} is not here")
    config = json.loads(REAL.read_text())
    config.pop("quantization_config", None)  # the derivative's NVFP4; google's release is bf16
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_real_gemma_4_26b_a4b_config(real):
    from moechat.engine.load.loader import read_model_config

    cls, a, _ = read_model_config(real)
    assert cls.__name__ == "Gemma4ForConditionalGeneration"
    assert (a.num_hidden_layers, a.num_experts, a.top_k, a.moe_intermediate, a.intermediate_size) == \
        (30, 128, 8, 704, 2112)
    assert a.layer_heads[:6] == [(256, 8)] * 5 + [(512, 2)]
    assert a.kv_layer_layouts()[4:6] == [(8, 256, 256), (2, 512, 512)]
    assert a.layer_window(0) == 1024 and a.layer_window(5) is None and a.final_logit_softcapping == 30.0
    assert a.rope_by_type["full_attention"]["rope_type"] == "proportional"
    shapes = cls.dense_weight_names(a)
    assert shapes["model.language_model.layers.5.self_attn.q_proj.weight"] == (16 * 512, 2816)
    assert shapes["model.language_model.layers.5.self_attn.k_proj.weight"] == (2 * 512, 2816)
    assert shapes["model.language_model.layers.0.self_attn.v_proj.weight"] == (8 * 256, 2816)
    assert shapes["model.language_model.layers.0.mlp.gate_proj.weight"] == (2112, 2816)
    assert not any(".experts." in n or "lm_head" in n for n in shapes)


def test_fit_plans_gemma_4_26b_a4b(real, capsys):
    from moechat.app.cli.main import main

    code = main(["fit", str(real), "--vram-gb", "24", "--ram-gb", "64", "--disk-gb", "2000", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code in (0, 3) and data["runnable"]
    spec = data["spec"]
    assert (spec["moe_layers"], spec["num_experts"], spec["top_k"]) == (30, 128, 8)
    assert spec["expert_bytes"] == 3 * 704 * 2816 * 2
    assert spec["kv_bytes_per_token"] == 2 * 2 * (25 * 8 * 256 + 5 * 2 * 512) == 220 * 1024  # each layer's width
    assert spec["dense_parts"]["dense MLP layers"] == 30 * 3 * 2112 * 2816 * 2  # the MLP beside the experts
    assert any("vision tower" in n and "text model only" in n for n in spec["notes"])
    assert spec["all_experts_bytes"] + spec["dense_bytes"] == pytest.approx(2 * 25.2e9, rel=0.01)  # the catalog's


def test_fit_counts_what_the_model_allocates(real):
    """fit's dense bytes are the model's dense tensors and its KV per token the sequence state's buffers (full layers
    at global_head_dim x num_global_key_value_heads, no v_proj with attention_k_eq_v)."""
    import math

    from moechat.engine.layers.kv_cache import KVCache
    from moechat.engine.load.loader import read_model_config
    from moechat.engine.plan import spec_from_config

    cls, args, _ = read_model_config(real)
    spec = spec_from_config(json.loads((real / "config.json").read_text()))
    assert spec.dense_bytes == sum(math.prod(s) for s in cls.dense_weight_names(args).values()) * 2
    context = 16  # under the window: every layer holds all of it
    kv = KVCache.for_model(args, context, torch.bfloat16, device="meta")
    assert [tuple(t.shape) for t in kv.k[4:6]] == [(8, context, 256), (2, context, 512)]
    assert spec.kv_bytes(context) == sum(t.numel() * t.element_size() for t in kv.k + kv.v) == context * 220 * 1024
    context = 131072  # past it: the 25 sliding layers a ring of 1024 positions each, as the windowed plan counts
    kv = KVCache.for_model(args, context, torch.bfloat16, device="meta")
    assert [tuple(t.shape) for t in kv.k[4:6]] == [(8, 1024, 256), (2, context, 512)]
    held = sum(t.numel() * t.element_size() for t in kv.k + kv.v)
    assert spec.kv_bytes(context, windowed=True) == held == 25 * 1024 * 8 * 1024 + context * 5 * 2 * 2 * 512 * 2
    assert "5 layers x 2 (K, V) x 2 KV heads x 512" in spec.kv_detail


def test_the_catalog_lists_gemma_4_as_runnable():
    from moechat.engine.plan.catalog import find

    entry = find("google/gemma-4-26B-A4B-it")
    assert entry.supported and entry.family == "gemma4"
