"""The MoE over FP8, int8 and int4 slot buffers in two Triton launches: packed bytes read once, decoded in registers.

The same plan as kernels/mxfp4_moe.py (whose grouping and decode plumbing it reuses). Decode: a `w13` launch per
(t, k) pair and tile of I outputs (the slot looked up in the kernel, gate and up GEMVs, + biases, the activation),
a `w2` launch per token and tile of H outputs that loops over the token's K pairs in order (+ bias, x the routing
weight, fp32 sum, + residual, one rounding): no torch op around them. The decode GEMV (`_gemv`) gives a thread
whole 16-byte chunks of code words of several rows and loads x in the same shape (decoded once per chunk for
those rows); a chunk's products are one FMA chain, scaled once. Prefill sorts the pairs by slot on the device and
runs tl.dot per group. One kernel source, the format a compile-time constant:

* fp8 (Qwen3-*-FP8, DeepSeek-V3): e4m3 bytes [rows, in] (passed as uint8) and fp32 block scales
  [ceil(rows/b0), ceil(in/b1)]; w13's gate and up halves keep their own blocking. The e4m3 byte is decoded
  by the hardware's cvt.rn.f16x2.e4m3x2 from sm_89 (the decode GEMV; `hardware_fp8`), else with integer ops
  (exact, no fp8 type needed: sm_80 and the interpreter run them), and a block's sum times its scale. Without the
  hardware a word's bytes 0, 2 and 1, 3 become fp16x2 words of the values x 2^-8 in 6 integer ops (two bit-select
  lop3s, packed._e4m3x4_int) and 4 widenings, and the FMA chain stays fp32 (e4m3's 4 bits x bf16's 8 are exact in
  fp32, the sums round as fp32's); blocks of B0 rows, B0 a multiple of the tile, give the tile's rows one scale
  load a chunk (w13: one for the gate rows, one for the up rows). SASS instructions a packed byte
  (bench/kernel_sass.py, bf16 x): w2 (16 rows a thread) 3.83 on sm_80, 3.82 on sm_86, 2.82 on sm_90 (from 4.37,
  4.87, 3.11); w13 3.89 / 3.91 / 2.91 (from 4.31, 4.88, 3.14).
* int8: int8 [rows, in] and an fp32 scale per output row, applied once to the row's sum.
* int4: bytes [rows, in/2] (low nibble the even element, code = q + 8) and fp16 group scales [rows, in/group],
  widened to fp32 after the load (exact: the product is weight()'s). The decode sums code x x and takes 8 sum(x)
  (shared by a thread's rows) off; from sm_89 a nibble byte goes through the e4m3 conversion (byte n is n x 2^-9),
  and for a 16-bit x with groups of 32 the products run in fp16x2 on every target, with no conversion
  instruction: a word's nibbles t and t + 4 masked in place are the fp16 subnormals code x 2^-24 (nibbles 1, 3, 5,
  7 16 code x 2^-24, their x carrying 2^-4), one packed FMA per two weights (5 integer ops and 4 packed FMAs a word
  of 8 codes; sm_80/86 took 13 by magic numbers, sm_89+ 11 through the e4m3 conversion), the lanes started at
  -8 x 2^-24 sum(x) (a fp16x2 sum shared by the thread's rows). x is first scaled on the device into [2^13, 2^14)
  (packed._x_guard with UP: a power of two, exact), so a lane (|sum| <= 16 x 8 x 2^-24 2^14) stays finite and each
  of its fp16 roundings errs by at most 2^-11 of the lane or fp16's subnormal step, 2^-25 (2^-14 max|x| in x's
  units): a simulated K = 2048 row errs as the earlier 2^-9-scaled lanes did, ~4e-5 of sum |code x| (2.4e-4 with
  1% outliers at 300x). Each chunk's lane sums are added in fp16, the scale applied in fp32. SASS instructions a
  packed byte (bench/kernel_sass.py, 16 rows a thread; a group's scale addresses a base that moves with the loop
  plus a fixed offset a row): w2 3.36 on sm_80, 3.41 on sm_86 / sm_89 / sm_90 (from 4.42, 4.43, 3.99, 3.95; 7.9
  on sm_90 before fp16x2), w13 3.35 / 3.38 / 3.38 / 3.37 (from 4.48, 4.55, 4.11, 4.10).

Bytes per Qwen3-30B-A3B decode step and layer (8 experts): bf16 75.5 MB, fp8 37.8, int8 37.9, int4 21.2 (codes
+ fp16 scales; 23.6 with fp32 scales); `bench/gpu_check.sh` runs the `gpu` tests and the rates
(`bench/quantized_experts.py --device cuda`, `bench/kernel_rates.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mxfp4_moe import (
    _gate_up_rows,
    _gate_up_tile,
    _gated_act,
    _pair_slot,
    _split_gate_up,
    _x_chunk,
    decode_io,
    is_decode,
    plan_groups,
    sum_pairs,
)
from .packed import (
    INTERPRET,
    _e4m3x4,
    _e4m3x4_int,
    _hfma2,
    _lane_sum,
    _x_guard,
    _x_pairs_t4,
    hardware_fp8,
)

# T = tokens, K = top-k, P = computed (t, k) pairs, C = slots, H = hidden, I = intermediate, NB = groups,
# N = outputs of a projection, KB = bytes in one packed row

FP8, INT8, INT4 = 0, 1, 2
FORMAT_IDS = {"fp8": FP8, "int8": INT8, "int4": INT4}


@triton.jit
def _e4m3(code):
    """float8_e4m3fn bytes (int32, 0..255) -> fp32 x 2^-8, exactly (the NaN pattern, refused at load, reads as
    480 x 2^-8): the byte's exponent and mantissa placed at fp16's lowest exponent bits and top mantissa bits
    (e = 0 is then fp16's subnormal, no branch), its sign at bit 15, widened to fp32 (exact). Three integer ops
    and a conversion a byte, where a branch on the subnormals took eight."""
    bits = ((code & 0x7F) << 7) | ((code & 0x80) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dot(x_ptr, x_rows, x_ok, stride_x, w_ptr, s_ptr, w_rows, s_rows, w_ok, KB, S_COLS, S_DIV: tl.constexpr,
         FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr,
         USE_DOT: tl.constexpr, DOT_BF16: tl.constexpr):
    """x[x_rows] [BLOCK_M, in] @ W[w_rows]^T -> [BLOCK_M, BLOCK_N] fp32 (int8: before the row scale).

    W is one slot's packed rows (w_ptr [rows, KB] bytes); s_rows are the rows of its scales (s_ptr [., S_COLS],
    one column per S_DIV elements along the input; unused for int8). int4 bytes hold elements 2i and 2i + 1, so
    x is read as its even and odd elements; fp8 and int8 bytes are one element each."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # the GEMV sums products elementwise across the K loop and reduces across threads once, at the end
    acc_e = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_KB), dtype=tl.float32)  # unused (and dropped) with tl.dot
    for k0 in range(0, KB, BLOCK_KB):
        kk = k0 + tl.arange(0, BLOCK_KB)  # [BKB] bytes along the row
        k_ok = kk < KB
        w_mask = w_ok[:, None] & k_ok[None, :]
        x_mask = x_ok[:, None] & k_ok[None, :]
        if FMT == 2:  # int4: two elements a byte
            codes = tl.load(w_ptr + w_rows[:, None] * KB + kk[None, :], mask=w_mask, other=0x88).to(tl.int32)
            scale = tl.load(s_ptr + s_rows[:, None] * S_COLS + ((2 * kk) // S_DIV)[None, :], mask=w_mask,
                            other=0.0).to(tl.float32)  # fp16 -> fp32, exact
            w_lo = ((codes & 15) - 8).to(tl.float32) * scale  # [BN, BKB] elements 2i
            w_hi = ((codes >> 4) - 8).to(tl.float32) * scale  # [BN, BKB] elements 2i + 1
            x_at = x_ptr + x_rows[:, None] * stride_x + 2 * kk[None, :]
            # upcast right after the load: the interpreter's bf16 arithmetic is not IEEE's
            x_lo = tl.load(x_at, mask=x_mask, other=0.0).to(tl.float32)  # [BM, BKB]
            x_hi = tl.load(x_at + 1, mask=x_mask, other=0.0).to(tl.float32)  # [BM, BKB]
            if USE_DOT:
                if DOT_BF16:  # weights rounded to bf16, as the torch path rounds them for a bf16 model
                    acc = tl.dot(x_lo.to(tl.bfloat16), tl.trans(w_lo.to(tl.bfloat16)), acc)
                    acc = tl.dot(x_hi.to(tl.bfloat16), tl.trans(w_hi.to(tl.bfloat16)), acc)
                else:
                    acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision="ieee")
                    acc = tl.dot(x_hi, tl.trans(w_hi), acc, input_precision="ieee")
            else:
                acc_e += x_lo[:, None, :] * w_lo[None, :, :] + x_hi[:, None, :] * w_hi[None, :, :]
        else:
            if FMT == 1:  # int8: the codes themselves (the row scale comes after the sum)
                w = tl.load(w_ptr + w_rows[:, None] * KB + kk[None, :], mask=w_mask, other=0).to(tl.float32)
            else:  # fp8: e4m3 x its block's scale
                codes = tl.load(w_ptr + w_rows[:, None] * KB + kk[None, :], mask=w_mask, other=0).to(tl.int32)
                scale = tl.load(s_ptr + s_rows[:, None] * S_COLS + (kk // S_DIV)[None, :], mask=w_mask, other=0.0)
                w = _e4m3(codes) * scale  # [BN, BKB] x 2^-8
            xv = tl.load(x_ptr + x_rows[:, None] * stride_x + kk[None, :], mask=x_mask, other=0.0).to(tl.float32)
            if USE_DOT:
                if DOT_BF16:  # int8 codes are exact in bf16; fp8 weights x scale rounded as the torch path does
                    acc = tl.dot(xv.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
                else:
                    acc = tl.dot(xv, tl.trans(w), acc, input_precision="ieee")
            else:
                acc_e += xv[:, None, :] * w[None, :, :]
    if not USE_DOT:
        acc = tl.sum(acc_e, axis=2)
    if FMT == 1:
        acc = acc * tl.load(s_ptr + s_rows, mask=w_ok, other=0.0)[None, :]
    if FMT == 0:
        acc = acc * 256.0  # the codes' 2^-8 (a power of two: the sum rounds as the true weights' would)
    return acc


@triton.jit
def _load_masked(at, MASKED: tl.constexpr, ok):
    """A load, masked (0 where not ok) only in a partial tile."""
    if MASKED:
        return tl.load(at, mask=ok, other=0.0)
    else:
        return tl.load(at)


@triton.jit
def _scales(s_ptr, s_rows, s_row0, s_row1, col, rows_ok, cols_ok, S_COLS, MASKED: tl.constexpr,
            S_GROUPS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The scales at columns col [BG] of the rows' scale rows s_rows [BN], [BN, BG] (masked where not rows_ok x
    cols_ok in a partial tile). S_GROUPS 1: every row's scale row is s_row0 (FP8 blocks of B0 rows, B0 a multiple of
    BN: one load a chunk for all the thread's rows, [1, BG]); 2: the first BN / 2 rows' is s_row0, the rest's s_row1
    (w13's gate and up halves); 0: a load a row."""
    if S_GROUPS == 0:
        return _load_masked(s_ptr + s_rows[:, None] * S_COLS + col[None, :], MASKED,
                            rows_ok[:, None] & cols_ok[None, :])
    elif S_GROUPS == 1:
        return _load_masked(s_ptr + s_row0 * S_COLS + col, MASKED, cols_ok)[None, :]
    else:
        a = _load_masked(s_ptr + s_row0 * S_COLS + col, MASKED, cols_ok)
        b = _load_masked(s_ptr + s_row1 * S_COLS + col, MASKED, cols_ok)
        return tl.where((tl.arange(0, BLOCK_N) < BLOCK_N // 2)[:, None], a[None, :], b[None, :])


@triton.jit
def _x_start_t4(xp):
    """The lanes' start for _fma_int4_sub_word: -8 x 2^-24 times the sum of each lane's x (x mul), from the pairs
    of _x_pairs_t4 (the odd t's x 2^-4 weigh -2^-17, the even t's -2^-21: fp16 subnormals, exact), one packed FMA a
    pair: 16 a chunk, shared by the thread's rows (the codes' - 8 at no cost a row)."""
    even = tl.full(xp[0].shape, 0x80088008, tl.uint32)  # fp16x2 (-2^-21, -2^-21)
    odd = tl.full(xp[0].shape, 0x80808080, tl.uint32)  # fp16x2 (-2^-17, -2^-17)
    h = tl.zeros(xp[0].shape, tl.uint32)
    for i in tl.static_range(16):
        h = _hfma2(xp[i], odd if i % 2 == 1 else even, h)
    return h


@triton.jit
def _fma_int4_sub_word(h, cw, xp, w: tl.constexpr):
    """h += word w's eight int4 codes times their x pairs (_x_pairs_t4), in fp16x2 without a conversion
    instruction: nibbles 0 and 4 of a word masked in place (cw & 0x000F000F) are the fp16 subnormals code x 2^-24,
    nibbles 1 and 5 (cw & 0x00F000F0) 16 code x 2^-24 (their x carry the 2^-4), nibbles 2, 6 and 3, 7 the same
    from cw >> 8: 5 integer ops and 4 packed FMAs a word of 8 codes (the - 8 is in the lanes' start, _x_start_t4).
    The weights are exact; an FMA rounds only its sum, to fp16 (2^-11 of it, or the subnormal step 2^-25)."""
    hi8 = cw >> 8
    for t in tl.static_range(4):
        src = cw if t < 2 else hi8
        wt = src & (0x000F000F if t % 2 == 0 else 0x00F000F0)
        h = _hfma2(wt, xp[4 * w + t][None, :], h)
    return h


@triton.jit
def _gemv_tile(acc, c, xs, k0, KW, g, s_ptr, s_rows, s_row0, s_row1, w_ok, S_COLS, x_mul, GB: tl.constexpr,
               FMT: tl.constexpr, BLOCK_N: tl.constexpr, BG: tl.constexpr, HW_CVT: tl.constexpr, PACKED: tl.constexpr,
               MASKED: tl.constexpr, S_GROUPS: tl.constexpr):
    """acc [BN, BG] += one tile of _gemv: the code words c [BN, BG, 4] (words k0 .. k0 + 4 BG of each row) with
    their x (xs, fp32 [BG] each), scaled per chunk or per word."""
    a, b = tl.split(tl.reshape(c, (BLOCK_N, BG, 2, 2)))
    c0, c2 = tl.split(a)
    c1, c3 = tl.split(b)
    if FMT == 1:  # int8: element 4w + b is byte b of word w, sign-extended
        for w in tl.static_range(4):
            cw = c0 if w == 0 else c1 if w == 1 else c2 if w == 2 else c3
            for bb in tl.static_range(4):
                acc += ((cw << (24 - 8 * bb)) >> 24).to(tl.float32) * xs[4 * w + bb][None, :]
    else:
        if FMT == 0:  # fp8: bytes 0, 2 and 1, 3 of a word decoded in pairs
            part = tl.zeros((BLOCK_N, BG), dtype=tl.float32)
            for w in tl.static_range(4):
                cw = c0 if w == 0 else c1 if w == 1 else c2 if w == 2 else c3
                if HW_CVT:  # the hardware's conversion (sm_89+): the values themselves
                    v0, v1, v2, v3 = _e4m3x4(cw)
                else:  # integer ops: the values x 2^-8 (6 and 4 conversions a word)
                    v0, v1, v2, v3 = _e4m3x4_int(cw)
                part += v0 * xs[4 * w][None, :]
                part += v1 * xs[4 * w + 1][None, :]
                part += v2 * xs[4 * w + 2][None, :]
                part += v3 * xs[4 * w + 3][None, :]
                if GB % 16 != 0:  # the scale of each word's block
                    col = (4 * (k0 + 4 * g) + 4 * w) // GB  # [BG]
                    sc = _scales(s_ptr, s_rows, s_row0, s_row1, col, w_ok, 4 * g + w < KW - k0, S_COLS, MASKED,
                                 S_GROUPS, BLOCK_N)
                    acc += part * sc
                    part = tl.zeros((BLOCK_N, BG), dtype=tl.float32)
        elif PACKED:  # int4 in fp16x2, every target (no conversion instruction: sm_80/86 have no e4m3 one, and
            # from sm_89 this takes fewer instructions than the e4m3 route): nibbles t and t + 4 of a word masked in
            # place are fp16 subnormals, code x 2^-24 (x 16 for the odd nibbles, whose x carry 2^-4), one packed FMA
            # each: 9 instructions a word of 8 codes; each row's lanes start at -8 x 2^-24 sum(x) (shared by the
            # thread's rows), the two lanes added in fp16, widened once
            # x pairs (t, t + 4), the odd t's x 2^-4: exact for |x mul| >= 2^-13, below rounded to fp16's
            # subnormal step (2^-25: 2^-38 of max|x mul| >= 2^13)
            xp = _x_pairs_t4(xs, x_mul, 0.0625)
            h = tl.broadcast_to(_x_start_t4(xp)[None, :], (BLOCK_N, BG))
            for w in tl.static_range(4):
                cw = (c0 if w == 0 else c1 if w == 1 else c2 if w == 2 else c3).to(tl.uint32, bitcast=True)
                h = _fma_int4_sub_word(h, cw, xp, w)
            part = _lane_sum(h)  # a lane's |sum| <= 16 x 8 x 2^-24 2^14 = 2^-3
        else:  # int4: element 8w + 2b (+ 1) is byte b's low (high) nibble of word w; code - 8 summed as
            # sum(code x) - 8 sum(x), the second shared by the thread's rows
            part = tl.zeros((BLOCK_N, BG), dtype=tl.float32)
            xsum = tl.zeros((BG,), dtype=tl.float32)
            for w in tl.static_range(4):
                cw = c0 if w == 0 else c1 if w == 1 else c2 if w == 2 else c3
                if HW_CVT:  # a byte 0..15 is the e4m3 of code x 2^-9 (subnormal below 8): the hardware's
                    # conversion, 4 codes a word of low (high) nibbles
                    n_lo = _e4m3x4(cw & 0x0F0F0F0F)
                    n_hi = _e4m3x4((cw >> 4) & 0x0F0F0F0F)
                for bb in tl.static_range(4):
                    x_lo = xs[8 * w + 2 * bb]
                    x_hi = xs[8 * w + 2 * bb + 1]
                    if HW_CVT:
                        part += n_lo[bb] * x_lo[None, :]
                        part += n_hi[bb] * x_hi[None, :]
                    else:
                        part += ((cw >> (8 * bb)) & 15).to(tl.float32) * x_lo[None, :]
                        part += ((cw >> (8 * bb + 4)) & 15).to(tl.float32) * x_hi[None, :]
                    xsum += x_lo + x_hi
                if GB % 16 != 0:
                    col = (4 * (k0 + 4 * g) + 4 * w) // GB  # [BG]
                    sc = _load_masked(s_ptr + s_rows[:, None] * S_COLS + col[None, :],
                                      MASKED, w_ok[:, None] & (4 * g[None, :] + w < KW - k0)).to(tl.float32)
                    acc += (part - (8.0 / 512.0 if HW_CVT else 8.0) * xsum[None, :]) * sc
                    part = tl.zeros((BLOCK_N, BG), dtype=tl.float32)
                    xsum = tl.zeros((BG,), dtype=tl.float32)
            if GB % 16 == 0:
                part -= (8.0 / 512.0 if HW_CVT else 8.0) * xsum[None, :]
        if GB % 16 == 0:  # one scale a chunk
            if (16 * BG) % GB == 0 and S_GROUPS == 0:  # k0's columns in the base, the chunk's a fixed offset
                s_at = s_ptr + (4 * k0) // GB
                col = (16 * g) // GB  # [BG]
            else:
                s_at = s_ptr
                col = (16 * (k0 // 4 + g)) // GB  # [BG]
            sc = _scales(s_at, s_rows, s_row0, s_row1, col, w_ok, 4 * g < KW - k0, S_COLS, MASKED, S_GROUPS,
                         BLOCK_N).to(tl.float32)
            acc += part * sc
    return acc


@triton.jit
def _gemv(x_ptr, x_row, stride_x, w_ptr, s_ptr, w_rows, s_rows, w_ok, KB, S_COLS, x_mul, x_inv, GB: tl.constexpr,
          FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr, HW_CVT: tl.constexpr,
          s_row0=0, s_row1=0, S_GROUPS: tl.constexpr = 0):
    """Decode: x[x_row] . W[w_rows] -> [BLOCK_N] fp32 for one pair (int8: before the row scale).

    A thread holds whole 16-byte chunks of code words (one 16-byte load) of several rows, and the chunk's x
    in the same shape (no layout change: x decoded once, used for each of its rows); each chunk's products are
    summed in an FMA chain and scaled once (GB bytes share a scale: fp8 b1, int4 group / 2; a GB that is no
    multiple of 16 takes a scale a word).
    KB is a multiple of 4 (the caller checks); a partial last chunk is masked per word. x_mul, x_inv: _x_guard's
    powers of two for the packed fp16 path (x x_mul, the sum x x_inv)."""
    BG: tl.constexpr = BLOCK_KB // 16  # chunks per tile row
    N_ELEM: tl.constexpr = 32 if FMT == 2 else 16  # elements in a chunk
    X32: tl.constexpr = x_ptr.dtype.element_ty == tl.float32
    XF16: tl.constexpr = x_ptr.dtype.element_ty == tl.float16
    KW = KB // 4  # code words in a row
    g = tl.arange(0, BG)  # [BG]
    i4 = tl.arange(0, 4)
    rows = tl.where(w_ok, w_rows, 0)  # rows past N read row 0 (never stored): whole tiles load unmasked
    s_rows = tl.where(w_ok, s_rows, 0)
    # the codes' (and scales') addresses: a scalar base that moves with k0 plus int32 offsets fixed over the loop,
    # one wide multiply-add a row
    words_at = (w_ptr.to(tl.pointer_type(tl.uint32)) + (rows[:, None, None] * KW + 4 * g[None, :, None]
                                                         + i4[None, None, :]))  # [BN, BG, 4]
    XPW: tl.constexpr = 1 if X32 else 2  # x elements in a word
    # int4 with a 16-bit x and a scale a chunk: products in fp16x2 on every target and under the interpreter (each
    # 16-term lane sum rounds in fp16, 2^-11 or the subnormal step; a lane stays below 16 x 8 x 2^-24 2^14)
    PACKED: tl.constexpr = FMT == 2 and (not X32) and GB % 16 == 0
    x_base = x_ptr.to(tl.pointer_type(tl.uint32)) + x_row.to(tl.int64) * (stride_x // XPW)
    x_off = (N_ELEM // XPW) * g[:, None] + i4[None, :]  # [BG, 4] the first x words of each chunk
    x_at = x_base + x_off
    acc = tl.zeros((BLOCK_N, BG), dtype=tl.float32)
    KW_FULL = (KW // (4 * BG)) * (4 * BG)  # whole tiles unmasked (rows past N read row 0, never stored)
    for k0 in range(0, KW_FULL, 4 * BG):  # in words
        c = tl.load(words_at + k0).to(tl.int32)  # [BN, BG, 4]
        xs = _x_chunk(x_at + k0 * (N_ELEM // 4) // XPW, x_off, (KW - k0) * (N_ELEM // 4) // XPW, N_ELEM, X32, XF16,
                      False)
        acc = _gemv_tile(acc, c, xs, k0, KW, g, s_ptr, s_rows, s_row0, s_row1, w_ok, S_COLS, x_mul, GB, FMT,
                         BLOCK_N, BG, HW_CVT, PACKED, False, S_GROUPS)
    if KW_FULL < KW:  # the last partial tile, masked per word
        w_ok3 = w_ok[:, None, None] & (4 * g[None, :, None] + i4[None, None, :] < KW - KW_FULL)
        # int4 pads with code 8 (zero), but the packed path with 0: its x pads are zero and a zero clears faster
        c = tl.load(words_at + KW_FULL, mask=w_ok3, other=0x88888888 if FMT == 2 and not PACKED else 0).to(tl.int32)
        xs = _x_chunk(x_at + KW_FULL * (N_ELEM // 4) // XPW, x_off, (KW - KW_FULL) * (N_ELEM // 4) // XPW, N_ELEM,
                      X32, XF16, True)
        acc = _gemv_tile(acc, c, xs, KW_FULL, KW, g, s_ptr, s_rows, s_row0, s_row1, w_ok, S_COLS, x_mul, GB, FMT,
                         BLOCK_N, BG, HW_CVT, PACKED, True, S_GROUPS)
    out = tl.sum(acc, axis=1)  # [BN]
    if FMT == 1:
        out = out * tl.load(s_ptr + s_rows, mask=w_ok, other=0.0)
    if FMT == 0 and not HW_CVT:
        out = out * 256.0  # the codes' 2^-8
    if FMT == 2 and PACKED:
        out = out * (16777216.0 * x_inv)  # the codes' 2^-24, x's 2^-e
    elif FMT == 2 and HW_CVT:
        out = out * 512.0  # the codes' 2^-9
    return out


@triton.jit
def _scale_rows(rows, SPLIT, SPLIT_AT, B0):
    """The scale rows of weight rows: fp8 blocks b0 rows, and w13's up half (rows >= SPLIT) starts its own
    blocking at scale row SPLIT_AT; the int formats pass B0 = 1, SPLIT_AT = SPLIT (one scale row per row)."""
    return tl.where(rows < SPLIT, rows // B0, SPLIT_AT + (rows - SPLIT) // B0)


@triton.jit
def _w13_kernel(x_ptr, stride_x, w_ptr0, s_ptr0, bias_ptr, group_slot_ptr, group_pairs_ptr, act_ptr,
                stride_act, N, KB, TOPK, limit, alpha, stride_wc, stride_sc, stride_biasc, S_COLS,
                S_DIV: tl.constexpr, SPLIT_AT, B0, FMT: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
                USE_DOT: tl.constexpr, DOT_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_KB: tl.constexpr):
    """act[pair, j] = activation(gate_j, up_j) for the group's pairs and a tile of j in [0, I) (N = I)."""
    slot = tl.load(group_slot_ptr + tl.program_id(0))
    if slot >= 0:
        pairs = tl.load(group_pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM], -1 = padding
        ok = pairs >= 0
        tokens = tl.where(ok, pairs // TOPK, 0)
        j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        j_ok = j < N
        gate_rows, up_rows = _gate_up_rows(j, N, CLAMPED)
        slot64 = slot.to(tl.int64)  # a pool of slots can pass 2^31 bytes
        w_ptr = w_ptr0 + slot64 * stride_wc
        s_ptr = s_ptr0 + slot64 * stride_sc
        gate = _dot(x_ptr, tokens, ok, stride_x, w_ptr, s_ptr, gate_rows, _scale_rows(gate_rows, N, SPLIT_AT, B0),
                    j_ok, KB, S_COLS, S_DIV, FMT, BLOCK_M, BLOCK_N, BLOCK_KB, USE_DOT, DOT_BF16)
        up = _dot(x_ptr, tokens, ok, stride_x, w_ptr, s_ptr, up_rows, _scale_rows(up_rows, N, SPLIT_AT, B0),
                  j_ok, KB, S_COLS, S_DIV, FMT, BLOCK_M, BLOCK_N, BLOCK_KB, USE_DOT, DOT_BF16)
        if HAS_BIAS:
            b_ptr = bias_ptr + slot64 * stride_biasc
            gate += tl.load(b_ptr + gate_rows, mask=j_ok, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b_ptr + up_rows, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        a = _gated_act(gate, up, limit, alpha, CLAMPED)
        tl.store(act_ptr + pairs[:, None] * stride_act + j[None, :], a.to(act_ptr.dtype.element_ty),
                 mask=ok[:, None] & j_ok[None, :])


@triton.jit
def _w2_kernel(act_ptr, stride_act, w_ptr0, s_ptr0, bias_ptr, weights_ptr, group_slot_ptr, group_pairs_ptr,
               y_ptr, stride_y, N, KB, stride_wc, stride_sc, stride_biasc, S_COLS, S_DIV: tl.constexpr, B0,
               FMT: tl.constexpr, HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, DOT_BF16: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr):
    """y[pair, j] = (down_j . act[pair] + bias_j) * topk_weight[pair] for a tile of j in [0, H) (N = H)."""
    slot = tl.load(group_slot_ptr + tl.program_id(0))
    if slot >= 0:
        pairs = tl.load(group_pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
        ok = pairs >= 0
        rows = tl.where(ok, pairs, 0)
        j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        j_ok = j < N
        slot64 = slot.to(tl.int64)
        acc = _dot(act_ptr, rows, ok, stride_act, w_ptr0 + slot64 * stride_wc, s_ptr0 + slot64 * stride_sc, j,
                   j // B0, j_ok, KB, S_COLS, S_DIV, FMT, BLOCK_M, BLOCK_N, BLOCK_KB, USE_DOT, DOT_BF16)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + slot64 * stride_biasc + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        weight = tl.load(weights_ptr + rows, mask=ok, other=0.0).to(tl.float32)  # [BM]
        tl.store(y_ptr + pairs[:, None] * stride_y + j[None, :], acc * weight[:, None],
                 mask=ok[:, None] & j_ok[None, :])


@triton.jit
def _w13_decode_kernel(x_ptr, stride_x, w_ptr0, s_ptr0, bias_ptr, ids_ptr, map_ptr, act_ptr, stride_act, N, KB,
                       TOPK, limit, alpha, stride_wc, stride_sc, stride_biasc, S_COLS, GB: tl.constexpr, SPLIT_AT,
                       B0: tl.constexpr, FMT: tl.constexpr, HAS_MAP: tl.constexpr, HAS_BIAS: tl.constexpr,
                       CLAMPED: tl.constexpr, HW_CVT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr):
    """Decode: act[pair, j] = activation(gate_j, up_j) for one (t, k) pair and a tile of j in [0, I) (N = I)."""
    pair = tl.program_id(0)
    slot = _pair_slot(ids_ptr, map_ptr, pair, HAS_MAP)
    if slot >= 0:
        j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        j_ok = j < N
        gate_rows, up_rows = _gate_up_rows(j, N, CLAMPED)
        slot64 = slot.to(tl.int64)  # a pool of slots can pass 2^31 bytes
        w_ptr = w_ptr0 + slot64 * stride_wc
        s_ptr = s_ptr0 + slot64 * stride_sc
        token = pair // TOPK
        x_mul, x_inv = _x_guard(x_ptr, token, stride_x, 2 * KB, FMT == 2 and GB % 16 == 0, True)
        rows2, ok2 = _gate_up_tile(BLOCK_N, N, CLAMPED)  # one GEMV over the gate and up rows: x decoded once
        # FP8 blocks of B0 rows, B0 a multiple of the tile: the gate rows share a scale row, and the up rows
        j0 = tl.program_id(1) * BLOCK_N
        y = _gemv(x_ptr, token, stride_x, w_ptr, s_ptr, rows2, _scale_rows(rows2, N, SPLIT_AT, B0), ok2, KB, S_COLS,
                  x_mul, x_inv, GB, FMT, 2 * BLOCK_N, BLOCK_KB, HW_CVT, j0 // B0, SPLIT_AT + j0 // B0,
                  2 if FMT == 0 and not CLAMPED and B0 % BLOCK_N == 0 else 0)
        gate, up = _split_gate_up(y, BLOCK_N)
        if HAS_BIAS:
            b_ptr = bias_ptr + slot64 * stride_biasc
            gate += tl.load(b_ptr + gate_rows, mask=j_ok, other=0.0).to(tl.float32)
            up += tl.load(b_ptr + up_rows, mask=j_ok, other=0.0).to(tl.float32)
        a = _gated_act(gate, up, limit, alpha, CLAMPED)
        tl.store(act_ptr + pair.to(tl.int64) * stride_act + j, a.to(act_ptr.dtype.element_ty), mask=j_ok)


@triton.jit
def _w2_decode_kernel(act_ptr, stride_act, w_ptr0, s_ptr0, bias_ptr, weights_ptr, ids_ptr, map_ptr, res_ptr,
                      stride_res, out_ptr, stride_out, N, KB, TOPK, stride_wc, stride_sc, stride_biasc, S_COLS,
                      GB: tl.constexpr, B0: tl.constexpr, FMT: tl.constexpr, HAS_MAP: tl.constexpr,
                      HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HW_CVT: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_KB: tl.constexpr):
    """Decode: out[t, j] = [residual[t, j] +] sum over k in order of topk_weight[t, k] (down_j . act[t K + k] +
    bias_j) for one token and a tile of j in [0, H) (N = H): the CTA loops over the token's K pairs (no atomics)."""
    t = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    j_ok = j < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, TOPK):
        pair = t * TOPK + k
        slot = _pair_slot(ids_ptr, map_ptr, pair, HAS_MAP)
        if slot >= 0:
            slot64 = slot.to(tl.int64)
            x_mul, x_inv = _x_guard(act_ptr, pair, stride_act, 2 * KB, FMT == 2 and GB % 16 == 0, True)
            # FP8 blocks of B0 rows, B0 a multiple of the tile: one scale row for the tile
            y = _gemv(act_ptr, pair, stride_act, w_ptr0 + slot64 * stride_wc, s_ptr0 + slot64 * stride_sc, j, j // B0,
                      j_ok, KB, S_COLS, x_mul, x_inv, GB, FMT, BLOCK_N, BLOCK_KB, HW_CVT,
                      (tl.program_id(1) * BLOCK_N) // B0, 0, 1 if FMT == 0 and B0 % BLOCK_N == 0 else 0)
            if HAS_BIAS:
                y += tl.load(bias_ptr + slot64 * stride_biasc + j, mask=j_ok, other=0.0).to(tl.float32)
            acc += y * tl.load(weights_ptr + pair).to(tl.float32)
    if HAS_RES:  # the CPU's order: the k-sum first, then the residual
        acc += tl.load(res_ptr + t.to(tl.int64) * stride_res + j, mask=j_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + j, acc.to(out_ptr.dtype.element_ty), mask=j_ok)


def _configs(use_dot: bool) -> list[triton.Config]:
    if INTERPRET:  # one config, big tiles: the interpreter runs a program in numpy
        return [triton.Config({"BLOCK_N": 32, "BLOCK_KB": 32}, num_warps=4)]
    # few configs, so the first call of each shape compiles in seconds; GEMV tiles give a thread 16-32 code bytes
    # (16-byte loads; bench/kernel_sass.py reports the first), <= 168 registers on sm_90, no spills
    if use_dot:
        return [triton.Config({"BLOCK_N": n, "BLOCK_KB": kb}, num_warps=w, num_stages=st)
                for n, kb, w, st in [(64, 32, 8, 3), (128, 32, 8, 3)]]
    return [triton.Config({"BLOCK_N": n, "BLOCK_KB": kb}, num_warps=w, num_stages=st)
            for n, kb, w, st in [(16, 256, 4, 2), (8, 256, 4, 2), (8, 512, 8, 2)]]


def _decode_configs(which: str, fmt: str = "int4") -> list[triton.Config]:
    """Decode tiles: a warp spans 32 chunks of 16 bytes of a row (512 bytes), the warps more rows, and a thread
    holds BLOCK_N / num_warps rows of its chunk (x decoded once for them; w13's one GEMV takes the tile's gate and
    up rows, twice BLOCK_N); w2 has only T x H / BLOCK_N programs. The first (one warp, 16 rows a thread) keeps x
    in the codes' layout (no shared-memory pass): the one bench/kernel_sass.py counts. int4's packed decode shares
    its x conversion over 16 rows (3.41 SASS instructions a byte on sm_90), and so does FP8's w2
    (its tile's rows one scale load: 3.83 on sm_80, 2.82 on sm_90, against 3.95 / 2.95 over 8, no spills); int8's
    w2 keeps 8 (16 rows spill on sm_90)."""
    if INTERPRET:
        return [triton.Config({"BLOCK_N": 16, "BLOCK_KB": 32}, num_warps=4)]
    tiles = [(8, 512, 1, 2), (16, 512, 4, 2), (8, 512, 4, 2), (16, 512, 8, 2)]
    if which == "w2":
        tiles = [(16, 512, 1, 2), (8, 512, 1, 2), (16, 512, 2, 2), (16, 512, 4, 2)]
        if fmt == "int8":
            tiles = [(8, 512, 1, 2), (16, 512, 2, 2), (16, 512, 4, 2), (8, 512, 4, 2)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_KB": kb}, num_warps=w, num_stages=st) for n, kb, w, st in tiles]


_KEY = ["N", "KB", "BLOCK_M", "FMT"]
_W13_DECODE = triton.autotune(_decode_configs("w13"), key=["N", "KB", "FMT"])(_w13_decode_kernel)
_W2_DECODE = {f: triton.autotune(_decode_configs("w2", f), key=["N", "KB", "FMT"])(_w2_decode_kernel)
              for f in FORMAT_IDS}
_W13 = {d: triton.autotune(_configs(d), key=_KEY)(_w13_kernel) for d in (False, True)}
_W2 = {d: triton.autotune(_configs(d), key=_KEY)(_w2_kernel) for d in (False, True)}


def decode_constexprs(fmt: str, block: tuple[int, int] | None = None, group: int = 32) -> dict[str, int]:
    """The compile-time scale blocking of a format: S_DIV elements along the input share a scale (FP8: the block's
    b1; int4: the group; int8: 1, unused), so the scale column is a shift, not a division per element; GB, the same
    in code bytes, for the decode GEMV (int8: 16, unused)."""
    s_div = block[1] if fmt == "fp8" else group if fmt == "int4" else 1
    return {"S_DIV": s_div, "GB": s_div // 2 if fmt == "int4" else s_div if fmt == "fp8" else 16,
            "B0": block[0] if fmt == "fp8" else 1}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quant_moe(hidden_states: torch.Tensor, topk_weights: torch.Tensor, slot_ids: torch.Tensor, tensors, act,
              fmt: str, block: tuple[int, int] | None = None, residual: torch.Tensor | None = None,
              pairs: torch.Tensor | None = None, mode: str | None = None,
              slot_map: torch.Tensor | None = None) -> torch.Tensor:
    """[residual +] sum_k topk_weights[t, k] * Expert_{slot_ids[t, k]}(hidden_states[t]) -> [T, H], input dtype.

    hidden_states [T, H], topk_weights [T, K], slot_ids [T, K]; tensors: the slot buffers by name, for fmt
    "fp8" w13 [C, 2I, H] e4m3 + w13_scale [C, 2 ceil(I/b0), ceil(H/b1)], w2 [C, H, I] + w2_scale (block = (b0, b1));
    "int8" w13_q [C, 2I, H] int8 + w13_scale [C, 2I], w2_q + w2_scale [C, H]; "int4" w13_q [C, 2I, H/2] uint8 +
    w13_scale [C, 2I, H/g] fp16, w2_q [C, H, I/2] + w2_scale [C, H, I/g]; optional w13_bias [C, 2I] / w2_bias [C, H].
    act: an ExpertActivation (`swiglu`: gate rows then up rows; `clamped_swiglu`: interleaved). pairs [P]: flat
    (t, k) indices to compute (None: all). mode: "gemv" or "grouped" (None: by tokens per expert). slot_map [E]
    int32 (this layer's row of the pool's map): `slot_ids` are then the routed expert ids, looked up in the kernels.
    """
    T, H = hidden_states.shape
    K = slot_ids.shape[1]
    fid = FORMAT_IDS[fmt]
    wname = "" if fid == FP8 else "_q"
    w13, s13, w2, s2 = (tensors[n] for n in (f"w13{wname}", "w13_scale", f"w2{wname}", "w2_scale"))
    if fid == FP8:  # the e4m3 bytes as bytes: decoded by the kernel
        w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)
    C, I2 = w13.shape[0], w13.shape[1]
    I = I2 // 2
    per_byte = 2 if fid == INT4 else 1
    if w13.shape[2] * per_byte != H or w2.shape[1] != H or w2.shape[2] * per_byte != I:
        raise ValueError(f"{fmt} slot buffers {list(w13.shape)} / {list(w2.shape)} do not fit H = {H}")
    for t in (w13, s13, w2, s2):
        if t.stride(-1) != 1 or not t[0].is_contiguous():  # slots at stride(0) (one buffer per slot: views)
            raise ValueError(f"{fmt} slot buffers must be contiguous within each slot")
    if act.kind not in ("swiglu", "clamped_swiglu"):
        raise ValueError(f"activation {act.kind!r} has no fused {fmt} kernel")
    # scale layout: (columns, elements per column) of w13's and w2's scales; the row blocking (b0) and where
    # w13's up half starts its scale rows
    if fid == FP8:
        b0, b1 = block
        cols13, div13, cols2, div2, B0, split_at = s13.shape[2], b1, s2.shape[2], b1, b0, _cdiv(I, b0)
    elif fid == INT4:
        cols13, div13, cols2, div2, B0, split_at = s13.shape[2], H // s13.shape[2], s2.shape[2], I // s2.shape[2], 1, I
    else:
        cols13 = div13 = cols2 = div2 = B0 = 1
        split_at = I
    x = hidden_states.contiguous()
    b13, b2 = tensors.get("w13_bias"), tensors.get("w2_bias")
    P = T * K if pairs is None else pairs.numel()
    if is_decode(T, P, mode):
        if not P:
            return residual.clone() if residual is not None else torch.zeros_like(hidden_states)
        gb13, gb2 = (div13, div2) if fid == FP8 else (div13 // 2, div2 // 2) if fid == INT4 else (16, 16)
        if w13.shape[2] % 4 or w2.shape[2] % 4 or gb13 % 4 or gb2 % 4:
            raise ValueError(f"the fused {fmt} decode reads 4-byte words: rows of {w13.shape[2]} / {w2.shape[2]} "
                             f"bytes and scale blocks of {gb13} / {gb2} bytes must be multiples of 4")
        d = decode_io(x, topk_weights, slot_ids, pairs, slot_map, residual, I)
        smap = d.slot_map if d.slot_map is not None else d.ids
        _W13_DECODE[lambda meta: (T * K, triton.cdiv(I, meta["BLOCK_N"]))](
            x, x.stride(0), w13, s13, b13 if b13 is not None else s13, d.ids, smap, d.act, d.act.stride(0), I,
            w13.shape[2], K, float(act.limit), float(act.alpha), w13.stride(0), s13.stride(0),
            b13.stride(0) if b13 is not None else 0, cols13, gb13, split_at, B0, FMT=fid,
            HAS_MAP=d.slot_map is not None, HAS_BIAS=b13 is not None, CLAMPED=act.kind == "clamped_swiglu",
            HW_CVT=fid != INT8 and hardware_fp8(x.device))
        res = d.residual if d.residual is not None else d.out
        _W2_DECODE[fmt][lambda meta: (T, triton.cdiv(H, meta["BLOCK_N"]))](
            d.act, d.act.stride(0), w2, s2, b2 if b2 is not None else s2, d.weights, d.ids, smap, res, res.stride(0),
            d.out, d.out.stride(0), H, w2.shape[2], K, w2.stride(0), s2.stride(0),
            b2.stride(0) if b2 is not None else 0, cols2, gb2, B0, FMT=fid, HAS_MAP=d.slot_map is not None,
            HAS_BIAS=b2 is not None, HAS_RES=d.residual is not None, HW_CVT=fid != INT8 and hardware_fp8(x.device))
        return d.out
    if slot_map is not None:  # prefill groups by slot on the device: one gather
        slot_ids = slot_map.index_select(0, slot_ids.reshape(-1).long()).view(T, K)  # [T, K]
    g = plan_groups(x, topk_weights, slot_ids, pairs, C, I, H)
    if g.count:
        nb = g.groups
        _W13[g.use_dot][lambda meta: (nb, triton.cdiv(I, meta["BLOCK_N"]))](
            x, x.stride(0), w13, s13, b13 if b13 is not None else s13, g.group_slot, g.group_pairs, g.act_buf,
            g.act_buf.stride(0), I, w13.shape[2], K, float(act.limit), float(act.alpha), w13.stride(0), s13.stride(0),
            b13.stride(0) if b13 is not None else 0, cols13, div13, split_at, B0, FMT=fid, HAS_BIAS=b13 is not None,
            CLAMPED=act.kind == "clamped_swiglu", USE_DOT=g.use_dot, DOT_BF16=g.dot_bf16, BLOCK_M=g.block_m)
        _W2[g.use_dot][lambda meta: (nb, triton.cdiv(H, meta["BLOCK_N"]))](
            g.act_buf, g.act_buf.stride(0), w2, s2, b2 if b2 is not None else s2, g.weights, g.group_slot,
            g.group_pairs, g.y, g.y.stride(0), H, w2.shape[2], w2.stride(0), s2.stride(0),
            b2.stride(0) if b2 is not None else 0, cols2, div2, B0, FMT=fid, HAS_BIAS=b2 is not None,
            USE_DOT=g.use_dot, DOT_BF16=g.dot_bf16, BLOCK_M=g.block_m)
    return sum_pairs(g.y, T, K, residual, hidden_states.dtype)
