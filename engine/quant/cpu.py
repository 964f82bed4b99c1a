"""Packed-expert compute on the CPU: one token through the native kernels, more through decoded row tiles.

One token (decode) with the native kernels loaded (quant/native.py: C, built at first use) reads the packed bytes
once and decodes in registers. Otherwise, and for more tokens, a projection's rows are decoded `tile_rows` at a time
into a 4 MB fp32 tile; for one token each tile is multiplied at once (a GEMV sums each output in the same order
whatever the number of rows: equal to one F.linear over the dequantized matrix), so only the packed bytes come from
RAM. More tokens (prefill) with the native kernels loaded take quant/prefill.py's kernels (each 4-row block decoded
once into cache for all the tokens, fp32 FMA sums: F.linear up to the order of the sum; a bf16/fp16 x with groups of
32: integer dots over x quantized to int8 blocks, within prefill.bound_q8); MOECHAT_PREFILL_KERNEL=0, or
no kernels, decode the projection into one reused [R, in] fp32 scratch and run one GEMM, whose cost
there is the multiply, not the bytes: with the native kernels loaded one call of native.c's decoder (AVX2, rows over
its thread pool, bit for bit the torch decoders below: 7-20x them, so at a 128-token prompt's ~8 tokens an expert
the GEMM is most of the time), else the torch decoders tile by tile (MOECHAT_NATIVE_DECODE=0 forces them). A CPU without native bf16 runs an fp32 GEMV faster than a bf16 one, so the tile is
fp32 and the result is rounded once.

The decoders (int4, fp8 below; MXFP4 has its own in mxfp4.py) are whole-tensor integer ops that build float bit
patterns, no table gathers (a gather costs ~1 ns a byte in torch); each is exact: bit for bit the format's
`weight()` in fp32. `bench/format_compute.py` measures them in GB/s of packed bytes against the machine's read
bandwidth: a handful of passes over the tile in torch ops each cost more than reading the packed bytes, so these
paths reach 0.03-0.11 of the bandwidth, the native kernels several times that (README). One bf16 token on FP8
experts without the native kernels takes a faster torch path that is not bit for bit (the block scale moved onto
the input, a bf16 GEMV: `_fp8_gemv_bf16`), tested against the reference within bf16 tolerances.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import native, prefill

_TILE_BYTES = 4 << 20  # fp32 tile of decoded rows: fewer, longer ops (each costs ~5 us to dispatch), still in L3
_BUFFERS: dict[tuple, object] = {}  # scratch tensors, FP8 scale-row maps


def buffer(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A scratch tensor reused per (name, shape, dtype). Made as a normal tensor: calls come from inside and outside
    torch.inference_mode (an inference tensor cannot be written outside it; a normal one can be inside)."""
    key = (name, shape, dtype)
    buf = _BUFFERS.get(key)
    if buf is None:
        with torch.inference_mode(False):
            buf = _BUFFERS[key] = torch.empty(shape, dtype=dtype)
    return buf


# -- many-token dense GEMMs in two column halves, one per core ----------------------------------------------------
SPLIT_ENV = "MOECHAT_SPLIT_GEMM"  # "0": one GEMM always (the A/B)
SPLIT_MIN_TOKENS = 16  # a prompt's chunk: below it (decode, a short turn) one GEMM, as before
SPLIT_MIN_COLUMNS = 1024
_SPLIT_POOL = None  # one worker thread: the second half's GEMM (torch releases the GIL inside it)


