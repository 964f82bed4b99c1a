"""Packed arithmetic for the fused MoE decode kernels (kernels/mxfp4_moe.py, kernels/quant_moe.py): E2M1 and int4 codes
to fp16 or e4m3 bits, the e4m3x2 -> f16x2 conversion (sm_80/86: e4m3 to fp16 bits in integer ops) and fp16x2 FMAs
(inline PTX, each with a pure-Triton twin the interpreter runs, tested bit for bit:
tests/engine/quant/test_kernel_lop3.py, test_mxfp4_triton.py), the lane sums,
the device-side |x| guard (x scaled by a power of two below 2^14) and `hardware_fp8`, whether the device converts
e4m3 itself (sm_89 and later). The kernels' docstrings give the SASS counts these reach."""

from __future__ import annotations

import os
from functools import cache

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _e2m1(code):
    """FP4 E2M1 codes (int32, 0..15) -> fp32: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    mag = code & 7
    # mag >= 2 is normal: exponent (mag >> 1) - 1 and mantissa bit mag & 1, i.e. fp32 bits (mag + 252) << 22
    v = tl.where(mag < 2, mag.to(tl.float32) * 0.5, ((mag + 252) << 22).to(tl.float32, bitcast=True))
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def _e8m0(s):
    """E8M0 scales (int32, 0..255) -> 2^(s - 127) in fp32 (s = 0 is the one subnormal)."""
    return tl.where(s > 0, (s << 23).to(tl.float32, bitcast=True), 5.877471754111438e-39)


@triton.jit
def _f16_pair(h):
    """Two fp16 bit patterns packed in a uint32 (element a in the low half, b in the high) -> (a, b) in fp32."""
    # joined, the two halves of one word sit side by side, so the widening reads them in place (no repacking)
    halves = tl.join(h.to(tl.uint16), (h >> 16).to(tl.uint16))
    return tl.split(halves.to(tl.float16, bitcast=True).to(tl.float32))


@triton.jit
def _e2m1_pair(words, EM_SHIFT: tl.constexpr, SIGN_SHIFT: tl.constexpr):
    """Nibbles t and t + 4 of each uint32 of E2M1 codes -> two fp32 tensors, the values x 2^-14, exactly.

    The shifts place each code's e1 e0 m bits at fp16's lowest exponent bits and top mantissa bit (bits 11..9)
    and its sign at bit 15, in both halves at once: e = 0 is then fp16's subnormal, so 0.5 needs no branch, and
    widening fp16 to fp32 is exact."""
    if EM_SHIFT >= 0:
        em = words << EM_SHIFT
    else:
        em = words >> -EM_SHIFT
    sign = words << SIGN_SHIFT
    return _f16_pair((em & 0x0E000E00) | (sign & 0x80008000))


@triton.jit
def _e2m1_f16x2(words, EM_SHIFT: tl.constexpr, SIGN_SHIFT: tl.constexpr):
    """Nibbles t and t + 4 of each uint32 of E2M1 codes -> a uint32 word of fp16x2, the values x 2^-14, exactly:
    _e2m1_pair's bits (e1 e0 m under fp16's lowest exponent bits and top mantissa bit, the sign at bit 15) before
    the widening, for fma.rn.f16x2 (two shifts and two logic ops a pair, one for nibbles 3, 7: SIGN_SHIFT 0)."""
    if EM_SHIFT >= 0:
        em = words << EM_SHIFT
    else:
        em = words >> -EM_SHIFT
    if SIGN_SHIFT == 0:
        sign = words
    else:
        sign = words << SIGN_SHIFT
    return (em & 0x0E000E00) | (sign & 0x80008000)


@triton.jit
def _e2m1_f16x2x4(words):
    """uint32 words of eight E2M1 codes -> the four fp16x2 words of _e2m1_f16x2 (nibbles t and t + 4, t = 0..3), the
    values x 2^-14. In PTX 14 integer ops a word, where the four pairs apart take 15: the signs masked once and
    moved by 4 once (s, s4); each pair's signs are whole bytes of s or s4 (prmt, or a mask), whose other sign bits
    fall under the e m field, so one bit-select lop3 per pair places the shifted e m bits and the signs."""
    if _ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 s, s4, t, b, z;
            mov.b32 z, 0;
            and.b32 s, $4, 0x88888888;
            shl.b32 s4, s, 4;
            shl.b32 t, $4, 9;
            prmt.b32 b, s4, z, 0x2404;
            lop3.b32 $0, t, b, 0x0E000E00, 0xE4;
            shl.b32 t, $4, 5;
            prmt.b32 b, s, z, 0x2404;
            lop3.b32 $1, t, b, 0x0E000E00, 0xE4;
            shl.b32 t, $4, 1;
            and.b32 b, s4, 0xFF00FF00;
            lop3.b32 $2, t, b, 0x0E000E00, 0xE4;
            shr.b32 t, $4, 3;
            and.b32 b, $4, 0x88008800;
            lop3.b32 $3, t, b, 0x0E000E00, 0xE4;
            }""",
            constraints="=r,=r,=r,=r,r", args=[words], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
            is_pure=True, pack=1)
    else:
        return (_e2m1_f16x2(words, 9, 12), _e2m1_f16x2(words, 5, 8), _e2m1_f16x2(words, 1, 4),
                _e2m1_f16x2(words, -3, 0))


