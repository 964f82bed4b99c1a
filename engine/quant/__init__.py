"""Expert formats: how one routed expert is stored, how many bytes it is, and how to compute with it.

A format turns an expert's shape (H hidden, I intermediate) into a set of named packed tensors
(`layout`), each [..] per expert; every cache tier (slots, RAM, disk, repacked files) stores exactly
those bytes, so the cache never knows what a format is. Compute goes through the format too
(`linear`: x @ W^T + b from the packed tensors), with a slow obvious `dequantize` as the reference
for every fast path. GPT-OSS-20B, one expert: bf16 3 x 2880 x 2880 x 2 B = 49.8 MB (with biases);
MXFP4 13.2 MB, 3.8x fewer bytes per miss and 3.8x more experts per GiB of slots.
"""

from __future__ import annotations

from .base import ExpertFormat, TensorSpec
from .registry import detect_format, get_format, native_format

__all__ = ["ExpertFormat", "TensorSpec", "detect_format", "get_format", "native_format"]
