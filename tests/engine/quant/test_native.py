"""The native one-token kernels (quant/native.c via native.py) against each format's slow reference (`weight()` +
F.linear in fp32): within fp32 rounding of the sum (|err| <= 1e-6 x sum |x w| per output), on odd shapes (rows not a
multiple of the 4-row step, int4 groups of 16 and 8 with a tail past the last 32-element block, partial FP8 blocks,
w13's halves), both x dtypes, the SIMD build and the scalar one; the cached library reused, a damaged one rebuilt;
the torch fallback (MOECHAT_NATIVE=0, no compiler) silent, said by `status()`, and equal within the same bounds.
The SIMD build's 4-bit kernels with 32-element scales (int4 groups of 32, MXFP4) sum a bf16 x in integers, over
x rounded to 16 bits per block (native.c): their reference is F.linear over x rounded that way
(`native.round_x16`), and x itself is within the rounding's bound of it. On a CPU with AVX-512 BW that path's
64-byte loop (with and without VNNI) writes the AVX2 build's bits (block counts of every remainder, extremes, zero
and non-finite scales, any thread count) and is within x's rounding of the scalar build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from moechat.engine.quant import get_format, mxfp4, native
from moechat.engine.quant.fp8 import fp8_format, quantize_blocks

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the torch paths run (tested)")


def _close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """got [1, R] against F.linear(x, w) in fp32: each output within 1e-6 of its sum of |x w| (~8 fp32 ulps of the
    largest partial sum; a wrong code or scale is off by far more)."""
    xf = x.float()
    want = F.linear(xf, w, None if bias is None else bias.float())
    bound = 1e-6 * (xf.abs() @ w.abs().t()) + 1e-30
    err = (got.float() - want).abs()
    assert torch.isfinite(got).all()
    assert (err <= bound).all(), f"max error {float((err / bound).max()):.1f}x the bound"


def _kernel_x(lib, x: torch.Tensor, integer_path: bool) -> torch.Tensor:
    """The x a kernel sums over: round_x16(x) on the SIMD build's integer path (bf16 x), else x."""
    return native.round_x16(x).float() if integer_path and x.dtype == torch.bfloat16 and lib.moechat_simd() else x