@triton.jit
def _x_pairs_t4(xs, mul, ODD: tl.constexpr = 1.0):
    """The 32 fp32 x of a 16-byte block of nibble codes (element 8w + t: nibble t of word w), times `mul`
    (_x_guard's power of two, exact) -> 16 uint32 words of fp16x2 in the order of decodes that pair nibbles t and
    t + 4 of a word: elements (t, t + 4) of each word w, t = 0..3, the odd t's times ODD (a power of two) more."""
    ps = ()
    for w in tl.static_range(4):
        for t in tl.static_range(4):
            m = mul * ODD if t % 2 == 1 else mul
            ps = ps + (_cvt_f16x2(xs[8 * w + t] * m, xs[8 * w + t + 4] * m),)
    return ps


@triton.jit
def _e4m3x4(words):
    """uint32 words of four e4m3 bytes -> their values as four fp32 tensors, byte 0 first: the hardware's
    cvt.rn.f16x2.e4m3x2 (sm_89 and later; every e4m3 value is exact in fp16) and the exact widening, 6
    instructions a word. Compiled kernels only (the interpreter cannot run PTX): callers take integer decodes there."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 l, h, a0, a1, b0, b1;
        .reg .b32 a, b;
        mov.b32 {l, h}, $4;
        cvt.rn.f16x2.e4m3x2 a, l;
        cvt.rn.f16x2.e4m3x2 b, h;
        mov.b32 {a0, a1}, a;
        mov.b32 {b0, b1}, b;
        cvt.f32.f16 $0, a0;
        cvt.f32.f16 $1, a1;
        cvt.f32.f16 $2, b0;
        cvt.f32.f16 $3, b1;
        }""",
        constraints="=r,=r,=r,=r,r", args=[words], dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
        is_pure=True, pack=1)


_ASM: tl.constexpr = tl.constexpr(not INTERPRET)  # inline PTX compiles; the interpreter takes the pure-Triton twins


@triton.jit
def _e2m1_as_e4m3(w):
    """uint32 words of eight E2M1 codes -> two words of e4m3 bytes with the same values x 2^-6, exactly (lows:
    byte j the low nibble of byte j, highs: its high nibble): the code's e and m bits under e4m3's lowest exponent
    bits and top mantissa bit, so e = 0 is e4m3's subnormal (0.5 needs no branch), its sign at bit 7."""
    if _ASM:  # 6 integer ops a word (LLVM folds the Triton form back to 7): the signs masked once, each half one
        # bit-select lop3 (a & M) | (b & ~M), b's only bits under M (a sign on a neighbour byte's bit 3) dropped
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 s, t, u;
            and.b32 s, $2, 0x88888888;
            shl.b32 t, $2, 2;
            shl.b32 u, s, 4;
            lop3.b32 $0, t, u, 0x1C1C1C1C, 0xE4;
            shr.b32 t, $2, 2;
            lop3.b32 $1, t, s, 0x1C1C1C1C, 0xE4;
            }""",
            constraints="=r,=r,r", args=[w], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        lows = ((w << 2) & 0x1C1C1C1C) | ((w << 4) & 0x80808080)
        highs = ((w >> 2) & 0x1C1C1C1C) | (w & 0x80808080)
        return lows, highs


@triton.jit
def _e4m3x4_int(words):
    """uint32 words of four e4m3 bytes -> their values x 2^-8 as four fp32 tensors, byte 0 first, exactly, without
    the hardware's conversion (sm_80/86): bytes 0, 2 of a word become the fp16x2 word ((w << 7) & 0x3F803F80) |
    ((w << 8) & 0x80008000), bytes 1, 3 ((w >> 1) & 0x3F803F80) | (w & 0x80008000) (e and m under fp16's lowest
    exponent bits and top mantissa bits, so e = 0 is fp16's subnormal and needs no branch; the sign at bit 15),
    each half widened to fp32 (exact). In PTX 6 integer ops (the four signs masked once, each pair one bit-select
    lop3) and 4 conversions a word, read from the halves in place (the NaN pattern, refused at load, reads as
    480 x 2^-8)."""
    if _ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 s, t, u, a, b;
            .reg .b16 a0, a1, b0, b1;
            and.b32 s, $4, 0x80808080;
            shl.b32 t, $4, 7;
            shl.b32 u, s, 8;
            lop3.b32 a, t, u, 0x3F803F80, 0xE4;
            shr.b32 t, $4, 1;
            lop3.b32 b, t, s, 0x3F803F80, 0xE4;
            mov.b32 {a0, a1}, a;
            mov.b32 {b0, b1}, b;
            cvt.f32.f16 $0, a0;
            cvt.f32.f16 $1, b0;
            cvt.f32.f16 $2, a1;
            cvt.f32.f16 $3, b1;
            }""",
            constraints="=r,=r,=r,=r,r", args=[words], dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True, pack=1)
    else:
        w = words.to(tl.uint32, bitcast=True)
        v0, v2 = _f16_pair(((w << 7) & 0x3F803F80) | ((w << 8) & 0x80008000))
        v1, v3 = _f16_pair(((w >> 1) & 0x3F803F80) | (w & 0x80008000))
        return v0, v1, v2, v3


