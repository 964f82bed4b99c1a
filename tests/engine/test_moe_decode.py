"""One token through a layer's experts in one native call (native.c moechat_moe_decode, engine/layers/experts.py
`_native_moe`) against the per-projection path it replaces (each format's `linear` for gate/up, the activation in
torch, `linear` for down, then contrib[k].add_(y, alpha=w_k)): bit for bit, for int4, int8, MXFP4 and FP8, SwiGLU and
GPT-OSS's clamped SwiGLU, with and without biases, bf16 and fp32 activations, odd sizes (int4 groups of 16 and 8,
partial FP8 blocks, rows not a multiple of the 4-row step, intermediate sizes that leave a tail past torch's vectorised
steps), a subset of pairs, a mixed slots + host batch, and 1, 2 and 3 threads."""

from __future__ import annotations

import shutil

import pytest
import torch

from moechat.engine.layers import experts
from moechat.engine.layers.experts import expert_compute
from moechat.engine.layers.moe import SWIGLU, ExpertActivation, ExpertBatch
from moechat.engine.quant import get_format, mxfp4, native
from moechat.engine.quant.fp8 import fp8_format, quantize_blocks

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the torch paths run")

CLAMPED = ExpertActivation("clamped_swiglu", 7.0, 1.702)


def _pack(name: str, w: torch.Tensor, halves: bool, block=(128, 128)) -> dict[str, torch.Tensor]:
    if name == "mxfp4":
        b, s = mxfp4.quantize(w)
        return {"blocks": b, "scales": s}
    if name == "fp8":
        if not halves:
            q, s = quantize_blocks(w, block)
            return {"": q, "scale": s}
        h = w.shape[0] // 2
        (q0, s0), (q1, s1) = quantize_blocks(w[:h], block), quantize_blocks(w[h:], block)
        return {"": torch.cat([q0, q1]), "scale": torch.cat([s0, s1])}
    return get_format(name).quantize(w)


def _experts(name: str, C: int, H: int, I: int, bias: bool, dtype: torch.dtype, seed: int, block=(128, 128)):
    """C random experts in `name`, stacked [C, ...] as a slot buffer holds them; the format."""
    g = torch.Generator().manual_seed(seed)
    per: dict[str, list[torch.Tensor]] = {}
    for _ in range(C):
        for which, (rows, cols) in (("w13", (2 * I, H)), ("w2", (H, I))):
            w = torch.randn(rows, cols, generator=g) * (2.0 / cols**0.5)
            for part, t in _pack(name, w, which == "w13", block).items():
                per.setdefault(f"{which}_{part}" if part else which, []).append(t)
            if bias:
                per.setdefault(f"{which}_bias", []).append((torch.randn(rows, generator=g) * 0.5).to(dtype))
    fmt = fp8_format(block) if name == "fp8" else get_format(name)
    return {k: torch.stack(v).contiguous() for k, v in per.items()}, fmt


def _run(x, weights, batch, act, native_on: bool, monkeypatch) -> torch.Tensor:
    contrib = torch.zeros(weights.shape[1], x.shape[1])
    if not native_on:
        monkeypatch.setattr(experts, "_native_moe", lambda *a: False)
    expert_compute(x, weights, batch, act=act, contrib=contrib)
    monkeypatch.undo()
    return contrib


def _batch(tensors, fmt, ids, pairs=None, host=None):
    ids = torch.tensor([ids])
    return ExpertBatch(tensors, ids, ids, pairs, fmt, host_tensors=host)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.isfinite(a).all()
    bad = a.view(torch.int32) != b.view(torch.int32)
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} differ, max {float((a - b).abs().max()):.3g}"


CASES = [  # (format, H, I): the Qwen3-like shape scaled down, odd ones
    ("int4", 256, 96), ("int4", 80, 72), ("int4", 104, 40),  # groups of 32; 16 along H; 8 along both
    ("int8", 256, 96), ("int8", 70, 45),
    ("mxfp4", 256, 96), ("mxfp4", 96, 160),
    ("fp8", 256, 96), ("fp8", 200, 70),  # 128-blocks: partial at the edges, the halves blocked apart
]


