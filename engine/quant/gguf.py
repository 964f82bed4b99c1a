"""GGUF quant types (llama.cpp's ggml block formats) as expert formats, kept packed in every tier.

A GGUF tensor is rows of blocks along the input dimension: a row of K values is K / block_size blocks of
`block_bytes` each (Q4_K: 256 values in 144 bytes, 4.5 bits a weight; Q6_K 210 bytes, 6.56 bits; Q8_0 34 bytes
per 32, 8.5 bits). Rows are independent, so an expert's projection is its rows' bytes as they lie in the file
(`w1`/`w3`: ffn_gate_exps / ffn_up_exps [I, K/blk * bytes], `w2`: ffn_down_exps [H, ...] uint8), read by the
disk tier straight from the .gguf with preadv and never converted. The format names one ggml type per
projection (Q4_K_M files ship gate/up in Q4_K and down in Q6_K), so `GGUFFormat("Q4_K", "Q4_K", "Q6_K")`.

`dequantize` is the slow obvious reference (vectorised torch over whole blocks, checked in the tests against
the `gguf` package's numpy decoders). native_gguf.c decodes every type (plain C with SSE/AVX2 forms of the inner
loops, bit for bit the reference in every build) and computes `linear` three ways:

* one token (bf16 / fp16 activations) of every quantized type: `vecdot`, llama.cpp's integer path: x rounded to Q8
  blocks once per call (of 32 for the 32-value types, 256 for the k-quants and IQ4_XS), integer sums per (sub-)block
  (AVX-512 VNNI / AVX2 / scalar, the same bits in each and at any thread count), one fp32 step per block. x's
  rounding costs at most sum over blocks of (amax_b / 127) / 2 * sum_{i in b} |w_i| (`vecdot_bound`; observed
  0.04-0.12 of it). One token through a Qwen3-30B-A3B expert's w13 (1536 x 2048), one thread of a 2-core machine
  under a load of ~8 (minima of 7 interleaved calls): 0.12-0.38 ms for every type (Q8_0 0.12, Q4_0 / Q6_K / Q4_K
  0.17, MXFP4 / IQ4_NL 0.18, IQ4_XS 0.19, Q5_0 / Q4_1 0.22, Q5_K 0.23, Q5_1 0.29, Q2_K 0.33, Q3_K 0.38), 2-6x the
  tile path's 0.52-1.54 ms (medians of 5 rounds in bench/gguf_vecdot.py: 2.5-6.9x).
* many tokens, and one fp32 token: `prefill`: each 4-row block of W decoded once into a cache-resident fp32 scratch
  and multiplied there by every token (fp32 FMA tiles, 6 tokens x 4 rows with AVX-512): F.linear(x, dequantize(W))
  up to the order of the fp32 sum (|error| <= cols 2^-24 sum |x w|), the same bits at any thread count and in any
  batch. Against the tile path on the same w13 and machine (minima): T = 4 1.4-1.7x for every type (0.8-1.0 ms
  against 1.3-1.5), T = 32 1.2-1.3x where neither run was preempted (2.7-2.9 ms against 3.3-3.5), T = 128 about
  even (18-28 ms both: torch's GEMM on a decoded tile is as fast there).
* many bf16 / fp16 tokens of Q8_0, Q4_0, MXFP4, Q4_K, Q5_K and Q6_K (`prefill_q8`): native_prefill_int.c's integer dots
  over the rows as the file stores them, x rounded to int8 per block of 32 once per call (as the one-token dots and
  llama.cpp round it; Q4_K's and Q5_K's mins through x's block sums; Q6_K's two 16-value halves a block summed and
  scaled apart,
  the -32 through x's half sums), within quant/prefill.py `bound_q8` (observed 0.07-0.36 of it); and a
  chunk's experts of those types (gate and up apart, SwiGLU, no biases) in one call a layer
  (engine/layers/experts.py `_layer_prefill`, the same bits). fp32 tokens keep `prefill` (exact to fp32 sums). A
  Qwen3-30B-A3B-shaped GGUF (2 layers, 128-token prompt, Zen 2): Q4_0 202 -> 286 tok/s on one thread and 367 -> 509
  on two, Q8_0 195 -> 241 and 328 -> 447. Q4_K_M (Q4_K gate/up, Q6_K down): 198 -> 217 tok/s on one thread with
  Q4_K alone, 227 -> 263 (and 420 -> 484 on two) once Q6_K and its layer call joined (stop 41).
* on CUDA: kernels/gguf_matmul.py's Triton kernel, the blocks decoded in registers (bit for bit `dequantize`) and
  fp32 dots, for any token count (MOECHAT_GGUF_TRITON=0 decodes tiles instead; =1 runs it on CPU tensors too, which
  is how the tests drive it under the Triton interpreter).
* otherwise (MOECHAT_GGUF_PREFILL=0, no kernel library): 256 rows decoded at a time into fp32
  (`decode_rows`: 2 MB at 2048 columns) and torch's GEMM on each tile, exact to the reference's order.

fp32 runs keep the fp32 paths, exact to the reference up to the order of the sum (MOECHAT_GGUF_VECDOT=1 sends their
one token through the integer dots too, =0 never).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from .base import ExpertFormat, TensorSpec
from .ggml_codebooks import FP4X2, IQ4


@dataclass(frozen=True)
class GGMLType:
    name: str
    id: int  # ggml_type (gguf.GGMLQuantizationType)
    block: int  # values per block
    nbytes: int  # bytes per block

    def row_bytes(self, cols: int) -> int:
        return cols // self.block * self.nbytes


# The types moechat computes with: ggml_type id, values and bytes per block (ggml-common.h's block structs)
TYPES: dict[str, GGMLType] = {t.name: t for t in (
    GGMLType("F32", 0, 1, 4), GGMLType("F16", 1, 1, 2), GGMLType("Q4_0", 2, 32, 18), GGMLType("Q4_1", 3, 32, 20),
    GGMLType("Q5_0", 6, 32, 22), GGMLType("Q5_1", 7, 32, 24), GGMLType("Q8_0", 8, 32, 34),
    GGMLType("Q2_K", 10, 256, 84), GGMLType("Q3_K", 11, 256, 110), GGMLType("Q4_K", 12, 256, 144),
    GGMLType("Q5_K", 13, 256, 176), GGMLType("Q6_K", 14, 256, 210), GGMLType("IQ4_NL", 20, 32, 18),
    GGMLType("IQ4_XS", 23, 256, 136), GGMLType("BF16", 30, 1, 2), GGMLType("MXFP4", 39, 32, 17),
)}
BY_ID = {t.id: t for t in TYPES.values()}

# IQ4_NL / IQ4_XS's non-linear 4-bit codebook, and MXFP4's E2M1 values doubled (ggml's int8 table; the scale
# halves them back: 2^(e - 128))
_IQ4, _FP4x2 = IQ4, FP4X2


def ggml_type(name_or_id: str | int, tensor: str = "") -> GGMLType:
    """A type moechat computes with, or one typed line naming the tensor and the type."""
    t = TYPES.get(name_or_id) if isinstance(name_or_id, str) else BY_ID.get(name_or_id)
    if t is None:
        try:
            import gguf

            label = gguf.GGMLQuantizationType(name_or_id).name if isinstance(name_or_id, int) else name_or_id
        except (ImportError, ValueError):
            label = str(name_or_id)
        raise CheckpointError(f"tensor {tensor!r} is stored as {label}, a GGUF type moechat cannot compute yet; "
                              f"use a file quantized to one of {', '.join(TYPES)}", tensor=tensor or None)
    return t


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (little-endian) -> [...] fp32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _u32(b: torch.Tensor) -> torch.Tensor:
    """[..., 4] uint8 little-endian -> [...] int64."""
    b = b.long()
    return b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] -> [..., 32]: the low nibbles are the block's first 16 values, the high ones the last 16."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).long()


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes [N, 12] -> 6-bit scales and mins [N, 8] (ggml's get_scale_min_k4)."""
    s = s.long()
    lo, hi = s[:, 0:4], s[:, 4:8]
    top = s[:, 8:12]
    sc = torch.cat([lo & 63, (top & 0x0F) | ((lo >> 6) << 4)], dim=1)  # [N, 8]
    mn = torch.cat([hi & 63, (top >> 4) | ((hi >> 6) << 4)], dim=1)  # [N, 8]
    return sc.float(), mn.float()


