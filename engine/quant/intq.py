"""int8 and int4 experts quantized by moechat from a full-precision checkpoint (`--expert-format`).

int8: symmetric per output channel, `*_q` int8 [out, in] and `*_scale` fp32 [out] (w = q * scale). The
CPU computes straight from the int8 matrix (no dequantized copy).
int4: symmetric in groups of 32 along the input (16 or 8 when the input size is not a multiple of 32),
`*_q` uint8 [out, in/2] (two codes a byte, low nibble the even element, code = q + 8 for q in -8..7) and
`*_scale` fp16 [out, in/group]; the group is the input size over the scale's columns. 4.5 bits a weight in groups
of 32 (Q4_K_M: ~4.8), from 5.0 with fp32 scales. A Qwen3-30B-A3B expert: 9.4 MB in bf16, 4.7 MB in int8 (+12 KB
of scales), 2.36 MB + 0.29 MB in int4. The scale is rounded to fp16 *down* (never above amax / 7.5, at least 2^-24)
before the codes are computed against it, so `weight()` is codes x the stored scale exactly; down, because at
exactly amax / 7.5 a negative extreme lands on code -8 (nearly exact) and rounding the scale up loses that: with the
scale 2^-11 above amax / 7.5 the demo model's held-out arith top-1 agreement fell 0.952 -> 0.929 and KL rose 26%,
2^-11 below changed nothing (bench/expert_formats.py). Every weight stays within half a stored step plus 7.5 x the
scale's rounding (under 0.51 steps in fp16's normal range; below it, a group's amax under 4.6e-4, the scale is an
fp16 subnormal and the excess under 7.5 x 2^-24 in absolute terms). A group whose scale would pass fp16's
65504 (|w| above 491,280) is a typed error that names int8 (fp32 scales), never a silent infinity.

Compute: on the CPU one token runs the native kernels (quant/native.py: the codes decoded in registers; int8 and
fp32 x in fp32 sums, a bf16 x through int4 in integer sums over x rounded to 16 bits per 32-element block);
many bf16/fp16 tokens through int4 in groups of 32 and through int8 (inputs a multiple of 32) take integer dots
over x quantized to int8 per block (quant/prefill.py, within its bound_q8; fp32 x the exact decoded tile; int8 at
Qwen3-30B-A3B widths and 128 tokens 3.1-3.6x torch's int8 GEMM and 1.3-1.5x MKL's bf16 GEMM, one thread); otherwise
int8 runs torch's fused `_weight_int8pack_mm` (bf16 activations, the row scale rounded to bf16) where this
machine's check passed (quant/torch_paths.py), else one GEMM over the codes cast to x's dtype, and int4 row tiles
decoded exactly with integer ops and multiplied in cache (quant/cpu.py); on CUDA the MoE is one fused Triton
kernel pair (kernels/quant_moe.py).

Quantization happens once, when the repacked store is written (engine/cache/repacked.py); `quantize` here
is the packer and `weight` the slow reference every compute path is tested against.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ..errors import CheckpointError, ConfigError
from . import native, prefill, torch_paths
from .base import ExpertFormat, TensorSpec, projection_shape, register
from .cpu import int4_linear
from .kernels import quant_fused_moe

INT4_GROUP = 32
INT4_SCALE_MAX = float(torch.finfo(torch.float16).max)  # 65504: fp16's largest scale, |w| up to 7.5 x it
_F16_TINY = 2.0**-24  # fp16's smallest subnormal: the scale of an all-zero group (any positive one decodes zeros)


def int4_group(cols: int) -> int:
    """The group along an input of `cols`: 32, else the largest of 16, 8 dividing it."""
    for g in (INT4_GROUP, 16, 8):
        if cols % g == 0:
            return g
    raise ConfigError(f"int4 experts need an input size divisible by 8 (got {cols}): use --expert-format int8")


class Int8Format(ExpertFormat):
    name = "int8"
    packed = True

    def projection_layout(self, hidden: int, inter: int, dtype: torch.dtype,
                          gated: bool = True) -> dict[str, TensorSpec]:
        out: dict[str, TensorSpec] = {}
        for w in ("w13", "w2"):
            rows, cols = projection_shape(w, hidden, inter, gated)
            out[f"{w}_q"] = ((rows, cols), torch.int8)
            out[f"{w}_scale"] = ((rows,), torch.float32)
        return out

    @staticmethod
    def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
        """w [out, in] -> q int8 [out, in], scale fp32 [out] (round to nearest, symmetric, |q| <= 127)."""
        wf = w.float()
        scale = (wf.abs().amax(dim=-1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)  # [out]
        q = torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
        return {"q": q, "scale": scale}

    def weight(self, tensors: Mapping[str, torch.Tensor], which: str, dtype: torch.dtype) -> torch.Tensor:
        return (tensors[f"{which}_q"].float() * tensors[f"{which}_scale"][:, None]).to(dtype)

    def linear(self, x: torch.Tensor, tensors: Mapping[str, torch.Tensor], which: str) -> torch.Tensor:
        q, scale = tensors[f"{which}_q"], tensors[f"{which}_scale"]
        bias = tensors.get(f"{which}_bias")
        # One token: the native GEMV (fp32 sums and scales, quant/native.py: 1.6-1.8x torch's kernel on one thread,
        # its rows split over torch's threads as torch's kernel splits them).
        if (x.device.type == "cpu" and x.shape[0] == 1 and (lib := native.library()) is not None
                and q.is_contiguous()):
            y = native.int8_gemv(lib, x, q, scale.float().contiguous(), native.out_dtype(x, bias))  # [1, out]
            if bias is not None:
                y.add_(bias.float())
            return y if y.dtype == x.dtype else y.to(x.dtype)
        if prefill.int8_integer(x, q, lib := native.decode_library()):
            # many bf16/fp16 tokens: integer dots over x quantized to int8 per 32-element block (quant/prefill.py)
            return prefill.finish(prefill.int8_q8(lib, x, q, scale), x.dtype, bias)
        if x.device.type == "cpu" and torch_paths.int8pack_usable(x.dtype, q.shape[1]):
            # int8 weights straight into torch's GEMM, scaled per output channel; only where this machine's check
            # passed (quant/torch_paths.py: garbage or a crash on AVX-512 for some widths)
            y = torch.ops.aten._weight_int8pack_mm(x, q, scale.to(x.dtype))  # [n, out]
        else:  # the slow obvious path: codes cast exactly (|q| <= 127), one GEMM
            y = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)
        return y if bias is None else (y + bias).to(x.dtype)  # an fp32 bias must not promote a bf16 result

    @property
    def fused_moe(self):
        """The fused Triton MoE on CUDA (kernels/quant_moe.py); None where triton is not installed."""
        return quant_fused_moe("int8")


def int4_scale(amax: torch.Tensor) -> torch.Tensor:
    """Group amax [...] fp32 -> the stored int4 scale [...] fp16: the largest fp16 <= amax / 7.5, or 2^-24 where
    that is smaller (so never 0)."""
    want = (amax / 7.5).clamp(min=_F16_TINY)  # [...] fp32
    if not bool((want <= INT4_SCALE_MAX).all()):
        big = float(amax.max())
        raise CheckpointError(f"expert weights reach |w| = {big:.4g}, past int4's fp16 group scales (|w| up to "
                              f"{7.5 * INT4_SCALE_MAX:,.0f}): use --expert-format int8 (fp32 scales)")
    scale = want.to(torch.float16)  # nearest; one step down where that went above
    down = (scale.view(torch.int16) - 1).view(torch.float16)  # a positive fp16's bits - 1: the next one down
    return torch.where((scale.float() > want) & (scale.float() > _F16_TINY), down, scale)


class Int4Format(ExpertFormat):
    name = "int4"
    packed = True

    def projection_layout(self, hidden: int, inter: int, dtype: torch.dtype,
                          gated: bool = True) -> dict[str, TensorSpec]:
        out: dict[str, TensorSpec] = {}
        for w in ("w13", "w2"):
            rows, cols = projection_shape(w, hidden, inter, gated)
            out[f"{w}_q"] = ((rows, cols // 2), torch.uint8)
            out[f"{w}_scale"] = ((rows, cols // int4_group(cols)), torch.float16)
        return out

    @staticmethod
    def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
        """w [out, in] -> q uint8 [out, in/2], scale fp16 [out, in/32]: per group, scale = amax / 7.5 rounded down
        to fp16 and codes round(w / scale) in -8..7 against that stored scale (the asymmetric end used for the group's
        most negative weight)."""
        rows, cols = w.shape
        group = int4_group(cols)
        g = w.float().reshape(rows, cols // group, group)  # [out, G, group]
        scale = int4_scale(g.abs().amax(dim=-1))  # [out, G] fp16
        q = torch.round(g / scale.float()[..., None]).clamp(-8, 7).to(torch.int16) + 8  # [out, G, group] codes 0..15
        q = q.reshape(rows, cols // 2, 2).to(torch.uint8)
        return {"q": (q[..., 0] | (q[..., 1] << 4)).contiguous(), "scale": scale.contiguous()}

    def weight(self, tensors: Mapping[str, torch.Tensor], which: str, dtype: torch.dtype) -> torch.Tensor:
        q, scale = tensors[f"{which}_q"], tensors[f"{which}_scale"]
        rows = q.shape[0]
        codes = torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(rows, -1).to(torch.int16) - 8  # [out, in]
        w = codes.float().reshape(rows, scale.shape[1], -1) * scale.float()[..., None]  # [out, G, group], exact
        return w.reshape(rows, -1).to(dtype)

    def linear(self, x: torch.Tensor, tensors: Mapping[str, torch.Tensor], which: str) -> torch.Tensor:
        q, scale = tensors[f"{which}_q"], tensors[f"{which}_scale"]
        if x.device.type == "cpu":  # row tiles decoded with integer ops, each multiplied in cache (quant/cpu.py)
            return int4_linear(x, q, scale, tensors.get(f"{which}_bias"))
        rows, cols = q.shape[0], q.shape[1] * 2
        w = _scratch(rows, cols, x.dtype, x.device)  # [out, in], reused
        pair = _int4_pair_lut(x.dtype, x.device)
        vals = torch.embedding(pair, q.to(torch.int32))  # [out, in/2, 2]
        groups = scale.shape[1]
        torch.mul(vals.view(rows, groups, -1), scale.to(x.dtype)[..., None], out=w.view(rows, groups, -1))
        return F.linear(x, w, tensors.get(f"{which}_bias"))

    @property
    def fused_moe(self):
        """The fused Triton MoE on CUDA (kernels/quant_moe.py); None where triton is not installed."""
        return quant_fused_moe("int4")


_PAIRS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
_SCRATCH: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}


def _int4_pair_lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, device)
    if key not in _PAIRS:
        b = torch.arange(256)
        _PAIRS[key] = torch.stack([(b & 0xF) - 8, (b >> 4) - 8], dim=-1).to(dtype=dtype, device=device)  # [256, 2]
    return _PAIRS[key]


def _scratch(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (rows, cols, dtype, device)
    if key not in _SCRATCH:
        with torch.inference_mode(False):  # a normal tensor: reused both inside and outside inference mode
            _SCRATCH[key] = torch.empty(rows, cols, dtype=dtype, device=device)
    return _SCRATCH[key]


INT8 = register(Int8Format())
INT4 = register(Int4Format())
