"""The native many-token decoders (native.c `moechat_<fmt>_decode`, quant/native.py) against each format's `weight()`:
bit for bit (int32 views: signed zeros too) for int4 (groups of 32, 16 and 8 with a tail past the last 32-element
block), MXFP4 (every code against every scale 0..255) and FP8 (every finite e4m3 byte, partial blocks, w13's halves,
rows not a multiple of a block), on the SIMD build and the scalar one; the same bits at 1, 2, 3 and 7 threads; and the
many-token `linear` of each format taking them (a counted call): bit for bit the torch decoders' path (the same GEMM
over the same matrix), within the stated tolerances of the reference, and the torch decoders where the library is
absent or MOECHAT_NATIVE_DECODE=0."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from moechat.engine.quant import get_format, mxfp4, native
from moechat.engine.quant.fp8 import fp8_format, quantize_blocks

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the torch decoders run (tested)")


@pytest.fixture(autouse=True)
def _decode_then_gemm(monkeypatch):
    """These tests pin the decode-then-GEMM path (the many-token kernels, quant/prefill.py, are tested apart)."""
    monkeypatch.setenv("MOECHAT_PREFILL_KERNEL", "0")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _w(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) / cols**0.5


def _garbage(rows: int, cols: int) -> torch.Tensor:
    """An output buffer full of NaNs: an element a decoder skipped cannot pass."""
    return torch.full((rows, cols), float("nan"))


@pytest.mark.parametrize("rows,cols", [(1, 32), (7, 64), (9, 96), (13, 40), (6, 24), (5, 48), (4, 8), (37, 2064),
                                       (3, 480), (300, 768)])
def test_int4_decode_is_weight_bit_for_bit(any_lib, rows, cols):
    fmt = get_format("int4")
    t = {f"w2_{k}": v for k, v in fmt.quantize(_w(rows, cols, rows + cols) * 10).items()}
    got = native.int4_decode(any_lib, t["w2_q"], t["w2_scale"], _garbage(rows, cols))
    assert torch.equal(_bits(got), _bits(fmt.weight(t, "w2", torch.float32)))


def _every_fp16_scale(cols: int, group: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """An int4 w2 whose scales are every positive finite fp16 (2^-24, the subnormals, the normals to 65504; padded
    with 1.0 to fill the last row) and whose codes are random bytes: [rows, cols / group] scales."""
    G = cols // group
    scales = torch.arange(1, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16)  # [31743]
    scales = torch.cat([scales, torch.ones(-len(scales) % G, dtype=torch.float16)]).reshape(-1, G).contiguous()
    q = torch.randint(0, 256, (scales.shape[0], cols // 2), generator=torch.Generator().manual_seed(seed),
                      dtype=torch.uint8)
    return {"w2_q": q, "w2_scale": scales}


@pytest.mark.parametrize("cols,group", [(64, 32), (48, 16), (40, 8)])
def test_int4_decode_every_fp16_scale(any_lib, cols, group):
    """int4's fp16 group scales: every positive finite value, subnormals included, widened exactly (F16C on the
    SIMD build, integer ops on the scalar one): bit for bit weight()."""
    t = _every_fp16_scale(cols, group)
    want = get_format("int4").weight(t, "w2", torch.float32)
    assert (want.abs().amax(dim=1) < 2.0**-14 * 8).sum() >= 1023 // (cols // group)  # the subnormal rows are there
    got = native.int4_decode(any_lib, t["w2_q"], t["w2_scale"], _garbage(*want.shape))
    assert torch.equal(_bits(got), _bits(want))


def test_int4_kernels_refuse_fp32_scales(lib):
    """The old layout's fp32 scales are not read as fp16 bit patterns by mistake."""
    t = get_format("int4").quantize(_w(8, 64, 0))
    for bad in (t["scale"].float(), t["scale"].repeat(1, 2)[:, ::2]):
        with pytest.raises(ValueError, match="fp16 scales"):
            native.int4_decode(lib, t["q"], bad, torch.empty(8, 64))
        with pytest.raises(ValueError, match="fp16 scales"):
            native.int4_gemv(lib, torch.randn(1, 64), t["q"], bad)


