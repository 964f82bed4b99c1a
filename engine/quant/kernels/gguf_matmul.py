"""GGUF (ggml) rows through a Triton kernel: y [T, rows] = x [T, cols] @ W^T with W's blocks decoded in registers
from the packed bytes (CUDA; the Triton interpreter runs it on CPU tensors in the tests).

One kernel source, the ggml type a compile-time constant. A program owns BLOCK_T tokens x BLOCK_R rows; it walks the
row's blocks (32 values for the 32-value types and, as 32-value chunks, the float ones; 256 for the k-quants and
IQ4_XS), decodes each block of its BLOCK_R rows into a [BLOCK_R, BLK] fp32 tile (`_decode`: the operations, in the
order, of quant/gguf.py's dequantize_blocks, so the tile is bit for bit `dequantize`: `gguf_decode` writes it for
the tests) and adds tl.dot(x, tile^T) in fp32 (input_precision "ieee": no TF32 rounding of x or of the weights).
So each output is F.linear(x, dequantize(W)) up to the order of the fp32 sum (|error| <= cols 2^-24 sum |x w|).

Codebooks (IQ4_NL / IQ4_XS, MXFP4's doubled E2M1) are read from a 16-entry int8 tensor on the device.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

# T = tokens, R = rows, C = cols (values per row), BLK = values per block, NB = bytes per block

# ggml type -> (values a block as the kernel walks it, its bytes): the float types in chunks of 32 values
_BLOCKS = {"F32": (32, 128), "F16": (32, 64), "BF16": (32, 64), "Q4_0": (32, 18), "Q4_1": (32, 20),
           "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34), "Q2_K": (256, 84), "Q3_K": (256, 110),
           "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136),
           "MXFP4": (32, 17)}
_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12,
        "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "BF16": 30, "MXFP4": 39}
TYPES = frozenset(_BLOCKS)


@triton.jit
def _u8(p, ok):
    return tl.load(p, mask=ok, other=0).to(tl.int32)


@triton.jit
def _f16(p, ok):
    """Two little-endian bytes at p -> their fp16 value as fp32 (exact)."""
    h = _u8(p, ok) | (_u8(p + 1, ok) << 8)
    return h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _decode(base, i, ok, lut_ptr, TYPE: tl.constexpr):
    """The block at base [R, 1] (byte pointers), values i [1, BLK] -> [R, BLK] fp32, bit for bit dequantize_blocks."""
    if TYPE == 0:  # F32: 4 bytes a value
        p = base + 4 * i
        bits = _u8(p, ok) | (_u8(p + 1, ok) << 8) | (_u8(p + 2, ok) << 16) | (_u8(p + 3, ok) << 24)
        w = bits.to(tl.float32, bitcast=True)
    elif TYPE == 1:  # F16
        w = _f16(base + 2 * i, ok)
    elif TYPE == 30:  # BF16: the top half of an fp32
        p = base + 2 * i
        w = ((_u8(p, ok) | (_u8(p + 1, ok) << 8)) << 16).to(tl.float32, bitcast=True)
    elif TYPE == 8:  # Q8_0: d, int8 qs[32]
        w = _f16(base, ok) * _u8(base + 2 + i, ok).to(tl.int8).to(tl.float32)
    elif TYPE == 2 or TYPE == 3 or TYPE == 6 or TYPE == 7 or TYPE == 20 or TYPE == 39:
        # the 32-value nibble types: value i is the low nibble of byte i % 16 for i < 16, the high one after
        o: tl.constexpr = 2  # where the nibbles start
        if TYPE == 39:
            o: tl.constexpr = 1
        elif TYPE == 3:
            o: tl.constexpr = 4
        elif TYPE == 6:
            o: tl.constexpr = 6
        elif TYPE == 7:
            o: tl.constexpr = 8
        byte = _u8(base + o + i % 16, ok)
        q = tl.where(i < 16, byte & 0x0F, byte >> 4)
        if TYPE == 6 or TYPE == 7:  # the fifth bits: bit i of the u32 before the nibbles
            ph = base + (o - 4)
            qh = _u8(ph, ok) | (_u8(ph + 1, ok) << 8) | (_u8(ph + 2, ok) << 16) | (_u8(ph + 3, ok) << 24)
            q = q | (((qh.to(tl.uint32) >> i.to(tl.uint32)) & 1).to(tl.int32) << 4)
        if TYPE == 2:
            w = _f16(base, ok) * (q - 8).to(tl.float32)
        elif TYPE == 6:
            w = _f16(base, ok) * (q - 16).to(tl.float32)
        elif TYPE == 3 or TYPE == 7:
            w = _f16(base, ok) * q.to(tl.float32) + _f16(base + 2, ok)
        elif TYPE == 20:
            w = _f16(base, ok) * tl.load(lut_ptr + q).to(tl.float32)
        else:  # MXFP4: 2^(e - 128) x the doubled E2M1 value, from the exponent's bits (a normal from e = 2)
            e = _u8(base, ok)
            bits = tl.where(e >= 2, (e - 1) << 23, 1 << (21 + e))
            w = tl.load(lut_ptr + q).to(tl.float32) * bits.to(tl.float32, bitcast=True)
    elif TYPE == 12 or TYPE == 13:  # Q4_K / Q5_K: d, dmin, scales[12], (qh[32],) qs[128]; sub-block j of 32
        j = i // 32
        l = i % 32
        s = base + 4
        s_j = _u8(s + j, ok)
        s_j4 = _u8(s + j + 4, ok)
        s_m4 = _u8(s + tl.where(j >= 4, j - 4, 0), ok)
        sc = tl.where(j < 4, s_j & 63, (s_j4 & 0x0F) | ((s_m4 >> 6) << 4))
        mn = tl.where(j < 4, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
        qs = base + 16 + 32 * (TYPE == 13)  # Q5_K's qh[32] before its codes
        q = (_u8(qs + 32 * (j // 2) + l, ok) >> (4 * (j % 2))) & 0x0F
        if TYPE == 13:
            q = q | (((_u8(base + 16 + l, ok) >> j) & 1) << 4)
        w = _f16(base, ok) * sc.to(tl.float32) * q.to(tl.float32) - _f16(base + 2, ok) * mn.to(tl.float32)
    elif TYPE == 14:  # Q6_K: ql[128], qh[64], int8 scales[16], d: value 128n + 32k + l
        n = i // 128
        k = (i % 128) // 32
        l = i % 32
        lo = (_u8(base + 64 * n + 32 * (k % 2) + l, ok) >> (4 * (k // 2))) & 0x0F
        hi = (_u8(base + 128 + 32 * n + l, ok) >> (2 * k)) & 3
        sc = _u8(base + 192 + 8 * n + 2 * k + l // 16, ok).to(tl.int8).to(tl.float32)
        w = _f16(base + 208, ok) * sc * ((lo | (hi << 4)) - 32).to(tl.float32)
    elif TYPE == 10:  # Q2_K: scales[16], qs[64], d, dmin: value 128n + 32j + m is bits 2j of qs[32n + m]
        n = i // 128
        jj = (i % 128) // 32
        q = (_u8(base + 16 + 32 * n + i % 32, ok) >> (2 * jj)) & 3
        s = _u8(base + i // 16, ok)
        w = (_f16(base + 80, ok) * (s & 0x0F).to(tl.float32)) * q.to(tl.float32) - _f16(base + 82, ok) * (
            s >> 4).to(tl.float32)
    elif TYPE == 11:  # Q3_K: hmask[32], qs[64], scales[12], d: Q2_K's layout, the third bit in hmask (clear: - 4)
        n = i // 128
        jj = (i % 128) // 32
        q2 = (_u8(base + 32 + 32 * n + i % 32, ok) >> (2 * jj)) & 3
        hb = (_u8(base + i % 32, ok) >> (4 * n + jj)) & 1
        g = i // 16
        s = base + 96
        lo = tl.where(g < 8, _u8(s + g % 8, ok) & 0x0F, _u8(s + g % 8, ok) >> 4)
        hi = (_u8(s + 8 + g % 4, ok) >> (2 * (g // 4))) & 3
        sc = ((lo | (hi << 4)) - 32).to(tl.float32)
        w = _f16(base + 108, ok) * sc * (q2 - 4 * (1 - hb)).to(tl.float32)
    else:  # IQ4_XS (23): d, scales_h u16, scales_l[4], qs[128]: 8 sub-blocks of 32, IQ4_NL's nibbles in each
        ib = i // 32
        l = i % 32
        sh = _u8(base + 2, ok) | (_u8(base + 3, ok) << 8)
        ls = ((_u8(base + 4 + ib // 2, ok) >> (4 * (ib % 2))) & 0x0F) | (((sh >> (2 * ib)) & 3) << 4)
        byte = _u8(base + 8 + 16 * ib + l % 16, ok)
        q = tl.where(l < 16, byte & 0x0F, byte >> 4)
        w = _f16(base, ok) * (ls - 32).to(tl.float32) * tl.load(lut_ptr + q).to(tl.float32)
    return w


@triton.jit
def _decode_kernel(w_ptr, out_ptr, lut_ptr, rows, row_bytes, cols, TYPE: tl.constexpr, BLK: tl.constexpr,
                   NB: tl.constexpr, BLOCK_R: tl.constexpr):
    """out [rows, cols] fp32 = dequantize(W): one program per BLOCK_R rows x one block."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    b = tl.program_id(1)
    i = tl.arange(0, BLK)[None, :]  # [1, BLK]
    ok = (r < rows)[:, None]  # [BR, 1]
    base = w_ptr + r[:, None].to(tl.int64) * row_bytes + b * NB  # [BR, 1]
    w = _decode(base, i, ok, lut_ptr, TYPE)  # [BR, BLK]
    tl.store(out_ptr + r[:, None].to(tl.int64) * cols + b * BLK + i, w, mask=ok)


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, y_ptr, lut_ptr, T, rows, row_bytes, nblocks, stride_x, stride_y,
                   TYPE: tl.constexpr, BLK: tl.constexpr, NB: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    """y [T, rows] = x [T, cols] @ W^T: a program's BLOCK_T tokens x BLOCK_R rows, W decoded a block at a time."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    t_ok, r_ok = t < T, r < rows
    i = tl.arange(0, BLK)[None, :]  # [1, BLK]
    rows_at = w_ptr + r[:, None].to(tl.int64) * row_bytes  # [BR, 1]
    x_at = x_ptr + t[:, None].to(tl.int64) * stride_x + i  # [BT, BLK]
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for b in range(0, nblocks):
        w = _decode(rows_at + b * NB, i, r_ok[:, None], lut_ptr, TYPE)  # [BR, BLK] fp32
        xv = tl.load(x_at + b * BLK, mask=t_ok[:, None], other=0.0)  # [BT, BLK] fp32
        acc += tl.dot(xv, tl.trans(w), input_precision="ieee")
    tl.store(y_ptr + t[:, None].to(tl.int64) * stride_y + r[None, :], acc, mask=t_ok[:, None] & r_ok[None, :])


@cache
def _lut(name: str, device: str) -> torch.Tensor:
    from ..ggml_codebooks import FP4X2, IQ4

    return torch.tensor(FP4X2 if name == "MXFP4" else IQ4, dtype=torch.int8, device=device)


def _check(raw: torch.Tensor, name: str, cols: int) -> tuple[int, int]:
    blk, nb = _BLOCKS[name]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or not raw.is_contiguous() or cols % blk or \
            raw.shape[1] != cols // blk * nb:
        raise ValueError(f"the GGUF Triton kernel takes contiguous uint8 rows of {name} ({nb} bytes per {blk} "
                         f"values), not {raw.dtype} {list(raw.shape)} for {cols} columns")
    return blk, nb


def gguf_decode(raw: torch.Tensor, name: str, cols: int, block_r: int = 16) -> torch.Tensor:
    """raw [rows, row_bytes] of ggml type `name` -> [rows, cols] fp32, bit for bit quant/gguf.py's dequantize."""
    blk, nb = _check(raw, name, cols)
    rows = raw.shape[0]
    out = torch.empty(rows, cols, dtype=torch.float32, device=raw.device)  # [R, C]
    grid = (triton.cdiv(rows, block_r), cols // blk)
    _decode_kernel[grid](raw, out, _lut(name, str(raw.device)), rows, raw.shape[1], cols, TYPE=_IDS[name], BLK=blk,
                         NB=nb, BLOCK_R=block_r)
    return out


def gguf_matmul(x: torch.Tensor, raw: torch.Tensor, name: str, cols: int, block_t: int = 16,
                block_r: int = 32) -> torch.Tensor:
    """x [T, cols] @ dequantize(raw)^T -> [T, rows] fp32, raw's blocks decoded in registers (fp32 sums)."""
    blk, nb = _check(raw, name, cols)
    if x.dim() != 2 or x.shape[1] != cols:
        raise ValueError(f"x must be [T, {cols}], not {list(x.shape)}")
    xf = x.float().contiguous()
    T, rows = xf.shape[0], raw.shape[0]
    y = torch.empty(T, rows, dtype=torch.float32, device=x.device)  # [T, R]
    grid = (triton.cdiv(T, block_t), triton.cdiv(rows, block_r))
    _matmul_kernel[grid](xf, raw, y, _lut(name, str(raw.device)), T, rows, raw.shape[1], cols // blk, xf.stride(0),
                         y.stride(0), TYPE=_IDS[name], BLK=blk, NB=nb, BLOCK_T=block_t, BLOCK_R=block_r)
    return y
