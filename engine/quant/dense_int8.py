"""The first name of quant/dense_quant.py (`--dense-format int8`), kept so existing imports work."""

from .dense_quant import DENSE_FORMATS, Int8Linear, QuantLinear, check_dense_format

__all__ = ["DENSE_FORMATS", "Int8Linear", "QuantLinear", "check_dense_format"]
