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
        return bf16_linear(x, tensors[which], tensors.get(f"{which}_bias"))


def bf16_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for a plain matrix, with the CPU's bf16 paths: the few tokens an expert sees in prefill
    through native_prefill_bf16.c (AVX-512 BF16 tiles, fp32 sums rounded once to bf16 as F.linear rounds; 1.4-2.9x
    torch's GEMM at 4-8 tokens; MOECHAT_PREFILL_KERNEL=0 keeps torch's GEMM for the A/B), a lone token with no bias
    through native.c's bf16 GEMV rather than MKL's one-row GEMM."""
    if x.shape[0] > 1 and prefill.bf16_path(x, w, lib := native.decode_library()):
        return prefill.finish(prefill.bf16(lib, x, w), x.dtype, bias)
    if bias is None and x.shape[0] == 1 and x.dtype == w.dtype == torch.bfloat16 and x.device.type == "cpu" \
            and w.is_contiguous() and (lib := native.library()) is not None:
        return native.bf16_gemv(lib, x, w, x.dtype)
    return F.linear(x, w, bias)


DENSE = register(DenseFormat())