def _two_bit_positions(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K / Q3_K's 64 code bytes [N, 64] -> 2-bit codes [N, 256] in value order: value 128n + 32j + 16h + l is
    bits 2j of byte 32n + 16h + l (n: half, j: shift, h: sixteen-group, l)."""
    q = qs.long().view(-1, 2, 1, 2, 16)  # [N, n, 1, h, l]
    shifts = torch.arange(0, 8, 2, device=qs.device).view(1, 1, 4, 1, 1)
    return ((q >> shifts) & 3).reshape(-1, 256)  # [N, n, j, h, l] -> [N, 256]


def dequantize_blocks(raw: torch.Tensor, t: GGMLType) -> torch.Tensor:
    """raw [N, block_bytes] uint8 -> [N, block] fp32: the slow obvious decoding of each ggml block."""
    N = raw.shape[0]
    if t.name == "F32":
        return raw.contiguous().view(torch.float32).reshape(N, 1)
    if t.name == "F16":
        return raw.contiguous().view(torch.float16).float().reshape(N, 1)
    if t.name == "BF16":
        return raw.contiguous().view(torch.bfloat16).float().reshape(N, 1)
    if t.name == "Q8_0":  # d f16, qs int8[32]
        return _f16(raw[:, 0:2].reshape(N, 1, 2)) * raw[:, 2:].contiguous().view(torch.int8).float()
    if t.name == "Q4_0":  # d, qs[16]: w = d * (q - 8)
        return _f16(raw[:, 0:2].reshape(N, 1, 2)) * (_nibbles(raw[:, 2:18]) - 8).float()
    if t.name == "Q4_1":  # d, m, qs[16]: w = d * q + m
        return _f16(raw[:, 0:2].reshape(N, 1, 2)) * _nibbles(raw[:, 4:20]).float() + _f16(raw[:, 2:4].reshape(N, 1, 2))
    if t.name in ("Q5_0", "Q5_1"):  # d[, m], qh u32 (bit j: value j's fifth bit), qs[16]
        o = 2 if t.name == "Q5_0" else 4
        qh = _u32(raw[:, o:o + 4])[:, None]  # [N, 1]
        high = (qh >> torch.arange(32, device=raw.device)) & 1  # [N, 32]
        q = (_nibbles(raw[:, o + 4:o + 20]) | high << 4).float()
        d = _f16(raw[:, 0:2].reshape(N, 1, 2))
        return d * (q - 16) if t.name == "Q5_0" else d * q + _f16(raw[:, 2:4].reshape(N, 1, 2))
    if t.name == "IQ4_NL":  # d, qs[16]: w = d * codebook[q]
        lut = torch.tensor(_IQ4, dtype=torch.float32, device=raw.device)
        return _f16(raw[:, 0:2].reshape(N, 1, 2)) * lut[_nibbles(raw[:, 2:18])]
    if t.name == "MXFP4":  # e (E8M0), qs[16]: w = 2^(e - 128) * 2 * fp4[q]
        lut = torch.tensor(_FP4x2, dtype=torch.float32, device=raw.device)
        return torch.ldexp(lut[_nibbles(raw[:, 1:17])], raw[:, 0:1].long() - 128)
    if t.name in ("Q4_K", "Q5_K"):  # d, dmin, scales[12], (qh[32],) qs[128]: 8 sub-blocks of 32
        d, dmin = _f16(raw[:, 0:2].reshape(N, 1, 2)), _f16(raw[:, 2:4].reshape(N, 1, 2))
        sc, mn = _k_scale_min(raw[:, 4:16])  # [N, 8]
        qs = raw[:, -128:].long().view(N, 4, 1, 32)  # 64-value chunks: the low nibbles, then the high ones
        q = (qs >> torch.tensor([0, 4], device=raw.device).view(1, 1, 2, 1)) & 0x0F  # [N, 4, 2, 32]
        if t.name == "Q5_K":
            qh = raw[:, 16:48].long().view(N, 1, 1, 32)
            bit = torch.arange(8, device=raw.device).view(1, 4, 2, 1)  # sub-block 2i + h takes bit 2i + h
            q = q | ((qh >> bit) & 1) << 4
        q = q.reshape(N, 8, 32).float()
        return (d[:, :, None] * sc[:, :, None] * q - dmin[:, :, None] * mn[:, :, None]).reshape(N, 256)
    if t.name == "Q6_K":  # ql[128], qh[64], scales int8[16], d: value 128n + 32k + l
        ql = raw[:, 0:128].long().view(N, 2, 2, 32)  # [N, n, byte half, l]
        qh = raw[:, 128:192].long().view(N, 2, 1, 32)  # [N, n, 1, l]
        sc = raw[:, 192:208].contiguous().view(torch.int8).float().view(N, 2, 4, 2)  # [N, n, k, l // 16]
        d = _f16(raw[:, 208:210].reshape(N, 1, 2))
        low = torch.stack([ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], dim=2)
        high = (qh >> torch.arange(0, 8, 2, device=raw.device).view(1, 1, 4, 1)) & 3  # [N, n, k, l]
        q = ((low | high << 4) - 32).float().view(N, 2, 4, 2, 16)
        return (d.view(N, 1, 1, 1, 1) * sc[..., None] * q).reshape(N, 256)
    if t.name == "Q2_K":  # scales[16] (low nibble scale, high nibble min), qs[64], d, dmin
        s = raw[:, 0:16].long()
        d, dmin = _f16(raw[:, 80:82].reshape(N, 1, 2)), _f16(raw[:, 82:84].reshape(N, 1, 2))
        q = _two_bit_positions(raw[:, 16:80]).float().view(N, 16, 16)  # [N, scale group, 16]
        return (d * (s & 0x0F).float())[..., None].mul(q).sub((dmin * (s >> 4).float())[..., None]).reshape(N, 256)
    if t.name == "Q3_K":  # hmask[32], qs[64], scales[12] (16 6-bit, -32), d
        hm = raw[:, 0:32].long().view(N, 1, 1, 2, 16)
        bit = torch.arange(8, device=raw.device).view(1, 2, 4, 1, 1)  # value (n, j, h, l): hmask bit 4n + j
        high = ((hm >> bit) & 1).reshape(N, 256)
        q = _two_bit_positions(raw[:, 32:96]) - 4 * (1 - high)  # [N, 256]
        s = raw[:, 96:108].long()
        lo = torch.cat([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], dim=1)  # [N, 16] low 4 bits of scales 0..15
        hi = (s[:, 8:12, None] >> torch.arange(0, 8, 2, device=raw.device)) & 3  # [N, 4 bytes, 4 pairs]
        hi = hi.transpose(1, 2).reshape(N, 16)  # scale i's top 2 bits: byte i % 4, bits 2 * (i // 4)
        sc = ((lo | hi << 4) - 32).float()
        d = _f16(raw[:, 108:110].reshape(N, 1, 2))
        return (d[:, :, None] * sc[:, :, None] * q.float().view(N, 16, 16)).reshape(N, 256)
    if t.name == "IQ4_XS":  # d, scales_h u16, scales_l[4], qs[128]: 8 sub-blocks of 32, 6-bit scales - 32
        d = _f16(raw[:, 0:2].reshape(N, 1, 2))
        sh = raw[:, 2].long() | raw[:, 3].long() << 8  # [N]
        sl = raw[:, 4:8].long()
        ib = torch.arange(8, device=raw.device)
        ls = ((sl[:, ib // 2] >> (4 * (ib % 2))) & 0x0F) | (((sh[:, None] >> (2 * ib)) & 3) << 4)  # [N, 8]
        lut = torch.tensor(_IQ4, dtype=torch.float32, device=raw.device)
        q = lut[_nibbles(raw[:, 8:136].reshape(N * 8, 16))].view(N, 8, 32)
        return (d[:, :, None] * (ls - 32).float()[:, :, None] * q).reshape(N, 256)
    raise ggml_type(t.name)  # not reached: every type in TYPES is decoded above


def dequantize(raw: torch.Tensor, t: GGMLType | str, cols: int) -> torch.Tensor:
    """raw [..., row_bytes] uint8 (rows of `cols` values) -> [..., cols] fp32."""
    t = TYPES[t] if isinstance(t, str) else t
    lead = raw.shape[:-1]
    if raw.shape[-1] != t.row_bytes(cols) or cols % t.block:
        raise CheckpointError(f"a {t.name} row of {cols} values needs {t.row_bytes(cols)} bytes in blocks of "
                              f"{t.block}, found {raw.shape[-1]}")
    blocks = raw.reshape(-1, t.nbytes)
    return dequantize_blocks(blocks, t).reshape(*lead, cols)


TILE_ROWS = 256  # rows decoded at a time by the tile path: 2 MB of fp32 at 2048 columns
NATIVE_TYPES = frozenset(TYPES)  # every type decoded by native_gguf.c


def _native_dequant():
    """native_gguf.c's decoder from the kernel library (quant/native.py), typed here; None without the library."""
    from . import native

    lib = native.library()
    fn = getattr(lib, "moechat_gguf_dequant", None) if lib is not None else None
    if fn is not None and fn.argtypes is None:
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        fn.restype = ctypes.c_int
    return fn


# one token by native_gguf.c's integer dots: every quantized type (the float ones go through the many-token path)
VECDOT_TYPES = frozenset(TYPES) - {"F32", "F16", "BF16"}
# "0": never the integer dots; "1": for fp32 activations too. Unset: for bf16 / fp16 activations only, whose own
# rounding (2^-9 of each value) is already of the size of x's int8 rounding (amax / 254 per block), while an fp32
# run is the one compared with the reference to 1e-4 (the tests against transformers)
VECDOT_ENV = "MOECHAT_GGUF_VECDOT"


def use_vecdot(x: torch.Tensor) -> bool:
    """Whether one token of `x` goes through `vecdot` (MOECHAT_GGUF_VECDOT, and x's dtype)."""
    v = os.environ.get(VECDOT_ENV)
    return v != "0" and (v == "1" or x.dtype != torch.float32)


def _native_vecdot():
    """native_gguf.c's one-token integer-dot kernel and the library, typed here; (None, None) without it."""
    from . import native

    lib = native.library()
    fn = getattr(lib, "moechat_gguf_vecdot", None) if lib is not None else None
    if fn is not None and fn.argtypes is None:
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        fn.restype = ctypes.c_int
    return fn, lib


def quantize_x(x: torch.Tensor, t: GGMLType) -> tuple[torch.Tensor, torch.Tensor]:
    """x [cols] fp32 -> (q [cols / B, B] int8 values as fp32, d [cols / B, 1]) as `vecdot` rounds it: B = 32 (256
    for the k-quants), d = amax / 127, q = round-half-even(x * (127 / amax))."""
    xb = x.float().reshape(-1, 32 if t.block == 32 else 256)  # [blocks, B]
    amax = xb.abs().amax(dim=1, keepdim=True)  # [blocks, 1]
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(xb * inv).clamp(-127, 127), amax / 127.0


def vecdot_reference(x: torch.Tensor, raw: torch.Tensor, t: GGMLType, cols: int) -> torch.Tensor:
    """The slow obvious `vecdot`: W dequantized, times x rounded as `quantize_x` rounds it, in fp64 -> [1, rows]."""
    q, d = quantize_x(x.reshape(-1), t)
    return (q.double() * d.double()).reshape(1, cols) @ dequantize(raw, t, cols).double().t()


def vecdot_bound(x: torch.Tensor, raw: torch.Tensor, t: GGMLType, cols: int) -> torch.Tensor:
    """[1, rows]: how far `vecdot` may be from the fp32 reference x @ W^T, rounding aside: each x_i is d_b * q_i +
    e_i with |e_i| <= d_b / 2 (d_b = amax_b / 127), so |error| <= sum_b d_b / 2 * sum_{i in b} |w_i|."""
    _, d = quantize_x(x.reshape(-1), t)  # [blocks, 1]
    w = dequantize(raw, t, cols).double().abs().reshape(raw.shape[0], d.shape[0], -1).sum(-1)  # [rows, blocks]
    return (w @ (d.double() / 2)).reshape(1, -1)


def vecdot(x: torch.Tensor, raw: torch.Tensor, t: GGMLType, cols: int) -> torch.Tensor | None:
    """x [1, cols] -> [1, rows] fp32 by native_gguf.c's integer dots (x rounded to int8 per block of 32, or of 256
    for the k-quants: |error| <= sum over blocks of (amax_b / 127) / 2 * sum_{i in b} |w_i|), or None where the
    type, the tensors or the library do not allow it (the caller decodes tiles instead)."""
    if not (t.name in VECDOT_TYPES and raw.device.type == "cpu" and x.device.type == "cpu" and raw.is_contiguous()
            and raw.dtype == torch.uint8 and raw.shape[-1] == t.row_bytes(cols) and x.shape == (1, cols)):
        return None
    fn, lib = _native_vecdot()
    if fn is None:
        return None
    from . import native

    xf = x.float().contiguous()
    y = torch.empty(1, raw.shape[0], dtype=torch.float32)  # [1, rows]
    native._threads(lib)  # the pool's thread count as torch's, as every native call
    rc = fn(t.id, xf.data_ptr(), raw.data_ptr(), raw.shape[0], cols, y.data_ptr())
    return y if rc == 0 else None


# "0": many tokens (and one fp32 token) decode 256-row tiles and run torch's GEMM on each instead of `prefill`
PREFILL_ENV = "MOECHAT_GGUF_PREFILL"


def _native_prefill():
    """native_gguf.c's many-token kernel and the library, typed here; (None, None) without it or when switched off."""
    from . import native

    lib = native.library() if os.environ.get(PREFILL_ENV, "1") != "0" else None
    fn = getattr(lib, "moechat_gguf_prefill", None) if lib is not None else None
    if fn is not None and fn.argtypes is None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ctypes.c_int, p, i64, p, i64, i64, p, i64]
        fn.restype = ctypes.c_int
    return fn, lib