def _x(cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(1, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _w(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) / cols**0.5


def _check_quantized(name: str, gemv, lib, rows: int, cols: int, dtype: torch.dtype) -> None:
    """The format's packer on a random [rows, cols] matrix; its native GEMV against weight() + F.linear."""
    fmt = get_format(name)
    t = {f"w2_{k}": v for k, v in fmt.quantize(_w(rows, cols, rows + cols)).items()}
    x = _x(cols, dtype, cols)
    integer_path = name in ("int4", "int8") and cols % 32 == 0
    _close(gemv(lib, x, t["w2_q"], t["w2_scale"]), _kernel_x(lib, x, integer_path), fmt.weight(t, "w2", torch.float32))


def test_this_machine_runs_the_native_kernels():
    assert native.status().startswith("native kernels"), native.status()


@pytest.mark.parametrize("rows,cols", [(1, 32), (7, 64), (9, 96), (13, 40), (6, 24), (5, 48), (4, 8), (37, 2064),
                                       (5, 352), (3, 480), (1536, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4(any_lib, rows, cols, dtype):
    _check_quantized("int4", native.int4_gemv, any_lib, rows, cols, dtype)


@pytest.mark.parametrize("rows,cols", [(1, 1), (7, 15), (9, 17), (5, 100), (3, 32), (11, 96), (1536, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8(any_lib, rows, cols, dtype):
    _check_quantized("int8", native.int8_gemv, any_lib, rows, cols, dtype)


def test_int8_integer_path_rounds_x_and_its_switch_keeps_fp32(lib, monkeypatch):
    """A bf16 x through int8 (inputs a multiple of 32) sums over round_x16(x) on the SIMD build: x's elements far
    below their block's largest are rounded (so not F.linear over x bit for bit); MOECHAT_INT8_I16=0 (read at load)
    switches the library to the fp32 path, whose sums are over x itself."""
    if not lib.moechat_simd():
        pytest.skip("the scalar build has no integer path")
    t = get_format("int8").quantize(_w(29, 128, 2))
    t["q"][:, 32:] = 0  # only the first block counts
    t["q"][:, 0] = 0  # ... and in it only the elements that round
    w = t["q"].float() * t["scale"][:, None]
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(1))
    x[0, 0] = 8.0
    x[0, 1:32] *= 1e-4  # rounded to the block's step, 2^-12: a large relative change
    x = x.bfloat16()
    xr = native.round_x16(x).float()
    exact = F.linear(x.float(), w)
    assert float((F.linear(xr, w) - exact).abs().max()) > 1e-3 * float(exact.abs().max())
    _close(native.int8_gemv(lib, x, t["q"], t["scale"]), xr, w)
    try:
        lib.moechat_set_int8_i16(0)
        _close(native.int8_gemv(lib, x, t["q"], t["scale"]), x, w)
    finally:
        lib.moechat_set_int8_i16(1)


@pytest.mark.parametrize("rows,cols,block", [(7, 15, (2, 4)), (9, 33, (4, 16)), (130, 300, (128, 128)),
                                             (5, 17, (1, 1)), (256, 2048, (128, 128)), (11, 40, (3, 7))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8(any_lib, rows, cols, block, dtype):
    w, s = quantize_blocks(_w(rows, cols, rows + cols) * 40, block)
    x = _x(cols, dtype, cols)
    y = torch.empty(rows)
    _close(native.fp8_gemv(any_lib, x, w, s, block, y)[None], x, fp8_format(block).weight({"w2": w, "w2_scale": s},
                                                                                         "w2", torch.float32))


def test_fp8_every_byte(any_lib):
    """All 254 finite e4m3 values (both zeros, subnormals, the largest), a partial block, unequal scales."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].reshape(2, 127)  # [2, 127] without the two NaN patterns
    w8 = codes.view(torch.float8_e4m3fn)
    scale = torch.tensor([[0.37, 1.9], [3.1e-3, 12.5]])  # [2, ceil(127/64)]
    x = _x(127, torch.float32, 1)
    want = fp8_format((1, 64)).weight({"w2": w8, "w2_scale": scale}, "w2", torch.float32)
    for k in range(127):  # each column alone: each byte's value (one product: x s w against x (w s), 2 roundings)
        xk = torch.zeros(1, 127)
        xk[0, k] = x[0, k]
        got = native.fp8_gemv(any_lib, xk, w8, scale, (1, 64), torch.empty(2))
        torch.testing.assert_close(got, want[:, k] * x[0, k], atol=0, rtol=2.5e-7)


@pytest.mark.parametrize("rows,cols", [(1, 32), (7, 64), (9, 96), (5, 352), (3, 480), (13, 2880)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4(any_lib, rows, cols, dtype):
    blocks, scales = mxfp4.quantize(_w(rows, cols, rows + cols))
    x = _x(cols, dtype, cols)
    _close(native.mxfp4_gemv(any_lib, x, blocks, scales), _kernel_x(any_lib, x, True),
           mxfp4.dequantize_reference(blocks, scales))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_every_code_and_scale(any_lib, dtype):
    """Every byte value against every scale 0..252 (2^-127, subnormal, to 2^125: past it 6 x the scale overflows the
    reference's fp32 weight), one column at a time: a product by a power of two, exact (bf16 on the SIMD build: the
    integer path, its scale made from the E8M0 byte in integer ops)."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (253, 2, 16), generator=g, dtype=torch.uint8)
    blocks[:, 0] = torch.arange(256, dtype=torch.uint8).view(16, 16).repeat(16, 1)[:253]
    scales = torch.stack([torch.arange(253), torch.arange(253).flip(0)], 1).to(torch.uint8)  # [253, 2]
    w = mxfp4.dequantize_reference(blocks, scales)  # [253, 64]
    for k in (0, 1, 5, 30, 31, 33, 62):
        xk = torch.zeros(1, 64, dtype=dtype)
        xk[0, k] = 0.75
        got = native.mxfp4_gemv(any_lib, xk, blocks, scales)
        assert torch.equal(got[0], w[:, k] * 0.75), k


@pytest.mark.parametrize("cols,group", [(64, 32), (48, 16), (40, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_every_fp16_scale(any_lib, cols, group, dtype):
    """Every positive finite fp16 scale (subnormals included) against random codes, one column at a time: x = 0.75
    there (exact in bf16 and in the integer path's 16 bits), so each output is code x scale x 0.75 rounded once on
    every path (groups of 32 with a bf16 x: the integer path, its fp16 scales widened by F16C eight at a time)."""
    G = cols // group
    scales = torch.arange(1, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16)  # [31743]
    scales = torch.cat([scales, torch.ones(-len(scales) % G, dtype=torch.float16)]).reshape(-1, G).contiguous()
    q = torch.randint(0, 256, (scales.shape[0], cols // 2), generator=torch.Generator().manual_seed(cols),
                      dtype=torch.uint8)
    w = get_format("int4").weight({"w2_q": q, "w2_scale": scales}, "w2", torch.float32)  # [rows, cols]
    for k in sorted({0, 1, group - 1, group, cols - 2, cols - 1}):
        xk = torch.zeros(1, cols, dtype=dtype)
        xk[0, k] = 0.75
        got = native.int4_gemv(any_lib, xk, q, scales)
        assert torch.equal(got[0], w[:, k] * 0.75), k


def _four_bit(name: str, rows: int, cols: int):
    """(gemv(lib, x), weight fp32) of a random int4 (groups of 32), MXFP4 or int8 matrix: the integer paths."""
    w = _w(rows, cols, 7)
    if name == "int8":
        t = get_format("int8").quantize(w)
        return (lambda lib, x: native.int8_gemv(lib, x, t["q"], t["scale"])), t["q"].float() * t["scale"][:, None]
    if name == "mxfp4":
        blocks, scales = mxfp4.quantize(w)
        return (lambda lib, x: native.mxfp4_gemv(lib, x, blocks, scales)), mxfp4.dequantize_reference(blocks, scales)
    t = {f"w2_{k}": v for k, v in get_format("int4").quantize(w).items()}
    return (lambda lib, x: native.int4_gemv(lib, x, t["w2_q"], t["w2_scale"])), get_format("int4").weight(
        t, "w2", torch.float32)


@pytest.mark.parametrize("name", ["int4", "mxfp4", "int8"])
def test_integer_path_edges(lib, name):
    """bf16 blocks the rounding treats apart: all zero, subnormal, below 2^-113 (rounded in scalar code), a largest
    value of 1 - 2^-8 (2^15 - 128 as an integer), huge, one element alone, elements far below their block's largest
    (rounded), and a lone odd last block; each output
    against F.linear over round_x16(x), and against x itself within the rounding's bound (half a step per element).
    An fp32 x takes the fp32 path: exact."""
    cols = 32 * 9
    gemv, w = _four_bit(name, 37, cols)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(3))
    x[0, 0:32] = 0.0
    x[0, 32:64] *= 1e-40
    x[0, 64:96] *= 2.0**-118
    x[0, 96:128] = torch.linspace(-0.5, 1 - 2**-8, 32)
    x[0, 128:160] *= 1e30
    x[0, 160:192] = 0.0
    x[0, 170] = 0.3
    x[0, 192:224] *= 1e-3  # far below the block's largest: rounded to its step
    x[0, 200] = 1.0
    x = x.bfloat16()
    got = gemv(lib, x)
    _close(got, native.round_x16(x).float(), w)
    b = x.double().reshape(-1, 32)
    _, e = torch.frexp(b.abs().amax(dim=1, keepdim=True).float())
    half_step = torch.ldexp(torch.ones_like(b), e.double() - 16).reshape(1, cols)  # [1, cols]
    bound = 1e-6 * (x.abs().double() @ w.abs().double().t()) + half_step @ w.abs().double().t() + 1e-30
    assert ((got.double() - F.linear(x.double(), w.double())).abs() <= bound).all()
    assert not torch.equal(native.round_x16(x), x.double())  # some element did round
    _close(gemv(lib, x.float()), x.float(), w)


@pytest.mark.parametrize("name", ["int4", "mxfp4", "int8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_integer_path_non_finite_x(lib, name, bad):
    """A NaN or infinite element makes every output NaN (as the fp32 sums would make them NaN or infinite): the
    rounding never turns it into a finite number."""
    gemv, _ = _four_bit(name, 9, 96)
    x = torch.randn(1, 96).bfloat16()
    x[0, 40] = bad
    assert torch.isnan(gemv(lib, x)).all()


@pytest.mark.parametrize("name", ["int8", "int4", "fp8", "mxfp4"])
def test_bf16_output_is_the_fp32_output_rounded(any_lib, name):
    """y written as bf16 by the kernel (no .to() after it) is bit for bit its fp32 y rounded by torch; NaN stays NaN."""
    rows, cols = 67, 160
    w = _w(rows, cols, 5) * 30
    if name == "fp8":
        q, sc = quantize_blocks(w, (16, 64))

        def gemv(x, dtype):
            return native.fp8_gemv(any_lib, x, q, sc, (16, 64), torch.empty(rows, dtype=dtype))[None]
    elif name == "mxfp4":
        b, sc = mxfp4.quantize(w)

        def gemv(x, dtype):
            return native.mxfp4_gemv(any_lib, x, b, sc, dtype)
    else:
        t = get_format(name).quantize(w)
        fn = native.int8_gemv if name == "int8" else native.int4_gemv

        def gemv(x, dtype):
            return fn(any_lib, x, t["q"], t["scale"], dtype)
    for x in (_x(cols, torch.bfloat16, 2), _x(cols, torch.float32, 2)):
        want = gemv(x, torch.float32).to(torch.bfloat16)
        got = gemv(x, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))
    x = _x(cols, torch.bfloat16, 2)
    x[0, 7] = float("nan")
    assert torch.isnan(gemv(x, torch.bfloat16)).all() and torch.isnan(gemv(x, torch.float32)).all()


@pytest.mark.parametrize("name", ["int8", "int4", "fp8", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_takes_the_kernel_and_the_fallback_agrees(lib, name, dtype, monkeypatch):
    """fmt.linear for one token (the engine's call) with biases and w13's halves: native and torch paths both
    within the bound of the reference, and the native one really ran (a counted call)."""
    H, I = 96, 64
    g = torch.Generator().manual_seed(1)
    w13, w2 = torch.randn(2 * I, H, generator=g) / H**0.5, torch.randn(H, I, generator=g) / I**0.5
    if name == "fp8":
        fmt = fp8_format((16, 32))
        (a, sa), (b, sb) = quantize_blocks(w13[:I], fmt.block), quantize_blocks(w13[I:], fmt.block)
        d, sd = quantize_blocks(w2, fmt.block)
        t = {"w13": torch.cat([a, b]), "w13_scale": torch.cat([sa, sb]), "w2": d, "w2_scale": sd}
    elif name == "mxfp4":
        fmt = get_format("mxfp4")
        (b13, s13), (b2, s2) = mxfp4.quantize(w13), mxfp4.quantize(w2)
        t = {"w13_blocks": b13, "w13_scales": s13, "w2_blocks": b2, "w2_scales": s2}
    else:
        fmt = get_format(name)
        t = {f"{p}_{k}": v for p, w in (("w13", w13), ("w2", w2)) for k, v in fmt.quantize(w).items()}
    t["w13_bias"], t["w2_bias"] = torch.randn(2 * I, generator=g).to(dtype), torch.randn(H, generator=g).to(dtype)
    calls = []
    for fn in ("int4_gemv", "int8_gemv", "fp8_gemv", "mxfp4_gemv"):
        real = getattr(native, fn)
        monkeypatch.setattr(native, fn, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    for which, cols in (("w13", H), ("w2", I)):
        x = _x(cols, dtype, cols)
        w = fmt.weight(t, which, torch.float32)
        monkeypatch.setenv("MOECHAT_NATIVE", "1")
        n = len(calls)
        with torch.inference_mode():
            got = fmt.linear(x, t, which)
        assert len(calls) > n and got.dtype == dtype
        monkeypatch.setenv("MOECHAT_NATIVE", "0")
        slow = fmt.linear(x, t, which)
        if dtype == torch.float32:
            _close(got, _kernel_x(lib, x, name in ("int4", "mxfp4")), w, t[f"{which}_bias"])
            _close(slow, x, w, t[f"{which}_bias"])
        else:  # both round an fp32 result to bf16 once (int8's torch path: bf16 math, looser)
            want = F.linear(x.float(), w, t[f"{which}_bias"].float())
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)
            torch.testing.assert_close(slow.float(), want, atol=2e-2, rtol=1e-2)


def test_status_says_which_path(monkeypatch):
    monkeypatch.setenv("MOECHAT_NATIVE", "0")
    assert native.library() is None
    assert native.status() == "torch paths: MOECHAT_NATIVE=0"
    monkeypatch.setenv("MOECHAT_NATIVE", "1")
    assert native.library() is not None and native.status().startswith("native kernels")


def test_no_compiler_is_a_silent_fallback(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native.reset()
    try:
        assert native.library() is None
        assert native.status().startswith("torch paths:") and "compiler" in native.status()
        fmt = get_format("int4")
        t = {f"w2_{k}": v for k, v in fmt.quantize(_w(8, 64, 0)).items()}
        x = _x(64, torch.float32, 0)
        _close(fmt.linear(x, t, "w2"), x, fmt.weight(t, "w2", torch.float32))
    finally:
        native.reset()


def test_a_failed_build_is_a_silent_fallback(monkeypatch, tmp_path):
    """A compiler that fails (here: `false`) leaves the torch paths and says why."""
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` binary")
    monkeypatch.setenv("CC", false)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native.reset()
    try:
        assert native.library() is None
        assert native.status().startswith("torch paths: the kernels did not compile")
    finally:
        native.reset()


def test_a_build_without_simd_or_source_is_a_silent_fallback(monkeypatch, scalar_lib, tmp_path):
    """A compiler that does not target AVX2+FMA+F16C (another CPU) builds the scalar code: the torch paths run."""
    monkeypatch.setattr(native, "build_and_load", lambda *a, **k: scalar_lib)
    native.reset()
    try:
        assert native.library() is None
        assert native.status() == "torch paths: the compiler did not target AVX2+FMA+F16C on this CPU"
        monkeypatch.setattr(native, "SOURCE", tmp_path / "native.c")  # an install without the C file
        native.reset()
        assert native.library() is None and native.status() == ("torch paths: the kernel source native.c is not "
                                                                 "installed")
    finally:
        native.reset()


def test_the_library_is_cached_and_a_damaged_one_rebuilt(tmp_path, monkeypatch):
    path = native.build(directory=tmp_path)
    assert path.parent == tmp_path and path.name.startswith("kernels-") and path.suffix == ".so"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".sha256"]  # no temp file left
    assert native.verified(path)
    built = path.stat().st_mtime_ns

    def no_compile(*a, **k):
        raise AssertionError("compiled again")

    with monkeypatch.context() as m:
        m.setattr(subprocess, "run", no_compile)
        assert native.build(directory=tmp_path) == path  # reused, not compiled
    assert path.stat().st_mtime_ns == built

    # damaged before this process loaded it (a crash mid-copy, a full disk); replaced, never written in place: a
    # library a process has mapped must not change under it
    (tmp_path / "damaged").write_bytes(b"not a shared library")
    (tmp_path / "damaged").replace(path)
    lib = native.build_and_load(directory=tmp_path)
    assert lib.moechat_abi() == native.ABI and path.read_bytes()[:4] == b"\x7fELF"
    # another source, flags or CPU is another file: a stale build is never picked up
    other = native.library_path(b"int moechat_abi(void) { return 0; }", native.FLAGS, shutil.which("cc"), tmp_path)
    assert other != path


def test_non_contiguous_input(lib):
    fmt = get_format("int4")
    t = {f"w2_{k}": v for k, v in fmt.quantize(_w(8, 64, 3)).items()}
    x = torch.randn(64, 2)[:, :1].t()  # [1, 64], strided
    assert not x.is_contiguous()
    _close(fmt.linear(x, t, "w2"), x, fmt.weight(t, "w2", torch.float32))
    xb = torch.randn(64, 2).bfloat16()[:, :1].t()  # [1, 64], strided
    assert not xb.is_contiguous()
    _close(native.int4_gemv(lib, xb, t["w2_q"], t["w2_scale"]), _kernel_x(lib, xb, True),
           fmt.weight(t, "w2", torch.float32))


@pytest.fixture
def torch_threads():
    """Set torch's intra-op thread count (which the GEMVs follow) for one test, then put it back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _big(name: str):
    """(gemv(x, dtype), packed bytes) of a matrix large enough to be split (1.5-3 MB; shares of >= 256 KB)."""
    rows, cols = 1536, 2048
    w = _w(rows, cols, 11)
    if name == "fp8":
        q, sc = quantize_blocks(w, (128, 128))
        return (lambda lib, x: native.fp8_gemv(lib, x, q, sc, (128, 128), torch.empty(rows))[None]), q.numel()
    if name == "mxfp4":
        b, sc = mxfp4.quantize(w)
        return (lambda lib, x: native.mxfp4_gemv(lib, x, b, sc)), b.numel()
    t = get_format(name).quantize(w)
    fn = native.int8_gemv if name == "int8" else native.int4_gemv
    return (lambda lib, x: fn(lib, x, t["q"], t["scale"])), t["q"].numel()


@pytest.mark.parametrize("name", ["int8", "int4", "fp8", "mxfp4"])
def test_threads_split_rows_and_change_nothing(lib, torch_threads, name):
    """One call's rows split over 1, 2, 3 or 7 threads (more than this machine's cores: shares of 4 rows, or of
    FP8's 128-row blocks): every output bit for bit the one-thread output, for both x dtypes."""
    gemv, _ = _big(name)
    for dtype in (torch.bfloat16, torch.float32):
        x = _x(2048, dtype, 4)
        torch_threads(1)
        want = gemv(lib, x)
        for n in (2, 3, 7, 1):
            torch_threads(n)
            assert torch.equal(gemv(lib, x), want), (n, dtype)


def test_threads_concurrent_calls(lib, torch_threads):
    """Two Python threads calling at once (the GIL released): one uses the pool, the other runs alone; both right."""
    import threading

    torch_threads(2)
    gemv, _ = _big("int4")
    xs = [_x(2048, torch.bfloat16, s) for s in range(8)]
    torch_threads(1)
    want = [gemv(lib, x) for x in xs]
    torch_threads(2)
    got: dict[int, list] = {0: [], 1: []}

    def work(k: int) -> None:
        for _ in range(5):
            got[k].append([gemv(lib, x) for x in xs])

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert all(torch.equal(a, b) for k in (0, 1) for run in got[k] for a, b in zip(run, want, strict=True))


def test_threads_survive_fork(lib, torch_threads):
    """A process forked while the pool runs computes on: its child has no workers and starts its own (the child
    runs no torch op that would use OpenMP, which is not fork-safe itself)."""
    import os
    import select

    torch_threads(2)
    t = get_format("int4").quantize(_w(1536, 2048, 11))
    x = _x(2048, torch.bfloat16, 1)
    want = native.int4_gemv(lib, x, t["q"], t["scale"])  # the parent's pool is running now
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one threaded call, its bytes to the parent
        try:
            y = native.int4_gemv(lib, x, t["q"], t["scale"])
            os.write(w, bytes(y.view(torch.uint8).flatten().tolist()))
        finally:
            os._exit(0)
    os.close(w)
    got = b""
    while select.select([r], [], [], 60)[0]:
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        got += chunk
    os.close(r)
    os.waitpid(pid, 0)
    assert got == bytes(want.view(torch.uint8).flatten().tolist())


def test_a_truncated_library_is_rebuilt_not_a_sigbus(tmp_path):
    """What a power loss after the rename leaves (the name, half of the bytes): dlopen would map it past its end and
    the process die of SIGBUS on every run; the sidecar's size and SHA-256 say it is damaged and it is rebuilt."""
    path = native.build(directory=tmp_path / "moechat" / "native")
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "MOECHAT_NATIVE": "1"}
    done = subprocess.run([sys.executable, "-c", "from moechat.engine.quant import native; print(native.status())"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -7: SIGBUS
    assert done.stdout.startswith("native kernels") and str(path) in done.stdout
    assert path.stat().st_size == size and native.verified(path)
    # a library without its sidecar (written by an older moechat, or a crash before the sidecar) is rebuilt too
    native.sidecar_path(path).unlink()
    with open(path, "r+b") as f:
        f.truncate(size // 3)
    assert native.build(directory=path.parent) == path and native.verified(path) and path.stat().st_size == size


def test_parallel_for_covers_every_unit_once(lib, torch_threads):
    """moechat_parallel_for (the companions' pool, native_*.c): fn gets disjoint ranges cut at multiples of `align`
    that cover [0, units) exactly, at most one a thread, whichever thread runs them; an error return is the call's."""
    import ctypes
    import threading

    fn_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
    lib.moechat_parallel_for.argtypes = [fn_t, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    lib.moechat_parallel_for.restype = ctypes.c_int
    for n in (1, 2, 3):
        torch_threads(n)
        native._threads(lib)
        seen, lock, idents = [], threading.Lock(), set()

        def fn(ctx, a, b):
            with lock:
                seen.append((a, b))
                idents.add(threading.get_ident())
            return 0

        cb = fn_t(fn)
        assert lib.moechat_parallel_for(cb, None, 1001, 8, 1 << 24) == 0
        seen.sort()
        assert seen[0][0] == 0 and seen[-1][1] == 1001 and len(seen) <= n
        assert all(a % 8 == 0 and a < b for a, b in seen)
        assert all(p[1] == q[0] for p, q in zip(seen, seen[1:]))
        assert lib.moechat_parallel_for(fn_t(lambda ctx, a, b: 7 if a == 0 else 0), None, 64, 8, 1 << 24) == 7


# -- the integer path's AVX-512 loop (native.c i16_quad) against the AVX2 one and the scalar build ------------------
AVX2_FLAGS = ("-O3", "-march=x86-64-v3", "-shared", "-fPIC", "-fno-math-errno")  # AVX2 + FMA + F16C, no AVX-512
I16_ISA = {0: "scalar", 1: "AVX2", 2: "AVX-512BW", 3: "AVX-512 VNNI"}  # moechat_i16_isa()


def _cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo").read().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _has_avx512() -> bool:
    return {"avx512f", "avx512bw"} <= _cpu_flags()


@pytest.fixture(scope="module")
def avx2_lib():
    """The kernels as an AVX2-only x86-64 CPU builds them (cached on disk like the default build)."""
    if "avx2" not in _cpu_flags():
        pytest.skip("this CPU has no AVX2")
    lib = native.build_and_load(AVX2_FLAGS)
    assert I16_ISA[lib.moechat_i16_isa()] == "AVX2"
    return lib


@pytest.fixture(scope="module")
def avx512_libs(lib):
    """The default build (VNNI's vpdpbusd where the CPU has it) and the AVX-512BW one without VNNI (vpmaddubsw +
    vpmaddwd: a Skylake-X); skipped on a CPU without AVX-512 BW, whose default build is the AVX2 one."""
    if not _has_avx512():
        pytest.skip("this CPU has no AVX-512 F + BW: the default build is the AVX2 one (tested against the scalar one)")
    libs = {"default": lib, "no-vnni": native.build_and_load(native.FLAGS + ("-mno-avx512vnni",))}
    assert I16_ISA[libs["no-vnni"].moechat_i16_isa()] == "AVX-512BW"
    return libs


def test_the_default_build_takes_the_widest_integer_loop(lib, scalar_lib):
    """-march=native builds the AVX-512 loop where the CPU has AVX-512 F + BW (with VNNI where it has that), else the
    AVX2 one; the scalar build has no integer path."""
    flags = _cpu_flags()
    want = ("AVX-512 VNNI" if "avx512_vnni" in flags else "AVX-512BW") if _has_avx512() else "AVX2"
    assert I16_ISA[lib.moechat_i16_isa()] == want
    assert I16_ISA[scalar_lib.moechat_i16_isa()] == "scalar"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # NaN == NaN, -0 != +0


def _random_4bit(name: str, rows: int, cols: int, seed: int):
    """(gemv(lib, x), weight fp32) of random codes with random scales: int4 fp16 scales of mixed magnitudes, MXFP4
    E8M0 scales 118..133."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
    if name == "mxfp4":
        scales = torch.randint(118, 134, (rows, cols // 32), generator=g, dtype=torch.uint8)
        blocks = codes.view(rows, cols // 32, 16)
        return (lambda lib, x: native.mxfp4_gemv(lib, x, blocks, scales)), mxfp4.dequantize_reference(blocks, scales)
    scales = (torch.randn(rows, cols // 32, generator=g) * 10.0 ** torch.randint(-4, 1, (rows, 1), generator=g)).half()
    t = {"w2_q": codes, "w2_scale": scales}
    return (lambda lib, x: native.int4_gemv(lib, x, codes, scales)), get_format("int4").weight(t, "w2", torch.float32)


def _within_scalar(got: torch.Tensor, want_scalar: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """The integer path's output against the scalar build's (fp32 sums over x itself): within fp32 rounding of
    both sums (1e-6 of sum |x w| each) plus x's rounding to 16 bits (half a step of each block, times |w|)."""
    b = x.double().reshape(-1, 32)
    _, e = torch.frexp(b.abs().amax(dim=1, keepdim=True).float())
    half_step = torch.ldexp(torch.ones_like(b), e.double() - 16).reshape(1, -1)  # [1, cols]
    bound = 2e-6 * (x.abs().double() @ w.abs().double().t()) + half_step @ w.abs().double().t() + 1e-30
    assert ((got.double() - want_scalar.double()).abs() <= bound).all()


@pytest.mark.parametrize("name", ["int4", "mxfp4"])
@pytest.mark.parametrize("rows", [1, 3, 37])
@pytest.mark.parametrize("blocks", [1, 2, 3, 4, 5, 7, 8, 9, 15, 17, 24, 65, 90])
def test_avx512_writes_the_avx2_bits(lib, avx2_lib, avx512_libs, scalar_lib, name, rows, blocks):
    """Block counts of every remainder by the 4-block quad and the 8-block step (an odd last block, a last pair, a
    last quad), rows of no multiple: every AVX-512 build's outputs bit for bit the AVX2 build's (the same int32
    lanes in the same fp32 order), and within the rounding of x of the scalar build's."""
    cols = 32 * blocks
    gemv, w = _random_4bit(name, rows, cols, rows * 1000 + blocks)
    x = (torch.randn(1, cols, generator=torch.Generator().manual_seed(blocks)) *
         torch.logspace(-3, 3, cols // 32).repeat_interleave(32)).bfloat16()  # blocks of every magnitude
    want = gemv(avx2_lib, x)
    for which, l in avx512_libs.items():
        assert torch.equal(_bits(gemv(l, x)), _bits(want)), which
    _close(want, native.round_x16(x).float(), w)
    _within_scalar(want, gemv(scalar_lib, x), x, w)


@pytest.mark.parametrize("name", ["int4", "mxfp4"])
def test_avx512_extremes(lib, avx2_lib, avx512_libs, name):
    """The largest 16-bit x (1 - 2^-8 of its block's power of two: |q| = 32640, high byte -128 or 127) against the
    largest and smallest codes (int4 15 and 0; MXFP4 +6 and -6: u = 24 and 0): no byte product sum saturates
    (vpmaddubsw) or wraps; each output equal on every build and to F.linear over round_x16(x)."""
    cols, rows = 32 * 9, 8
    codes = torch.tensor([0xFF, 0x00, 0x0F, 0xF0, 0x77, 0x88, 0x7F, 0xF7], dtype=torch.uint8)
    codes = codes[:, None].expand(rows, cols // 2).contiguous()  # [rows, cols/2]: one byte a row
    if name == "mxfp4":
        scales = torch.full((rows, cols // 32), 127, dtype=torch.uint8)
        blocks = codes.view(rows, cols // 32, 16)
        w = mxfp4.dequantize_reference(blocks, scales)
        gemv = lambda l, x: native.mxfp4_gemv(l, x, blocks, scales)  # noqa: E731
    else:
        scales = torch.ones(rows, cols // 32, dtype=torch.float16)
        w = get_format("int4").weight({"w2_q": codes, "w2_scale": scales}, "w2", torch.float32)
        gemv = lambda l, x: native.int4_gemv(l, x, codes, scales)  # noqa: E731
    top = 1 - 2**-8
    for signs in ([1.0] * cols, [-1.0] * cols, [(-1.0) ** k for k in range(cols)]):
        x = (torch.tensor(signs) * top).reshape(1, cols).bfloat16()
        want = gemv(avx2_lib, x)
        for which, l in avx512_libs.items():
            assert torch.equal(_bits(gemv(l, x)), _bits(want)), which
        _close(want, native.round_x16(x).float(), w)


def test_avx512_zero_and_non_finite_scales(lib, avx2_lib, avx512_libs):
    """int4 fp16 scales 0, -0, subnormal, the largest, inf, -inf and NaN; MXFP4's E8M0 bytes 0, 1 (subnormal scales),
    2, 127, 254, 255: every build the same bit patterns (NaN and infinite outputs included)."""
    rows, cols = 7, 32 * 11
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
    special = torch.tensor([0.0, -0.0, 2.0**-24, 65504.0, float("inf"), -float("inf"), float("nan")],
                           dtype=torch.float16)
    s4 = (torch.rand(rows, cols // 32, generator=g) + 0.5).half()
    s4[:, 3] = special  # one block a row
    s4[2, :] = special[4]  # a row of infinities
    e8 = torch.tensor([0, 1, 2, 127, 254, 255, 130], dtype=torch.uint8)[:, None].expand(rows, cols // 32).contiguous()
    x = torch.randn(1, cols, generator=g).bfloat16()
    for gemv in (lambda l: native.int4_gemv(l, x, codes, s4),
                 lambda l: native.mxfp4_gemv(l, x, codes.view(rows, cols // 32, 16), e8)):
        want = gemv(avx2_lib)
        assert torch.isnan(want).any() and torch.isfinite(want).any()
        for which, l in avx512_libs.items():
            assert torch.equal(_bits(gemv(l)), _bits(want)), which


@pytest.mark.parametrize("name", ["int4", "mxfp4"])
def test_avx512_any_thread_count_writes_the_avx2_bits(lib, avx2_lib, avx512_libs, torch_threads, name):
    """An expert-sized matrix (1536 x 2048) split over 1, 2 or 3 threads (each share's x16 made again): every
    output bit for bit the AVX2 build's on one thread."""
    gemv, _ = _random_4bit(name, 1536, 2048, 9)
    x = _x(2048, torch.bfloat16, 2)
    torch_threads(1)
    want = gemv(avx2_lib, x)
    for n in (1, 2, 3):
        torch_threads(n)
        for which, l in avx512_libs.items():
            assert torch.equal(_bits(gemv(l, x)), _bits(want)), (which, n)
    torch_threads(1)
