"""The same engine on CUDA: logits close to the CPU run and identical greedy tokens."""

from __future__ import annotations

import pytest
import torch

from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0.0, do_sample=False)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral_window", "olmoe"])
def test_cuda_matches_cpu(tiny_models, name):
    path, _ = tiny_models[name]
    cpu = Engine.load(path, dtype="float32", device="cpu")
    gpu = Engine.load(path, dtype="float32", device="cuda")
    ids = list(range(3, 40))
    with torch.inference_mode():
        a = cpu._forward(cpu.new_sequence(), ids)
        b = gpu._forward(gpu.new_sequence(), ids).cpu()
    assert (a - b).abs().max().item() < 1e-3
    tok = lambda e: [t for c in e.generate(ids, sampling=GREEDY, max_tokens=24) for t in c.token_ids]
    assert tok(cpu) == tok(gpu)


def test_cuda_bfloat16_decode_runs(tiny_models):
    path, _ = tiny_models["qwen3_moe"]
    engine = Engine.load(path, dtype="bfloat16", device="cuda")
    chunks = list(engine.generate([1, 2, 3], sampling=GREEDY, max_tokens=8))
    assert chunks[-1].finish_reason == "length" and chunks[-1].decode_tokens_per_s > 0


def test_cuda_cached_matches_resident(tiny_models):
    from moechat.engine.cache.provider import CacheConfig

    path, _ = tiny_models["qwen3_moe"]
    ids = list(range(3, 30))
    resident = Engine.load(path, dtype="float32", device="cuda")
    want = [t for c in resident.generate(ids, sampling=GREEDY, max_tokens=16) for t in c.token_ids]
    for slots, budget in [(1, None), (2, 3 * 32 * 64 * 4), (24, None)]:
        cached = Engine.load(path, dtype="float32", device="cuda",
                             cache=CacheConfig(expert_slots=slots, policy="lru", ram_cache_bytes=budget))
        got = [t for c in cached.generate(ids, sampling=GREEDY, max_tokens=16) for t in c.token_ids]
        assert got == want, (slots, budget)
        assert cached.provider.pool.buffers["w13"].is_cuda


@pytest.mark.parametrize("mode,depth", [("next-layer", 1), ("both", 2)])
def test_cuda_prefetch_on_the_copy_stream_matches_resident(tiny_models, mode, depth):
    """Prefetches run on the transfer thread's copy stream; the compute stream waits on per-slot events."""
    import threading

    from moechat.engine.cache.provider import CacheConfig
    from moechat.engine.cache.transfer import ThreadTransfer

    path, _ = tiny_models["mixtral"]
    ids = list(range(3, 30))
    resident = Engine.load(path, dtype="float32", device="cuda")
    want = [t for c in resident.generate(ids, sampling=GREEDY, max_tokens=24) for t in c.token_ids]
    for slots, budget in [(3, None), (6, None), (6, 2 * 3 * 48 * 64 * 4)]:
        cached = Engine.load(path, dtype="float32", device="cuda",
                             cache=CacheConfig(expert_slots=slots, ram_cache_bytes=budget, prefetch=mode,
                                               prefetch_depth=depth))
        assert isinstance(cached.provider.transfer, ThreadTransfer) and cached.provider.transfer._stream is not None
        got = [t for c in cached.generate(ids, sampling=GREEDY, max_tokens=24) for t in c.token_ids]
        assert got == want, (slots, budget)
        snap = cached.cache_snapshot()
        assert sum(snap.prefetch_issued) > 0
        assert not cached.provider.inflight
        assert not [t for t in threading.enumerate() if t.name.startswith("moechat-prefetch")]