# the types whose rows the integer prefill kernel reads as the file stores them (native_prefill_int.c): blocks of 32
# with one scale each (Q4_K / Q5_K: per 32 of its super-block a scale and a min; Q6_K: a scale per 16)
Q8_PREFILL_TYPES = frozenset({"Q8_0", "Q4_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K"})


def prefill_q8(x: torch.Tensor, raw: torch.Tensor, t: GGMLType, cols: int) -> torch.Tensor | None:
    """x [T, cols] -> [T, rows] fp32 by native_prefill_int.c's integer dots over the rows as the file stores them
    (`Q8_PREFILL_TYPES`): x rounded to int8 per block of 32 once per call (as `vecdot` and llama.cpp round it), each
    block's dot an exact int32, times the two scales, summed in fp32 over the blocks in order: within
    quant/prefill.py `bound_q8` of F.linear(x, dequantize(W)), the same bits at any thread count and in any batch.
    For bf16 / fp16 x only (`prefill.integer_path`; an fp32 run keeps the exact `prefill`); None where it does not
    apply."""
    from . import native
    from . import prefill as q8

    if not (t.name in Q8_PREFILL_TYPES and x.dim() == 2 and x.shape[0] > 1 and x.shape[1] == cols
            and x.device.type == "cpu" and raw.device.type == "cpu" and raw.dtype == torch.uint8 and raw.dim() == 2
            and raw.is_contiguous() and raw.shape[-1] == t.row_bytes(cols) and cols % 32 == 0
            and os.environ.get(PREFILL_ENV, "1") != "0"):
        return None
    lib = native.decode_library()
    if not (q8.available(lib) and q8.integer_path(x, lib)):
        return None
    fn = lib.moechat_prefill_q8_gguf
    if fn.argtypes is None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ctypes.c_int, p, i64, p, i64, i64, i64, p, i64]
        fn.restype = ctypes.c_int
    xf = x.float().contiguous()
    rows = raw.shape[0]
    y = torch.empty(x.shape[0], rows, dtype=torch.float32)  # [T, rows]
    native._threads(lib)
    rc = fn(t.id, xf.data_ptr(), x.shape[0], raw.data_ptr(), rows, cols, raw.shape[1], y.data_ptr(), rows)
    return y if rc == 0 else None


