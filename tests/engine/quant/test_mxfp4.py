"""MXFP4's CPU path against the slow reference: bit for bit in fp32, every code and every scale."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moechat.engine.layers.experts import expert_compute
from moechat.engine.layers.moe import ExpertActivation, ExpertBatch, moe_reference
from moechat.engine.quant import mxfp4


@pytest.fixture(autouse=True)
def _decode_then_gemm(monkeypatch):
    """These tests pin the decode-then-GEMM path for many tokens (bit for bit F.linear); the many-token kernels
    (quant/prefill.py: the same fp32 sums in another order) are tested in test_prefill.py."""
    monkeypatch.setenv("MOECHAT_PREFILL_KERNEL", "0")


def _packed(rows: int, cols: int, seed: int, spread: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes (every byte value) and scales around 2^-6 spread over +-`spread` binades."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(121 - spread, 122 + spread, (rows, cols // 32), generator=g).to(torch.uint8)
    return blocks, scales


@pytest.fixture
def small_tiles(monkeypatch):
    """8-row tiles, so small matrices run through several tiles and a ragged last one (the torch path: one token
    would take the native kernel, tested in test_native.py)."""
    monkeypatch.setattr(mxfp4, "_TILE_BYTES", 8 * 4 * 64)
    monkeypatch.setenv("MOECHAT_NATIVE", "0")


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setenv("MOECHAT_NATIVE", "0")


def test_decode_tile_is_the_reference_for_every_code_and_scale():
    # every byte value against every scale the fast path takes (0..240), one scale per block
    blocks = torch.arange(256, dtype=torch.uint8).repeat(241 * 2).reshape(241, 32, 16)  # [241, 32, 16]
    scales = torch.arange(241, dtype=torch.uint8)[:, None].expand(241, 32).contiguous()
    R, G = scales.shape
    out = torch.empty(R, G * 32)
    codes, signs = torch.empty(R, G * 16, dtype=torch.int32), torch.empty(R, G * 16, dtype=torch.int32)
    got = mxfp4.decode_tile(blocks, mxfp4.scale_factors(scales), codes, signs, out)
    want = mxfp4.dequantize_reference(blocks, scales)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # signed zeros too


@pytest.mark.parametrize("n", [1, 3, 32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,cols", [(64, 64), (44, 96), (128, 2880 // 10)])
def test_linear_cpu_is_f_linear_on_the_reference_bit_for_bit(small_tiles, n, bias, rows, cols):
    blocks, scales = _packed(rows, cols, seed=rows + cols)
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n))
    b = torch.randn(rows) if bias else None
    want = F.linear(x, mxfp4.dequantize_reference(blocks, scales), b)
    assert torch.equal(mxfp4.linear_cpu(x, blocks, scales, b), want)


def test_linear_cpu_one_tile_equals_many_tiles(monkeypatch, torch_path):
    blocks, scales = _packed(96, 128, seed=5)
    x = torch.randn(1, 128)  # one token: a GEMV per tile
    whole = mxfp4.linear_cpu(x, blocks, scales)
    monkeypatch.setattr(mxfp4, "_TILE_BYTES", 8 * 4 * 128)
    assert mxfp4.tile_rows(128) == 8
    assert torch.equal(mxfp4.linear_cpu(x, blocks, scales), whole)


def test_scales_past_the_fast_range_take_the_table_path():
    blocks, scales = _packed(16, 64, seed=1)
    scales[3, 1] = 250  # 2^123: the fp32 factor 2^(s - 113) would overflow
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)) / 8  # seeded: row 3's sums stay finite
    got = mxfp4.linear_cpu(x, blocks, scales)
    want = F.linear(x, mxfp4.dequantize_reference(blocks, scales))
    assert torch.isfinite(want).all() and torch.equal(got, want)


def test_bf16_computes_in_fp32_and_rounds_once(torch_path):
    blocks, scales = _packed(96, 256, seed=2)
    w = mxfp4.dequantize_reference(blocks, scales)
    b = torch.randn(96).bfloat16()
    for n in (1, 8):
        x = torch.randn(n, 256).bfloat16()
        got = mxfp4.linear_cpu(x, blocks, scales, b)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, F.linear(x.float(), w, b.float()).bfloat16())
        torch.testing.assert_close(got, F.linear(x, w.bfloat16(), b), atol=2e-2, rtol=1e-2)


def test_format_linear_on_cpu_is_the_fast_path():
    blocks, scales = _packed(64, 64, seed=3)
    tensors = {"w13_blocks": blocks, "w13_scales": scales, "w13_bias": torch.randn(64)}
    x = torch.randn(3, 64)
    want = F.linear(x, mxfp4.MXFP4.weight(tensors, "w13", torch.float32), tensors["w13_bias"])
    assert torch.equal(mxfp4.MXFP4.linear(x, tensors, "w13"), want)


@pytest.mark.parametrize("kind", ["swiglu", "clamped_swiglu"])
@pytest.mark.parametrize("T", [1, 5])
def test_expert_compute_on_cpu_matches_the_reference(kind, T):
    """The CPU never takes the fused kernel (CUDA only): the per-expert path over linear_cpu."""
    E, K, H, I = 4, 2, 64, 32
    g = torch.Generator().manual_seed(T)
    b13, s13 = mxfp4.quantize(torch.randn(E, 2 * I, H, generator=g) * 0.3)
    b2, s2 = mxfp4.quantize(torch.randn(E, H, I, generator=g) * 0.3)
    bias13, bias2 = torch.randn(E, 2 * I, generator=g) * 0.2, torch.randn(E, H, generator=g) * 0.2
    tensors = {"w13_blocks": b13, "w13_scales": s13, "w13_bias": bias13, "w2_blocks": b2, "w2_scales": s2,
               "w2_bias": bias2}
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    tw = torch.softmax(torch.randn(T, K, generator=g), dim=-1)
    act = ExpertActivation(kind)
    got = expert_compute(x, tw, ExpertBatch(tensors, ids, ids, format=mxfp4.MXFP4), act=act)
    want = moe_reference(x, tw, ids, mxfp4.dequantize_reference(b13, s13), mxfp4.dequantize_reference(b2, s2),
                         act=act, w13_bias=bias13, w2_bias=bias2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_scratch_made_in_inference_mode_is_written_outside_it():
    """The engine runs under torch.inference_mode, tests and benches outside it: buffers serve both."""
    blocks, scales = _packed(40, 160, seed=9)  # a shape no other test uses: its buffers are made here
    big = scales.clone()
    big[0, 0] = 250  # the table path and its scratch
    x1, x3 = torch.randn(1, 160), torch.randn(3, 160)
    with torch.inference_mode():
        want = [mxfp4.linear_cpu(x, blocks, s) for x in (x1, x3) for s in (scales, big)]
    got = [mxfp4.linear_cpu(x, blocks, s) for x in (x1, x3) for s in (scales, big)]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
