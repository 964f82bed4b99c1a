"""Many tokens (prefill) through a packed expert projection on the CPU: native_prefill.c's kernels, and the prefill
chunk size.

The kernels (int4, MXFP4, FP8 block, int8) take the tokens routed to an expert together: the rows are cut into
blocks of 4, each block decoded once into a per-thread fp32 scratch (bit for bit the format's `weight()`, 32 KB at
a 2048-wide input: cache, never RAM) and multiplied by every token there, 6 tokens x 4 rows of fp32 FMA
accumulators at a time (AVX-512; 3 x 4 with AVX2). The path they replace (quant/cpu.py `decoded_linear`) wrote the
whole projection in fp32 (4 bytes per weight out to memory and back) and ran one MKL GEMM on it.

Exactness: fp32 products of the exact weights and the fp32 x, summed in fp32: F.linear(x.float(), weight()) up to
the order of the sum. Each output is within `bound()` of it (cols x 2^-24 x sum |w x|, the worst case of a
sequential fp32 sum; tested, with the observed error far below). The order depends only on the element (t, r), so
any thread count, any batch the token is in and any chunking give the same bits.

`MOECHAT_PREFILL_KERNEL=0` takes the old path (the native decoders and one GEMM) for the bench's A/B.

Integer dots for int4 (groups of 32) and MXFP4 with a bf16 or fp16 x (native_prefill_int.c, `int4_q8` /
`mxfp4_q8`): x quantized once per call to int8 per 32-element block with an fp32 scale (llama.cpp's Q8_0), the
weights decoded to bytes once per call (16 rows a group with AVX-512, in cache), every block's dot product an exact
int32 (`vpdpbusd` u8 x s8 on AVX-512 VNNI / AVX-VNNI, `vpmaddubsw` on AVX2), scaled and summed in fp32 over the
blocks in order. Not fp32-exact: x is rounded to 8 bits, so each output is within `bound_q8` of F.linear(x,
weight()) (x's rounding, at most half a step of max |x| / 127 per element, times sum |w|, plus the fp32 sum over the
blocks; observed ~0.5% of the largest output on Gaussian x, where x's bf16 rounding alone is ~0.1%). So only a
bf16/fp16 compute dtype takes it, a model whose activations are already rounded to 8 mantissa bits and whose
one-token int4/MXFP4 path already sums over a rounded x (native.c, 16 bits); fp32 x keeps the decoded-tile kernel
and fp32 sums, the exact reference. Every build (AVX-512 VNNI, AVX-VNNI, AVX2, scalar) writes the same bits, and the
order is a function of (t, r): any thread count, any batch. Measured (bench/format_compute.py --prefill-int --clock
thread: one thread's CPU seconds, 7 interleaved rounds, 2-core Zen 4 with AVX-512 VNNI, load average ~11 from other
jobs), one expert's w13 + w2, bf16 x: 117-140 GMAC/s at 128 tokens against the decoded tile's 35-41 (3.1-3.4x;
Qwen3-30B-A3B and GPT-OSS-20B widths, int4 and MXFP4), 47-62 at 8 tokens against 18-24 (2.3-2.7x); relative L2
error of w13's bf16 output against F.linear(x, weight()) 5.6e-3, the decoded tile's 1.7e-3 (its bf16 rounding).
Model level (the demo model in bf16 with int4 experts, 8 x 128 random tokens teacher-forced, against the fp32 native
model): KL 0.01375 a token against the decoded tile's 0.01343, top-1 agreement 0.901 against 0.905 (int4's weights
and bf16 are most of it).
Engine level (--prefill, 1-layer Qwen3-30B-A3B shape, int4 experts, 128-token prompt, one thread): 315 tok/s
against the decoded tile's 88 and bf16's 264. So it is the default for those dtypes; `MOECHAT_PREFILL_INT=0` sends
a bf16 x to the decoded-tile kernel (the A/B).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from pathlib import Path

import torch

ENV = "MOECHAT_PREFILL_KERNEL"
TILES_ENV = "MOECHAT_BF16_TILES"  # "0": torch's bf16 GEMM where the fp32 tiles would run (the A/B)
INT_ENV = "MOECHAT_PREFILL_INT"  # "0": a bf16/fp16 x takes the decoded-tile kernel too
_TYPED = "moechat_prefill_typed"
INT_DTYPES = (torch.bfloat16, torch.float16)  # the compute dtypes that take the integer kernels (fp32 stays exact)
Q8_BLOCK = 32  # elements of x sharing one int8 scale

# Prefill chunk sizes measured (tokens per forward pass); chunk_size's docstring has the figures.
CHUNK_CHOICES = (64, 128, 256, 512, 1024)


def available(lib) -> bool:
    """Whether `lib` (native.library()) has the prefill kernels and they are not switched off."""
    if lib is None or os.environ.get(ENV, "1") == "0":
        return False
    if not getattr(lib, _TYPED, False):
        if not hasattr(lib, "moechat_prefill_int4"):
            return False
        _type(lib)
    return True


def _type(lib) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.moechat_prefill_int4.argtypes = [p, i64, p, p, i64, i64, i64, p, i64]
    lib.moechat_prefill_mxfp4.argtypes = [p, i64, p, p, i64, i64, p, i64]
    lib.moechat_prefill_fp8.argtypes = [p, i64, p, p, i64, i64, i64, i64, p, i64]
    lib.moechat_prefill_int8.argtypes = [p, i64, p, p, i64, i64, p, i64]
    for f in (lib.moechat_prefill_int4, lib.moechat_prefill_mxfp4, lib.moechat_prefill_fp8, lib.moechat_prefill_int8):
        f.restype = ctypes.c_int
    if hasattr(lib, "moechat_prefill_q8_int4"):
        for f in (lib.moechat_prefill_q8_int4, lib.moechat_prefill_q8_mxfp4, lib.moechat_prefill_q8_int8):
            f.argtypes = [p, i64, p, p, i64, i64, p, i64]
            f.restype = ctypes.c_int
        lib.moechat_prefill_q8_isa.restype = ctypes.c_int
    if hasattr(lib, "moechat_prefill_bf16"):
        lib.moechat_prefill_bf16.argtypes = [p, i64, p, i64, i64, p, i64]
        lib.moechat_prefill_bf16.restype = ctypes.c_int
        lib.moechat_prefill_bf16_isa.restype = ctypes.c_int
    setattr(lib, _TYPED, True)


def has_integer(lib) -> bool:
    """Whether `lib` has the integer (Q8 activation) kernels."""
    return lib is not None and hasattr(lib, "moechat_prefill_q8_int4")


ISAS = {3: "AVX-512 VNNI", 2: "AVX-VNNI", 1: "AVX2", 0: "scalar"}


def integer_isa(lib) -> str:
    """The instruction set the integer kernels of `lib` were built for."""
    return ISAS[lib.moechat_prefill_q8_isa()]


def integer_path(x: torch.Tensor, lib) -> bool:
    """Whether x takes the integer kernels: a bf16/fp16 x, the library has them, MOECHAT_PREFILL_INT is not 0."""
    return x.dtype in INT_DTYPES and has_integer(lib) and os.environ.get(INT_ENV, "1") != "0"


def _threads(lib) -> None:
    """The pool's thread count follows torch's (as native.py's kernels do), unless native.pin_threads fixed it."""
    n = getattr(lib, "moechat_pinned", None) or torch.get_num_threads()
    if getattr(lib, "moechat_threads", None) != n:
        lib.moechat_set_threads(n)
        lib.moechat_threads = n


def _x(x: torch.Tensor) -> torch.Tensor:
    """x [T, in] as the kernels read it: fp32, contiguous (a bf16 x widens exactly)."""
    return x.float().contiguous() if x.dtype != torch.float32 or not x.is_contiguous() else x


def _call(lib, fn, what: str, *args) -> None:
    if not getattr(lib, _TYPED, False):  # a library `available` was not asked about (the tests' scalar build)
        _type(lib)
    _threads(lib)
    rc = fn(*args)
    if rc != 0:
        raise RuntimeError(f"native {what} prefill kernel failed ({rc})")


def _out(T: int, rows: int, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(T, rows)  # [T, R] fp32
    if out.dtype != torch.float32 or out.dim() != 2 or out.shape[0] != T or out.stride(1) != 1:
        raise ValueError(f"prefill kernels write fp32 [T, R] rows, not {out.dtype} {list(out.shape)}")
    return out


def int4(lib, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ W^T -> [T, R] fp32, W the int4 projection q [R, in/2] u8 / scale [R, in/g] fp16 (contiguous).
    A bf16/fp16 x with groups of 32 takes the integer kernel (`int4_q8`), else the decoded tile (fp32 sums)."""
    rows, cols = q.shape[0], q.shape[1] * 2
    if scale.dtype != torch.float16 or not (q.is_contiguous() and scale.is_contiguous()):
        raise ValueError("the int4 prefill kernel reads contiguous codes and fp16 scales")
    if integer_path(x, lib) and scale.shape[1] * Q8_BLOCK == cols:
        return int4_q8(lib, x, q, scale)
    xf = _x(x)
    y = _out(xf.shape[0], rows, None)
    _call(lib, lib.moechat_prefill_int4, "int4", xf.data_ptr(), xf.shape[0], q.data_ptr(), scale.data_ptr(), rows,
          cols, cols // scale.shape[1], y.data_ptr(), y.stride(0))
    return y


def mxfp4(lib, x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ W^T -> [T, R] fp32, W from blocks [R, in/32, 16] u8 / scales [R, in/32] u8 (contiguous).
    A bf16/fp16 x takes the integer kernel (`mxfp4_q8`), an fp32 one the decoded tile (fp32 sums)."""
    rows, cols = blocks.shape[0], blocks.shape[1] * 32
    if not (blocks.is_contiguous() and scales.is_contiguous()):
        raise ValueError("the MXFP4 prefill kernel reads contiguous blocks and scales")
    if integer_path(x, lib):  # a bf16/fp16 x: the integer kernel (`mxfp4_q8`)
        return mxfp4_q8(lib, x, blocks, scales)
    xf = _x(x)
    y = _out(xf.shape[0], rows, None)
    _call(lib, lib.moechat_prefill_mxfp4, "mxfp4", xf.data_ptr(), xf.shape[0], blocks.data_ptr(), scales.data_ptr(),
          rows, cols, y.data_ptr(), y.stride(0))
    return y


def int4_q8(lib, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The integer kernel whatever x's dtype: x [T, in] @ W^T -> [T, R] fp32 within `bound_q8`, W the int4 projection
    q [R, in/2] u8 / scale [R, in/32] fp16 (groups of 32, contiguous)."""
    rows, cols = q.shape[0], q.shape[1] * 2
    if (scale.dtype != torch.float16 or scale.shape != (rows, cols // Q8_BLOCK) or cols % Q8_BLOCK
            or not (q.is_contiguous() and scale.is_contiguous())):
        raise ValueError("the int4 integer prefill kernel reads contiguous codes and fp16 scales in groups of 32")
    xf = _x(x)
    y = _out(xf.shape[0], rows, None)
    _call(lib, lib.moechat_prefill_q8_int4, "int4 integer", xf.data_ptr(), xf.shape[0], q.data_ptr(),
          scale.data_ptr(), rows, cols, y.data_ptr(), y.stride(0))
    return y


def mxfp4_q8(lib, x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The integer kernel whatever x's dtype: x [T, in] @ W^T -> [T, R] fp32 within `bound_q8`, W from blocks
    [R, in/32, 16] u8 / scales [R, in/32] u8 (contiguous)."""
    rows, cols = blocks.shape[0], blocks.shape[1] * 32
    if not (blocks.is_contiguous() and scales.is_contiguous()):
        raise ValueError("the MXFP4 integer prefill kernel reads contiguous blocks and scales")
    xf = _x(x)
    y = _out(xf.shape[0], rows, None)
    _call(lib, lib.moechat_prefill_q8_mxfp4, "mxfp4 integer", xf.data_ptr(), xf.shape[0], blocks.data_ptr(),
          scales.data_ptr(), rows, cols, y.data_ptr(), y.stride(0))
    return y


def int8_q8(lib, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The integer kernel whatever x's dtype: x [T, in] @ W^T -> [T, R] fp32 within `bound_q8`, W = q [R, in] int8 x
    scale [R] fp32 per row (q contiguous, `in` a multiple of 32)."""
    rows, cols = q.shape
    if q.dtype != torch.int8 or cols % Q8_BLOCK or not q.is_contiguous() or scale.shape != (rows,):
        raise ValueError("the int8 integer prefill kernel reads contiguous int8 codes, inputs in blocks of 32, and a "
                         "scale per row")
    s = scale.float().contiguous()
    xf = _x(x)
    y = _out(xf.shape[0], rows, None)
    _call(lib, lib.moechat_prefill_q8_int8, "int8 integer", xf.data_ptr(), xf.shape[0], q.data_ptr(), s.data_ptr(),
          rows, cols, y.data_ptr(), y.stride(0))
    return y


def int8_integer(x: torch.Tensor, q: torch.Tensor, lib) -> bool:
    """Whether int8 weights q [R, in] take the integer kernel for x: more than one token on the CPU, a bf16/fp16 x
    (`integer_path`), contiguous codes with inputs in blocks of 32."""
    return (x.device.type == "cpu" and x.dim() == 2 and x.shape[0] > 1 and q.is_contiguous()
            and q.shape[1] % Q8_BLOCK == 0 and available(lib) and integer_path(x, lib))


def has_bf16(lib) -> bool:
    """Whether bf16 many-token products take native_prefill_bf16.c: its AVX-512 BF16 kernel, or its fp32 tiles where
    torch has no fast bf16 GEMM (`slow_torch_bf16`: torch's fallback runs a 128-token prompt's bf16 GEMMs several times
    slower than these tiles on a Zen 2 core; where oneDNN takes bf16 (AVX-512 BW) torch's GEMM is kept, unmeasured)."""
    if lib is None or not hasattr(lib, "moechat_prefill_bf16_isa"):
        return False
    if not getattr(lib, _TYPED, False):
        _type(lib)
    isa = lib.moechat_prefill_bf16_isa()
    return isa == 1 or (isa == 2 and slow_torch_bf16() and os.environ.get(TILES_ENV, "1") != "0")


@functools.cache
def slow_torch_bf16() -> bool:
    """torch multiplies bf16 through its scalar-ish fallback here: oneDNN's bf16 matmul needs AVX-512 BW/VL/DQ (or
    AMX / AVX-512 BF16), which this CPU lacks (an AVX2-only x86 CPU: Zen 1-3, Intel client cores to date)."""
    from . import native

    flags = set(native._cpu_flags().split())
    return platform.machine().lower() in ("x86_64", "amd64") and not {"avx512bw", "avx512vl", "avx512dq"} <= flags


def tiles_for_torch(x: torch.Tensor, w: torch.Tensor, lib) -> bool:
    """Whether x [T, in] @ w^T, which takes torch's bf16 GEMM on other CPUs (a prompt's attention projections and
    router), takes this kernel here instead: torch's bf16 GEMM is the slow fallback and `bf16_path` holds."""
    return x.shape[0] > 1 and x.dtype == torch.bfloat16 and slow_torch_bf16() and bf16_path(x, w, lib)


def bf16_path(x: torch.Tensor, w: torch.Tensor, lib) -> bool:
    """Whether x [T, in] @ w^T takes the bf16 kernel: more than one bf16 token on the CPU, a contiguous bf16 w whose
    input is a multiple of 32, the kernels on (`available`) and the bf16 kernel in use (`has_bf16`)."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] > 1
            and w.dtype == torch.bfloat16 and w.dim() == 2 and w.is_contiguous() and w.shape[1] % 32 == 0
            and x.shape[1] == w.shape[1] and available(lib) and has_bf16(lib))


def bf16(lib, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, in] bf16 @ w^T (w [R, in] bf16, contiguous) -> [T, R] fp32: exact products, fp32 sums, within `bound`
    of F.linear(x.float(), w.float())."""
    rows, cols = w.shape
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or cols % 32 or not w.is_contiguous():
        raise ValueError("the bf16 prefill kernel reads bf16 x and a contiguous bf16 weight, inputs in blocks of 32")
    xc = x.contiguous()
    y = _out(xc.shape[0], rows, None)
    _call(lib, lib.moechat_prefill_bf16, "bf16", xc.data_ptr(), xc.shape[0], w.data_ptr(), rows, cols, y.data_ptr(),
          y.stride(0))
    return y


def fp8(lib, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
        split: int | None) -> torch.Tensor:
    """x [T, in] @ W^T -> [T, R] fp32, W the e4m3 w [R, in] (contiguous) with fp32 block scales [ceil(R/b0),
    ceil(in/b1)]; split: w13's gate rows, the up half blocked from its own start (two calls into one y)."""
    rows, cols = w.shape
    b0, b1 = block
    if not w.is_contiguous():
        raise ValueError("the FP8 prefill kernel reads a contiguous weight")
    s = scale.float().contiguous()
    xf = _x(x)
    T = xf.shape[0]
    y = _out(T, rows, None)
    halves = [(0, rows, 0)] if split is None else [(0, split, 0), (split, rows, -(-split // b0))]
    for r0, r1, s0 in halves:
        _call(lib, lib.moechat_prefill_fp8, "fp8", xf.data_ptr(), T, w[r0:r1].data_ptr(), s[s0:].data_ptr(),
              r1 - r0, cols, b0, b1, y[:, r0:].data_ptr(), y.stride(0))
    return y


def int8(lib, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ W^T -> [T, R] fp32, W = q [R, in] int8 x scale [R] fp32 per row (contiguous)."""
    rows, cols = q.shape
    if not q.is_contiguous():
        raise ValueError("the int8 prefill kernel reads contiguous codes")
    s = scale.float().contiguous()
    xf = _x(x)
    y = _out(xf.shape[0], rows, None)
    _call(lib, lib.moechat_prefill_int8, "int8", xf.data_ptr(), xf.shape[0], q.data_ptr(), s.data_ptr(), rows, cols,
          y.data_ptr(), y.stride(0))
    return y


def finish(y: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """A kernel's fp32 [T, R] -> + bias (fp32, as F.linear adds it) -> x's dtype (rounded once)."""
    if bias is not None:
        y.add_(bias.float())
    return y if dtype == torch.float32 else y.to(dtype)


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The stated bound of a kernel's output against F.linear(x.float(), w) (w = weight() in fp32): per element,
    cols x 2^-24 x sum_k |x_tk w_rk| (a sequential fp32 sum's worst case; any order of the sum obeys it), plus the
    smallest normal for outputs that underflow. [T, R] fp32."""
    cols = w.shape[1]
    return (x.double().abs() @ w.double().abs().t() * (cols * 2.0**-24)).float() + torch.finfo(torch.float32).tiny


def round_x8(x: torch.Tensor) -> torch.Tensor:
    """The x the integer kernels sum over, as a slow reference in fp64: per 32-element block with m = max |x| (fp32),
    q = round(x * (127 / m)) to nearest even with the quotient and the product in fp32, as the kernels compute them
    (|q| <= 127; in fp64 where m < 2^-100, whose 127 / m would pass fp32's range), times xs = m / 127 rounded to fp32;
    NaN for a block with a non-finite element, 0 for an all-zero one."""
    b = x.float().reshape(*x.shape[:-1], -1, Q8_BLOCK)  # [..., G, 32]
    mx = b.abs().amax(dim=-1, keepdim=True)  # [..., G, 1] fp32
    xs = (mx / 127).double()  # the fp32 quotient, as the kernel's
    q = torch.round(b * (127 / mx)).double()  # fp32 quotient and product
    q = torch.where(mx < 2.0**-100, torch.round(b.double() * (127.0 / mx.double())), q)
    out = torch.where(mx > 0, q * xs, torch.zeros_like(q))
    return out.where(b.isfinite().all(dim=-1, keepdim=True), torch.nan).reshape(x.shape)


def bound_q8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The stated bound of an integer kernel's output against F.linear(x, w) in exact arithmetic (w = weight() in
    fp32, x as the kernel reads it: fp32), per element [T, R] fp64:
    sum_b xs_b (1/2 + 2^-15) sum_{k in b} |w_rk|   (x rounded to q xs_b, xs_b = max_b |x| / 127: half a step, and the
                                                    step's own fp32 rounding)
    + (G + 1) 2^-24 sum_k |w_rk| (|x_tk| + xs_b(k))  (each block's ws x xs rounded once, the fp32 sum over G blocks)
    + 2^-126 G (T, R)                                 (scales that underflow)."""
    T, cols = x.shape
    G = cols // Q8_BLOCK
    xd, wd = x.double(), w.double().abs()
    xs = xd.abs().reshape(T, G, Q8_BLOCK).amax(dim=-1) / 127  # [T, G]
    w1 = wd.reshape(-1, G, Q8_BLOCK).sum(dim=-1)  # [R, G]
    rounding = (xs * (0.5 + 2.0**-15)) @ w1.t()  # [T, R]
    mags = xd.abs() + xs.repeat_interleave(Q8_BLOCK, dim=1)  # [T, in]
    return rounding + (G + 1) * 2.0**-24 * (mags @ wd.t()) + 2.0**-126 * G


def chunk_size(hidden: int, cache_bytes: int = 32 << 20, intermediate: int = 0) -> int:
    """Tokens per prefill chunk for a model of width `hidden` (experts `intermediate` wide) on a CPU whose last-level
    cache holds `cache_bytes`.

    Measured (bench/format_compute.py --prefill --prefill-chunks 64,128,256,512, Qwen3-30B-A3B-shaped, 2 layers,
    int4 experts resident, a 512-token prompt, one thread, 2-core Zen 4 with 1 MB L2 a core and 32 MB L3, machine
    loaded to ~7-11): 65 / 85 / 98 / 113 tok/s at 64 / 128 / 256 / 512. 1024 against 512 (bench/prefill_chunk.py,
    1024-token prompt, bf16 / int4 experts, 4 interleaved rounds, load 2.6, tight spreads): 419 / 276 vs 423 / 272 tok/s
    on 1 thread (0.99x / 1.02x), 578 / 373 vs 575 / 338 on 2 (1.00x / 1.10x); at load 4-9 its medians were 1.05-1.93x
    512's in all six tables, spreads wide. Bigger chunks give each expert more tokens (512 x top-8 / 128 experts = 32 an
    expert), so its decode is shared more widely and its packed bytes are read fewer times; the prefill kernels stream x
    in 6-token blocks, so the chunk's activations need not fit L2. They should stay in the last-level cache: the largest
    of CHUNK_CHOICES whose fp32 rows [T, hidden] and [T, intermediate] fit half of `cache_bytes` (the other half for the
    weights streaming through), never under 64: 1024 at hidden 2048 and intermediate 768 in 32 MB; 256 at 7168 and
    2048."""
    per_token = 4 * (hidden + intermediate)  # bytes: one fp32 row of each width per token
    best = CHUNK_CHOICES[0]
    for c in CHUNK_CHOICES:
        if c * per_token <= cache_bytes // 2:
            best = c
    return best


SYSFS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")
DEFAULT_CACHE_BYTES = 32 << 20  # where sysfs does not say (not Linux, a container hiding it): a desktop CPU's L3


def _size(text: str) -> int:
    """sysfs's cache size ("32768K", "1M", or bytes) -> bytes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if scale != 1 else text) * scale


def last_level_cache_bytes(root: Path = SYSFS_CACHE) -> int | None:
    """The size of the highest-level data or unified cache cpu0 sees (its L3 on most x86-64, shared by its cores),
    read from sysfs; None where it cannot be read."""
    best: tuple[int, int] | None = None
    try:
        entries = sorted(root.glob("index*"))
    except OSError:
        return None
    for index in entries:
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level, size = int((index / "level").read_text()), _size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if size > 0 and (best is None or level > best[0]):
            best = (level, size)
    return best[1] if best is not None else None


def machine_chunk_size(hidden: int, intermediate: int = 0, root: Path = SYSFS_CACHE) -> int:
    """`chunk_size` for this machine: its last-level cache read from sysfs (DEFAULT_CACHE_BYTES where unreadable)."""
    llc = last_level_cache_bytes(root)
    return chunk_size(hidden, llc if llc is not None else DEFAULT_CACHE_BYTES, intermediate)
