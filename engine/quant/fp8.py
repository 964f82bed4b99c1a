"""FP8 experts as the Hub ships them (Qwen3-*-FP8, DeepSeek-V3): e4m3 weights with block scales.

Each quantised linear is `weight` float8_e4m3fn [out, in] and `weight_scale_inv` fp32 [ceil(out/b0),
ceil(in/b1)]; despite the name the weight is `weight * scale`, block by block, with partial blocks at the
edges. An expert stores `w13` [2I, H] (gate rows then up rows) and `w13_scale` [2 ceil(I/b0), ceil(H/b1)]
(gate's scale rows then up's: each half keeps its own blocking), `w2` [H, I] and `w2_scale`; an ungated expert
(Nemotron-H's relu^2) stores up alone, `w13` [I, H] and `w13_scale` [ceil(I/b0), ceil(H/b1)], told apart by w13
having I rows (w2's input size) rather than 2I. Half the bytes
of bf16: a Qwen3-30B-A3B expert is 4.7 MB + 1 KB of scales.

Compute: on the CPU one token runs the native kernel (quant/native.py: the e4m3 byte as a bf16 bit pattern in
registers, the block scale on the input), more tokens row tiles decoded exactly with integer ops (the e4m3 byte
as an fp16 bit pattern) and multiplied in cache (quant/cpu.py); on CUDA the MoE is one fused Triton kernel pair
(kernels/quant_moe.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .base import ExpertFormat, TensorSpec
from .cpu import fp8_linear
from .kernels import quant_fused_moe

FP8_DTYPE = torch.float8_e4m3fn


def _blocks(n: int, b: int) -> int:
    return -(-n // b)


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [out, in] (fp8) times its block scale [ceil(out/b0), ceil(in/b1)] -> [out, in] in `dtype`."""
    out_dim, in_dim = weight.shape
    b0, b1 = block
    s = scale.float().repeat_interleave(b0, dim=0)[:out_dim].repeat_interleave(b1, dim=1)[:, :in_dim]  # [out, in]
    return (weight.float() * s).to(dtype)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The writer the tests use: w [out, in] -> (fp8 weight, fp32 scale_inv) with amax/448 block scales."""
    out_dim, in_dim = w.shape
    b0, b1 = block
    nb0, nb1 = _blocks(out_dim, b0), _blocks(in_dim, b1)
    padded = torch.zeros(nb0 * b0, nb1 * b1)
    padded[:out_dim, :in_dim] = w.float()
    tiles = padded.reshape(nb0, b0, nb1, b1)
    scale = (tiles.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)  # [nb0, nb1]
    q = (tiles / scale[:, None, :, None]).reshape(nb0 * b0, nb1 * b1)[:out_dim, :in_dim].to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


class Fp8Format(ExpertFormat):
    packed = True
    scale_suffix = "_scale_inv"  # the checkpoint's name for a weight's scale: `<weight name>_scale_inv`

    def __init__(self, block: tuple[int, int]):
        self.block = (int(block[0]), int(block[1]))
        self.name = "fp8"

    def projection_layout(self, hidden: int, inter: int, dtype: torch.dtype,
                          gated: bool = True) -> dict[str, TensorSpec]:
        b0, b1 = self.block
        n = 2 if gated else 1  # gate and up each with their own block grid, or up alone
        return {"w13": ((n * inter, hidden), FP8_DTYPE), "w13_scale": ((n * _blocks(inter, b0), _blocks(hidden, b1)),
                                                                        torch.float32),
                "w2": ((hidden, inter), FP8_DTYPE), "w2_scale": ((_blocks(hidden, b0), _blocks(inter, b1)),
                                                                  torch.float32)}

    def weight(self, tensors: Mapping[str, torch.Tensor], which: str, dtype: torch.dtype) -> torch.Tensor:
        w, scale = tensors[which], tensors[f"{which}_scale"]
        if not _gate_up(tensors, which):
            return dequantize_blocks(w, scale, self.block, dtype)
        half, sh = w.shape[0] // 2, scale.shape[0] // 2  # gate and up keep their own blocking
        return torch.cat([dequantize_blocks(w[:half], scale[:sh], self.block, dtype),
                          dequantize_blocks(w[half:], scale[sh:], self.block, dtype)])

    def linear(self, x: torch.Tensor, tensors: Mapping[str, torch.Tensor], which: str) -> torch.Tensor:
        if x.device.type == "cpu":  # row tiles decoded with integer ops, each multiplied in cache (quant/cpu.py)
            w = tensors[which]
            half = w.shape[0] // 2 if _gate_up(tensors, which) else None
            return fp8_linear(x, w, tensors[f"{which}_scale"], self.block, half, tensors.get(f"{which}_bias"))
        return F.linear(x, self.weight(tensors, which, x.dtype), tensors.get(f"{which}_bias"))

    @property
    def fused_moe(self):
        """The fused Triton MoE on CUDA (kernels/quant_moe.py); None where triton is not installed."""
        return quant_fused_moe("fp8", self.block)


def _gate_up(tensors: Mapping[str, torch.Tensor], which: str) -> bool:
    """Whether projection `which` is gate and up stacked (each blocked on its own): w13 of 2I rows, I being w2's
    input size; an ungated expert's w13 (Nemotron-H's relu^2: up alone, I rows) is one projection. Without w2 to
    compare (a projection passed alone) w13 is taken as gate and up, as every gated model stores it."""
    w2 = tensors.get("w2")
    return which == "w13" and (w2 is None or tensors["w13"].shape[0] == 2 * w2.shape[1])


@cache
def fp8_format(block: tuple[int, int]) -> Fp8Format:
    return Fp8Format(block)


def fp8_from_config(q: Mapping, where: str) -> Fp8Format:
    """quantization_config {quant_method: fp8, fmt: e4m3, weight_block_size: [b0, b1]} -> the format."""
    fmt = q.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):  # DeepSeek-V3 spells it e4m3, MiniMax-M2 by torch's dtype name
        raise ConfigError(f"{where}: quantization_config.fmt {fmt!r} is not supported (moechat reads e4m3 FP8)")
    block = q.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"{where}: quantization_config.weight_block_size must be two positive integers, found "
                          f"{block!r} (per-tensor FP8 is not supported yet)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(f"{where}: FP8 activation_scheme {q.get('activation_scheme')!r} is not supported "
                          "(moechat reads dynamic)")
    return fp8_format(tuple(block))
