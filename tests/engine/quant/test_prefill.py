"""The many-token kernels (native_prefill.c through quant/prefill.py) against each format's weight(): the decoded
tile bit for bit (x = the identity), random x within the stated bound of F.linear(x, weight()) (tails in rows,
tokens and input; int4 groups 32/16/8; FP8 partial blocks and w13's halves; MXFP4 every scale), on the SIMD build
and the scalar one; the same bits at 1, 2 and 3 threads and for a token whatever else is in its batch; each
format's many-token linear taking the kernel, its bias and bf16 rounding; MOECHAT_PREFILL_KERNEL=0 the old path."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from moechat.engine.quant import get_format, mxfp4, native, prefill
from moechat.engine.quant.fp8 import fp8_format, quantize_blocks

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the decode-then-GEMM path runs")


def _w(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) / cols**0.5


def _x(T: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(T, cols, generator=torch.Generator().manual_seed(seed))


def _packed(name: str, rows: int, cols: int, seed: int, block=(16, 24)):
    """(format, tensors as `w2`, the kernel's call x -> y fp32, weight() fp32) for one projection."""
    w = _w(rows, cols, seed)
    if name == "mxfp4":
        b, s = mxfp4.quantize(w * 50)
        s = torch.randint(100, 140, s.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
        t = {"w2_blocks": b, "w2_scales": s}
        return get_format("mxfp4"), t, lambda lib, x: prefill.mxfp4(lib, x, b, s)
    if name == "fp8":
        q, s = quantize_blocks(w, block)
        t = {"w2": q, "w2_scale": s}
        return fp8_format(block), t, lambda lib, x: prefill.fp8(lib, x, q.view(torch.uint8), s, block, None)
    fmt = get_format(name)
    t = {f"w2_{k}": v for k, v in fmt.quantize(w).items()}
    if name == "int4":
        return fmt, t, lambda lib, x: prefill.int4(lib, x, t["w2_q"], t["w2_scale"])
    return fmt, t, lambda lib, x: prefill.int8(lib, x, t["w2_q"], t["w2_scale"])


SHAPES = {"int4": [(5, 64), (9, 48), (3, 40), (13, 2080)], "mxfp4": [(5, 64), (9, 96), (7, 2048)],
          "fp8": [(5, 64), (37, 100), (6, 2050)], "int8": [(5, 64), (9, 33), (7, 2051)]}
CASES = [(n, r, c) for n, shapes in SHAPES.items() for r, c in shapes]


@pytest.mark.parametrize("name,rows,cols", [(n, r, c) for n, r, c in CASES if c <= 100])
def test_decoded_tile_is_weight_bit_for_bit(any_lib, name, rows, cols):
    """x = the identity: each output is one product w x 1 plus exact zeros, so y^T is the decoded tile itself."""
    fmt, t, run = _packed(name, rows, cols, rows * cols)
    got = run(any_lib, torch.eye(cols))  # [cols, rows]
    assert torch.equal(got.t(), fmt.weight(t, "w2", torch.float32))


@pytest.mark.parametrize("T", [2, 7, 13])
@pytest.mark.parametrize("name,rows,cols", CASES)
def test_within_the_bound_of_the_reference(any_lib, name, rows, cols, T):
    fmt, t, run = _packed(name, rows, cols, rows + cols)
    x = _x(T, cols, T)
    w = fmt.weight(t, "w2", torch.float32)
    want = F.linear(x, w)
    err = (run(any_lib, x) - want).abs()
    assert bool((err <= prefill.bound(x, w)).all())
    # the stated bound is the worst case; the sums seen are far inside it
    assert float(err.max()) <= 1e-4 * float(want.abs().max())


def test_fp8_w13_halves_each_blocked_from_their_own_start(lib):
    I, H, block = 200, 96, (128, 32)
    fmt = fp8_format(block)
    w13 = _w(2 * I, H, 3)
    (a, sa), (b, sb) = quantize_blocks(w13[:I], block), quantize_blocks(w13[I:], block)
    t = {"w13": torch.cat([a, b]), "w13_scale": torch.cat([sa, sb])}
    w = fmt.weight(t, "w13", torch.float32)
    got = prefill.fp8(lib, torch.eye(H), t["w13"].view(torch.uint8), t["w13_scale"], block, I)
    assert torch.equal(got.t(), w)
    x = _x(5, H, 1)
    assert bool(((prefill.fp8(lib, x, t["w13"].view(torch.uint8), t["w13_scale"], block, I) - F.linear(x, w)).abs()
                 <= prefill.bound(x, w)).all())


def test_mxfp4_every_scale(lib):
    """Every E8M0 scale 0..247 (2^-127 .. 2^120, subnormal products included; above, 6 x the scale overflows and the
    identity's 0 x inf would be NaN) through the identity: weight()."""
    g = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (62, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.arange(248, dtype=torch.int32).to(torch.uint8).reshape(62, 4)
    got = prefill.mxfp4(lib, torch.eye(128), blocks, scales)
    assert torch.equal(got.t(), mxfp4.dequantize_reference(blocks, scales))


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["int4", "mxfp4", "fp8", "int8"])
def test_same_bits_at_any_thread_count_and_in_any_batch(lib, torch_threads, name):
    _, _, run = _packed(name, 516, 512, 7, block=(128, 128))  # 516 rows: a ragged last row block
    x = _x(14, 512, 2)
    outs = []
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        outs.append(run(lib, x))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    torch.set_num_threads(1)
    alone = torch.cat([run(lib, x[i : i + 1].repeat(2, 1))[:1] for i in range(0, 14, 5)])  # each in a batch of 2
    assert torch.equal(alone, outs[0][0:14:5])


def _tensors13(name: str, rows: int, cols: int):
    fmt, t, _ = _packed(name, rows, cols, 11, block=(8, 32))
    return fmt, {k.replace("w2", "w13"): v for k, v in t.items()}


@pytest.mark.parametrize("name,fn", [("int4", "int4"), ("mxfp4", "mxfp4"), ("fp8", "fp8")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_token_linear_takes_the_kernel(lib, name, fn, dtype, monkeypatch):
    fmt, t = _tensors13(name, 48, 64)
    t["w13_bias"] = torch.randn(48)
    x = _x(6, 64, 3).to(dtype)
    calls = []
    real = getattr(prefill, fn)
    monkeypatch.setattr(prefill, fn, lambda *a, **k: calls.append(1) or real(*a, **k))
    got = fmt.linear(x, t, "w13")
    assert calls and got.dtype == dtype
    w = fmt.weight(t, "w13", torch.float32)
    kernel = real(lib, x, *_args(name, t))
    assert torch.equal(got, (kernel + t["w13_bias"]).to(dtype))  # fp32 sums + the bias in fp32, rounded once
    want = F.linear(x.float(), w, t["w13_bias"])
    integer = dtype == torch.bfloat16 and name in ("int4", "mxfp4")  # x rounded to int8 blocks (test_prefill_int.py)
    bound = prefill.bound_q8(x.float(), w).float() if integer else prefill.bound(x.float(), w)
    assert bool(((kernel + t["w13_bias"] - want).abs() <= bound * 2).all())


def _args(name: str, t):
    if name == "int4":
        return t["w13_q"], t["w13_scale"]
    if name == "mxfp4":
        return t["w13_blocks"], t["w13_scales"]
    return t["w13"].view(torch.uint8), t["w13_scale"], (8, 32), t["w13"].shape[0] // 2


@pytest.mark.parametrize("name", ["int4", "mxfp4", "fp8"])
def test_the_switch_takes_the_decode_then_gemm_path(lib, name, monkeypatch):
    """MOECHAT_PREFILL_KERNEL=0: the native decoders and one GEMM, bit for bit F.linear over weight()."""
    fmt, t = _tensors13(name, 48, 64)
    x = _x(5, 64, 8)
    monkeypatch.setenv(prefill.ENV, "0")
    assert not prefill.available(lib)
    assert torch.equal(fmt.linear(x, t, "w13"), F.linear(x, fmt.weight(t, "w13", torch.float32)))
    monkeypatch.setenv(prefill.ENV, "1")
    assert prefill.available(lib)


def test_bad_shapes_are_refused(lib):
    fmt, t, _ = _packed("int4", 8, 64, 1)
    with pytest.raises(ValueError):
        prefill.int4(lib, _x(3, 64, 0), t["w2_q"], t["w2_scale"].float())
    with pytest.raises(RuntimeError):  # a group that does not divide the input
        prefill._call(lib, lib.moechat_prefill_int4, "int4", 0, 1, 0, 0, 8, 64, 48, 0, 8)


def test_chunk_size():
    assert prefill.chunk_size(2048, intermediate=768) == 1024  # Qwen3-30B-A3B in 32 MB: measured best
    assert prefill.chunk_size(2880, intermediate=2880) == 512  # GPT-OSS
    assert prefill.chunk_size(7168, intermediate=2048) == 256  # DeepSeek-V3
    assert prefill.chunk_size(2048, cache_bytes=8 << 20, intermediate=768) == 256
    assert prefill.chunk_size(1 << 20) == min(prefill.CHUNK_CHOICES)
