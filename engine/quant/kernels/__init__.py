"""Triton kernels that compute with packed experts straight from the slot buffers (CUDA; the Triton
interpreter runs them on CPU tensors in the tests). Importing a kernel module imports triton: formats
import them lazily, when a CUDA tensor first needs one.
"""

from __future__ import annotations

import importlib.util
from functools import cache


@cache
def has_triton() -> bool:
    """triton is installed (found, not imported: a CPU-only run never loads it)."""
    return importlib.util.find_spec("triton") is not None


@cache
def quant_fused_moe(fmt: str, block: tuple[int, int] | None = None):
    """The fused MoE that `expert_compute` runs on CUDA tensors of an fp8/int8/int4 batch: (hidden_states,
    topk_weights, batch, residual, act) -> residual + MoE output (kernels/quant_moe.py); None without triton, or for
    FP8 blocks whose columns are no multiple of 4 (the decode GEMV reads 4-byte words): the per-expert path runs."""
    if not has_triton() or (fmt == "fp8" and block is not None and block[1] % 4):
        return None

    def run(hidden_states, topk_weights, batch, residual, act):
        from .quant_moe import quant_moe

        ids, slot_map = batch.kernel_ids()  # the routed ids and the layer's map where the batch carries them
        return quant_moe(hidden_states, topk_weights, ids, batch.tensors, act, fmt, block=block,
                         residual=residual, pairs=batch.pairs, slot_map=slot_map)
    return run