def test_mxfp4_decode_every_code_and_scale(any_lib):
    """Every byte value in every block position against every E8M0 scale 0..255: 2^-127 (its values subnormal), the
    normal range and 2^127..2^128 (6 x the scale overflows to inf as the reference's does); -0 stays -0."""
    blocks = torch.arange(256, dtype=torch.uint8).repeat(256 * 2).reshape(256, 32, 16)  # [256, 32, 16]
    blocks = blocks.roll(shifts=5, dims=2).contiguous()  # each byte also at another position of its block
    scales = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 32).contiguous()  # [256, 32]
    scales[1::2] = scales[1::2].flip(1)  # unequal scales along a row too
    scales = scales.roll(shifts=3, dims=1).contiguous()
    got = native.mxfp4_decode(any_lib, blocks, scales, _garbage(256, 1024))
    want = mxfp4.dequantize_reference(blocks, scales)
    assert torch.isinf(want).any() and (torch.signbit(want) & (want == 0)).any()
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("rows,cols", [(1, 32), (7, 64), (13, 2880), (130, 288)])
def test_mxfp4_decode_random(any_lib, rows, cols):
    blocks, scales = mxfp4.quantize(_w(rows, cols, rows * cols))
    got = native.mxfp4_decode(any_lib, blocks, scales, _garbage(rows, cols))
    assert torch.equal(_bits(got), _bits(mxfp4.dequantize_reference(blocks, scales)))


@pytest.mark.parametrize("rows,cols,block", [(7, 15, (2, 4)), (9, 33, (4, 16)), (130, 300, (128, 128)),
                                             (5, 17, (1, 1)), (256, 2048, (128, 128)), (11, 40, (3, 7))])
def test_fp8_decode_is_weight_bit_for_bit(any_lib, rows, cols, block):
    w, s = quantize_blocks(_w(rows, cols, rows + cols) * 40, block)
    got = native.fp8_decode(any_lib, w, s, block, _garbage(rows, cols))
    want = fp8_format(block).weight({"w2": w, "w2_scale": s}, "w2", torch.float32)
    assert torch.equal(_bits(got), _bits(want))


def test_fp8_decode_every_byte_and_huge_scales(any_lib):
    """All 254 finite e4m3 values (both zeros, subnormals, the largest), a partial block, unequal scales up to 1e36
    (scale x 2^8 would overflow: the decoder multiplies by 2^8 and the scale apart, each exact)."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].reshape(2, 127)  # [2, 127] without the two NaN patterns
    w8 = codes.view(torch.float8_e4m3fn)
    scale = torch.tensor([[0.37, 1.9e36], [3.1e-3, 1e-30]])  # [2, ceil(127/64)]
    want = fp8_format((1, 64)).weight({"w2": w8, "w2_scale": scale}, "w2", torch.float32)
    got = native.fp8_decode(any_lib, w8, scale, (1, 64), _garbage(2, 127))
    assert torch.equal(_bits(got), _bits(want))


def test_fp8_decode_w13_halves(lib):
    """w13's gate and up halves, each blocked from its own start (I = 200: the gate's last scale block is partial),
    through fp8_linear's two calls into one scratch: weight() for the whole w13."""
    from moechat.engine.quant import cpu

    I, H, block = 200, 96, (128, 32)
    fmt = fp8_format(block)
    w13 = _w(2 * I, H, 3)
    (a, sa), (b, sb) = quantize_blocks(w13[:I], block), quantize_blocks(w13[I:], block)
    t = {"w13": torch.cat([a, b]), "w13_scale": torch.cat([sa, sb])}
    x = torch.randn(3, H)
    got = fmt.linear(x, t, "w13")
    want = F.linear(x, fmt.weight(t, "w13", torch.float32))
    assert torch.equal(got, want)
    full = cpu.buffer("full", (2 * I, H), torch.float32)
    assert torch.equal(_bits(full), _bits(fmt.weight(t, "w13", torch.float32)))  # what that GEMM multiplied


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["int4", "mxfp4", "fp8"])
def test_threads_split_rows_and_change_nothing(lib, torch_threads, name):
    """A matrix large enough to split (4.7 MB of fp32 out: shares of >= 256 KB), 1029 rows (no multiple of any
    share count, nor of FP8's 128-row blocks): the same bits at 1, 2, 3 and 7 threads, and weight()'s."""
    rows, cols = 1029, 1152
    w = _w(rows, cols, 9)
    if name == "fp8":
        q, sc = quantize_blocks(w * 40, (128, 128))

        def dec(out):
            return native.fp8_decode(lib, q, sc, (128, 128), out)
        want = fp8_format((128, 128)).weight({"w2": q, "w2_scale": sc}, "w2", torch.float32)
    elif name == "mxfp4":
        b, sc = mxfp4.quantize(w)

        def dec(out):
            return native.mxfp4_decode(lib, b, sc, out)
        want = mxfp4.dequantize_reference(b, sc)
    else:
        t = {f"w2_{k}": v for k, v in get_format("int4").quantize(w).items()}

        def dec(out):
            return native.int4_decode(lib, t["w2_q"], t["w2_scale"], out)
        want = get_format("int4").weight(t, "w2", torch.float32)
    for n in (1, 2, 3, 7):
        torch_threads(n)
        assert torch.equal(_bits(dec(_garbage(rows, cols))), _bits(want)), n


