"""Expert formats by name and from a checkpoint's config: the one place that knows every format.

The formats register themselves (`base.register`) when their modules are imported, which this module does at the
top; `base` itself imports none of them, so the arrows point one way (formats -> base, registry -> formats)."""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import ConfigError, UnsupportedModelError
from . import dense, intq, mxfp4  # noqa: F401 - they register themselves
from .base import _FORMATS, ExpertFormat
from .fp8 import fp8_from_config


def get_format(name: str) -> ExpertFormat:
    """A format by name: dense, mxfp4, int8, int4 (fp8 comes from a checkpoint's config: `native_format`)."""
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
