"""MXFP4 experts (GPT-OSS as shipped): FP4 E2M1 codes in blocks of 32 sharing one E8M0 scale.

Per projection [out, in]: `*_blocks` uint8 [out, in/32, 16] (two codes a byte, the low nibble is the
even element) and `*_scales` uint8 [out, in/32] (the block's scale is 2^(s - 127)). 4.25 bits a weight:
a GPT-OSS-20B expert is 13.2 MB of codes and scales (+ 17 KB of bf16 biases) against 49.8 MB in bf16.

CPU compute: one token runs the native kernel (quant/native.py: a bf16 token summed in integers over x rounded
to 16 bits per block, the codes mapped by an in-register table; fp32 x in fp32 sums); otherwise a projection is
decoded a row tile at a time (4 MB of fp32, in cache) with vectorised integer ops, bit for bit F.linear on the
dequantized matrix. One token multiplies each tile at once, so only
packed bytes come from RAM; more tokens run quant/prefill.py's kernels where the native library is loaded (4-row
blocks decoded once into cache for all the tokens, fp32 sums in another order; a bf16/fp16 x: integer dots over x
quantized to int8 per 32-element block, within prefill.bound_q8), else (or MOECHAT_PREFILL_KERNEL=0)
fill one reused fp32 scratch per projection shape (66 MB for GPT-OSS's w13), by native.c's decoder in one call where
it is loaded (every scale, bit for bit), and run one GEMM. On CUDA the whole MoE is two fused Triton launches over the slot buffers
(kernels/mxfp4_moe.py). `bench/quantized_experts.py` measures both against the machine's bandwidth and
against the other ways torch offers.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from . import native, prefill
from .base import ExpertFormat, TensorSpec, projection_shape, register

BLOCK = 32  # elements sharing one scale
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_reference(blocks: torch.Tensor, scales: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The slow obvious decoding: blocks [..., G, 16] u8, scales [..., G] u8 -> [..., G*32] in `dtype`."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    lo = lut[(blocks & 0x0F).long()]  # [..., G, 16] even elements
    hi = lut[(blocks >> 4).long()]  # [..., G, 16] odd elements
    vals = torch.stack([lo, hi], dim=-1).flatten(-2)  # [..., G, 32]
    out = torch.ldexp(vals, scales.to(torch.int32)[..., None] - 127)  # [..., G, 32]
    return out.flatten(-2).to(dtype)  # [..., G*32]


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., in] (in a multiple of 32) -> (blocks [..., in/32, 16] u8, scales [..., in/32] u8).

    The writer the tests and benches use: per block the smallest power-of-two scale that keeps the block's
    largest magnitude within 6, then each value to the nearest FP4 code (ties to the lower code).
    """
    *lead, n = w.shape
    if n % BLOCK:
        raise ValueError(f"MXFP4 needs the input size to be a multiple of {BLOCK}, got {n}")
    x = w.float().reshape(*lead, n // BLOCK, BLOCK)  # [..., G, 32]
    amax = x.abs().amax(dim=-1)  # [..., G]
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    scaled = x / torch.ldexp(torch.ones_like(amax), exp.to(torch.int32))[..., None]  # [..., G, 32], |v| <= 6
    mags = torch.tensor(FP4_VALUES[:8])  # [8]
    code = (scaled.abs()[..., None] - mags).abs().argmin(dim=-1)  # [..., G, 32] magnitude code 0..7
    code = code | ((scaled < 0) & (code > 0)).long() << 3  # sign bit (no negative zero)
    pairs = code.reshape(*lead, n // BLOCK, 16, 2).to(torch.uint8)  # [..., G, 16, 2]
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)  # [..., G, 16]
    return blocks.contiguous(), (exp.to(torch.int32) + 127).to(torch.uint8).contiguous()


class Mxfp4Format(ExpertFormat):
    name = "mxfp4"
    packed = True

    def projection_layout(self, hidden: int, inter: int, dtype: torch.dtype,
                          gated: bool = True) -> dict[str, TensorSpec]:
        out: dict[str, TensorSpec] = {}
        for w in ("w13", "w2"):
            rows, cols = projection_shape(w, hidden, inter, gated)
            if cols % BLOCK:
                raise ConfigError(f"MXFP4 experts need the input size of {w} ({cols}) to be a multiple of {BLOCK}")
            out[f"{w}_blocks"] = ((rows, cols // BLOCK, BLOCK // 2), torch.uint8)
            out[f"{w}_scales"] = ((rows, cols // BLOCK), torch.uint8)
        return out

    def check(self, name: str, shape, dtype_name: str, expected: TensorSpec, where: str) -> None:
        super().check(name, shape, dtype_name, expected, where)
        if not name.endswith("_bias") and dtype_name != "U8":
            raise ConfigError(f"{where}: {name} is {dtype_name}; MXFP4 blocks and scales are stored as U8")

    def weight(self, tensors: Mapping[str, torch.Tensor], which: str, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_reference(tensors[f"{which}_blocks"], tensors[f"{which}_scales"], dtype)

    def linear(self, x: torch.Tensor, tensors: Mapping[str, torch.Tensor], which: str) -> torch.Tensor:
        blocks, scales = tensors[f"{which}_blocks"], tensors[f"{which}_scales"]
        bias = tensors.get(f"{which}_bias")
        if x.device.type == "cpu":
            return linear_cpu(x, blocks, scales, bias)
        w = dequantize_into(blocks, scales, _scratch(blocks.shape[0], blocks.shape[1] * BLOCK, x.dtype, x.device))
        return F.linear(x, w, bias)

    @property
    def fused_moe(self):
        """The fused Triton MoE that `expert_compute` runs on CUDA tensors: (hidden_states, topk_weights, batch,
        residual, act) -> residual + MoE output. None where triton is not installed: the per-expert path runs."""
        return _fused_moe if _has_triton() else None


# -- the fast CPU path ---------------------------------------------------------------------------------------
# Row tiles: decode rows of a projection into an fp32 tile that stays in cache and, for one token, multiply
# it at once, so the dequantized matrix never goes to RAM and only the packed bytes do (a GEMV sums each output
# in the same order whatever the number of rows: bit for bit one F.linear over the whole matrix, tested).
# The decoding is vectorised integer ops and no table gather (a gather costs ~1 ns a byte in torch, a scalar
# loop): each byte becomes an int32 holding two fp16 bit patterns, code -> sign bit 15, its 3 magnitude bits
# -> the exponent's bottom 2 bits and the mantissa's top bit. That fp16 is exactly the E2M1 value x 2^-14
# (E2M1's one subnormal, 0.5, lands on an fp16 subnormal); fp16 -> fp32 is a vectorised conversion and x
# 2^(s - 113) restores the block scale exactly for every s <= 240 (larger scales mean |w| > 2^116: decoded
# through the table instead). bench/quantized_experts.py measures it against the other ways torch offers.
_TILE_BYTES = 4 << 20  # fp32 tile of decoded rows: fewer, longer ops (each costs ~5 us to dispatch), still in L3
_MAX_FAST_SCALE = 240  # 2^(s - 113) must be a normal fp32: s - 113 <= 127
_TILES: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_FACTORS: dict[tuple[int, int], torch.Tensor] = {}


# Scratch buffers live across calls made inside and outside torch.inference_mode: they are made as normal
# tensors (an inference tensor cannot be written outside inference mode; a normal one can be inside).
def _tile_buffers(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    key = (rows, cols)
    if key not in _TILES:
        with torch.inference_mode(False):
            codes = torch.empty(rows, cols // 2, dtype=torch.int32)  # [tile, in/2]: one byte (two codes) a lane
            _TILES[key] = (codes, torch.empty_like(codes), torch.empty(rows, cols))  # + sign bits, fp32 tile
    return _TILES[key]


def tile_rows(cols: int) -> int:
    """Rows of a projection with `cols` inputs decoded at a time (a 4 MB fp32 tile, a multiple of 8)."""
    return max(8, _TILE_BYTES // (4 * cols) // 8 * 8)


def decode_tile(blocks: torch.Tensor, factors: torch.Tensor, codes: torch.Tensor, signs: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor:
    """blocks [n, G, 16] u8, factors [n, G] fp32 (2^(s - 113)) -> out [n, G*32] fp32 (scratch: codes, signs)."""
    n, G, _ = blocks.shape
    codes.copy_(blocks.reshape(n, G * 16))  # [n, G*16] int32, the byte in bits 0-7
    codes.mul_(0x200200)  # low code to bits 9-12, high code to bits 25-28 (no overlap, no overflow)
    codes.bitwise_and_(0x1E001E00)
    torch.bitwise_and(codes, 0x10001000, out=signs)  # the codes' sign bits (12, 28) ...
    codes.bitwise_xor_(signs)
    signs.bitwise_left_shift_(3)  # ... move to the fp16 sign bits (15, 31)
    codes.bitwise_or_(signs)
    out.copy_(codes.view(torch.float16))  # [n, G*32]: code x 2^-14, exact
    out.view(n, G, BLOCK).mul_(factors[:, :, None])  # x 2^(s - 113): exact
    return out


def scale_factors(scales: torch.Tensor) -> torch.Tensor:
    """scales [R, G] u8 -> 2^(s - 113) [R, G] fp32, built from the exponent bits (a scratch reused per shape)."""
    key = tuple(scales.shape)
    if key not in _FACTORS:
        with torch.inference_mode(False):
            _FACTORS[key] = torch.empty(key, dtype=torch.int32)
    bits = _FACTORS[key]
    bits.copy_(scales)
    bits.add_(127 - 113).bitwise_left_shift_(23)  # fp32 exponent field s - 113 + 127, mantissa 0
    return bits.view(torch.float32)


def linear_cpu(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, in] @ W^T (+ bias) -> [n, R] in x's dtype, W decoded from blocks [R, G, 16] / scales [R, G].

    Exactly F.linear(x, W, bias) in fp32; other dtypes compute in fp32 and round once (a CPU without native
    bf16 runs a bf16 GEMM many times slower than fp32). One row (decode): a GEMV per tile, W never leaves the
    cache. More rows: the tiles go into one reused [R, in] scratch and one GEMM runs on it, because a GEMM
    over fewer output columns may sum in another order (MKL picks its kernel by shape), and the GEMM's cost
    there is the multiply, not the bytes.
    """
    R, G, _ = blocks.shape
    if x.shape[0] == 1 and (lib := native.library()) is not None and blocks.is_contiguous() and scales.is_contiguous():
        y = native.mxfp4_gemv(lib, x, blocks, scales, native.out_dtype(x, bias))  # [1, R]: one pass over the bytes
        if bias is not None:
            y.add_(bias.float())
        return y if y.dtype == x.dtype else y.to(x.dtype)
    if (x.shape[0] > 1 and prefill.available(lib := native.decode_library()) and blocks.is_contiguous()
            and scales.is_contiguous()):  # every scale, each row decoded once into cache for all the tokens
        return prefill.finish(prefill.mxfp4(lib, x, blocks, scales), x.dtype, bias)
    if (x.shape[0] > 1 and (lib := native.decode_library()) is not None and blocks.is_contiguous()
            and scales.is_contiguous()):  # every scale, one native pass over the bytes, then one GEMM
        w = native.mxfp4_decode(lib, blocks, scales, _scratch(R, G * BLOCK, torch.float32, x.device))  # [R, in]
        y = F.linear(x.float(), w, None if bias is None else bias.float())  # [n, R]
        return y if x.dtype == torch.float32 else y.to(x.dtype)
    if int(scales.max()) > _MAX_FAST_SCALE:
        w = dequantize_into(blocks, scales, _scratch(R, G * BLOCK, x.dtype, x.device))
        return F.linear(x, w, bias)
    xf = x.float()
    b = None if bias is None else bias.float()
    factors = scale_factors(scales)  # [R, G]
    rows = tile_rows(G * BLOCK)
    codes, signs, tile = _tile_buffers(rows, G * BLOCK)
    gemv = x.shape[0] == 1
    full = None if gemv else _scratch(R, G * BLOCK, torch.float32, x.device)  # [R, in]
    y = torch.empty(1, R) if gemv else None  # [1, R] fp32
    for r0 in range(0, R, rows):
        r1 = min(R, r0 + rows)
        n = r1 - r0
        out = tile[:n] if gemv else full[r0:r1]
        w = decode_tile(blocks[r0:r1], factors[r0:r1], codes[:n], signs[:n], out)  # [n, in] fp32
        if not gemv:
            continue
        if b is None:
            torch.mm(xf, w.t(), out=y[:, r0:r1])
        else:
            torch.addmm(b[r0:r1], xf, w.t(), out=y[:, r0:r1])
    if not gemv:
        y = F.linear(xf, full, b)  # [n, R]
    return y if x.dtype == torch.float32 else y.to(x.dtype)


# The table decoding (any scale, any device): byte -> its two values (low nibble first), one gather for two
# weights, and the scale is one multiply by a power of two (exact in any float dtype while the result is in range).
_PAIR_LUT: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
_SCALE_LUT: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
_SCRATCH: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}


def _pair_lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, device)
    if key not in _PAIR_LUT:
        with torch.inference_mode(False):
            v = torch.tensor(FP4_VALUES, dtype=torch.float32)
            b = torch.arange(256)
            _PAIR_LUT[key] = torch.stack([v[b & 0xF], v[b >> 4]], dim=-1).to(dtype=dtype, device=device)  # [256, 2]
            _SCALE_LUT[key] = torch.ldexp(torch.ones(256), torch.arange(256) - 127).to(dtype=dtype, device=device)
    return _PAIR_LUT[key]


def _scratch(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (rows, cols, dtype, device)
    buf = _SCRATCH.get(key)
    if buf is None:
        with torch.inference_mode(False):  # a normal tensor: reused both inside and outside inference mode
            buf = _SCRATCH[key] = torch.empty(rows, cols, dtype=dtype, device=device)  # [out, in], reused
    return buf


def dequantize_into(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """blocks [R, G, 16] u8, scales [R, G] u8 -> out [R, G*32] (written in place and returned)."""
    R, G, _ = blocks.shape
    pair = _pair_lut(out.dtype, out.device)
    scale = _SCALE_LUT[(out.dtype, out.device)]
    vals = torch.embedding(pair, blocks.reshape(R, G * 16).to(torch.int32))  # [R, G*16, 2]
    factors = torch.embedding(scale[:, None], scales.to(torch.int32))  # [R, G, 1]
    torch.mul(vals.view(R, G, BLOCK), factors, out=out.view(R, G, BLOCK))
    return out


def _has_triton() -> bool:
    global _TRITON
    if _TRITON is None:
        _TRITON = importlib.util.find_spec("triton") is not None  # found, not imported: the CPU never loads it
    return _TRITON


_TRITON: bool | None = None


def _fused_moe(hidden_states: torch.Tensor, topk_weights: torch.Tensor, batch, residual: torch.Tensor | None,
               act) -> torch.Tensor:
    from .kernels.mxfp4_moe import mxfp4_moe

    ids, slot_map = batch.kernel_ids()  # the routed ids and the layer's map where the batch carries them
    return mxfp4_moe(hidden_states, topk_weights, ids, batch.tensors, act, residual=residual, pairs=batch.pairs,
                     slot_map=slot_map)


MXFP4 = register(Mxfp4Format())
