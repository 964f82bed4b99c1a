"""native.c's decode attention (one query token over a bf16 K/V cache, quant/native.py attn_decode) against a
float64 softmax(scale q K^T) V on random bf16 inputs: key counts 1..4000, 1-8 query heads per KV head, head sizes
64 and 128, a window's first key > 0 and a cache with spare rows (the head stride), the SIMD build and the scalar
one; and the engine's decode step through it equal to SDPA's within bf16 rounding."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from moechat.engine.quant import native

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: SDPA runs")


def _inputs(nkv, G, D, s_max, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(nkv, s_max, D, generator=g).bfloat16()
    v = torch.randn(nkv, s_max, D, generator=g).bfloat16()
    q = (torch.randn(nkv, G, D, generator=g) * 3).bfloat16()  # peaked softmaxes as well as flat ones
    return q, k, v


def _reference(q, k, v, first, end, scale):
    kd, vd = k[:, first:end].double(), v[:, first:end].double()
    return torch.softmax(q.double() @ kd.transpose(1, 2) * scale, dim=-1) @ vd  # [nKV, G, D]


@pytest.mark.parametrize("S", [1, 7, 300, 4000])
@pytest.mark.parametrize("G", [1, 2, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("first", [0, 5])
def test_attn_decode_matches_float64(any_lib, S, G, D, first):
    nkv = 2
    q, k, v = _inputs(nkv, G, D, first + S + 3, S * 31 + G * 7 + D + first)
    got = native.attn_decode(any_lib, q, k, v, first, first + S, D**-0.5)
    want = _reference(q, k, v, first, first + S, D**-0.5)
    assert got.dtype == torch.float32 and got.shape == (nkv, G, D)
    # |v| <= ~5: the outputs are convex combinations of bf16 values, exact in fp32; 1e-5 of the largest |v|
    err = (got.double() - want).abs().max() / v.float().abs().max()
    assert err < 1e-5, float(err)


def test_odd_head_size_and_tail(any_lib):
    q, k, v = _inputs(3, 3, 40, 50, 0)
    got = native.attn_decode(any_lib, q, k, v, 2, 45, 0.3)
    assert (got.double() - _reference(q, k, v, 2, 45, 0.3)).abs().max() < 1e-5


def test_simd_equals_scalar_within_fp32(lib, scalar_lib):
    q, k, v = _inputs(2, 2, 64, 4000, 1)
    a = native.attn_decode(lib, q, k, v, 0, 4000, 0.125)
    b = native.attn_decode(scalar_lib, q, k, v, 0, 4000, 0.125)
    assert (a - b).abs().max() < 1e-5


def test_rounded_output_matches_sdpa(lib):
    """What the engine uses: the fp32 result rounded to bf16 once, as SDPA's fused kernel rounds its own."""
    q, k, v = _inputs(2, 2, 64, 4000, 2)
    got = native.attn_decode(lib, q, k, v, 0, 4000, 0.125).bfloat16()
    sdpa = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=0.125)[0]
    want = _reference(q, k, v, 0, 4000, 0.125)
    # both within a bf16 half-ulp-ish of the exact value (SDPA's accumulation order differs)
    assert (got.double() - want).abs().max() <= (sdpa.double() - want).abs().max() + 2**-8 * want.abs().max()
