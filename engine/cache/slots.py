"""The slot pool: C fixed-address expert slots on the compute device, shared by all layers.

Each slot is one contiguous byte buffer (`raw` [C, slot_bytes] uint8, allocated once and never reallocated,
so kernels and captured graphs can hold their addresses); an expert's named tensors (`w13` [2I, H], `w2`
[H, I], MXFP4's six blocks/scales/bias) are views into it at offsets aligned to 256 bytes (`SlotLayout`).
`buffers[name]` [C, ...] is the strided view over every slot: each slot's part is contiguous, the slot
stride is `slot_bytes`. A miss is then ONE copy of slot_bytes from a host buffer in the same layout (the RAM
tier keeps that layout): a 13.2 MB GPT-OSS-20B MXFP4 expert is one DMA instead of six, three of them under
0.5 MB, each paying the ~10 us a copy costs to issue.

`slot_map` [L, E] int32 on the device says which slot holds (layer, expert), -1 if none;
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
ALIGN = 256  # bytes: each named tensor starts here within its slot (16-byte vector loads, any dtype)


class SlotLayout:
    """Where each named tensor of one expert lives inside a slot's bytes: offsets aligned to ALIGN, the slot
    padded to a multiple of ALIGN (a handful of bytes per expert: GPT-OSS-20B's MXFP4 expert grows by < 0.01%)."""

    def __init__(self, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]):
        self.shapes = {name: (tuple(shape), dtype) for name, (shape, dtype) in shapes.items()}
        self.offsets: dict[str, int] = {}
        at = 0
        for name, (shape, dtype) in self.shapes.items():
            self.offsets[name] = at
            at += -(-int(np.prod(shape, dtype=np.int64)) * dtype.itemsize // ALIGN) * ALIGN
        self.nbytes = max(at, ALIGN)  # bytes of one slot
        self.payload = sum(int(np.prod(s, dtype=np.int64)) * d.itemsize for s, d in self.shapes.values())

    def __eq__(self, other) -> bool:
        return isinstance(other, SlotLayout) and self.shapes == other.shapes

    def __hash__(self) -> int:
        return hash(tuple(self.shapes.items()))

    def views(self, raw: torch.Tensor) -> dict[str, torch.Tensor]:
        """raw [N, nbytes] uint8 (or one row [nbytes]) -> each named tensor [N, *shape] (or [*shape]) as a view."""
        one = raw.dim() == 1
        rows = raw.unsqueeze(0) if one else raw  # [N, nbytes]
        out = {}
        for name, (shape, dtype) in self.shapes.items():
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            part = rows[:, self.offsets[name] : self.offsets[name] + n].view(dtype)  # [N, n / itemsize]
            t = part.view(rows.shape[0], *shape)  # [N, *shape]: each row contiguous, the row stride nbytes
            out[name] = t[0] if one else t
        return out

    def empty(self, n: int, device: torch.device | str = "cpu", pin: bool = False) -> tuple[torch.Tensor, dict]:
        """n slots' bytes [n, nbytes] (huge pages asked for in plain host memory) and their named views."""
        raw = hostmem.empty((n, self.nbytes), torch.uint8, device, pin=pin)  # [n, nbytes]
        return raw, self.views(raw)


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
        self.layout = SlotLayout(shapes)
        # [C, slot_bytes] and its named views
        self.raw, self.buffers = self.layout.empty(num_slots, self.device, pin=pin and self.device.type == "cpu")
        self.slot_map = torch.full((num_layers, num_experts), -1, dtype=torch.int32, device=self.device)  # [L, E]
        self.host_map = np.full((num_layers, num_experts), -1, dtype=np.int32)  # [L, E] mirror of slot_map
        self.owner: list[tuple[int, int] | None] = [None] * num_slots
        self.state = np.full(num_slots, FREE, dtype=np.int8)
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.slot_bytes = self.layout.nbytes

    # -- queries ---------------------------------------------------------------------------------
    def slot_of(self, layer: int, expert: int) -> int:
        return int(self.host_map[layer, expert])

    def views(self, slot: int) -> dict[str, torch.Tensor]:
        """The slot's tensors by name: where a load writes."""
        return {name: buf[slot] for name, buf in self.buffers.items()}

    def raw_of(self, slot: int) -> torch.Tensor:
        """The slot's bytes [slot_bytes] uint8: where a one-copy load writes."""
        return self.raw[slot]

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