@triton.jit
def _f16_bits(v):
    """fp32 -> the bits of its fp16 rounding, in a uint32's low half."""
    return v.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def _f16x2(lo, hi):
    """Two fp32 tensors -> uint32 words of fp16x2 (lo in the low half), each rounded to fp16."""
    return _f16_bits(lo) | (_f16_bits(hi) << 16)


@triton.jit
def _cvt_e4m3x2(words):
    """uint32 words of four e4m3 bytes -> two uint32 words of fp16x2 (bytes 0, 1 and bytes 2, 3; every e4m3 value is
    exact in fp16): cvt.rn.f16x2.e4m3x2 (sm_89 on), one instruction per two bytes; under the interpreter the same
    bits from integer ops (the byte's bits under fp16's lowest exponent bits are the value x 2^-8, exact)."""
    if _ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 l, h;
            mov.b32 {l, h}, $2;
            cvt.rn.f16x2.e4m3x2 $0, l;
            cvt.rn.f16x2.e4m3x2 $1, h;
            }""",
            constraints="=r,=r,r", args=[words], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        u = words.to(tl.uint32, bitcast=True)
        # byte b -> the fp16 bits of its value x 2^-8: e and m under fp16's lowest exponent bits, the sign at 15
        e0 = ((u & 0x7F) << 7) | ((u & 0x80) << 8)
        e1 = (((u >> 8) & 0x7F) << 7) | (((u >> 8) & 0x80) << 8)
        e2 = (((u >> 16) & 0x7F) << 7) | (((u >> 16) & 0x80) << 8)
        e3 = (((u >> 24) & 0x7F) << 7) | (((u >> 24) & 0x80) << 8)
        v0, v2 = _f16_pair(e0 | (e2 << 16))
        v1, v3 = _f16_pair(e1 | (e3 << 16))
        return _f16x2(v0 * 256.0, v1 * 256.0), _f16x2(v2 * 256.0, v3 * 256.0)


@triton.jit
def _hfma2(a, b, c):
    """a * b + c on uint32 words of fp16x2, lane by lane, rounded once (fma.rn.f16x2: two products an instruction);
    the interpreter computes each lane in fp64 and rounds it to fp16."""
    a = tl.broadcast_to(a, c.shape)
    b = tl.broadcast_to(b, c.shape)
    if _ASM:
        return tl.inline_asm_elementwise(asm="fma.rn.f16x2 $0, $1, $2, $3;", constraints="=r,r,r,r",
                                         args=[a, b, c], dtype=tl.uint32, is_pure=True, pack=1)
    else:
        a0, a1 = _f16_pair(a)
        b0, b1 = _f16_pair(b)
        c0, c1 = _f16_pair(c)
        # in fp64 the fp16 product is exact, and so is the sum unless the terms lie over 2^30 apart: one rounding
        r0 = a0.to(tl.float64) * b0.to(tl.float64) + c0.to(tl.float64)
        r1 = a1.to(tl.float64) * b1.to(tl.float64) + c1.to(tl.float64)
        return _f16_bits(r0) | (_f16_bits(r1) << 16)


@triton.jit
def _cvt_f16x2(lo, hi):
    """Two fp32 tensors -> uint32 words of fp16x2 (lo in the low half), each rounded to fp16: cvt.rn.f16x2.f32, one
    instruction a pair (the interpreter: _f16x2)."""
    if _ASM:
        return tl.inline_asm_elementwise(asm="cvt.rn.f16x2.f32 $0, $2, $1;", constraints="=r,r,r", args=[lo, hi],
                                         dtype=tl.uint32, is_pure=True, pack=1)
    else:
        return _f16x2(lo, hi)


@triton.jit
def _x_pairs16(xs, mul):
    """The 32 fp32 x of a 16-byte block (element 8w + t: nibble t of word w), times `mul` (_x_guard's power of two,
    exact) -> 16 uint32 words of fp16x2 in the order the e4m3 decode yields a word's weights: (0, 2), (4, 6),
    (1, 3), (5, 7) of each word w."""
    ps = ()
    for w in tl.static_range(4):
        ps = ps + (_cvt_f16x2(xs[8 * w] * mul, xs[8 * w + 2] * mul),
                   _cvt_f16x2(xs[8 * w + 4] * mul, xs[8 * w + 6] * mul),
                   _cvt_f16x2(xs[8 * w + 1] * mul, xs[8 * w + 3] * mul),
                   _cvt_f16x2(xs[8 * w + 5] * mul, xs[8 * w + 7] * mul))
    return ps


@triton.jit
def _lane_sum(h):
    """uint32 words of fp16x2 -> the sum of their two lanes rounded to fp16, widened to fp32: add.rn.f16 on the
    halves and one conversion (2 instructions, where widening both lanes and adding took 3); the interpreter adds
    in fp64 (exact) and rounds once, the same bits."""
    if _ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 l, h;
            mov.b32 {l, h}, $1;
            add.rn.f16 l, l, h;
            cvt.f32.f16 $0, l;
            }""",
            constraints="=r,r", args=[h], dtype=tl.float32, is_pure=True, pack=1)
    else:
        a, b = _f16_pair(h)
        return (a.to(tl.float64) + b.to(tl.float64)).to(tl.float16).to(tl.float32)


