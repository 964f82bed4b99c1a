"""The expert-format contract and the registry.

An expert is two projections: `w13` ([2I, H]: gate and up, in the order the model's activation
expects; [I, H], up alone, for an ungated activation such as Nemotron-H's relu^2: `gated=False`) and `w2` ([H, I]:
down), each optionally with a bias. A format stores each projection as one
or more named tensors (`w13`, or `w13_blocks` + `w13_scales`, ...) plus `w13_bias` / `w2_bias` in the
compute dtype when the model has biases. Everything a cache tier moves is `layout(...)`: its bytes are
the expert's bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from ..errors import ConfigError

TensorSpec = tuple[tuple[int, ...], torch.dtype]
PROJECTIONS = ("w13", "w2")


def projection_shape(which: str, hidden: int, inter: int, gated: bool = True) -> tuple[int, int]:
    """[out, in] of a projection: w13 [2I, H] ([I, H] ungated), w2 [H, I]."""
    return ((2 if gated else 1) * inter, hidden) if which == "w13" else (hidden, inter)


class ExpertFormat:
    """One way to store an expert. Subclasses set `name` and implement the four methods."""

    name: ClassVar[str] = ""
    packed: ClassVar[bool] = False  # True: the stored bytes are not the compute dtype

    def layout(self, hidden: int, inter: int, dtype: torch.dtype, bias: bool,
               gated: bool = True) -> dict[str, TensorSpec]:
        """The named tensors of one expert, with their shapes and dtypes (biases are in the compute dtype)."""
        out = self.projection_layout(hidden, inter, dtype, gated)
        if bias:
            out["w13_bias"] = (((2 if gated else 1) * inter,), dtype)
            out["w2_bias"] = ((hidden,), dtype)
        return out

    def projection_layout(self, hidden: int, inter: int, dtype: torch.dtype,
                          gated: bool = True) -> dict[str, TensorSpec]:
        raise NotImplementedError

    def expert_bytes(self, hidden: int, inter: int, dtype: torch.dtype, bias: bool, gated: bool = True) -> int:
        return sum(torch.Size(shape).numel() * dt.itemsize for shape, dt in self.layout(hidden, inter, dtype,
                                                                                         bias, gated).values())

    def weight(self, tensors: Mapping[str, torch.Tensor], which: str, dtype: torch.dtype) -> torch.Tensor:
        """The slow obvious reference: projection `which` of one expert as a dense [out, in] matrix."""
        raise NotImplementedError

    def linear(self, x: torch.Tensor, tensors: Mapping[str, torch.Tensor], which: str) -> torch.Tensor:
        """x [n, in] -> x @ W^T (+ bias) [n, out] in x's dtype, from one expert's stored tensors."""
        raise NotImplementedError

    @staticmethod
    def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
        """w [out, in] -> this format's tensors for it, by part name (`q`, `scale`): formats moechat converts
        experts into (`--expert-format`) implement it."""
        raise NotImplementedError

    def check(self, name: str, shape: tuple[int, ...], dtype_name: str, expected: TensorSpec, where: str) -> None:
        """A stored tensor against the layout; a typed error saying what is wrong (shape or dtype)."""
        if tuple(shape) != tuple(expected[0]):
            raise ConfigError(f"{where}: {name} has shape {list(shape)}, the {self.name} format needs "
                              f"{list(expected[0])}")


_FORMATS: dict[str, ExpertFormat] = {}


def register(fmt: ExpertFormat) -> ExpertFormat:
    _FORMATS[fmt.name] = fmt
    return fmt
