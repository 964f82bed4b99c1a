"""The identity format: experts stored in the compute dtype (bf16/fp16/fp32 checkpoints)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from . import native, prefill
from .base import ExpertFormat, TensorSpec, projection_shape, register


class DenseFormat(ExpertFormat):
    name = "dense"
    packed = False

    def projection_layout(self, hidden: int, inter: int, dtype: torch.dtype,
                          gated: bool = True) -> dict[str, TensorSpec]:
        return {w: (projection_shape(w, hidden, inter, gated), dtype) for w in ("w13", "w2")}

    def weight(self, tensors: Mapping[str, torch.Tensor], which: str, dtype: torch.dtype) -> torch.Tensor:
        return tensors[which].to(dtype)

    def linear(self, x: torch.Tensor, tensors: Mapping[str, torch.Tensor], which: str) -> torch.Tensor:
        w, bias = tensors[which], tensors.get(f"{which}_bias")
        if x.shape[0] > 1 and prefill.bf16_path(x, w, lib := native.decode_library()):
            # the few tokens an expert sees in prefill: native_prefill_bf16.c (AVX-512 BF16 tiles, fp32 sums,
            # rounded once to bf16 as F.linear rounds; MOECHAT_PREFILL_KERNEL=0 keeps torch's GEMM for the A/B)
            return prefill.finish(prefill.bf16(lib, x, w), x.dtype, bias)
        return F.linear(x, w, bias)


DENSE = register(DenseFormat())
