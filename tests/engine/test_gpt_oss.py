"""GPT-OSS end to end against transformers, from checkpoints the project's own MXFP4 writer makes.

The tiny model has everything that makes GPT-OSS different: sinks and router biases non-zero, expert
biases, YaRN on, a sliding window (4) shorter than the prompts, alternating layer types, sharded with an
index, the Hub's config spelling (rope_scaling + rope_theta, experts_per_token). transformers reads the
same files with `Mxfp4Config(dequantize=True)` (which runs on the CPU) and is the oracle.
"""

from __future__ import annotations

import json

import pytest
import torch

from moechat.engine.cache import slots as slots_mod
from moechat.engine.errors import CheckpointError, ConfigError, MoechatError, UnsupportedModelError
from moechat.engine.quant import mxfp4
from moechat.engine.quant.writer import gpt_oss_expert_tensors, save_checkpoint
from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, do_sample=False)
E, K, L, H, I = 4, 2, 4, 64, 64
CONFIG = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 256, "hidden_size": H,
    "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_local_experts": E, "experts_per_token": K, "num_experts_per_tok": K,
    "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * (L // 2),
    "rms_norm_eps": 1e-5, "rope_theta": 150000, "max_position_embeddings": 512, "swiglu_limit": 7.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 64, "truncate": False},
    "attention_bias": True, "tie_word_embeddings": False, "initializer_range": 0.2, "hidden_act": "silu",
    "eos_token_id": None, "pad_token_id": None, "dtype": "float32",
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}


def _experts_of(model, layer):
    """transformers' experts as the checkpoint stores them: w13 [E, 2I, H] (interleaved rows), w2 [E, H, I]."""
    ex = model.model.layers[layer].mlp.experts
    return (ex.gate_up_proj.detach().transpose(1, 2).contiguous(), ex.down_proj.detach().transpose(1, 2).contiguous(),
            ex.gate_up_proj_bias.detach(), ex.down_proj_bias.detach())


def write_tiny_gpt_oss(path, seed: int = 0, config: dict | None = None, shards: int = 2):
    """A random tiny GPT-OSS written with moechat's MXFP4 writer; returns the dequantized expert weights."""
    import transformers

    config = dict(CONFIG if config is None else config)
    torch.manual_seed(seed)
    hf_config = transformers.GptOssConfig(**{k: v for k, v in config.items() if k != "quantization_config"})
    model = transformers.GptOssForCausalLM(hf_config).float().eval()
    tensors, dequantized = {}, {}
    for name, t in model.state_dict().items():
        if ".mlp.experts." not in name:
            tensors[name] = t.detach().clone()
    for layer in range(config["num_hidden_layers"]):
        w13, w2, b13, b2 = _experts_of(model, layer)
        b13 = torch.randn_like(b13) * 0.2  # transformers initialises expert biases to zero: make them count
        b2 = torch.randn_like(b2) * 0.2
        ex = gpt_oss_expert_tensors(layer, w13, w2, b13, b2, bias_dtype=torch.float32)
        tensors.update(ex)
        p = f"model.layers.{layer}.mlp.experts."
        dequantized[layer] = (mxfp4.dequantize_reference(ex[p + "gate_up_proj_blocks"], ex[p + "gate_up_proj_scales"]),
                              mxfp4.dequantize_reference(ex[p + "down_proj_blocks"], ex[p + "down_proj_scales"]),
                              b13, b2)
    save_checkpoint(path, tensors, config, shards=shards)
    return dequantized