def prefill(x: torch.Tensor, raw: torch.Tensor, t: GGMLType, cols: int) -> torch.Tensor | None:
    """x [T, cols] -> [T, rows] fp32 by native_gguf.c's many-token kernel: each 4-row block of W decoded once (bit for
    bit `dequantize`) into a cache-resident fp32 scratch and multiplied there by every token with fp32 FMAs, so each
    output is F.linear(x, dequantize(W)) up to the order of its fp32 sum (|error| <= cols 2^-24 sum |x w|), the same
    bits at any thread count and whatever other tokens are in the batch. None where the tensors, the library or
    MOECHAT_GGUF_PREFILL=0 do not allow it (the caller decodes tiles instead)."""
    if not (raw.device.type == "cpu" and x.device.type == "cpu" and raw.is_contiguous() and raw.dtype == torch.uint8
            and raw.dim() == 2 and raw.shape[-1] == t.row_bytes(cols) and x.dim() == 2 and x.shape[1] == cols):
        return None
    fn, lib = _native_prefill()
    if fn is None:
        return None
    from . import native

    xf = x.float().contiguous()
    y = torch.empty(x.shape[0], raw.shape[0], dtype=torch.float32)  # [T, rows]
    native._threads(lib)
    rc = fn(t.id, xf.data_ptr(), x.shape[0], raw.data_ptr(), raw.shape[0], cols, y.data_ptr(), raw.shape[0])
    return y if rc == 0 else None


