"""MXFP4 experts (GPT-OSS as shipped): FP4 E2M1 codes in blocks of 32 sharing one E8M0 scale.

Per projection [out, in]: `*_blocks` uint8 [out, in/32, 16] (two codes a byte, the low nibble is the
even element) and `*_scales` uint8 [out, in/32] (the block's scale is 2^(s - 127)). 4.25 bits a weight:
a GPT-OSS-20B expert is 12.4 MB of codes and scales (+ 23 KB of bf16 biases) against 49.8 MB in bf16.

CPU compute dequantizes one projection at a time into a reused scratch matrix and runs one GEMM on it:
the whole layer or model is never materialised at full width, and the scratch (at most one projection,
33 MB in bf16 for GPT-OSS-20B) stays the same buffer for every expert. `bench/quantized_experts.py`
measures it against the machine's read bandwidth and against the other ways torch offers.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .base import ExpertFormat, TensorSpec, projection_shape, register

BLOCK = 32  # elements sharing one scale
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_reference(blocks: torch.Tensor, scales: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The slow obvious decoding: blocks [..., G, 16] u8, scales [..., G] u8 -> [..., G*32] in `dtype`."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
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

    def projection_layout(self, hidden: int, inter: int, dtype: torch.dtype) -> dict[str, TensorSpec]:
        out: dict[str, TensorSpec] = {}
        for w in ("w13", "w2"):
            rows, cols = projection_shape(w, hidden, inter)
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
        w = dequantize_into(blocks, scales, _scratch(blocks.shape[0], blocks.shape[1] * BLOCK, x.dtype, x.device))
        return F.linear(x, w, tensors.get(f"{which}_bias"))


# -- the fast CPU decoding ---------------------------------------------------------------------------------
# Byte -> its two values (low nibble first): one gather decodes two weights, and the scale is one multiply by
# a power of two (exact in any float dtype while the result is in range).
_PAIR_LUT: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
_SCALE_LUT: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
_SCRATCH: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}


def _pair_lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, device)
    if key not in _PAIR_LUT:
        v = torch.tensor(FP4_VALUES, dtype=torch.float32)
        b = torch.arange(256)
        _PAIR_LUT[key] = torch.stack([v[b & 0xF], v[b >> 4]], dim=-1).to(dtype=dtype, device=device)  # [256, 2]
        _SCALE_LUT[key] = torch.ldexp(torch.ones(256), torch.arange(256) - 127).to(dtype=dtype, device=device)
    return _PAIR_LUT[key]


def _scratch(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (rows, cols, dtype, device)
    buf = _SCRATCH.get(key)
    if buf is None:
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


MXFP4 = register(Mxfp4Format())