# -- GPT-OSS: MXFP4 experts through the fused Triton kernel ------------------------------------------------------
GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 256, "hidden_size": 64,
           "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "num_local_experts": 8, "experts_per_token": 2, "num_experts_per_tok": 2,
           "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"], "rms_norm_eps": 1e-5,
           "rope_theta": 150000, "max_position_embeddings": 512, "swiglu_limit": 7.0, "attention_bias": True,
           "tie_word_embeddings": False, "eos_token_id": None, "pad_token_id": None, "dtype": "float32",
           "quantization_config": {"quant_method": "mxfp4"}}


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    """A random tiny GPT-OSS, MXFP4 experts from moechat's writer (no transformers needed)."""
    from moechat.engine.models import ARCHITECTURES
    from moechat.engine.quant.writer import gpt_oss_expert_tensors, save_checkpoint

    path = tmp_path_factory.mktemp("gpt_oss_cuda")
    cls = ARCHITECTURES["gpt_oss"]
    args = cls.args_class.from_dict(GPT_OSS)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in cls.dense_weight_names(args).items():
        std = 0.0 if name.endswith("norm.weight") else 0.5 if name.endswith("sinks") else 0.2
        tensors[name] = torch.randn(shape, generator=g) * std + (1.0 if name.endswith("norm.weight") else 0.0)
    E, H, I = GPT_OSS["num_local_experts"], GPT_OSS["hidden_size"], GPT_OSS["intermediate_size"]
    for layer in cls.moe_layers(args):
        tensors.update(gpt_oss_expert_tensors(layer, torch.randn(E, 2 * I, H, generator=g) * 0.2,
                                              torch.randn(E, H, I, generator=g) * 0.2,
                                              torch.randn(E, 2 * I, generator=g) * 0.2,
                                              torch.randn(E, H, generator=g) * 0.2, bias_dtype=torch.float32))
    save_checkpoint(path, tensors, GPT_OSS)
    return path


def _counting_kernel(monkeypatch) -> list[int]:
    """Count the fused MXFP4 kernel's calls (the format imports it at each call)."""
    from moechat.engine.quant.kernels import mxfp4_moe as kernels

    calls, real = [], kernels.mxfp4_moe

    def counted(hidden_states, *args, **kwargs):
        calls.append(hidden_states.shape[0])
        return real(hidden_states, *args, **kwargs)

    monkeypatch.setattr(kernels, "mxfp4_moe", counted)
    return calls


def test_cuda_gpt_oss_fused_mxfp4_matches_cpu(tiny_gpt_oss, monkeypatch):
    calls = _counting_kernel(monkeypatch)
    cpu = Engine.load(tiny_gpt_oss, dtype="float32", device="cpu")
    gpu = Engine.load(tiny_gpt_oss, dtype="float32", device="cuda")
    assert gpu.loaded.provider.prepare(0, torch.tensor([[0, 1]], device="cuda")).tensors["w13_blocks"].is_cuda
    ids = list(range(3, 40))
    with torch.inference_mode():
        a = cpu._forward(cpu.new_sequence(), ids)
        b = gpu._forward(gpu.new_sequence(), ids).cpu()
    assert (a - b).abs().max().item() < 1e-3
    assert calls and calls[0] == len(ids)  # the prefill went through the kernel (grouped by slot)
    assert _greedy(cpu, ids) == _greedy(gpu, ids)
    assert 1 in calls  # and the decode steps (one GEMV per pair)


def _greedy(engine, ids, n=24):
    return [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=n) for t in c.token_ids]


def test_cuda_gpt_oss_cached_slots_match_resident(tiny_gpt_oss):
    from moechat.engine.cache.provider import CacheConfig

    ids = list(range(5, 30))
    want = _greedy(Engine.load(tiny_gpt_oss, dtype="float32", device="cuda"), ids)
    for slots in (2, 5):  # fewer slots than a prefill chunk needs: expert-major groups (batch.pairs)
        cached = Engine.load(tiny_gpt_oss, dtype="float32", device="cuda",
                             cache=CacheConfig(expert_slots=slots, policy="lru"))
        assert _greedy(cached, ids) == want, slots
        assert cached.provider.pool.buffers["w13_blocks"].is_cuda


def test_cuda_gpt_oss_bfloat16_tracks_float32(tiny_gpt_oss):
    ids = list(range(3, 20))
    f32 = Engine.load(tiny_gpt_oss, dtype="float32", device="cuda")
    bf16 = Engine.load(tiny_gpt_oss, dtype="bfloat16", device="cuda")
    with torch.inference_mode():
        a = f32._forward(f32.new_sequence(), ids)
        b = bf16._forward(bf16.new_sequence(), ids).float()
    assert torch.isfinite(b).all() and (a - b).abs().max().item() < 0.1 * a.abs().max().item()
