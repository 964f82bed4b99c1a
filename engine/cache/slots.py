"""The slot pool: C fixed-address expert slots on the compute device, shared by all layers.

One buffer per named expert tensor (`w13` [C, 2I, H], `w2` [C, H, I], and whatever else a format
stores), allocated once and never reallocated, so kernels and captured graphs can hold their
addresses. `slot_map` [L, E] int32 on the device says which slot holds (layer, expert), -1 if none;
it is updated in place. A host mirror of the map and of each slot's owner and state lets the provider
decide hits, misses and victims without reading the device.

Slot states make in-flight loads first-class: FREE (no expert), LOADING (bytes being copied in; not
yet usable, never a victim), READY. One slot of Qwen3-30B-A3B in bf16 is 9.4 MB, so 1 GiB of VRAM buys
~110 slots of its 6144 experts.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from . import hostmem

FREE, LOADING, READY = 0, 1, 2


class SlotPool:
    def __init__(self, num_slots: int, num_layers: int, num_experts: int,
                 shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device | str = "cpu",
                 pin: bool = False):
        if num_slots < 1:
            raise ValueError("the slot pool needs at least one slot")
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.device = torch.device(device)
        self.buffers: dict[str, torch.Tensor] = {
            name: hostmem.empty((num_slots, *shape), dtype, self.device)  # [C, ...] (huge pages on a CPU)
            for name, (shape, dtype) in shapes.items()
        }
        self.slot_map = torch.full((num_layers, num_experts), -1, dtype=torch.int32, device=self.device)  # [L, E]
        self.host_map = np.full((num_layers, num_experts), -1, dtype=np.int32)  # [L, E] mirror of slot_map
        self.owner: list[tuple[int, int] | None] = [None] * num_slots
        self.state = np.full(num_slots, FREE, dtype=np.int8)
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.slot_bytes = sum(t[0].numel() * t.element_size() for t in self.buffers.values())

    # -- queries ---------------------------------------------------------------------------------
    def slot_of(self, layer: int, expert: int) -> int:
        return int(self.host_map[layer, expert])

    def views(self, slot: int) -> dict[str, torch.Tensor]:
        """The slot's tensors by name: where a load writes."""
        return {name: buf[slot] for name, buf in self.buffers.items()}

    def has_free(self) -> bool:
        return bool(self._free)

    @property
    def used(self) -> int:
        return self.num_slots - len(self._free)

    def nbytes(self) -> int:
        return self.slot_bytes * self.num_slots

    # -- transitions (the provider drives these) --------------------------------------------------
    def begin_load(self, layer: int, expert: int, slot: int | None = None) -> int:
        """Claim a free slot (or the given one, which must be free) for (layer, expert); state LOADING."""
        if slot is None:
            slot = self._free.pop()
        else:
            self._free.remove(slot)
        if self.state[slot] != FREE or self.host_map[layer, expert] != -1:
            raise RuntimeError(f"slot {slot} is not free or expert {(layer, expert)} is already resident")
        self.owner[slot] = (layer, expert)
        self.state[slot] = LOADING
        return slot

    def finish_load(self, slot: int) -> None:
        """Bytes are in: publish the slot in the map."""
        layer, expert = self.owner[slot]
        self.state[slot] = READY
        self.host_map[layer, expert] = slot
        self.slot_map[layer, expert] = slot

    def release(self, slot: int) -> tuple[int, int]:
        """Evict whatever the slot holds (READY or an abandoned LOADING); returns its key."""
        key = self.owner[slot]
        if key is None:
            raise RuntimeError(f"slot {slot} is already free")
        if self.host_map[key] == slot:
            self.host_map[key] = -1
            self.slot_map[key[0], key[1]] = -1
        self.owner[slot] = None
        self.state[slot] = FREE
        self._free.append(slot)
        return key

    def release_all(self) -> None:
        for slot, key in enumerate(self.owner):
            if key is not None:
                self.release(slot)
