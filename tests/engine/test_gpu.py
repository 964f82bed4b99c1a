"""The same engine on CUDA: logits close to the CPU run and identical greedy tokens."""

from __future__ import annotations

import pytest
import torch

from moechat.engine.generate import Engine
from moechat.engine.sampling import SamplingParams

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