def split_addmm(x: torch.Tensor, w_t: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """`add + x @ w_t` (x [T, in], w_t [in, out], `add` a bias [out] or a residual [T, out], or none) for a 16-bit
    CPU x of many tokens, computed as two GEMMs over the two halves of the output columns, side by side on two
    threads where native.c's pool has two and torch's ops run on one (plan/hardware/cores.py: up to 2 compute
    threads torch is kept to one thread, and a prompt's attention projections then ran on one core of two).
    The halves are the same at any thread count, so the bits do not depend on it; other shapes take one GEMM.
    Where torch has no fast bf16 GEMM (an AVX2-only CPU: prefill.slow_torch_bf16), a bf16 x of several tokens goes
    through native_prefill_bf16.c's fp32 tiles instead (rows over native.c's pool, the same bits at any count), the
    addend added to the fp32 sums and rounded once, as addmm does."""
    T, cols = x.shape[0], w_t.shape[1]
    if prefill.tiles_for_torch(x, w := w_t.t(), lib := native.decode_library()):
        return prefill.finish(prefill.bf16(lib, x, w), x.dtype, add)
    if not (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and T >= SPLIT_MIN_TOKENS
            and cols >= SPLIT_MIN_COLUMNS) or os.environ.get(SPLIT_ENV) == "0":
        return x @ w_t if add is None else torch.addmm(add, x, w_t)
    half = cols // 2 // 64 * 64
    parts = [(0, half), (half, cols)]

    def gemm(part: tuple[int, int]) -> torch.Tensor:
        a, b = part
        if add is None:
            return x @ w_t[:, a:b]
        return torch.addmm(add[..., a:b], x, w_t[:, a:b])

    lib = native.library()
    two = lib is not None and (getattr(lib, "moechat_pinned", None) or 1) >= 2 and torch.get_num_threads() == 1
    if two:
        global _SPLIT_POOL
        if _SPLIT_POOL is None:
            from concurrent.futures import ThreadPoolExecutor

            _SPLIT_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moechat-gemm")
        second = _SPLIT_POOL.submit(torch.inference_mode()(gemm), parts[1])
        first = gemm(parts[0])
        return torch.cat([first, second.result()], dim=-1)  # [T, out]
    return torch.cat([gemm(p) for p in parts], dim=-1)


def tile_rows(cols: int) -> int:
    """Rows of a projection with `cols` inputs decoded at a time (a 4 MB fp32 tile, a multiple of 8)."""
    return max(8, _TILE_BYTES // (4 * cols) // 8 * 8)


def tiled_linear(x: torch.Tensor, rows: int, cols: int, decode: Callable[[int, int, torch.Tensor], torch.Tensor],
                 bias: torch.Tensor | None = None, tile: int | None = None) -> torch.Tensor:
    """x [n, cols] @ W^T (+ bias) -> [n, rows] in x's dtype; decode(r0, r1, out) writes W[r0:r1] (fp32) into
    out [r1 - r0, cols] (or returns another fp32 tensor of that shape holding it)."""
    xf = x.float()
    b = None if bias is None else bias.float()
    step = tile or tile_rows(cols)
    if x.shape[0] == 1:
        out_tile = buffer("tile", (step, cols), torch.float32)  # [tile, in]
        y = torch.empty(1, rows)  # [1, R] fp32
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            w = decode(r0, r1, out_tile[: r1 - r0])  # [n, in] fp32
            if b is None:
                torch.mm(xf, w.t(), out=y[:, r0:r1])
            else:
                torch.addmm(b[r0:r1], xf, w.t(), out=y[:, r0:r1])
    else:
        full = buffer("full", (rows, cols), torch.float32)  # [R, in]
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            w = decode(r0, r1, full[r0:r1])
            if w.data_ptr() != full[r0:r1].data_ptr():
                full[r0:r1].copy_(w)
        y = F.linear(xf, full, b)  # [n, R]
    return y if x.dtype == torch.float32 else y.to(x.dtype)


# -- int4: bytes [R, in/2] (low nibble the even element, code = q + 8), fp16 group scales [R, in/g] ---------------
# Each byte becomes an int64 lane holding two fp32 bit patterns 0x4B000000 | code = 2^23 + code (low half the even
# element); minus 2^23 + 8 that is q exactly, and x its group's scale (fp16 widened to fp32: exact) it is weight()
# bit for bit.
_INT4_SPREAD = (1 << 28) + 1  # byte b -> b | b << 28: the high nibble lands at bit 32
_INT4_MASK = 0xF0000000F
_INT4_MAGIC = 0x4B0000004B000000
_INT4_BIAS = float(2**23 + 8)


def int4_decode(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """q [n, in/2] u8, scale [n, G] fp16 -> out [n, in] fp32 (written in place through an int64 view)."""
    n, half = q.shape
    lanes = out.view(torch.int64)  # [n, in/2]: the tile's own bytes
    lanes.copy_(q)
    lanes.mul_(_INT4_SPREAD).bitwise_and_(_INT4_MASK).bitwise_or_(_INT4_MAGIC)
    out.sub_(_INT4_BIAS)
    out.view(n, scale.shape[1], -1).mul_(scale.float()[:, :, None])
    return out


def int4_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, in] @ W^T (+ bias) -> [n, R], W the int4 projection q [R, in/2] / scale [R, in/g] fp16."""
    rows, cols = q.shape[0], q.shape[1] * 2
    if x.shape[0] == 1 and (lib := native.library()) is not None and q.is_contiguous():  # one pass over the bytes
        y = native.int4_gemv(lib, x, q, scale.contiguous(), native.out_dtype(x, bias))  # [1, R]
        return _finish(y, x.dtype, bias)
    if x.shape[0] > 1 and prefill.available(lib := native.decode_library()) and q.is_contiguous():
        return prefill.finish(prefill.int4(lib, x, q, scale.contiguous()), x.dtype, bias)  # each row decoded once
    if x.shape[0] > 1 and (lib := native.decode_library()) is not None and q.is_contiguous():
        full = native.int4_decode(lib, q, scale.contiguous(), buffer("full", (rows, cols), torch.float32))
        return decoded_linear(x, full, bias)
    return tiled_linear(x, rows, cols, lambda r0, r1, out: int4_decode(q[r0:r1], scale[r0:r1], out), bias)


def decoded_linear(x: torch.Tensor, full: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] @ full^T (+ bias) -> [n, R] in x's dtype: the many-token GEMM over a natively decoded [R, in] fp32
    matrix (the same GEMM as tiled_linear's, over the same bits: the same result)."""
    y = F.linear(x.float(), full, None if bias is None else bias.float())  # [n, R]
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def _finish(y: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """A native kernel's [1, R] (fp32, or already x's bf16: native.out_dtype) -> + bias (in fp32, as tiled_linear
    adds it) -> x's dtype."""
    if bias is not None:
        y.add_(bias.float())
    return y if y.dtype == dtype else y.to(dtype)


# -- fp8 e4m3: bytes [R, in], fp32 block scales [ceil(R/b0), ceil(in/b1)] (w13: per half) -------------------------
# The e4m3 byte read as int8 and widened to int16 sign-extends; << 7 puts its exponent and mantissa in the fp16
# exponent (5 bits) and mantissa fields and the sign at bit 15 (bit 14, a copy of the sign, is cleared). That fp16
# is the e4m3 value x 2^-8 exactly (subnormals included), and x (block scale x 2^8) gives weight() bit for bit.
_X128 = torch.tensor([128], dtype=torch.int16)  # not 0-dim: a 0-dim tensor would leave the product int8
_X16 = torch.tensor([16], dtype=torch.int16)


def fp8_decode(w8: torch.Tensor, factors: torch.Tensor, b1: int, lanes: torch.Tensor,
               out: torch.Tensor) -> torch.Tensor:
    """w8 [n, in] int8 (the e4m3 bytes), factors [n, ceil(in/b1)] fp32 (block scale x 256 per row) -> out [n, in]."""
    n, cols = w8.shape
    torch.mul(w8, _X128, out=lanes)  # widened and << 7 in one pass (a 1-element int16 tensor makes it int16 math)
    lanes.bitwise_and_(-16385)  # clear bit 14 (0xBFFF)
    out.copy_(lanes.view(torch.float16))
    full = cols // b1 * b1
    if full:
        out[:, :full].view(n, cols // b1, b1).mul_(factors[:, : cols // b1, None])
    if full < cols:  # a partial block at the edge
        out[:, full:].mul_(factors[:, -1:])
    return out


def fp8_scale_rows(rows: int, b0: int, split: int | None) -> torch.Tensor:
    """The scale row of each weight row [rows] (long): r // b0, and for w13 the up half (rows >= split) blocked from
    its own start."""
    key = ("fp8_rows", rows, b0, split)
    idx = _BUFFERS.get(key)
    if idx is None:
        r = torch.arange(rows)
        idx = r // b0 if split is None else torch.where(r < split, r // b0, -(-split // b0) + (r - split) // b0)
        _BUFFERS[key] = idx
    return idx


def fp8_scale_runs(rows: int, b0: int, split: int | None) -> list[tuple[int, int, int]]:
    """Runs of consecutive rows sharing a scale row: (first row, end row, scale row)."""
    key = ("fp8_runs", rows, b0, split)
    runs = _BUFFERS.get(key)
    if runs is None:
        srow = fp8_scale_rows(rows, b0, split).tolist()
        runs, start = [], 0
        for r in range(1, rows + 1):
            if r == rows or srow[r] != srow[start]:
                runs.append((start, r, srow[start]))
                start = r
        _BUFFERS[key] = runs
    return runs


# One bf16 token (decode on a bf16 model): the e4m3 byte as a bf16 bit pattern (sign-extended int16 << 4, bits
# 11-14 cleared) is the value x 2^-120 exactly (fp8 subnormals land on bf16 subnormals), so a row tile decodes in
# three integer passes and no float pass; the block scale goes on the input instead: per run of rows sharing a
# scale row, x * scale(columns) * 2^120 rounded to bf16, then a bf16 GEMV (fp32 accumulation). 1.5x the exact fp32
# path (bench/format_compute.py); the rounding of the scaled input is one bf16 rounding per product, the order
# of a bf16 model's own rounding. Inputs whose scaled values would overflow take the exact path.
_FP8_BF16_SHIFT = 2.0**120


def _fp8_gemv_bf16(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                   split: int | None, bias: torch.Tensor | None) -> torch.Tensor | None:
    rows, cols = w8.shape
    b0, b1 = block
    xs = x.float() * scale.float().repeat_interleave(b1, dim=1)[:, :cols] * _FP8_BF16_SHIFT  # [scale rows, in]
    if not bool(xs.abs().amax() < 3e38):
        return None
    xs = xs.bfloat16()
    step = tile_rows(2 * cols)  # a 4 MB bf16 tile
    lanes = buffer("fp8_bf16_lanes", (step, cols), torch.int16)  # [tile, in]
    y = torch.empty(1, rows, dtype=torch.bfloat16)  # [1, R]
    runs = fp8_scale_runs(rows, b0, split)
    i = 0
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        tile = lanes[: r1 - r0]
        torch.mul(w8[r0:r1], _X16, out=tile)  # widened and << 4 in one pass
        tile.bitwise_and_(-30721)  # keep bit 15 and bits 0-10 (0x87FF)
        tb = tile.view(torch.bfloat16)  # [n, in]: e4m3 x 2^-120
        while i < len(runs) and runs[i][0] < r1:
            a, b, sr = runs[i]
            lo, hi = max(a, r0), min(b, r1)
            torch.mm(xs[sr : sr + 1], tb[lo - r0 : hi - r0].t(), out=y[:, lo:hi])
            if b > r1:  # the run continues in the next tile
                break
            i += 1
    return y if bias is None else y + bias


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], split: int | None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, in] @ W^T (+ bias) -> [n, R], W the e4m3 projection w [R, in] with block scales (split: w13's half)."""
    rows, cols = w.shape
    b0, b1 = block
    if x.shape[0] == 1 and (lib := native.library()) is not None and w.is_contiguous():  # one pass over the bytes
        y = torch.empty(1, rows, dtype=native.out_dtype(x, bias))  # [1, R]
        s = scale.float().contiguous()
        if split is None:
            native.fp8_gemv(lib, x, w, s, block, y[0])
        else:  # w13: gate and up rows, each half blocked from its own start
            sh = -(-split // b0)
            native.fp8_gemv(lib, x, w[:split], s[:sh], block, y[0, :split])
            native.fp8_gemv(lib, x, w[split:], s[sh:], block, y[0, split:])
        return _finish(y, x.dtype, bias)
    if x.shape[0] > 1 and prefill.available(lib := native.decode_library()) and w.is_contiguous():
        return prefill.finish(prefill.fp8(lib, x, w.view(torch.uint8), scale, block, split), x.dtype, bias)
    if x.shape[0] > 1 and (lib := native.decode_library()) is not None and w.is_contiguous():
        full = buffer("full", (rows, cols), torch.float32)  # [R, in]
        s = scale.float().contiguous()
        if split is None:
            native.fp8_decode(lib, w, s, block, full)
        else:  # w13: gate and up rows, each half blocked from its own start
            sh = -(-split // b0)
            native.fp8_decode(lib, w[:split], s[:sh], block, full[:split])
            native.fp8_decode(lib, w[split:], s[sh:], block, full[split:])
        return decoded_linear(x, full, bias)
    w8 = w.view(torch.int8)
    if x.dtype == torch.bfloat16 and x.shape[0] == 1:
        y = _fp8_gemv_bf16(x, w8, scale, block, split, bias)
        if y is not None:
            return y
    srow = fp8_scale_rows(rows, b0, split)
    factors = scale.float() * 256.0  # [ceil(R/b0) (x2 for w13), ceil(in/b1)], exact
    step = tile_rows(cols)
    lanes = buffer("fp8_lanes", (step, cols), torch.int16)  # [tile, in]

    def decode(r0: int, r1: int, out: torch.Tensor) -> torch.Tensor:
        return fp8_decode(w8[r0:r1], factors.index_select(0, srow[r0:r1]), b1, lanes[: r1 - r0], out)

    return tiled_linear(x, rows, cols, decode, bias, tile=step)
