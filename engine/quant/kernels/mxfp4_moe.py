"""The MoE over MXFP4 slot buffers in two Triton launches: codes and scales are read once, decoded in registers.

Kernels see only slots. Decode (T <= DECODE_MAX_TOKENS or at most GEMV_MAX_PAIRS pairs: few tokens per expert),
one kernel pair per MoE layer and no torch op around it: the `w13` launch, one program per (t, k) pair and tile of
I outputs, reads the pair's slot (slot_ids[t, k], or slot_map[layer, topk_ids[t, k]] with a map), runs the gate
and up GEMVs (GPT-OSS interleaves them: even rows gate, odd rows up), + biases, the activation, stored per pair;
the `w2` launch, one program per token and tile of H outputs, loops over the token's K pairs in order: GEMV +
bias, x its routing weight, summed in fp32, + the residual, rounded once to the output (deterministic, no atomics:
the CPU's order, k-sum then residual).

The decode GEMV gives a thread whole 16-byte scale blocks of several rows and loads x in the codes' shape (no
layout change through shared memory); whole tiles load unmasked, the last partial one masked; w13's one GEMV
takes the tile's gate and up rows together (x loaded and decoded once for both). For a 16-bit x from sm_89
(`hardware_fp8`) the E2M1 codes become e4m3 bytes (6 integer ops a word of 8: two lop3 bit-selects), the
hardware's cvt.rn.f16x2.e4m3x2 makes two fp16 weights an instruction, and fma.rn.f16x2 two products (exact: 2
bits of code times bf16's 8 fit fp16's 11); each block's two 16-term lane sums round in fp16 (2^-11 of the sum,
against the bf16 tolerance's 2^-6), are added in fp16 and widened and scaled in fp32: 4.44 SASS instructions a
packed byte on sm_90 with 16 rows a thread (w2; w13 4.58), from 4.9 and 8.7 before (bench/kernel_sass.py; this
decode's floor is 3.5: 6 + 4 + 4 a word). fp16 holds x only below ~43,000 (a lane reaches 1.5 max|x|):
_x_guard scales x by 2^-e on the device, e the least making max|x| < 2^14 (one max pass over the row per
program, no host read; exact, as bf16's and fp16's exponents reach far below), and the sum back by 2^e. On sm_80/86
(no e4m3 conversion) a 16-bit x takes fp16x2 too: nibbles t and t + 4 of a word shifted straight under fp16's lowest
exponent bits (the values x 2^-14, e = 0 fp16's subnormal; 14 integer ops, packed._e2m1_f16x2x4, and 4 packed FMAs a
word), x scaled on the device into [2^13, 2^14) (_x_guard UP: a lane stays <= 96, and fp16's subnormal step, 2^-25,
is 2^-24 of max|x|): 5.45 SASS instructions a packed byte on sm_80 (w2; w13 5.52), 5.46 / 5.58 on
sm_86, from the fp32 chain's 8.37 / 8.43 and 9.39 / 9.50. An fp32 x keeps the fp32 FMA chain, E2M1 as fp16 bits in
place or e4m3 bytes, exact to fp32 rounding.

Prefill (more tokens per expert): pairs sorted by slot on the device and padded to BLOCK_M rows per slot (no host
sync: the grid is the upper bound, groups past the end hold slot -1 and return at once); tl.dot on tensor cores,
each slot's codes read once per group instead of once per pair; a torch sum over k in order adds the residual.

A group whose slot is -1 is never computed, and a pair left out of `pairs` is in no group. Bytes: a
GPT-OSS-20B decode step reads 4 experts x 13.2 MB = 52.9 MB of codes and scales per layer, 10 us at an
H200's 4.8 TB/s; bf16 experts would be 199 MB. `bench/gpu_check.sh` measures what these kernels reach.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .packed import (
    INTERPRET,
    _e2m1,
    _e2m1_as_e4m3,
    _e2m1_f16x2x4,
    _e2m1_pair,
    _e4m3x4,
    _e8m0,
    _f16_pair,
    _fma_e4m3_word,
    _hfma2,
    _lane_sum,
    _x_guard,
    _x_pairs16,
    _x_pairs_t4,
    hardware_fp8,
)

# T = tokens, K = top-k, P = computed (t, k) pairs, C = slots, H = hidden, I = intermediate, NB = groups,
# N = outputs of a projection, KB = bytes in one packed row (its input size / 2)

GEMV_MAX_PAIRS = 16  # up to this many pairs a step is a decode: one GEMV per pair


@triton.jit
def _gated_act(gate, up, limit, alpha, CLAMPED: tl.constexpr):
    """The expert activation in fp32: GPT-OSS's clamped SwiGLU ((up + 1) * gate * sigmoid(alpha gate), gate and up
    clamped to the limit), else SwiGLU (silu(gate) * up)."""
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        a = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    else:
        a = gate * tl.sigmoid(gate) * up
    return a


@triton.jit
def _gate_up_rows(j, N, CLAMPED: tl.constexpr):
    """The w13 rows of outputs j's gate and up: GPT-OSS interleaves them (even gate, odd up), the rest stack the gate
    rows, then the up rows."""
    if CLAMPED:
        gate_rows = 2 * j
        up_rows = 2 * j + 1
    else:
        gate_rows = j
        up_rows = j + N
    return gate_rows, up_rows


@triton.jit
def _gate_up_tile(BLOCK_N: tl.constexpr, N, CLAMPED: tl.constexpr):
    """The decode's one GEMV over a tile's gate and up rows together ([2 BLOCK_N]: BLOCK_N gate rows, then their up
    rows), so x is loaded and decoded once for both: (rows, ok) and the tile's outputs j."""
    r = tl.arange(0, 2 * BLOCK_N)
    j = tl.program_id(1) * BLOCK_N + (r % BLOCK_N)
    gate_rows, up_rows = _gate_up_rows(j, N, CLAMPED)
    return tl.where(r < BLOCK_N, gate_rows, up_rows), j < N


