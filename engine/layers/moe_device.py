"""Expert compute from the residency map: every pair's expert read where it lives, with no host read.

The device-resident decode step (issue 32) keeps routing, slot lookup and expert compute on the device. A layer's
row of the residency map (engine/cache/residency.py) says per expert "slot s" (0..C-1) or "host index h" (C + h,
into the RAM tier's buffers, on CUDA pinned host-mapped memory a kernel reads over the link). `MapBatch` carries
that row, the routed ids and `slot_ids` = row[topk_ids] ([T, K], gathered on the device by the provider); this
module computes from it with torch ops only:

    loc = slot_ids                                          # [T, K]: slot s, or C + h
    w   = where(loc < C, slots[name][loc], host[name][loc - C])   per stored tensor, both gathers static-shaped
    y   = act(x @ W13(w)^T + b13) @ W2(w)^T + b2            # the format's own `weight()` reference on the gather
    out = residual + sum_k topk_weights[:, k] * y[:, k]     # fp32, k in order

No shape depends on the data (T x K pairs, fixed buffers), so the step is capturable and `torch.compile(...,
fullgraph=True)` traces it whole (tests/engine/test_device_step.py). The price of two gathers is that each pair
reads one row from each side: on a CPU both sides are RAM; on CUDA this torch path is the reference, and the fused
kernels read from the matching base pointer only (the GPU kernels issue). On a CPU it is the protocol's test bed,
not a fast path: a 4-layer fp32 model (H 256, 16 experts of I 128, top-4, one thread, loaded 2-core machine) decodes
at 39.7 ms/token this way against 14.2 with the CPU's own path (all experts in slots; 61.3 vs 18.3 at 8 slots), so
the CPU keeps its own path by default (MOECHAT_DEVICE_STEP=1 opts in).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..quant.base import ExpertFormat
from .moe import SWIGLU, ExpertActivation, ExpertBatch, combine

# T = tokens, K = top-k, P = T*K pairs, C = slots, N = host experts of the layer, H = hidden size,
# I = expert intermediate size


@dataclass(frozen=True)
class MapBatch(ExpertBatch):
    """One layer of the device-resident step: `slot_ids` [T, K] are virtual slots (< num_slots: `tensors`
    [C, ...]; >= num_slots: `host_tensors` [N, ...] at id - C), looked up on the device from `residency` [E]
    int32 (the layer's row of the residency map) at `topk_ids`. Never built with host ids; `expert_compute`
    sends it here before any path that reads ids on the host."""

    num_slots: int = 0  # C
    residency: torch.Tensor | None = field(default=None)  # [E] int32 the layer's row of the map


def gather_experts(slot_ids: torch.Tensor, num_slots: int, tensors, host_tensors) -> dict[str, torch.Tensor]:
    """slot_ids [P] virtual slots -> each stored tensor of those P experts [P, ...], from the slots [C, ...] or the
    host tier [N, ...].

    Gathered as bytes (uint8 views of the same memory) so that every dtype, fp8 included, takes one index_select
    per side and one where."""
    C = num_slots
    loc = slot_ids.long()
    in_slot = loc < C  # [P]
    slot_idx = torch.where(in_slot, loc, 0).clamp(max=C - 1)  # [P]
    host_idx = torch.where(in_slot, 0, loc - C)  # [P]
    out = {}
    for name, slots in tensors.items():
        dtype = slots.dtype
        a = slots.view(torch.uint8).index_select(0, slot_idx)  # [P, ..., bytes]
        if host_tensors is not None:
            host = host_tensors[name].view(torch.uint8)  # [N, ..., bytes]
            b = host.index_select(0, host_idx.to(host.device))  # [P, ..., bytes]
            a = torch.where(in_slot.view(-1, *([1] * (a.dim() - 1))), a, b.to(a.device))
        out[name] = a.view(dtype)  # [P, ...]
    return out


def map_moe(hidden_states: torch.Tensor, topk_weights: torch.Tensor, slot_ids: torch.Tensor, num_slots: int,
            tensors, host_tensors, fmt: ExpertFormat, act: ExpertActivation = SWIGLU,
            residual: torch.Tensor | None = None, contrib: torch.Tensor | None = None) -> torch.Tensor | None:
    """[residual +] sum_k w[t, k] * Expert_{slot_ids[t, k]}(x[t]) -> [T, H] in x's dtype; with `contrib` (fp32
    [T*K, H]) each pair's weighted output in its own row instead (the caller sums them in k order).

    hidden_states [T, H], topk_weights [T, K], slot_ids [T, K] virtual slots (< num_slots: `tensors` [C, ...] by
    name; else `host_tensors` [N, ...] at id - C). Each expert's projections are its format's `weight()` (the slow
    obvious dense matrix, dequantized with torch ops) of the gathered tensors, computed in the input dtype as the
    format's `linear` is; biases added as there."""
    T, K = slot_ids.shape
    P = T * K
    dtype = hidden_states.dtype
    experts = gather_experts(slot_ids.reshape(P), num_slots, tensors, host_tensors)  # name -> [P, ...]
    x = hidden_states.repeat_interleave(K, dim=0) if T > 1 else hidden_states.expand(K, -1)  # [P, H]
    ys = []
    for p in range(P):  # P is static (T x top-k): unrolled by a tracer, no data-dependent control flow
        ts = {name: t[p] for name, t in experts.items()}
        gate_up = F.linear(x[p : p + 1], fmt.weight(ts, "w13", dtype), ts.get("w13_bias"))  # [1, 2I] ([1, I])
        ys.append(F.linear(act(gate_up), fmt.weight(ts, "w2", dtype), ts.get("w2_bias")))  # [1, H]
    y = torch.cat(ys).float() * topk_weights.reshape(P, 1).float()  # [P, H] fp32, weighted
    if contrib is not None:
        contrib.copy_(y)
        return None
    return combine(residual if residual is not None else torch.zeros_like(hidden_states), y, K)  # [T, H]


def map_expert_compute(hidden_states: torch.Tensor, topk_weights: torch.Tensor, batch: MapBatch,
                       residual: torch.Tensor | None = None, act: ExpertActivation = SWIGLU,
                       contrib: torch.Tensor | None = None) -> torch.Tensor | None:
    """`expert_compute`'s contract for a MapBatch (see `map_moe`)."""
    return map_moe(hidden_states, topk_weights, batch.slot_ids, batch.num_slots, batch.tensors, batch.host_tensors,
                   batch.format, act, residual, contrib)