def test_a_wrong_output_buffer_is_refused(lib):
    t = get_format("int4").quantize(_w(8, 64, 0))
    for bad in (torch.empty(8, 64, dtype=torch.bfloat16), torch.empty(8, 32), torch.empty(64, 8).t()):
        with pytest.raises(ValueError, match="contiguous fp32"):
            native.int4_decode(lib, t["q"], t["scale"], bad)


def _packed(name: str, which: str, rows: int, cols: int, block=(16, 32)):
    w = _w(rows, cols, rows + 3 * cols) * 4
    if name == "fp8":
        fmt = fp8_format(block)
        if which == "w13":
            half = rows // 2
            (a, sa), (b, sb) = quantize_blocks(w[:half], block), quantize_blocks(w[half:], block)
            return fmt, {"w13": torch.cat([a, b]), "w13_scale": torch.cat([sa, sb])}
        q, s = quantize_blocks(w, block)
        return fmt, {which: q, f"{which}_scale": s}
    if name == "mxfp4":
        b, s = mxfp4.quantize(w)
        return get_format("mxfp4"), {f"{which}_blocks": b, f"{which}_scales": s}
    fmt = get_format(name)
    return fmt, {f"{which}_{k}": v for k, v in fmt.quantize(w).items()}


DECODERS = ("int4_decode", "mxfp4_decode", "fp8_decode")


@pytest.mark.parametrize("name", ["int4", "mxfp4", "fp8"])
@pytest.mark.parametrize("which,rows,cols", [("w13", 2 * 40, 96), ("w2", 96, 64),
                                             ("w13", 2 * 72, 160)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [2, 7])
def test_many_token_linear_takes_the_decoder(lib, name, which, rows, cols, dtype, n, monkeypatch):
    """fmt.linear for n > 1 tokens (prefill): the native decoder ran (a counted call) and its result is bit for bit
    the torch decoders' (MOECHAT_NATIVE_DECODE=0: the same GEMM over the same matrix), within the stated tolerances
    of F.linear over weight(), with a bias, inside inference mode and out of it."""
    fmt, t = _packed(name, which, rows, cols)
    g = torch.Generator().manual_seed(n + rows)
    t[f"{which}_bias"] = torch.randn(rows, generator=g).to(dtype)
    x = torch.randn(n, cols, generator=g).to(dtype)
    calls = []
    for fn in DECODERS:
        real = getattr(native, fn)
        monkeypatch.setattr(native, fn, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    with torch.inference_mode():
        fast = fmt.linear(x, t, which)
    assert calls, "the native decoder did not run"
    monkeypatch.setenv(native.DECODE_ENV, "0")
    calls.clear()
    slow = fmt.linear(x, t, which)
    assert not calls and slow.dtype == fast.dtype == dtype
    assert torch.equal(fast, slow)
    want = F.linear(x.float(), fmt.weight(t, which, torch.float32), t[f"{which}_bias"].float())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(fast.float(), want, **tol)


def test_mxfp4_many_tokens_with_scales_past_the_torch_fast_range(lib):
    """Scales above 240 sent the torch path to its table decoder; the native one takes every scale: still F.linear
    over the reference bit for bit."""
    blocks, scales = mxfp4.quantize(_w(16, 64, 1))
    scales = scales.clone()
    scales[3, 1] = 250
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) / 8
    want = F.linear(x, mxfp4.dequantize_reference(blocks, scales))
    assert torch.isfinite(want).all() and torch.equal(mxfp4.linear_cpu(x, blocks, scales), want)


@pytest.mark.parametrize("name", ["int4", "mxfp4", "fp8"])
def test_no_library_takes_the_torch_decoders(name, monkeypatch, tmp_path):
    """No compiler: `decode_library()` is None and many tokens run the torch decoders, within the tolerances."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native.reset()
    try:
        assert native.decode_library() is None
        fmt, t = _packed(name, "w2", 96, 64)
        x = torch.randn(5, 64)
        want = F.linear(x, fmt.weight(t, "w2", torch.float32))
        torch.testing.assert_close(fmt.linear(x, t, "w2"), want, atol=1e-5, rtol=1e-5)
    finally:
        native.reset()


def test_the_decode_switch_is_narrow(monkeypatch):
    """MOECHAT_NATIVE_DECODE=0 turns off the many-token decoders only: one token keeps its native GEMV."""
    monkeypatch.setenv(native.DECODE_ENV, "0")
    assert native.decode_library() is None and native.library() is not None
    monkeypatch.setenv(native.DECODE_ENV, "1")
    assert native.decode_library() is native.library()
    monkeypatch.setenv(native.ENV, "0")
    assert native.decode_library() is None