@triton.jit
def _split_gate_up(y, BLOCK_N: tl.constexpr):
    """[2 BLOCK_N] (gate outputs, then up) -> gate, up [BLOCK_N] each."""
    return tl.split(tl.trans(tl.reshape(y, (2, BLOCK_N))))


@triton.jit
def _x_words(x_at, ok, X32: tl.constexpr, XF16: tl.constexpr, MASKED: tl.constexpr = True):
    """x at [BG, 4] word pointers (16 bytes a thread) -> its elements in fp32, [BG] each: 4 for an fp32 x, 8 for a
    16-bit x (a word holds elements 2i, low half, and 2i + 1). Loaded in the codes' shape, so no layout change."""
    if MASKED:
        v = tl.load(x_at, mask=ok, other=0)
    else:  # a whole tile: no predicates, no zeroing
        v = tl.load(x_at)
    a, b = tl.split(tl.reshape(v, (v.shape[0], 2, 2)))
    v0, v2 = tl.split(a)
    v1, v3 = tl.split(b)
    if X32:
        return (v0.to(tl.float32, bitcast=True), v1.to(tl.float32, bitcast=True), v2.to(tl.float32, bitcast=True),
                v3.to(tl.float32, bitcast=True))
    elif XF16:
        return _f16_pair(v0) + _f16_pair(v1) + _f16_pair(v2) + _f16_pair(v3)
    else:  # bf16: an fp32 with the low 16 bits zero
        return ((v0 << 16).to(tl.float32, bitcast=True), (v0 & 0xFFFF0000).to(tl.float32, bitcast=True),
                (v1 << 16).to(tl.float32, bitcast=True), (v1 & 0xFFFF0000).to(tl.float32, bitcast=True),
                (v2 << 16).to(tl.float32, bitcast=True), (v2 & 0xFFFF0000).to(tl.float32, bitcast=True),
                (v3 << 16).to(tl.float32, bitcast=True), (v3 & 0xFFFF0000).to(tl.float32, bitcast=True))