@pytest.mark.parametrize("name,H,I", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_call_is_the_per_projection_path(monkeypatch, name, H, I, dtype):
    C, K = 6, 4
    for bias, act in ((False, SWIGLU), (True, CLAMPED)) if name in ("mxfp4", "int4") else ((False, SWIGLU),
                                                                                          (True, SWIGLU)):
        tensors, fmt = _experts(name, C, H, I, bias, dtype, seed=H + I)
        g = torch.Generator().manual_seed(I)
        x = (torch.randn(1, H, generator=g) * 3).to(dtype)
        weights = torch.softmax(torch.randn(1, K, generator=g), -1)
        batch = _batch(tensors, fmt, [4, 1, 5, 1])
        want = _run(x, weights, batch, act, False, monkeypatch)
        got = _run(x, weights, batch, act, True, monkeypatch)
        assert want.abs().sum() > 0
        _same(got, want)


@pytest.mark.parametrize("name", ["int4", "mxfp4", "int8", "fp8"])
def test_clamped_activation_every_branch(monkeypatch, name):
    """GPT-OSS's clamps hit on both sides (large gate/up values), a limit bf16 cannot hold exactly, bf16 and fp32."""
    H, I = 128, 224  # a tail past the bf16 vectorised step (64 on AVX-512)
    tensors, fmt = _experts(name, 3, H, I, True, torch.bfloat16, seed=5)
    for dtype in (torch.bfloat16, torch.float32):
        t = {k: (v.to(dtype) if k.endswith("bias") else v) for k, v in tensors.items()}
        for act in (CLAMPED, ExpertActivation("clamped_swiglu", 3.1, 1.3)):
            x = (torch.randn(1, H, generator=torch.Generator().manual_seed(1)) * 12).to(dtype)
            weights = torch.tensor([[0.5, 0.3, 0.2]])
            batch = _batch(t, fmt, [2, 0, 1])
            _same(_run(x, weights, batch, act, True, monkeypatch), _run(x, weights, batch, act, False, monkeypatch))


def test_pairs_and_a_mixed_batch(monkeypatch):
    """Only a batch's pairs are computed (the other rows stay zero); slot ids >= C index the host buffers."""
    H, I = 128, 64
    slots, fmt = _experts("int4", 3, H, I, False, torch.bfloat16, seed=1)
    host, _ = _experts("int4", 4, H, I, False, torch.bfloat16, seed=2)
    x = torch.randn(1, H).bfloat16()
    weights = torch.softmax(torch.randn(1, 4), -1)
    batch = _batch(slots, fmt, [0, 5, 2, 6], pairs=torch.tensor([1, 3]), host=host)
    got = _run(x, weights, batch, SWIGLU, True, monkeypatch)
    _same(got, _run(x, weights, batch, SWIGLU, False, monkeypatch))
    assert got[0].abs().sum() == 0 and got[2].abs().sum() == 0 and got[1].abs().sum() > 0
    batch = _batch(slots, fmt, [0, 5, 2, 6], host=host)
    _same(_run(x, weights, batch, SWIGLU, True, monkeypatch), _run(x, weights, batch, SWIGLU, False, monkeypatch))


@pytest.mark.parametrize("name", ["int4", "int8", "fp8", "mxfp4"])
def test_threads_change_nothing(monkeypatch, name):
    """The layer call's two jobs split their rows over 1, 2 and 3 threads: the same bits (shapes large enough that
    the pool splits them)."""
    H, I = 1024, 384
    tensors, fmt = _experts(name, 4, H, I, False, torch.bfloat16, seed=3)
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(3)).bfloat16()
    weights = torch.softmax(torch.randn(1, 4), -1)
    batch = _batch(tensors, fmt, [0, 1, 2, 3])
    at_thread_counts(lambda: _run(x, weights, batch, SWIGLU, False, monkeypatch),
                     lambda: _run(x, weights, batch, SWIGLU, True, monkeypatch))


def at_thread_counts(off, on, counts=(2, 3, 1)) -> None:
    """off() at one thread, then on() at each of `counts` threads: each the same bits (torch's count restored)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = off()
        for n in counts:
            torch.set_num_threads(n)
            _same(on(), want)
    finally:
        torch.set_num_threads(before)


def test_the_layer_call_is_taken(monkeypatch):
    """A packed CPU batch takes the one native call (the per-projection `linear` is never reached)."""
    tensors, fmt = _experts("int8", 2, 64, 32, False, torch.bfloat16, seed=0)
    calls = []
    monkeypatch.setattr(type(fmt), "linear", lambda *a: calls.append(1))
    contrib = torch.zeros(2, 64)
    expert_compute(torch.randn(1, 64).bfloat16(), torch.tensor([[0.6, 0.4]]), _batch(tensors, fmt, [1, 0]),
                   contrib=contrib)
    assert not calls and contrib.abs().sum() > 0


def test_torch_vector_step():
    """The split native.c follows is torch's: the vectorised silu over the first n // step * step elements (Sleef's
    exp), libm's over the rest; a wrong step differs from torch's own silu in some of the last elements."""
    step = native.vector_step(torch.float32)
    assert step in (0, 16, 32)
    assert native.vector_step(torch.bfloat16) == 2 * step
