"""The residency map: where every (layer, expert) lives, as one device tensor a decode step indexes without a sync.

`map` [L, E] int32 on the compute device, allocated once and rewritten in place (a captured graph holds its
address):

    0 .. C-1   slot s of the slot pool (engine/cache/slots.py)
    C + h      host index h into the layer's RAM-tier buffers (`RamStore.raw[layer]` [E, slot_bytes], so h = e);
               on CUDA those buffers are pinned, and a kernel reads them over the link at the same address (UVA)
    -1         nowhere the step can read: a layer without routed experts

It is the slot pool's `slot_map` with the holes filled by host indices, so that an expert not in a slot costs link
bytes, not a sync: a GPT-OSS-20B MXFP4 expert read over PCIe 4.0 x16 (~25 GB/s) is 13.2 MB / 25 GB/s = 0.53 ms, the
same bytes a slot fill moves, without the round trip through the host that deciding the fill takes today.

A host mirror (numpy) is the truth the provider edits between tokens; `publish` copies all of it in one transfer
([L, E] x 4 bytes: 3 KB for GPT-OSS-20B, 24 KB for Qwen3-30B-A3B), on CUDA through a pinned staging buffer on the
stream it is given (the copy stream, after the fills). Only a model whose every expert is in the RAM tier (or a
slot) can use it: `unsupported_reason` says why not in one line.
"""

from __future__ import annotations

import numpy as np
import torch

from .slots import SlotPool

Key = tuple[int, int]


def host_index(store, num_layers: int, num_experts: int) -> np.ndarray:
    """[L, E] int64: each expert's index into its layer's RAM-tier buffers, -1 where the tier holds no buffer."""
    index = np.full((num_layers, num_experts), -1, dtype=np.int64)
    for layer in getattr(store, "raw", {}):
        index[layer] = np.arange(num_experts)
    return index


def unsupported_reason(store, pool: SlotPool) -> str | None:
    """None when the residency map can cover this store and pool; else one line saying why not and what to do."""
    raw = getattr(store, "raw", None)
    if not isinstance(raw, dict):
        held = getattr(store, "capacity", 0)
        return (f"the RAM tier holds {held} experts, not all of them (the rest stream from disk), and the "
                "device-resident step reads every expert from a slot or RAM: give the RAM tier every expert "
                "(no --ram-cache budget) or keep the cached step")
    if getattr(store, "layout", None) != pool.layout:
        return "the RAM tier stores experts in another layout than the slots: keep the cached step"
    if pool.device.type == "cuda" and not all(t.is_pinned() for t in raw.values()):
        return "the RAM tier is not in pinned memory, so the GPU cannot read it over the link: keep the cached step"
    return None


def host_mapped(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A pinned host tensor as a CUDA tensor over the same memory (UVA: pinned memory has one address on the host
    and the device), so kernels read it over the link with no copy. On a CPU it is the tensor itself."""
    if device.type != "cuda":
        return t
    if not t.is_pinned() or t.dtype != torch.uint8:
        raise ValueError("only the RAM tier's pinned raw bytes (uint8) can be read by the device in place")

    class _Mapped:  # the CUDA array interface over the host pointer (no copy, no ownership: `t` must outlive it)
        __cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": "|u1", "data": (t.data_ptr(), False),
                                    "version": 3, "strides": tuple(s * t.element_size() for s in t.stride())}

    return torch.as_tensor(_Mapped(), device=device)


class ResidencyMap:
    """[L, E] int32 on the device (see the module docstring) and its host mirror."""

    def __init__(self, pool: SlotPool, index: np.ndarray):
        self.device = pool.device
        self.index = np.asarray(index, dtype=np.int64)  # [L, E] host index, -1: none
        L, E = self.index.shape
        self.mirror = np.full((L, E), -1, dtype=np.int32)  # [L, E] what `map` holds once published
        self.map = torch.full((L, E), -1, dtype=torch.int32, device=self.device)  # [L, E]
        cuda = self.device.type == "cuda"
        self._staging = torch.empty((L, E), dtype=torch.int32, pin_memory=cuda)  # [L, E] host side of a publish
        self._published = None  # CUDA: the event of the last publish's copy (the staging buffer's reuse waits)
        self.publishes = 0
        self.rebuild(pool)

    def value(self, pool: SlotPool, layer: int, expert: int) -> int:
        slot = int(pool.host_map[layer, expert])
        if slot >= 0:
            return slot
        h = int(self.index[layer, expert])
        return pool.num_slots + h if h >= 0 else -1

    def rebuild(self, pool: SlotPool, stream=None) -> None:
        """Every entry from the pool and the host index (a new pool after a retune: C changed), then publish."""
        self.num_slots = pool.num_slots
        host = np.where(self.index >= 0, self.index + pool.num_slots, -1)
        self.mirror[:] = np.where(pool.host_map >= 0, pool.host_map, host)
        self.publish(stream)

    def update(self, pool: SlotPool, keys) -> None:
        """The mirror's entries of these keys from the pool (after fills and evictions); publish separately."""
        if pool.num_slots != self.num_slots:
            raise RuntimeError("the slot pool was replaced: rebuild the residency map")
        for layer, expert in keys:
            self.mirror[layer, expert] = self.value(pool, layer, expert)

    def publish(self, stream=None) -> None:
        """The mirror into `map`, in place, in one copy (on CUDA on `stream`, asynchronously)."""
        staging = self._staging
        if self.device.type == "cuda":
            if self._published is not None:
                self._published.synchronize()  # the previous publish has left the staging buffer (long since)
            staging.copy_(torch.from_numpy(self.mirror))  # host to pinned host: no device read
            stream = stream if stream is not None else torch.cuda.current_stream(self.device)
            with torch.cuda.stream(stream):
                self.map.copy_(staging, non_blocking=True)
                self._published = torch.cuda.Event()
                self._published.record(stream)
        else:
            self.map.copy_(torch.from_numpy(self.mirror))
        self.publishes += 1

    def entry(self, layer: int, expert: int) -> tuple[str, int] | None:
        """("slot", s), ("host", h) or None, as the published map says (from the mirror: no device read)."""
        v = int(self.mirror[layer, expert])
        if v < 0:
            return None
        return ("slot", v) if v < self.num_slots else ("host", v - self.num_slots)

    def mismatches(self, pool: SlotPool) -> list[Key]:
        """Keys whose mirror entry disagrees with the pool and the host index (empty when in step)."""
        L, E = self.mirror.shape
        return [(layer, e) for layer in range(L) for e in range(E)
                if self.mirror[layer, e] != self.value(pool, layer, e)]
