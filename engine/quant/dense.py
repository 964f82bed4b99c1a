"""The identity format: experts stored in the compute dtype (bf16/fp16/fp32 checkpoints)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

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
        return F.linear(x, tensors[which], tensors.get(f"{which}_bias"))


DENSE = register(DenseFormat())
