"""The host (RAM) tier over the disk tier: `RamStore` (every expert in RAM) and `RamCache` (a fixed slab of N experts
under an eviction policy).

Split from engine/cache/store.py (the disk tier's readers)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .policy import make_policy
from .slots import SlotLayout
from .store import DISK, RAM, DiskStore, fill


class RamStore:
    """Every expert in RAM, stacked per layer; filled once from the disk store."""

    tier = RAM

    def __init__(self, disk: DiskStore, layers: list[int], num_experts: int):
        pin = torch.cuda.is_available()
        self.disk = disk
        self.format = disk.format
        self.shapes = disk.shapes
        self.expert_bytes = disk.expert_bytes
        self.used_bytes = self.expert_bytes * len(layers) * num_experts
        self.budget_bytes = 0
        self.layout = SlotLayout(self.shapes)  # the slots' layout: a load is one copy of an expert's row
        self.raw: dict[int, torch.Tensor] = {}  # layer -> [E, slot_bytes] uint8
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}
        for layer in layers:
            self.raw[layer], self.tensors[layer] = self.layout.empty(num_experts, pin=pin)  # [E, ...] views
            fill(disk, [(layer, e, {name: t[e] for name, t in self.tensors[layer].items()})
                        for e in range(num_experts)])  # one read per segment into its row, experts side by side

    def read_into(self, layer: int, expert: int, dst: Mapping[str, torch.Tensor]) -> tuple[str, int]:
        src = self.tensors[layer]
        for name, out in dst.items():
            out.copy_(src[name][expert], non_blocking=True)
        return RAM, self.expert_bytes

    def raw_row(self, layer: int, expert: int) -> tuple[torch.Tensor, str, int]:
        """The expert's bytes in the slot layout [slot_bytes] (pinned under CUDA): the source of a one-copy load."""
        return self.raw[layer][expert], RAM, self.expert_bytes

    # -- host compute (hybrid execution): experts used in place, no copy --------------------------------
    def host_slot(self, layer: int, expert: int) -> tuple[dict[str, torch.Tensor], int, str, int]:
        """(host buffers [N, ...] by name, the expert's index in them, tier its bytes came from, bytes read)."""
        return self.tensors[layer], expert, RAM, 0

    def release_host(self) -> None:
        pass


class RamCache:
    """A RAM tier bounded by a byte budget, with its own eviction policy, over the disk tier."""

    tier = RAM

    def __init__(self, disk: DiskStore, budget_bytes: int, policy: str = "lru"):
        self.disk = disk
        self.format = disk.format
        self.shapes = disk.shapes
        self.expert_bytes = disk.expert_bytes
        self.budget_bytes = budget_bytes
        self.layout = SlotLayout(self.shapes)  # the slots' layout: a load is one copy of an entry's row
        self.capacity = budget_bytes // self.layout.nbytes  # entries with their alignment padding
        pin = torch.cuda.is_available()
        self.raw, self.slab = self.layout.empty(self.capacity, pin=pin)  # [N, slot_bytes], allocated once; views
        self.entry: dict[tuple[int, int], int] = {}
        self.owner: list[tuple[int, int] | None] = [None] * self.capacity
        self.policy = make_policy(policy, capacity=max(self.capacity, 1))
        self._copies: dict[int, torch.cuda.Event] = {}  # CUDA: slab entry -> its last async copy to the device
        self.pinned: set[tuple[int, int]] = set()  # entries a host computation of this step reads: never victims

    @property
    def used_bytes(self) -> int:
        return len(self.entry) * self.expert_bytes

    def read_into(self, layer: int, expert: int, dst: Mapping[str, torch.Tensor]) -> tuple[str, int]:
        if self.capacity == 0:
            return self.disk.read_into(layer, expert, dst)
        idx, tier = self._fill(layer, expert)
        if not dst:
            return tier, self.expert_bytes
        for name, out in dst.items():
            out.copy_(self.slab[name][idx], non_blocking=True)
        if out.is_cuda:
            self._copied(idx, torch.cuda.current_stream(out.device))
        return tier, self.expert_bytes

    def raw_row(self, layer: int, expert: int) -> tuple[torch.Tensor, str, int] | None:
        """The expert's slab row [slot_bytes] after reading it in from disk if needed (None with no slab): the
        source of a one-copy load. A caller copying it asynchronously calls `copied_from` after enqueuing."""
        if self.capacity == 0:
            return None
        idx, tier = self._fill(layer, expert)
        return self.raw[idx], tier, self.expert_bytes

    def copied_from(self, layer: int, expert: int, stream) -> None:
        """An async copy out of the expert's row was enqueued on the CUDA `stream`: a refill of the entry waits."""
        self._copied(self.entry[(layer, expert)], stream)

    def _copied(self, idx: int, stream) -> None:
        event = torch.cuda.Event()
        event.record(stream)
        self._copies[idx] = event

    def _fill(self, layer: int, expert: int) -> tuple[int, str]:
        """The slab entry holding the expert (read from disk when absent) and the tier it came from."""
        key = (layer, expert)
        self.policy.access(key)
        idx = self.entry.get(key)
        tier = RAM
        if idx is None:
            tier = DISK
            if len(self.entry) < self.capacity:
                idx = len(self.entry)
            else:
                victim = self.policy.victim(self.pinned)
                idx = self.entry.pop(victim)
                self.policy.evict(victim)
            pending = self._copies.pop(idx, None)
            if pending is not None:
                pending.synchronize()  # an async copy out of this entry may still be reading it
            self.disk.read_into(layer, expert, {name: t[idx] for name, t in self.slab.items()})
            self.entry[key] = idx
            self.owner[idx] = key
            self.policy.admit(key)
            assert self.used_bytes <= self.budget_bytes
        return idx, tier

    # -- host compute (hybrid execution) --------------------------------------------------------------------
    def host_slot(self, layer: int, expert: int) -> tuple[dict[str, torch.Tensor], int, str, int] | None:
        """The expert's slab entry for computing in place (read from disk into the slab first when needed; it
        stays pinned until `release_host`), or None when the RAM tier cannot hold one more for this step."""
        key = (layer, expert)
        # one entry always stays unpinned: the loads of this step pass through it
        if len(self.pinned) + 1 >= self.capacity:
            return None
        tier, nbytes = self.read_into(layer, expert, {})
        self.pinned.add(key)
        return self.slab, self.entry[key], tier, nbytes if tier == DISK else 0

    def release_host(self) -> None:
        self.pinned.clear()
