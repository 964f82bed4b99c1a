"""FP8 block-quantised checkpoints as the Hub ships them (Qwen3-*-FP8, DeepSeek-V3), loaded with the experts
kept FP8 in every tier. The tests write tiny qwen3_moe and mixtral checkpoints in that form with block sizes
that leave partial blocks; the oracle is transformers on the same dequantized weights (its own FP8 loader
needs a GPU)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moechat.engine.errors import CheckpointError, ConfigError, UnsupportedModelError
from moechat.engine.quant.fp8 import FP8_DTYPE, dequantize_blocks, quantize_blocks
from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, do_sample=False)
BLOCK = (24, 40)  # 64 and 32 are not multiples: partial blocks on both edges
TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=16,
            initializer_range=0.2, max_position_embeddings=512, rms_norm_eps=1e-6)
MODELS = {
    "qwen3_moe": dict(num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                      intermediate_size=96, norm_topk_prob=True),
    "mixtral": dict(num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                    eos_token_id=None, bos_token_id=None),
}


def _quantised(name: str) -> bool:
    """What FP8 checkpoints quantise: the linear layers of attention and experts (not router, norms, embed, head)."""
    return name.endswith("proj.weight") or (".experts." in name and name.endswith(("w1.weight", "w2.weight",
                                                                                  "w3.weight")))


def write_fp8(path, model_type: str, seed: int):
    """A tiny model written FP8 the Hub's way; returns the transformers model holding the dequantized weights."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **MODELS[model_type]})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)  # config, generation config; the weights are replaced below
    tensors = {}
    for file in path.glob("*.safetensors"):
        tensors.update(load_file(str(file)))
        file.unlink()
    out, dequantized = {}, {}
    for name, t in tensors.items():
        if _quantised(name) and t.dim() == 2:
            q, scale = quantize_blocks(t, BLOCK)
            out[name], out[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize_blocks(q, scale, BLOCK)
        else:
            out[name] = t
    assert any(".experts." in n for n in dequantized), "the checkpoint must name experts one by one"
    save_file(out, str(path / "model.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK)}
    (path / "config.json").write_text(json.dumps(raw))
    # the oracle: transformers reading the same checkpoint with its weights dequantized (fp32)
    ref_dir = path.parent / f"{path.name}_dequantized"
    ref_dir.mkdir(exist_ok=True)
    save_file({**tensors, **dequantized}, str(ref_dir / "model.safetensors"))
    config.save_pretrained(ref_dir)
    return transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=list(MODELS))
def fp8_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"fp8_{request.param}")
    return path, write_fp8(path, request.param, seed=3)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def _greedy(engine, ids, n=24):
    return [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=n) for t in c.token_ids]


def test_experts_stay_fp8_and_logits_match_transformers(fp8_model):
    path, ref = fp8_model
    engine = Engine.load(path, dtype="float32", prefill_chunk=16)
    batch = engine.loaded.provider.prepare(0, torch.zeros(1, 2, dtype=torch.long))
    assert batch.format.name == "fp8" and batch.tensors["w13"].dtype == FP8_DTYPE
    for n in (1, 7, 30):
        ids = _prompt(n, seed=n)
        with torch.inference_mode():
            ours = engine._forward(engine.new_sequence(), ids)
            theirs = ref(torch.tensor([ids])).logits[0, -1]
        assert (ours - theirs).abs().max().item() < 1e-4, n


def test_greedy_tokens_match_transformers(fp8_model):
    path, ref = fp8_model
    engine = Engine.load(path, dtype="float32", prefill_chunk=16)
    ids = _prompt(11, seed=4)
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32, min_new_tokens=0, pad_token_id=0)
    assert _greedy(engine, ids, 32) == out[0, len(ids):].tolist()


@pytest.mark.parametrize("slots", [1, 2, 7])
def test_cached_equals_resident(fp8_model, slots):
    from moechat.engine.cache.provider import CacheConfig

    path, _ = fp8_model
    ids = _prompt(9, seed=6)
    resident = _greedy(Engine.load(path, dtype="float32"), ids)
    engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=slots, ram_cache_bytes=0))
    assert _greedy(engine, ids) == resident
    snap = engine.provider.snapshot()
    loads = snap.expert_loads_prefill + snap.expert_loads_decode
    # a miss moves the FP8 expert: one byte a weight plus the fp32 block scales
    assert snap.bytes_from_disk == loads * engine.provider.store.expert_bytes
    args = engine.loaded.args
    H, I = args.hidden_size, args.moe_intermediate
    scales = (2 * -(-I // BLOCK[0]) * -(-H // BLOCK[1]) + -(-H // BLOCK[0]) * -(-I // BLOCK[1])) * 4
    assert engine.provider.store.expert_bytes == 3 * H * I + scales
    engine.close()


@pytest.mark.parametrize("on_miss, host_layers", [("host", 0), ("auto", 0), ("load", 1)])
def test_hybrid_execution_on_fp8_experts(fp8_model, on_miss, host_layers):
    """Issue 16 on FP8 experts: misses computed on the host straight from the RAM tier's FP8 bytes give the
    resident engine's greedy tokens."""
    from moechat.engine.cache.provider import CacheConfig

    path, _ = fp8_model
    ids = _prompt(9, seed=7)
    resident = _greedy(Engine.load(path, dtype="float32"), ids)
    engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=2, on_miss=on_miss,
                                                                  host_layers=host_layers))
    assert _greedy(engine, ids) == resident
    snap = engine.provider.snapshot()
    assert sum(snap.host_computed) > 0 or on_miss == "load" and not host_layers
    engine.close()


def _edit(tmp_path, edit):
    path = tmp_path / "m"
    write_fp8(path, "qwen3_moe", seed=1)
    tensors = load_file(str(path / "model.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    edit(tensors, raw)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw))
    return path


E0 = "model.layers.0.mlp.experts.0.gate_proj.weight"
Q0 = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("edit, error, message", [
    (lambda t, c: t.pop(E0 + "_scale_inv"), CheckpointError, "gate_proj.weight_scale_inv' is missing"),
    (lambda t, c: t.pop(Q0 + "_scale_inv"), CheckpointError, "q_proj.weight_scale_inv' is missing"),
    (lambda t, c: t.__setitem__(E0 + "_scale_inv", t[E0 + "_scale_inv"][:1].contiguous()), CheckpointError,
     r"gate_proj.weight_scale_inv' has shape \[1, 2\]"),
    (lambda t, c: c["quantization_config"].__setitem__("fmt", "e5m2"), ConfigError, "fmt 'e5m2' is not supported"),
    (lambda t, c: c["quantization_config"].pop("weight_block_size"), ConfigError,
     "weight_block_size must be two positive integers"),
    (lambda t, c: c["quantization_config"].__setitem__("quant_method", "gptq"), UnsupportedModelError,
     "GPTQ checkpoints are not supported; moechat reads MXFP4 and FP8"),
    (lambda t, c: c["quantization_config"].__setitem__("quant_method", "weird"), UnsupportedModelError,
     "quant_method 'weird' is not supported"),
])
def test_bad_fp8_checkpoints_are_one_typed_line(tmp_path, edit, error, message):
    path = _edit(tmp_path, edit)
    with pytest.raises(error, match=message):
        Engine.load(path, dtype="float32")