def load_reference(path):
    import transformers

    return transformers.GptOssForCausalLM.from_pretrained(
        path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    dequantized = write_tiny_gpt_oss(path)
    return path, load_reference(path), dequantized


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def test_transformers_reads_the_writers_mxfp4_bit_for_bit(gpt_oss):
    _, ref, dequantized = gpt_oss
    for layer, (w13, w2, b13, b2) in dequantized.items():
        ex = ref.model.layers[layer].mlp.experts
        assert torch.equal(ex.gate_up_proj.detach(), w13.transpose(1, 2)), layer  # transformers: [E, H, 2I]
        assert torch.equal(ex.down_proj.detach(), w2.transpose(1, 2)), layer
        assert torch.equal(ex.gate_up_proj_bias.detach(), b13) and torch.equal(ex.down_proj_bias.detach(), b2)
    assert any(ref.model.layers[0].self_attn.sinks.detach() != 0)
    assert any(ref.model.layers[0].mlp.router.bias.detach() != 0)


def test_experts_stay_mxfp4_in_the_resident_provider(gpt_oss):
    path, _, dequantized = gpt_oss
    engine = Engine.load(path, dtype="float32")
    batch = engine.loaded.provider.prepare(0, torch.tensor([[1, 3]]))
    assert batch.format.name == "mxfp4"
    assert batch.tensors["w13_blocks"].dtype == torch.uint8 and batch.tensors["w13_blocks"].shape == (E, 2 * I, 2, 16)
    assert "w13" not in batch.tensors  # never expanded to full width
    w13 = batch.format.weight({n: t[3] for n, t in batch.tensors.items()}, "w13", torch.float32)
    assert torch.equal(w13, dequantized[0][0][3])


@pytest.mark.parametrize("n", [1, 3, 9, 40])
def test_last_logits_match_transformers(gpt_oss, n):
    path, ref, _ = gpt_oss
    engine = Engine.load(path, dtype="float32", prefill_chunk=16)  # 40 tokens = 3 chunks, past the window
    ids = _prompt(n, seed=n)
    seq = engine.new_sequence()
    with torch.inference_mode():
        ours = engine._forward(seq, ids)
        theirs = ref(torch.tensor([ids])).logits[0, -1].float()
    err = (ours - theirs).abs().max().item()
    assert err < 1e-4, f"{n} tokens: max |logit diff| {err:.2e}"


def test_decode_logits_track_transformers_step_by_step(gpt_oss):
    path, ref, _ = gpt_oss
    engine = Engine.load(path, dtype="float32")
    seq = engine.new_sequence()
    with torch.inference_mode():
        logits = engine._forward(seq, _prompt(3, seed=11))
        for step in range(10):  # decode runs past the sliding window of 4
            theirs = ref(torch.tensor([seq.tokens])).logits[0, -1]
            assert (logits - theirs).abs().max().item() < 1e-4, f"step {step}"
            logits = engine._forward(seq, [int(logits.argmax())])


def test_greedy_tokens_match_transformers_generate(gpt_oss):
    path, ref, _ = gpt_oss
    engine = Engine.load(path, dtype="float32", prefill_chunk=16)
    for n in (4, 21):
        ids = _prompt(n, seed=100 + n)
        ours = [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=32) for t in c.token_ids]
        with torch.inference_mode():
            out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32, min_new_tokens=0,
                               pad_token_id=0)
        assert ours == out[0, n:].tolist(), f"{n}-token prompt"


def _greedy(engine, ids, n=24):
    return [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=n) for t in c.token_ids]


@pytest.mark.parametrize("slots", [1, K, E, L * E])
@pytest.mark.parametrize("ram", [None, "bounded"])
def test_cached_equals_resident_at_any_slot_count(gpt_oss, slots, ram):
    from moechat.engine.cache.provider import CacheConfig

    path, _, _ = gpt_oss
    ids = _prompt(13, seed=5)
    resident = _greedy(Engine.load(path, dtype="float32"), ids)
    fmt = mxfp4.MXFP4
    expert_bytes = fmt.expert_bytes(H, I, torch.float32, bias=True)
    ram_bytes = None if ram is None else 3 * expert_bytes  # 3 of 16 experts in RAM, the rest from the shards
    engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=slots, ram_cache_bytes=ram_bytes))
    assert _greedy(engine, ids) == resident
    snap = engine.provider.snapshot()
    loads = snap.expert_loads_prefill + snap.expert_loads_decode
    # every byte counter counts packed experts: one miss moves one MXFP4 expert
    assert snap.bytes_from_ram + snap.bytes_from_disk == loads * expert_bytes
    # a slot is the expert's bytes with each named tensor at a 256-byte offset (slots.SlotLayout)
    pool = engine.provider.pool
    assert expert_bytes <= pool.slot_bytes < expert_bytes + slots_mod.ALIGN * len(pool.buffers)
    engine.close()


def test_packed_expert_is_a_quarter_of_bf16():
    fmt, dense = mxfp4.MXFP4, __import__("moechat.engine.quant", fromlist=["get_format"]).get_format("dense")
    packed = fmt.expert_bytes(2880, 2880, torch.bfloat16, bias=True)
    full = dense.expert_bytes(2880, 2880, torch.bfloat16, bias=True)
    assert packed == 3 * 2880 * 2880 * 17 // 32 + (2 * 2880 + 2880) * 2  # 4.25 bits a weight + bf16 biases
    assert 3.7 < full / packed < 3.8