def decode_rows(raw: torch.Tensor, t: GGMLType, cols: int) -> torch.Tensor:
    """raw [rows, row_bytes] -> [rows, cols] fp32, bit for bit `dequantize`: native_gguf.c where it is loaded and
    decodes this type (a contiguous CPU tile), else the torch reference."""
    if (raw.device.type == "cpu" and t.name in NATIVE_TYPES and raw.is_contiguous()
            and raw.shape[-1] == t.row_bytes(cols) and (fn := _native_dequant()) is not None):
        out = torch.empty(raw.shape[0], cols, dtype=torch.float32)  # [rows, cols]
        if fn(t.id, raw.data_ptr(), raw.numel() // t.nbytes, out.data_ptr()) == 0:
            return out
    return dequantize(raw, t, cols)


# "0": CUDA tensors decode tiles and run torch's GEMM instead of the Triton kernel; "1": CPU tensors take the kernel
# too (the Triton interpreter's tests)
TRITON_ENV = "MOECHAT_GGUF_TRITON"


def _triton_matmul(x: torch.Tensor, raw: torch.Tensor, t: GGMLType):
    """kernels/gguf_matmul.py's gguf_matmul where it applies (CUDA tensors, or any under MOECHAT_GGUF_TRITON=1, a
    type it computes, Triton importable), else None."""
    flag = os.environ.get(TRITON_ENV)
    if flag == "0" or (flag != "1" and not (raw.is_cuda and x.is_cuda)) or raw.dim() != 2 or not raw.is_contiguous():
        return None
    try:
        from .kernels.gguf_matmul import TYPES as TRITON_TYPES
        from .kernels.gguf_matmul import gguf_matmul
    except ImportError:  # no Triton (a CPU-only install): the tiles
        return None
    return gguf_matmul if t.name in TRITON_TYPES else None


def gguf_linear(x: torch.Tensor, raw: torch.Tensor, t: GGMLType, cols: int,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [n, cols] -> x @ W^T (+ bias) [n, rows] in x's dtype (or `out_dtype`: fp32 for the LM head's logits): one
    token by `vecdot` where the type has it and `use_vecdot` says so, else `prefill` (W's 4-row blocks decoded once
    for all n tokens), else W decoded from `raw` [rows, row_bytes] a tile of rows at a time and torch's GEMM (fp32
    sums, all three); on CUDA the Triton kernel (`_triton_matmul`)."""
    out_dtype = out_dtype or x.dtype
    if (matmul := _triton_matmul(x, raw, t)) is not None:
        y = matmul(x, raw, t.name, cols)  # [n, rows] fp32
        if bias is not None:
            y += bias.float()
        return y.to(out_dtype)
    if x.shape[0] == 1 and use_vecdot(x) and (y1 := vecdot(x, raw, t, cols)) is not None:
        return (y1 + bias.float() if bias is not None else y1).to(out_dtype)
    y = prefill_q8(x, raw, t, cols)
    if y is None:
        y = prefill(x, raw, t, cols)
    if y is None:
        rows = raw.shape[0]
        xf = x.float()
        y = torch.empty(x.shape[0], rows, dtype=torch.float32, device=x.device)  # [n, rows]
        for r in range(0, rows, TILE_ROWS):
            w = decode_rows(raw[r:r + TILE_ROWS], t, cols)  # [tile, cols] fp32
            torch.matmul(xf, w.t(), out=y[:, r:r + w.shape[0]])
    if bias is not None:
        y += bias.float()
    return y.to(out_dtype)


class GGUFFormat(ExpertFormat):
    """Experts as a GGUF file stores them: gate (`w1`), up (`w3`) and down (`w2`) rows in their ggml types.

    `tensor_names` maps each stored part to the file's stacked tensor ([E, rows, row_bytes], a layer's experts
    back to back), so the disk tier reads an expert's three row ranges straight from the .gguf."""

    packed = True
    tensor_names: dict[str, str] = {"w1": "blk.{layer}.ffn_gate_exps.weight", "w3": "blk.{layer}.ffn_up_exps.weight",
                                    "w2": "blk.{layer}.ffn_down_exps.weight"}

    def __init__(self, gate: str | None, up: str, down: str, interleaved: bool = False, fused: bool = False):
        # gate None: an ungated expert (Nemotron-H's relu^2: ffn_up_exps and ffn_down_exps only, w13 = up alone);
        # fused: gate and up as one tensor (Gemma 4's ffn_gate_up_exps, [E, 2I, row_bytes] in type `gate` == `up`)
        self.types = {"w1": TYPES[gate], "w3": TYPES[up], "w2": TYPES[down]} if gate else {"w3": TYPES[up],
                                                                                             "w2": TYPES[down]}
        if fused:
            self.types = {"w13": TYPES[gate], "w2": TYPES[down]}
        names = dict.fromkeys(t for t in (gate, up, down) if t)
        self.name = "gguf-" + "-".join(names)  # gguf-Q4_K-Q6_K
        # gpt-oss: the activation reads w13's output rows interleaved (even gate, odd up), as the HF checkpoint
        # stores gate_up; llama.cpp's converter split them into ffn_gate_exps / ffn_up_exps, re-interleaved here
        self.interleaved = interleaved
        # experts with biases (gpt-oss): the converter's per-projection ffn_{gate,up,down}_exps.bias [E, rows]
        self.tensor_names = {**GGUFFormat.tensor_names, "w1_bias": "blk.{layer}.ffn_gate_exps.bias",
                             "w3_bias": "blk.{layer}.ffn_up_exps.bias", "w2_bias": "blk.{layer}.ffn_down_exps.bias"}
        if not gate or fused:
            self.tensor_names = {k: v for k, v in self.tensor_names.items() if not k.startswith(("w1", "w3"))
                                 or (k.startswith("w3") and not fused)}
        if fused:
            self.tensor_names["w13"] = "blk.{layer}.ffn_gate_up_exps.weight"

    def __repr__(self) -> str:
        return f"GGUFFormat({', '.join(t.name for t in self.types.values())})"

    def layout(self, hidden: int, inter: int, dtype: torch.dtype, bias: bool,
               gated: bool = True) -> dict[str, TensorSpec]:
        """As every format's, but the gate and up biases stay two tensors as the file stores them (`w1_bias`,
        `w3_bias` [I] each, `w2_bias` [H]), so the disk tier reads each with one preadv."""
        out = self.projection_layout(hidden, inter, dtype)
        if bias:
            out.update(w1_bias=((inter,), dtype), w3_bias=((inter,), dtype), w2_bias=((hidden,), dtype))
            if "w1" not in self.types:
                del out["w1_bias"]
        return out

    def projection_layout(self, hidden: int, inter: int, dtype: torch.dtype) -> dict[str, TensorSpec]:
        shapes = {"w1": (inter, hidden), "w3": (inter, hidden), "w13": (2 * inter, hidden), "w2": (hidden, inter)}
        out: dict[str, TensorSpec] = {}
        for part, (rows, cols) in shapes.items():
            if part not in self.types:
                continue  # an ungated expert's gate
            t = self.types[part]
            if cols % t.block:
                raise CheckpointError(f"{t.name} experts need an input size that is a multiple of {t.block}, the "
                                      f"model's is {cols}")
            out[part] = ((rows, t.row_bytes(cols)), torch.uint8)
        return out

    def _cols(self, part: str, raw: torch.Tensor) -> int:
        t = self.types[part]
        return raw.shape[-1] // t.nbytes * t.block

    def weight(self, tensors: Mapping[str, torch.Tensor], which: str, dtype: torch.dtype) -> torch.Tensor:
        parts = tuple(p for p in ("w1", "w3", "w13") if p in self.types) if which == "w13" else ("w2",)
        ws = [dequantize(tensors[p], self.types[p], self._cols(p, tensors[p])) for p in parts]
        if which == "w13" and self.interleaved:
            return torch.stack(ws, dim=1).reshape(-1, ws[0].shape[1]).to(dtype)  # rows g0, u0, g1, u1, ...
        return torch.cat(ws).to(dtype)

    def bias(self, tensors: Mapping[str, torch.Tensor], which: str) -> torch.Tensor:
        """`w13_bias` [2I] in the order `weight` gives w13's rows (interleaved for gpt-oss), or `w2_bias` [H]."""
        if which == "w2" or "w1" not in self.types:
            return tensors["w2_bias" if which == "w2" else "w3_bias"]
        b1, b3 = tensors["w1_bias"], tensors["w3_bias"]
        return torch.stack([b1, b3], dim=-1).reshape(-1) if self.interleaved else torch.cat([b1, b3])

    def linear(self, x: torch.Tensor, tensors: Mapping[str, torch.Tensor], which: str) -> torch.Tensor:
        if which == "w2" or "w1" not in self.types:  # down, an ungated expert's up alone, or fused gate_up
            p = "w2" if which == "w2" else "w13" if "w13" in self.types else "w3"
            return gguf_linear(x, tensors[p], self.types[p], self._cols(p, tensors[p]), tensors.get(f"{p}_bias"))
        g, u = (gguf_linear(x, tensors[p], self.types[p], self._cols(p, tensors[p]), tensors.get(f"{p}_bias"))
                for p in ("w1", "w3"))  # [n, I] each
        if self.interleaved:
            return torch.stack([g, u], dim=-1).reshape(x.shape[0], -1)  # [n, 2I]: g0, u0, g1, u1, ...
        return torch.cat([g, u], dim=-1)  # [n, 2I]