@triton.jit
def _x_chunk(x_at, off, limit, N_ELEM: tl.constexpr, X32: tl.constexpr, XF16: tl.constexpr,
             MASKED: tl.constexpr = True):
    """The N_ELEM (16 or 32) x elements of each 16-byte code chunk, fp32 [BG] each: x_at [BG, 4] points at the
    chunk's first x words, `off` [BG, 4] their offsets from the tile's first, `limit` the words left in the row."""
    WORDS: tl.constexpr = 4 if X32 else 8  # elements in one [BG, 4] word load
    xs = _x_words(x_at, off < limit, X32, XF16, MASKED)
    for i in tl.static_range(1, N_ELEM // WORDS):
        xs = xs + _x_words(x_at + 4 * i, off + 4 * i < limit, X32, XF16, MASKED)
    return xs


@triton.jit
def _x_split8(xv):
    """[A, 8] -> its eight columns, [A] each (a register shuffle where a thread holds whole rows)."""
    a, b = tl.split(tl.reshape(xv, (xv.shape[0], 2, 2, 2)))  # columns 0 mod 2, 1 mod 2
    a0, a1 = tl.split(a)  # 0 mod 4, 2 mod 4
    b0, b1 = tl.split(b)  # 1 mod 4, 3 mod 4
    c0, c4 = tl.split(a0)
    c2, c6 = tl.split(a1)
    c1, c5 = tl.split(b0)
    c3, c7 = tl.split(b1)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _packed_block(acc, words_at, s_at, x_at, x_off, k0, G, w_ok, x_mul, MASKED: tl.constexpr,
                  BLOCK_N: tl.constexpr, BG: tl.constexpr, X32: tl.constexpr, XF16: tl.constexpr, XPW: tl.constexpr,
                  HW_CVT: tl.constexpr, PACKED: tl.constexpr):
    """acc [BN, BG] += one tile of _packed_gemv's scale blocks (blocks k0 .. k0 + BG of each row), masked or whole."""
    g = tl.arange(0, BG)
    g_ok = g < G - k0
    if MASKED:
        words = tl.load(words_at + 4 * k0, mask=w_ok[:, None, None] & g_ok[None, :, None], other=0)  # [BN, BG, 4]
        scale = tl.load(s_at + k0, mask=w_ok[:, None] & g_ok[None, :], other=127).to(tl.int32)  # [BN, BG]
    else:
        words = tl.load(words_at + 4 * k0)
        scale = tl.load(s_at + k0).to(tl.int32)
    a, b = tl.split(tl.reshape(words, (BLOCK_N, BG, 2, 2)))
    c0, c2 = tl.split(a)
    c1, c3 = tl.split(b)
    # element 8w + t of a block is nibble t of its word w
    xs = _x_chunk(x_at + k0 * (32 // XPW), x_off, (G - k0) * (32 // XPW), 32, X32, XF16, MASKED)
    if PACKED and HW_CVT:  # fp16x2: a block's 32 products in two lanes of 16 packed FMAs, widened to fp32 once
        xp = _x_pairs16(xs, x_mul)
        h = tl.zeros((BLOCK_N, BG), dtype=tl.uint32)
        for w in tl.static_range(4):
            cw = c0 if w == 0 else c1 if w == 1 else c2 if w == 2 else c3
            lows, highs = _e2m1_as_e4m3(cw.to(tl.uint32, bitcast=True))
            h = _fma_e4m3_word(h, lows, highs, xp, w)
        part = _lane_sum(h)  # <= 2 x 1.5 x 2^14: finite
    elif PACKED:  # fp16x2 without e4m3 hardware (sm_80/86, the interpreter's default): nibbles t and t + 4 of a
        # word shifted under fp16's lowest exponent bits (_e2m1_pair's bits: the values x 2^-14, e = 0 fp16's
        # subnormal), 14 integer ops and 4 packed FMAs a word of 8 codes; x scaled into [2^13, 2^14) first
        xp = _x_pairs_t4(xs, x_mul)
        h = tl.zeros((BLOCK_N, BG), dtype=tl.uint32)
        for w in tl.static_range(4):
            cw = (c0 if w == 0 else c1 if w == 1 else c2 if w == 2 else c3).to(tl.uint32, bitcast=True)
            p0, p1, p2, p3 = _e2m1_f16x2x4(cw)
            h = _hfma2(p0, xp[4 * w][None, :], h)
            h = _hfma2(p1, xp[4 * w + 1][None, :], h)
            h = _hfma2(p2, xp[4 * w + 2][None, :], h)
            h = _hfma2(p3, xp[4 * w + 3][None, :], h)
        part = _lane_sum(h)  # a lane <= 16 x 6 x 2^-14 2^14 = 96
    else:
        part = _e2m1_block(c0, c1, c2, c3, xs, BLOCK_N, BG, HW_CVT)
    # 2^(s - 126), twice the scale, one instruction (s = 0 stays normal; s = 254 overflows, as its weights do)
    return acc + part * ((scale + 1) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _packed_gemv(x_ptr, x_row, stride_x, w_ptr, s_ptr, w_rows, w_ok, KB, x_mul, x_inv,
                 BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr, HW_CVT: tl.constexpr):
    """x[x_row] [2 KB] . W[w_rows] -> [BLOCK_N] fp32 for one pair (decode): W one slot's packed rows as in
    _packed_dot. A thread holds whole 16-byte scale blocks (one 16-byte load of 4 words, one scale byte) of several
    rows and the block's 32 x in the same shape (decoded once for those rows: no layout change), decodes two codes
    an instruction pair, sums the block's 32 products in an FMA chain and scales the sum once. x_mul, x_inv:
    _x_guard's powers of two (the packed fp16 path runs on x x_mul and scales the sum back by x_inv)."""
    BG: tl.constexpr = BLOCK_KB // 16  # scale blocks per tile row
    X32: tl.constexpr = x_ptr.dtype.element_ty == tl.float32
    XF16: tl.constexpr = x_ptr.dtype.element_ty == tl.float16
    XPW: tl.constexpr = 1 if X32 else 2  # x elements in a word
    # a 16-bit x: products in fp16x2 on every target (exact: 2 bits of code x bf16's 8 fit fp16's 11; each 16-term
    # lane sum rounds in fp16, 2^-11): from sm_89 through e4m3 bytes (|x| < 43000 keeps a lane sum, <= 16 x 6 x 2^-6
    # max|x|, and x itself inside fp16), else the values x 2^-14 in fp16 bits (x in [2^13, 2^14): a lane <= 96)
    PACKED: tl.constexpr = not X32
    KW = KB // 4  # words per packed row
    G = KB // 16
    g = tl.arange(0, BG)  # [BG]
    i4 = tl.arange(0, 4)
    rows = tl.where(w_ok, w_rows, 0)  # rows past N read row 0 (never stored): whole tiles load unmasked
    words_at = (w_ptr.to(tl.pointer_type(tl.uint32)) + (rows[:, None, None] * KW + 4 * g[None, :, None]
                                                         + i4[None, None, :]))  # [BN, BG, 4]
    s_at = s_ptr + (rows[:, None] * G + g[None, :])  # [BN, BG]
    x_off = (32 // XPW) * g[:, None] + i4[None, :]  # [BG, 4] the first x words of each block
    x_at = x_ptr.to(tl.pointer_type(tl.uint32)) + x_row.to(tl.int64) * (stride_x // XPW) + x_off
    acc = tl.zeros((BLOCK_N, BG), dtype=tl.float32)
    G_FULL = (G // BG) * BG  # whole tiles unmasked, the last partial one masked
    for k0 in range(0, G_FULL, BG):  # in scale blocks
        acc = _packed_block(acc, words_at, s_at, x_at, x_off, k0, G, w_ok, x_mul, False, BLOCK_N, BG, X32, XF16,
                            XPW, HW_CVT, PACKED)
    if G_FULL < G:
        acc = _packed_block(acc, words_at, s_at, x_at, x_off, G_FULL, G, w_ok, x_mul, True, BLOCK_N, BG, X32, XF16,
                            XPW, HW_CVT, PACKED)
    if PACKED and HW_CVT:  # the codes' 2^-6, the 2 above, x's 2^-e
        return tl.sum(acc, axis=1) * (32.0 * x_inv)
    elif PACKED:  # the codes' 2^-14, the 2 above, x's 2^-e
        return tl.sum(acc, axis=1) * (8192.0 * x_inv)
    else:
        return tl.sum(acc, axis=1) * (32.0 if HW_CVT else 8192.0)  # the codes' 2^-6 or 2^-14, the 2 above


@triton.jit
def _e2m1_block(c0, c1, c2, c3, xs, BLOCK_N: tl.constexpr, BG: tl.constexpr, HW_CVT: tl.constexpr):
    """A block's 32 products in fp32 from its four code words: one FMA chain, the values x 2^-6 (HW_CVT) or
    x 2^-14."""
    part = tl.zeros((BLOCK_N, BG), dtype=tl.float32)
    for w in tl.static_range(4):
        cw = c0 if w == 0 else c1 if w == 1 else c2 if w == 2 else c3
        if HW_CVT:  # through e4m3 bytes and the hardware's conversion: values x 2^-6
            lows, highs = _e2m1_as_e4m3(cw.to(tl.uint32, bitcast=True))
            v0, v2, v4, v6 = _e4m3x4(lows)
            v1, v3, v5, v7 = _e4m3x4(highs)
        else:  # through fp16 bits: values x 2^-14
            v0, v4 = _e2m1_pair(cw, 9, 12)
            v1, v5 = _e2m1_pair(cw, 5, 8)
            v2, v6 = _e2m1_pair(cw, 1, 4)
            v3, v7 = _e2m1_pair(cw, -3, 0)
        part += v0 * xs[8 * w][None, :]
        part += v1 * xs[8 * w + 1][None, :]
        part += v2 * xs[8 * w + 2][None, :]
        part += v3 * xs[8 * w + 3][None, :]
        part += v4 * xs[8 * w + 4][None, :]
        part += v5 * xs[8 * w + 5][None, :]
        part += v6 * xs[8 * w + 6][None, :]
        part += v7 * xs[8 * w + 7][None, :]
    return part


@triton.jit
def _packed_dot(x_ptr, x_rows, x_ok, stride_x, w_ptr, s_ptr, w_rows, w_ok, KB,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr,
                USE_DOT: tl.constexpr, DOT_BF16: tl.constexpr):
    """x[x_rows] [BLOCK_M, 2 KB] @ W[w_rows]^T -> [BLOCK_M, BLOCK_N] fp32, W one slot's packed rows
    (w_ptr [rows, KB] bytes, s_ptr [rows, KB / 16] scales). Byte i of a row is elements 2i (low nibble) and
    2i + 1 (high nibble), so x is read as its even and its odd elements."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # the GEMV sums products elementwise across the K loop and reduces across threads once, at the end
    acc_e = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_KB), dtype=tl.float32)  # unused (and dropped) with tl.dot
    G = KB // 16
    for k0 in range(0, KB, BLOCK_KB):
        kk = k0 + tl.arange(0, BLOCK_KB)  # [BKB] bytes along the row
        k_ok = kk < KB
        w_mask = w_ok[:, None] & k_ok[None, :]
        codes = tl.load(w_ptr + w_rows[:, None] * KB + kk[None, :], mask=w_mask, other=0).to(tl.int32)  # [BN, BKB]
        scales = tl.load(s_ptr + w_rows[:, None] * G + (kk // 16)[None, :], mask=w_mask, other=127)  # [BN, BKB]
        scale = _e8m0(scales.to(tl.int32))
        w_lo = _e2m1(codes & 15) * scale  # [BN, BKB] elements 2i
        w_hi = _e2m1(codes >> 4) * scale  # [BN, BKB] elements 2i + 1
        x_mask = x_ok[:, None] & k_ok[None, :]
        x_at = x_ptr + x_rows[:, None] * stride_x + 2 * kk[None, :]
        # upcast right after the load: the interpreter's bf16 arithmetic is not IEEE's
        x_lo = tl.load(x_at, mask=x_mask, other=0.0).to(tl.float32)  # [BM, BKB]
        x_hi = tl.load(x_at + 1, mask=x_mask, other=0.0).to(tl.float32)  # [BM, BKB]
        if USE_DOT:
            if DOT_BF16:  # every MXFP4 weight is exact in bf16
                acc = tl.dot(x_lo.to(tl.bfloat16), tl.trans(w_lo.to(tl.bfloat16)), acc)
                acc = tl.dot(x_hi.to(tl.bfloat16), tl.trans(w_hi.to(tl.bfloat16)), acc)
            else:
                acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision="ieee")
                acc = tl.dot(x_hi, tl.trans(w_hi), acc, input_precision="ieee")
        else:
            acc_e += x_lo[:, None, :] * w_lo[None, :, :] + x_hi[:, None, :] * w_hi[None, :, :]
    if not USE_DOT:
        acc = tl.sum(acc_e, axis=2)
    return acc


@triton.jit
def _w13_kernel(x_ptr, stride_x, blocks_ptr, scales_ptr, bias_ptr, group_slot_ptr, group_pairs_ptr, act_ptr,
                stride_act, N, KB, TOPK, limit, alpha, stride_bc, stride_sc, stride_biasc,
                HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, USE_DOT: tl.constexpr, DOT_BF16: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr):
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
        w_ptr = blocks_ptr + slot64 * stride_bc
        s_ptr = scales_ptr + slot64 * stride_sc
        if USE_DOT:
            gate = _packed_dot(x_ptr, tokens, ok, stride_x, w_ptr, s_ptr, gate_rows, j_ok, KB,
                               BLOCK_M, BLOCK_N, BLOCK_KB, USE_DOT, DOT_BF16)
            up = _packed_dot(x_ptr, tokens, ok, stride_x, w_ptr, s_ptr, up_rows, j_ok, KB,
                             BLOCK_M, BLOCK_N, BLOCK_KB, USE_DOT, DOT_BF16)
        else:  # decode: BLOCK_M = 1, one pair
            token = tl.max(tokens, axis=0)
            gate = _packed_gemv(x_ptr, token, stride_x, w_ptr, s_ptr, gate_rows, j_ok, KB, 1.0, 1.0, BLOCK_N,
                                BLOCK_KB, False)[None, :]
            up = _packed_gemv(x_ptr, token, stride_x, w_ptr, s_ptr, up_rows, j_ok, KB, 1.0, 1.0, BLOCK_N,
                              BLOCK_KB, False)[None, :]
        if HAS_BIAS:
            b_ptr = bias_ptr + slot64 * stride_biasc
            gate += tl.load(b_ptr + gate_rows, mask=j_ok, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b_ptr + up_rows, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        a = _gated_act(gate, up, limit, alpha, CLAMPED)
        tl.store(act_ptr + pairs[:, None] * stride_act + j[None, :], a.to(act_ptr.dtype.element_ty),
                 mask=ok[:, None] & j_ok[None, :])


@triton.jit
def _w2_kernel(act_ptr, stride_act, blocks_ptr, scales_ptr, bias_ptr, weights_ptr, group_slot_ptr, group_pairs_ptr,
               y_ptr, stride_y, N, KB, stride_bc, stride_sc, stride_biasc,
               HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, DOT_BF16: tl.constexpr,
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
        if USE_DOT:
            acc = _packed_dot(act_ptr, rows, ok, stride_act, blocks_ptr + slot64 * stride_bc,
                              scales_ptr + slot64 * stride_sc, j, j_ok, KB, BLOCK_M, BLOCK_N, BLOCK_KB, USE_DOT,
                              DOT_BF16)
        else:  # decode: BLOCK_M = 1, one pair
            acc = _packed_gemv(act_ptr, tl.max(rows, axis=0), stride_act, blocks_ptr + slot64 * stride_bc,
                               scales_ptr + slot64 * stride_sc, j, j_ok, KB, 1.0, 1.0, BLOCK_N, BLOCK_KB,
                               False)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + slot64 * stride_biasc + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        weight = tl.load(weights_ptr + rows, mask=ok, other=0.0).to(tl.float32)  # [BM]
        tl.store(y_ptr + pairs[:, None] * stride_y + j[None, :], acc * weight[:, None],
                 mask=ok[:, None] & j_ok[None, :])


@triton.jit
def _pair_slot(ids_ptr, map_ptr, pair, HAS_MAP: tl.constexpr):
    """The slot of flat (t, k) pair `pair`: ids[pair], or with a map slot_map[layer, ids[pair]] (ids the routed
    expert ids); -1 (an id of -1, or an expert with no slot): skipped."""
    s = tl.load(ids_ptr + pair)
    if HAS_MAP:
        s = tl.load(map_ptr + tl.maximum(s, 0), mask=s >= 0, other=-1)
    return s


@triton.jit
def _w13_decode_kernel(x_ptr, stride_x, blocks_ptr, scales_ptr, bias_ptr, ids_ptr, map_ptr, act_ptr, stride_act,
                       N, KB, TOPK, limit, alpha, stride_bc, stride_sc, stride_biasc, HAS_MAP: tl.constexpr,
                       HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, HW_CVT: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_KB: tl.constexpr):
    """Decode: act[pair, j] = activation(gate_j, up_j) for one (t, k) pair and a tile of j in [0, I) (N = I)."""
    pair = tl.program_id(0)
    slot = _pair_slot(ids_ptr, map_ptr, pair, HAS_MAP)
    if slot >= 0:
        j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        j_ok = j < N
        gate_rows, up_rows = _gate_up_rows(j, N, CLAMPED)
        slot64 = slot.to(tl.int64)  # a pool of slots can pass 2^31 bytes
        w_ptr = blocks_ptr + slot64 * stride_bc
        s_ptr = scales_ptr + slot64 * stride_sc
        token = pair // TOPK
        x_mul, x_inv = _x_guard(x_ptr, token, stride_x, 2 * KB, True, not HW_CVT)
        rows2, ok2 = _gate_up_tile(BLOCK_N, N, CLAMPED)
        gate, up = _split_gate_up(_packed_gemv(x_ptr, token, stride_x, w_ptr, s_ptr, rows2, ok2, KB, x_mul, x_inv,
                                               2 * BLOCK_N, BLOCK_KB, HW_CVT), BLOCK_N)
        if HAS_BIAS:
            b_ptr = bias_ptr + slot64 * stride_biasc
            gate += tl.load(b_ptr + gate_rows, mask=j_ok, other=0.0).to(tl.float32)
            up += tl.load(b_ptr + up_rows, mask=j_ok, other=0.0).to(tl.float32)
        a = _gated_act(gate, up, limit, alpha, CLAMPED)
        tl.store(act_ptr + pair.to(tl.int64) * stride_act + j, a.to(act_ptr.dtype.element_ty), mask=j_ok)


@triton.jit
def _w2_decode_kernel(act_ptr, stride_act, blocks_ptr, scales_ptr, bias_ptr, weights_ptr, ids_ptr, map_ptr,
                      res_ptr, stride_res, out_ptr, stride_out, N, KB, TOPK, stride_bc, stride_sc, stride_biasc,
                      HAS_MAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HW_CVT: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr):
    """Decode: out[t, j] = [residual[t, j] +] sum over k in order of topk_weight[t, k] (down_j . act[t K + k] +
    bias_j), for one token and a tile of j in [0, H) (N = H): the CTA loops over the token's K pairs, so the sum is
    deterministic (no atomics), in fp32, rounded once."""
    t = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    j_ok = j < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, TOPK):
        pair = t * TOPK + k
        slot = _pair_slot(ids_ptr, map_ptr, pair, HAS_MAP)
        if slot >= 0:
            slot64 = slot.to(tl.int64)
            x_mul, x_inv = _x_guard(act_ptr, pair, stride_act, 2 * KB, True, not HW_CVT)
            y = _packed_gemv(act_ptr, pair, stride_act, blocks_ptr + slot64 * stride_bc,
                             scales_ptr + slot64 * stride_sc, j, j_ok, KB, x_mul, x_inv, BLOCK_N, BLOCK_KB, HW_CVT)
            if HAS_BIAS:
                y += tl.load(bias_ptr + slot64 * stride_biasc + j, mask=j_ok, other=0.0).to(tl.float32)
            acc += y * tl.load(weights_ptr + pair).to(tl.float32)
    if HAS_RES:  # the CPU's order: the k-sum first, then the residual
        acc += tl.load(res_ptr + t.to(tl.int64) * stride_res + j, mask=j_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + j, acc.to(out_ptr.dtype.element_ty), mask=j_ok)


def _configs(use_dot: bool) -> list[triton.Config]:
    if INTERPRET:  # one config, big tiles: the interpreter runs a program in numpy
        return [triton.Config({"BLOCK_N": 32, "BLOCK_KB": 32}, num_warps=4)]
    # sm_90 (ptxas -v): these hold <= 230 registers a thread without spilling. GEMV tiles give a thread 32-64
    # code bytes (two to four 16-byte loads in flight) in <= 128 registers (bench/kernel_sass.py: the first)
    if use_dot:
        return [triton.Config({"BLOCK_N": n, "BLOCK_KB": kb}, num_warps=w, num_stages=st)
                for n, kb, w, st in [(32, 32, 4, 2), (64, 32, 8, 3), (128, 32, 8, 3), (64, 64, 8, 3)]]
    return [triton.Config({"BLOCK_N": n, "BLOCK_KB": kb}, num_warps=w, num_stages=st)
            for n, kb, w, st in [(64, 256, 8, 2), (32, 256, 4, 2), (32, 512, 8, 2), (16, 256, 4, 2)]]


def _decode_configs(which: str, x32: bool = False) -> list[triton.Config]:
    """The decode kernels' tiles: w13 has T K pairs x I / BLOCK_N programs, w2 only T x H / BLOCK_N (each loops
    over its K pairs), so w2 offers narrower tiles to fill the SMs at T = 1 (GPT-OSS-20B: 2880 / 16 = 180 CTAs).
    The first, one warp over 512 bytes of 16 rows (w13: 8 gate and their 8 up rows in one GEMV), gives a thread 16
    rows of one 16-byte block (x decoded once for 16 rows, and x's layout is the codes' own: no pass through shared
    memory); bench/kernel_sass.py counts it. An fp32 x's w2 starts at 8 rows (its fp32 sums spill at 16 on sm_90)."""
    if INTERPRET:
        return [triton.Config({"BLOCK_N": 32, "BLOCK_KB": 32}, num_warps=4)]
    tiles = [(8, 512, 1, 2), (16, 512, 4, 2), (32, 256, 4, 2), (16, 256, 4, 2)]
    if which == "w2":
        tiles = [(16, 512, 1, 2), (32, 512, 4, 2), (32, 256, 4, 2), (16, 256, 4, 2)]
        if x32:
            tiles = [(8, 512, 1, 2), (32, 512, 4, 2), (32, 256, 4, 2), (16, 256, 4, 2)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_KB": kb}, num_warps=w, num_stages=st) for n, kb, w, st in tiles]


_KEY = ["N", "KB", "BLOCK_M"]
_W13 = {d: triton.autotune(_configs(d), key=_KEY)(_w13_kernel) for d in (False, True)}
_W2 = {d: triton.autotune(_configs(d), key=_KEY)(_w2_kernel) for d in (False, True)}
_W13_DECODE = triton.autotune(_decode_configs("w13"), key=["N", "KB"])(_w13_decode_kernel)
_W2_DECODE = {x32: triton.autotune(_decode_configs("w2", x32), key=["N", "KB"])(_w2_decode_kernel)
              for x32 in (False, True)}  # by x's dtype: fp32 or 16-bit
DECODE_MAX_TOKENS = 8  # up to this many tokens (or GEMV_MAX_PAIRS pairs) a step is a decode: a GEMV per pair


def is_decode(T: int, P: int, mode: str | None) -> bool:
    """Decode (a GEMV per pair, the k-sum in the w2 kernel) or prefill (pairs grouped by slot, tl.dot): by tokens
    per expert, which is at most T and at most P; `mode` "gemv" / "grouped" forces one."""
    if mode is not None:
        return mode == "gemv"
    return T <= DECODE_MAX_TOKENS or P <= GEMV_MAX_PAIRS


@dataclass
class DecodeIO:
    """What both decode launches take: the pairs' slot (or expert) ids, -1 for a pair left out, and buffers."""

    ids: torch.Tensor  # [T*K] slot ids, or expert ids with slot_map; -1: not computed
    slot_map: torch.Tensor | None  # [E] int32 slot of each expert of this layer (-1: none), or None
    weights: torch.Tensor  # [T*K] routing weights
    act: torch.Tensor  # [T*K, I] the activations between the launches, rounded as torch rounds
    out: torch.Tensor  # [T, H] in the input dtype: [residual +] the MoE output
    residual: torch.Tensor | None  # [T, H]


def decode_io(x: torch.Tensor, topk_weights: torch.Tensor, ids: torch.Tensor, pairs: torch.Tensor | None,
              slot_map: torch.Tensor | None, residual: torch.Tensor | None, inter: int) -> DecodeIO:
    """The decode launches' inputs: no grouping, no zeroed buffer, no sum after (the w2 kernel adds in k order and
    writes the output); only a batch restricted to `pairs` pays two small ops to mark the others -1."""
    T, K = ids.shape
    flat = ids.reshape(-1)  # [T*K] a view: the kernels load int32 or int64 ids
    if pairs is not None:
        keep = pairs.reshape(-1).to(device=x.device, dtype=torch.long)  # [P]
        flat = torch.full_like(flat, -1).index_copy_(0, keep, flat.index_select(0, keep))  # [T*K]
    if residual is not None:
        residual = residual.contiguous()
    act_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    return DecodeIO(flat.contiguous(), slot_map, topk_weights.reshape(-1).contiguous(),
                    torch.empty(T * K, inter, device=x.device, dtype=act_dtype),
                    torch.empty(T, x.shape[1], device=x.device, dtype=x.dtype), residual)


def group_rows(pairs: int, slots: int) -> int:
    """BLOCK_M for the grouped path: about the pairs a used slot gets (16 is tl.dot's least)."""
    per_slot = pairs / max(1, min(pairs, slots))
    return 16 if per_slot <= 16 else 32 if per_slot <= 32 else 64


def group_by_slot(flat_slots: torch.Tensor, pair_ids: torch.Tensor, slots: int,
                  block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs sorted by slot and padded to block_m rows per slot, on the device without a host sync.

    flat_slots [T*K] int32, pair_ids [P] int32 flat (t, k) -> group_slot [NB] int32 (-1: nothing to do) and
    group_pairs [NB, block_m] int32 (-1: padding). NB is the bound cdiv(P, block_m) + min(P, C + 1).
    """
    device = flat_slots.device
    P = pair_ids.numel()
    bucket = flat_slots.index_select(0, pair_ids.long()).long().clamp(min=-1) + 1  # [P]; 0 holds slot -1
    order = torch.argsort(bucket, stable=True)  # [P]
    sorted_bucket = bucket.index_select(0, order)  # [P]
    counts = torch.zeros(slots + 1, dtype=torch.long, device=device).index_add_(0, bucket, torch.ones_like(bucket))
    starts = torch.cumsum(counts, 0) - counts  # [C+1] first sorted position of each bucket
    rank = torch.arange(P, device=device) - starts.index_select(0, sorted_bucket)  # [P] position in its bucket
    groups = (counts + block_m - 1) // block_m  # [C+1]
    group_start = torch.cumsum(groups, 0) - groups  # [C+1]
    group_of = group_start.index_select(0, sorted_bucket) + rank // block_m  # [P]
    nb = triton.cdiv(P, block_m) + min(P, slots + 1)
    group_slot = torch.full((nb,), -1, dtype=torch.int32, device=device)  # [NB]
    group_slot[group_of] = (sorted_bucket - 1).to(torch.int32)  # every pair of a group writes the same slot
    group_pairs = torch.full((nb, block_m), -1, dtype=torch.int32, device=device)  # [NB, BM]
    group_pairs[group_of, rank % block_m] = pair_ids.index_select(0, order).to(torch.int32)
    return group_slot, group_pairs


@dataclass
class PairGroups:
    """What both launches of a fused MoE (this module's, kernels/quant_moe.py's) take about the (t, k) pairs."""

    y: torch.Tensor  # [T*K, H] fp32 weighted expert output per pair (zero for a pair not computed)
    count: int  # P, the pairs computed (0: nothing to launch)
    group_slot: torch.Tensor | None = None  # [NB] int32
    group_pairs: torch.Tensor | None = None  # [NB, BLOCK_M] int32
    block_m: int = 1
    use_dot: bool = False  # tl.dot per group (the grouped kernels' GEMV branch is unused)
    dot_bf16: bool = False  # bf16 tensor cores for a bf16 model (the interpreter's bf16 dot runs the fp32 one)
    act_buf: torch.Tensor | None = None  # [T*K, I] the activations between the launches, rounded as torch rounds
    weights: torch.Tensor | None = None  # [T*K] routing weights

    @property
    def groups(self) -> int:
        return self.group_slot.numel()


def plan_groups(x: torch.Tensor, topk_weights: torch.Tensor, slot_ids: torch.Tensor, pairs: torch.Tensor | None,
                slots: int, inter: int, hidden: int) -> PairGroups:
    """Prefill: the pairs to compute (`pairs` [P] flat (t, k), None: all) sorted by slot into BLOCK_M rows on the
    device; buffers allocated."""
    T, K = slot_ids.shape
    device = x.device
    flat_slots = slot_ids.reshape(-1).to(device=device, dtype=torch.int32)  # [T*K]
    if pairs is None:
        pair_ids = torch.arange(T * K, device=device, dtype=torch.int32)  # [P]
    else:
        pair_ids = pairs.reshape(-1).to(device=device, dtype=torch.int32)  # [P]
    P = pair_ids.numel()
    y = torch.zeros(T * K, hidden, device=device, dtype=torch.float32)  # [T*K, H]
    if not P:
        return PairGroups(y, 0)
    block_m = group_rows(P, slots)
    group_slot, group_pairs = group_by_slot(flat_slots, pair_ids, slots, block_m)
    act_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    return PairGroups(y, P, group_slot, group_pairs, block_m, use_dot=True,
                      dot_bf16=x.dtype == torch.bfloat16 and not INTERPRET,
                      act_buf=torch.empty(T * K, inter, device=device, dtype=act_dtype),
                      weights=topk_weights.reshape(-1).contiguous())


def sum_pairs(y: torch.Tensor, T: int, K: int, residual: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """[residual +] the pairs' outputs summed over k in order (deterministic, no atomics) -> [T, H] in `dtype`."""
    out = y.view(T, K, -1).sum(dim=1)  # [T, H] fp32
    if residual is not None:
        out += residual.float()
    return out.to(dtype)


def mxfp4_moe(hidden_states: torch.Tensor, topk_weights: torch.Tensor, slot_ids: torch.Tensor,
              tensors, act, residual: torch.Tensor | None = None, pairs: torch.Tensor | None = None,
              mode: str | None = None, slot_map: torch.Tensor | None = None) -> torch.Tensor:
    """[residual +] sum_k topk_weights[t, k] * Expert_{slot_ids[t, k]}(hidden_states[t]) -> [T, H], input dtype.

    hidden_states [T, H], topk_weights [T, K], slot_ids [T, K], tensors: the MXFP4 slot buffers by name
    (w13_blocks [C, 2I, H/32, 16], w13_scales [C, 2I, H/32], w2_blocks [C, H, I/32, 16], w2_scales [C, H, I/32],
    optional w13_bias [C, 2I] / w2_bias [C, H]); act: an ExpertActivation (`swiglu`: gate rows then up rows;
    `clamped_swiglu`: interleaved). pairs [P]: flat (t, k) indices to compute (None: all). mode: "gemv" or
    "grouped" (None: by tokens per expert, `is_decode`). slot_map [E] int32 (this layer's row of the pool's map):
    `slot_ids` are then the routed expert ids and the decode kernels look the slots up themselves.
    """
    T, H = hidden_states.shape
    K = slot_ids.shape[1]
    w13_b, w13_s, w2_b, w2_s = (tensors[n] for n in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"))
    C, I2 = w13_b.shape[0], w13_b.shape[1]
    I = I2 // 2
    if w13_b.shape[2] * 32 != H or w2_b.shape[1] != H or w2_b.shape[2] * 32 != I:
        raise ValueError(f"MXFP4 slot buffers {list(w13_b.shape)} / {list(w2_b.shape)} do not fit H = {H}")
    for t in (w13_b, w13_s, w2_b, w2_s):
        if t.stride(-1) != 1 or not t[0].is_contiguous():  # slots at stride(0) (one buffer per slot: views)
            raise ValueError("MXFP4 slot buffers must be contiguous within each slot")
    if act.kind not in ("swiglu", "clamped_swiglu"):
        raise ValueError(f"activation {act.kind!r} has no fused MXFP4 kernel")
    x = hidden_states.contiguous()
    b13, b2 = tensors.get("w13_bias"), tensors.get("w2_bias")
    P = T * K if pairs is None else pairs.numel()
    if is_decode(T, P, mode):
        if not P:
            return residual.clone() if residual is not None else torch.zeros_like(hidden_states)
        d = decode_io(x, topk_weights, slot_ids, pairs, slot_map, residual, I)
        smap = d.slot_map if d.slot_map is not None else d.ids
        _W13_DECODE[lambda meta: (T * K, triton.cdiv(I, meta["BLOCK_N"]))](
            x, x.stride(0), w13_b, w13_s, b13 if b13 is not None else w13_s, d.ids, smap, d.act, d.act.stride(0), I,
            H // 2, K, float(act.limit), float(act.alpha), w13_b.stride(0), w13_s.stride(0),
            b13.stride(0) if b13 is not None else 0, HAS_MAP=d.slot_map is not None, HAS_BIAS=b13 is not None,
            CLAMPED=act.kind == "clamped_swiglu", HW_CVT=hardware_fp8(x.device))
        res = d.residual if d.residual is not None else d.out
        _W2_DECODE[x.dtype == torch.float32][lambda meta: (T, triton.cdiv(H, meta["BLOCK_N"]))](
            d.act, d.act.stride(0), w2_b, w2_s, b2 if b2 is not None else w2_s, d.weights, d.ids, smap, res,
            res.stride(0), d.out, d.out.stride(0), H, I // 2, K, w2_b.stride(0), w2_s.stride(0),
            b2.stride(0) if b2 is not None else 0, HAS_MAP=d.slot_map is not None, HAS_BIAS=b2 is not None,
            HAS_RES=d.residual is not None, HW_CVT=hardware_fp8(x.device))
        return d.out
    if slot_map is not None:  # prefill groups by slot on the device: one gather
        slot_ids = slot_map.index_select(0, slot_ids.reshape(-1).long()).view(T, K)  # [T, K]
    g = plan_groups(x, topk_weights, slot_ids, pairs, C, I, H)
    if g.count:
        nb = g.groups
        _W13[g.use_dot][lambda meta: (nb, triton.cdiv(I, meta["BLOCK_N"]))](
            x, x.stride(0), w13_b, w13_s, b13 if b13 is not None else w13_s, g.group_slot, g.group_pairs, g.act_buf,
            g.act_buf.stride(0), I, H // 2, K, float(act.limit), float(act.alpha), w13_b.stride(0), w13_s.stride(0),
            b13.stride(0) if b13 is not None else 0, HAS_BIAS=b13 is not None, CLAMPED=act.kind == "clamped_swiglu",
            USE_DOT=g.use_dot, DOT_BF16=g.dot_bf16, BLOCK_M=g.block_m)
        _W2[g.use_dot][lambda meta: (nb, triton.cdiv(H, meta["BLOCK_N"]))](
            g.act_buf, g.act_buf.stride(0), w2_b, w2_s, b2 if b2 is not None else w2_s, g.weights, g.group_slot,
            g.group_pairs, g.y, g.y.stride(0), H, I // 2, w2_b.stride(0), w2_s.stride(0),
            b2.stride(0) if b2 is not None else 0, HAS_BIAS=b2 is not None, USE_DOT=g.use_dot, DOT_BF16=g.dot_bf16,
            BLOCK_M=g.block_m)
    return sum_pairs(g.y, T, K, residual, hidden_states.dtype)