# the packed fp16 decode scales x below 2^X_GUARD_LOG2: x, every lane and the sum of two stay finite in fp16
X_GUARD_LOG2: tl.constexpr = tl.constexpr(14)


@triton.jit
def _x_guard(x_ptr, x_row, stride_x, n, ON: tl.constexpr, UP: tl.constexpr = False, BLOCK: tl.constexpr = 1024):
    """(2^-e, 2^e) for the packed fp16 decode of x[x_row] (n elements), on the device (no host read): e the least
    e >= 0 with max|x| 2^-e < 2^X_GUARD_LOG2, so x 2^-e, an MXFP4 lane sum (<= 16 x 6 x 2^-6 of it) and the sum of
    two lanes stay inside fp16 (65504); x 2^-e is exact (bf16 and fp16 keep their exponent range). UP: e may be
    negative too (down to -112), so max|x| 2^-e lies in [2^(X_GUARD_LOG2 - 1), 2^X_GUARD_LOG2) (a decode whose
    lanes sit low in fp16's range: quant_moe's int4 on sm_80/86). One pass over the row per program, before the
    K loop; (1, 1) where the decode keeps fp32 sums (ON false, or an fp32 x)."""
    if ON and x_ptr.dtype.element_ty != tl.float32:
        base = x_ptr + x_row.to(tl.int64) * stride_x
        m = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, n, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            m = tl.maximum(m, tl.abs(tl.load(base + offs, mask=offs < n, other=0.0).to(tl.float32)))
        top = (tl.max(m, axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of max|x|
        if UP:
            e = tl.maximum(top - (127 + X_GUARD_LOG2 - 1), -112)
        else:
            e = tl.maximum(top - (127 + X_GUARD_LOG2 - 1), 0)
        return ((127 - e) << 23).to(tl.float32, bitcast=True), ((127 + e) << 23).to(tl.float32, bitcast=True)
    else:
        return 1.0, 1.0


@triton.jit
def _fma_e4m3_word(h, lows, highs, xp, w: tl.constexpr):
    """h += the products of word w's weights given as e4m3 bytes (lows: its elements 0, 2, 4, 6; highs: 1, 3, 5, 7)
    and their x pairs, in fp16x2: four conversions and four packed FMAs for eight weights."""
    a0, a1 = _cvt_e4m3x2(lows)
    b0, b1 = _cvt_e4m3x2(highs)
    h = _hfma2(a0, xp[4 * w][None, :], h)
    h = _hfma2(a1, xp[4 * w + 1][None, :], h)
    h = _hfma2(b0, xp[4 * w + 2][None, :], h)
    return _hfma2(b1, xp[4 * w + 3][None, :], h)


@cache
def hardware_fp8(device: torch.device) -> bool:
    """The device converts e4m3 in hardware (sm_89 and later); never under the interpreter."""
    return not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
