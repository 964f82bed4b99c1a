"""The fast CPU `linear` of each packed format (quant/cpu.py, int8's `_weight_int8pack_mm`, and for one token the
native kernels, quant/native.py) against the slow reference (`weight()` + F.linear): the decoders bit for bit, the
products within stated tolerances, one token (native, or row tiles with a GEMV per tile) and several (one scratch,
one GEMM), partial FP8 blocks, w13's split halves, biases, inside and outside inference mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moechat.engine.quant import cpu, get_format, native, prefill
from moechat.engine.quant.fp8 import fp8_format, quantize_blocks


def _pack(name: str, which: str, w: torch.Tensor, block=(128, 128)) -> tuple[object, dict[str, torch.Tensor]]:
    if name == "fp8":
        fmt = fp8_format(block)
        if which == "w13":
            half = w.shape[0] // 2
            (a, sa), (b, sb) = quantize_blocks(w[:half], block), quantize_blocks(w[half:], block)
            return fmt, {"w13": torch.cat([a, b]), "w13_scale": torch.cat([sa, sb])}
        q, s = quantize_blocks(w, block)
        return fmt, {which: q, f"{which}_scale": s}
    fmt = get_format(name)
    return fmt, {f"{which}_{k}": v for k, v in fmt.quantize(w).items()}


SHAPES = [("w13", 80, 96, (16, 32)), ("w2", 96, 40, (16, 32)), ("w13", 2 * 768, 2048, (128, 128)),
          ("w2", 2048, 768, (128, 128)), ("w13", 2 * 40, 64, (128, 128)),
          ("w2", 400, 3000, (128, 128))]  # 168-row tiles: FP8 scale blocks of 128 rows span two tiles


@pytest.mark.parametrize("which,rows,cols,block", SHAPES)
@pytest.mark.parametrize("name", ["int4", "fp8"])
def test_decoders_are_bit_exact(name, which, rows, cols, block):
    g = torch.Generator().manual_seed(rows + cols)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 0.1
    fmt, t = _pack(name, which, w, block)
    want = fmt.weight(t, which, torch.float32)  # [rows, cols]
    out = torch.empty(rows, cols)
    if name == "int4":
        got = cpu.int4_decode(t[f"{which}_q"], t[f"{which}_scale"], out)
    else:
        wq, scale = t[which], t[f"{which}_scale"]
        srow = cpu.fp8_scale_rows(rows, block[0], rows // 2 if which == "w13" else None)
        got = cpu.fp8_decode(wq.view(torch.int8), scale[srow] * 256.0, block[1],
                             torch.empty(rows, cols, dtype=torch.int16), out)
    assert torch.equal(got, want)


@pytest.mark.parametrize("cols,group", [(64, 32), (40, 8)])
def test_int4_decoder_covers_every_fp16_scale(cols, group):
    """The torch decoder (the fallback) over every positive finite fp16 scale, subnormals included: weight()'s bits."""
    G = cols // group
    scales = torch.arange(1, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16)  # [31743]
    scales = torch.cat([scales, torch.ones(-len(scales) % G, dtype=torch.float16)]).reshape(-1, G).contiguous()
    q = torch.randint(0, 256, (scales.shape[0], cols // 2), generator=torch.Generator().manual_seed(1),
                      dtype=torch.uint8)
    want = get_format("int4").weight({"w2_q": q, "w2_scale": scales}, "w2", torch.float32)
    got = cpu.int4_decode(q, scales, torch.full(want.shape, float("nan")))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_fp8_decoder_covers_every_byte():
    """All 254 finite e4m3 values (both zeros, subnormals, the largest) with a non-power-of-two scale."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].reshape(2, 127)  # [2, 127] without the two NaN patterns
    w8 = codes.view(torch.float8_e4m3fn)
    scale = torch.tensor([[0.37, 1.9], [3.1e-3, 12.5]])  # [2, ceil(127/64)]
    fmt = fp8_format((1, 64))
    want = fmt.weight({"w2": w8, "w2_scale": scale}, "w2", torch.float32)
    got = cpu.fp8_decode(codes.view(torch.int8), scale * 256.0, 64, torch.empty(2, 127, dtype=torch.int16),
                         torch.empty(2, 127))
    assert torch.equal(got, want)


TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}


@pytest.mark.parametrize("which,rows,cols,block", SHAPES)
@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["native", "torch"])
def test_fast_linear_equals_the_reference(name, which, rows, cols, block, n, dtype, path, monkeypatch):
    monkeypatch.setenv("MOECHAT_NATIVE", "1" if path == "native" else "0")
    g = torch.Generator().manual_seed(rows * cols + n)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 2 / cols**0.5
    fmt, t = _pack(name, which, w, block)
    t[f"{which}_bias"] = torch.randn(rows, generator=g).to(dtype)
    x = torch.randn(n, cols, generator=g).to(dtype)
    lib = native.library()
    # one bf16 int4/int8 token (blocks of 32) on the SIMD kernels: sums over x rounded to 16 bits a block
    # (test_native.py); more tokens: over x rounded to int8 a block (prefill.py)
    integer = name in ("int4", "int8") and cols % 32 == 0
    xr = (native.round_x16(x) if n == 1 and integer and dtype == torch.bfloat16 and lib and lib.moechat_simd()
          else x)
    if n > 1 and integer and prefill.integer_path(x, lib):
        xr = prefill.round_x8(x)
    want = F.linear(xr.float(), fmt.weight(t, which, torch.float32), t[f"{which}_bias"].float())  # [n, rows]
    with torch.inference_mode():  # the engine's mode; the scratch buffers are reused outside it below
        got = fmt.linear(x, t, which)
    assert got.dtype == dtype and got.shape == (n, rows)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    torch.testing.assert_close(fmt.linear(x, t, which).float(), want, **TOL[dtype])


def test_one_token_tiles_equal_one_gemv_over_the_whole_matrix():
    """Several row tiles (a tile of 8 rows forced) sum each output as one F.linear over the matrix does."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 64, generator=g) / 8
    fmt, t = _pack("int4", "w2", w)
    x = torch.randn(1, 64, generator=g)
    dense = fmt.weight(t, "w2", torch.float32)
    got = cpu.tiled_linear(x, 40, 64, lambda r0, r1, out: cpu.int4_decode(t["w2_q"][r0:r1], t["w2_scale"][r0:r1],
                                                                          out), tile=8)
    torch.testing.assert_close(got, F.linear(x, dense), atol=1e-6, rtol=1e-6)


def test_fp8_bf16_gemv_falls_back_where_the_scaled_input_would_overflow(monkeypatch):
    """One bf16 token puts the block scale (x 2^120) on the input; scales that would overflow take the exact path."""
    monkeypatch.setenv("MOECHAT_NATIVE", "0")  # the torch path's bf16 GEMV
    g = torch.Generator().manual_seed(5)
    fmt, t = _pack("fp8", "w2", torch.randn(64, 96, generator=g), (16, 32))
    t["w2_scale"] = t["w2_scale"] * 1e30
    x = torch.randn(1, 96, generator=g).bfloat16()
    want = F.linear(x.float(), fmt.weight(t, "w2", torch.float32))
    got = fmt.linear(x, t, "w2")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, atol=0, rtol=1e-2)