def test_json_counts_packed_bytes_per_miss(gpt_oss, capsys):
    from moechat.app.cli.main import main

    path, _, _ = gpt_oss
    rc = main(["run", str(path), "--prompt-ids", "1,2,3,4,5", "--max-tokens", "4", "--temperature", "0",
               "--dtype", "float32", "--expert-slots", "2", "--ram-cache-mb", "0", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cache = out["cache"]
    loads = cache["expert_loads_prefill"] + cache["expert_loads_decode"]
    assert loads > 0
    assert cache["bytes_from_ram"] + cache["bytes_from_disk"] == loads * mxfp4.MXFP4.expert_bytes(
        H, I, torch.float32, bias=True)


# -- malformed MXFP4 -------------------------------------------------------------------------------------------

def _damaged(tmp_path, edit) -> str:
    from safetensors.torch import load_file, save_file

    path = tmp_path / "damaged"
    write_tiny_gpt_oss(path, shards=1)
    tensors = load_file(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


P = "model.layers.1.mlp.experts."


@pytest.mark.parametrize("edit, error, message", [
    (lambda t, c: t.__setitem__(P + "gate_up_proj_scales", t[P + "gate_up_proj_scales"][:, :, :1].contiguous()),
     CheckpointError, r"gate_up_proj_scales' has shape \[4, 128, 1\], the config and the mxfp4 expert format "
                      r"imply \[4, 128, 2\]"),
    (lambda t, c: t.pop(P + "down_proj_scales"), CheckpointError, "down_proj_scales' is missing"),
    (lambda t, c: t.__setitem__(P + "down_proj_blocks", t[P + "down_proj_blocks"].to(torch.int8)),
     CheckpointError, "down_proj_blocks' is stored as I8; the mxfp4 expert format needs uint8"),
    (lambda t, c: t.__setitem__(P + "down_proj_bias", t[P + "down_proj_bias"].to(torch.int32)),
     CheckpointError, "down_proj_bias' is stored as I32; the mxfp4 expert format needs F32, F16 or BF16"),
    (lambda t, c: c["quantization_config"].__setitem__("quant_method", "awq"), UnsupportedModelError,
     "quant_method 'awq': AWQ checkpoints are not supported"),
    (lambda t, c: c.__setitem__("quantization_config", "mxfp4"), ConfigError,
     "quantization_config = 'mxfp4' is not allowed: must be a JSON object"),
    (lambda t, c: c.pop("quantization_config"), CheckpointError, "gpt_oss experts cannot be read in the dense format"),
])
def test_malformed_mxfp4_is_one_typed_error(tmp_path, edit, error, message):
    path = _damaged(tmp_path, edit)
    with pytest.raises(error, match=message) as info:
        Engine.load(path, dtype="float32")
    assert isinstance(info.value, MoechatError)


def test_prefetch_on_gpt_oss_keeps_output_and_predicts_with_the_router_bias(gpt_oss):
    from moechat.engine.cache.provider import CacheConfig

    path, _, _ = gpt_oss
    ids = _prompt(9, seed=8)
    resident = _greedy(Engine.load(path, dtype="float32"), ids)
    engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=E, prefetch="next-layer"))
    assert _greedy(engine, ids) == resident
    snap = engine.provider.snapshot()
    assert sum(snap.prefetch_issued) > 0 and sum(snap.predicted) > 0
    engine.close()


def test_bfloat16_runs_close_to_float32(gpt_oss):
    path, _, _ = gpt_oss
    ids = _prompt(12, seed=3)
    f32, bf16 = Engine.load(path, dtype="float32"), Engine.load(path, dtype="bfloat16")
    with torch.inference_mode():
        a = f32._forward(f32.new_sequence(), ids)
        b = bf16._forward(bf16.new_sequence(), ids)
    assert torch.softmax(a, -1).sub(torch.softmax(b, -1)).abs().max().item() < 0.05


def test_repacked_store_and_warm_start_hold_packed_experts(gpt_oss, tmp_path):
    from moechat.engine.cache.provider import CacheConfig

    path, _, _ = gpt_oss
    ids = _prompt(7, seed=9)
    resident = _greedy(Engine.load(path, dtype="float32"), ids)
    config = CacheConfig(expert_slots=K, ram_cache_bytes=0, repack_dir=str(tmp_path / "repack"), warm_start=True)
    first = Engine.load(path, dtype="float32", cache=config)
    assert _greedy(first, ids) == resident
    first.close()  # saves the routing profile the next start warms from
    repacked = tmp_path / "repack" / "experts.bin"
    assert repacked.stat().st_size == L * E * mxfp4.MXFP4.expert_bytes(H, I, torch.float32, bias=True)
    second = Engine.load(path, dtype="float32", cache=config)
    assert second.provider.warm_loaded == K
    assert _greedy(second, ids) == resident
    second.close()


@pytest.mark.parametrize("on_miss, host_layers", [("host", 0), ("auto", 0), ("load", 2)])
def test_hybrid_execution_on_packed_mxfp4_experts(gpt_oss, on_miss, host_layers):
    from moechat.engine.cache.provider import CacheConfig

    path, _, _ = gpt_oss
    ids = _prompt(10, seed=12)
    resident = _greedy(Engine.load(path, dtype="float32"), ids)
    engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=K, on_miss=on_miss,
                                                                  host_layers=host_layers))
    assert _greedy(engine, ids) == resident
    assert sum(engine.provider.snapshot().host_computed) > 0
    engine.close()
