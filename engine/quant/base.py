"""The expert-format contract and the registry.

An expert is two projections: `w13` ([2I, H]: gate and up, in the order the model's activation
expects) and `w2` ([H, I]: down), each optionally with a bias. A format stores each projection as one
or more named tensors (`w13`, or `w13_blocks` + `w13_scales`, ...) plus `w13_bias` / `w2_bias` in the
compute dtype when the model has biases. Everything a cache tier moves is `layout(...)`: its bytes are
the expert's bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from ..errors import ConfigError, UnsupportedModelError

TensorSpec = tuple[tuple[int, ...], torch.dtype]
PROJECTIONS = ("w13", "w2")


def projection_shape(which: str, hidden: int, inter: int) -> tuple[int, int]:
    """[out, in] of a projection: w13 [2I, H], w2 [H, I]."""
    return (2 * inter, hidden) if which == "w13" else (hidden, inter)


class ExpertFormat:
    """One way to store an expert. Subclasses set `name` and implement the four methods."""

    name: ClassVar[str] = ""
    packed: ClassVar[bool] = False  # True: the stored bytes are not the compute dtype

    def layout(self, hidden: int, inter: int, dtype: torch.dtype, bias: bool) -> dict[str, TensorSpec]:
        """The named tensors of one expert, with their shapes and dtypes (biases are in the compute dtype)."""
        out = self.projection_layout(hidden, inter, dtype)
        if bias:
            out["w13_bias"] = ((2 * inter,), dtype)
            out["w2_bias"] = ((hidden,), dtype)
        return out

    def projection_layout(self, hidden: int, inter: int, dtype: torch.dtype) -> dict[str, TensorSpec]:
        raise NotImplementedError

    def expert_bytes(self, hidden: int, inter: int, dtype: torch.dtype, bias: bool) -> int:
        return sum(torch.Size(shape).numel() * dt.itemsize for shape, dt in self.layout(hidden, inter, dtype,
                                                                                         bias).values())

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


def get_format(name: str) -> ExpertFormat:
    """A format by name: dense, mxfp4, int8, int4 (fp8 comes from a checkpoint's config: `native_format`)."""
    from . import dense, intq, mxfp4  # noqa: F401 - registration

    if name not in _FORMATS:
        raise UnsupportedModelError(f"expert format {name!r} is not known: moechat has {', '.join(sorted(_FORMATS))}")
    return _FORMATS[name]


# Formats moechat converts full-precision (or MXFP4/FP8) experts into, with --expert-format
CONVERTIBLE = ("int8", "int4")


def target_format(name: str | None, native: ExpertFormat) -> ExpertFormat:
    """--expert-format: `native` (or None) keeps what the checkpoint ships; int8/int4 convert to it."""
    if name in (None, "native", native.name):
        return native
    if name not in CONVERTIBLE:
        raise ConfigError(f"--expert-format {name!r}: use native (the checkpoint's own {native.name}) or one of "
                          f"{', '.join(CONVERTIBLE)}")
    return get_format(name)


# quantization_config.quant_method values moechat reads as shipped
QUANT_METHODS = ("mxfp4", "fp8")
# Other methods a user may meet, with what to do instead
_OTHER_METHODS = {"gptq": "GPTQ", "awq": "AWQ", "bitsandbytes": "bitsandbytes", "compressed-tensors":
                  "compressed-tensors", "fbgemm_fp8": "FBGEMM FP8", "hqq": "HQQ", "eetq": "EETQ", "quanto": "quanto"}


def native_format(raw_config: Mapping, where: str = "config.json") -> ExpertFormat:
    """The format a checkpoint ships its experts in, from config.json (`dense` when unquantised)."""
    q = raw_config.get("quantization_config")
    if q is None:
        return get_format("dense")
    if not isinstance(q, Mapping):
        raise ConfigError(f"{where}: quantization_config must be an object, found {type(q).__name__}")
    method = q.get("quant_method")
    if method == "fp8":
        from .fp8 import fp8_from_config

        return fp8_from_config(q, where)
    if method in QUANT_METHODS:
        return get_format(method)
    known = _OTHER_METHODS.get(str(method).lower())
    what = f"{known} checkpoints are not supported" if known else f"quant_method {method!r} is not supported"
    raise UnsupportedModelError(f"{where}: quantization_config.quant_method {method!r}: {what}; moechat reads "
                                "MXFP4 and FP8 (e4m3, block scales) checkpoints and unquantised ones (bf16/fp16/"
                                "fp32), and makes int8/int4 experts from the latter with --expert-format")


def detect_format(raw_config: Mapping, where: str = "config.json") -> str:
    """The name of the native expert format (see `native_format`)."""
    return native_format(raw_config, where).name
