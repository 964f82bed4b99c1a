"""`CachedProvider`: the ExpertProvider over a fixed slot pool, an eviction policy and a tiered store.

`batches(layer, topk_ids)` reads the routing to the host once (the one sync a layer makes),
deduplicates the experts, counts hits and misses, picks victims through the policy (never an expert the
current step needs), copies the misses in from RAM or disk, and yields `ExpertBatch`es whose slot ids
the expert compute uses. When a prefill chunk needs more distinct experts than there are slots (C may
be 1), it yields them expert-major in groups of at most C: load a group, let every token routed to it
compute, move on. Each needed expert is loaded at most once per layer per chunk either way, so a
512-token chunk of Qwen3-30B-A3B moves <= 128 experts per layer instead of 512 x 8.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..moe import ExpertBatch
from .policy import DEFAULT_POLICY, EvictionPolicy, make_policy
from .slots import SlotPool
from .stats import CacheSnapshot, CacheStats
from .store import DiskStore, RamCache, RamStore, RepackedStore
from .trace import TraceRecorder


@dataclass(frozen=True)
class CacheConfig:
    """How to hold the experts: C slots on the compute device, a policy, and the RAM tier's budget."""

    expert_slots: int | None = None  # None: every expert, except on a CPU with a bounded RAM tier (2 steps' worth)
    policy: str = DEFAULT_POLICY
    ram_cache_bytes: int | None = None  # None: every expert in RAM; else a bounded RAM cache over disk
    record_trace: bool = False
    repack_dir: str | None = None  # read the disk tier from a repacked per-expert file kept here


def build_cached_provider(cls, args, ckpt, dtype: torch.dtype, device: torch.device,
                          config: CacheConfig) -> CachedProvider:
    """Slot pool + store + policy for a loaded model's experts, as `config` asks."""
    disk = DiskStore(cls, args, ckpt, dtype)
    layers = cls.moe_layers(args)
    E = args.num_experts
    if config.repack_dir is not None:
        disk = RepackedStore(disk, layers, E, Path(config.repack_dir))
    all_bytes = disk.expert_bytes * len(layers) * E
    if config.ram_cache_bytes is None or config.ram_cache_bytes >= all_bytes:
        store = RamStore(disk, layers, E)
    else:
        store = RamCache(disk, config.ram_cache_bytes, policy=config.policy)
    slots = config.expert_slots
    if slots is None:
        # On a CPU the slots are RAM too: with a RAM budget, keep them to two decode steps' worth of experts.
        bounded_cpu = device.type == "cpu" and config.ram_cache_bytes is not None
        slots = 2 * args.top_k * len(layers) if bounded_cpu else len(layers) * E
    slots = max(1, min(slots, len(layers) * E))
    pool = SlotPool(slots, args.num_hidden_layers, E, disk.shapes, device)
    recorder = TraceRecorder(args.num_hidden_layers, E, args.top_k) if config.record_trace else None
    return CachedProvider(pool, store, make_policy(config.policy, capacity=slots), recorder)


class CachedProvider:
    def __init__(self, pool: SlotPool, store, policy: EvictionPolicy, recorder=None):
        self.pool = pool
        self.store = store
        self.policy = policy
        self.recorder = recorder
        self.num_layers = pool.num_layers
        self.num_experts = pool.num_experts
        self.stats = CacheStats(pool.num_layers)
        self.frequency = np.zeros((pool.num_layers, pool.num_experts), dtype=np.int64)  # requests since start

    # -- the ExpertProvider protocol ---------------------------------------------------------------
    def prepare(self, layer: int, topk_ids: torch.Tensor) -> ExpertBatch:
        """One batch for every requested expert; only when they fit the pool (else use `batches`)."""
        batches = list(self.batches(layer, topk_ids))
        if len(batches) != 1:
            raise RuntimeError(f"layer {layer} needs more experts than the {self.pool.num_slots} slots at once; "
                               "iterate CachedProvider.batches() instead")
        return batches[0]

    def batches(self, layer: int, topk_ids: torch.Tensor) -> Iterator[ExpertBatch]:
        ids = topk_ids.cpu() if topk_ids.device.type != "cpu" else topk_ids  # [T, K] host copy: the one sync
        T = ids.shape[0]
        ids_np = ids.numpy()
        if self.recorder is not None:
            self.recorder.record(layer, ids_np, 0 if T > 1 else 1)
        experts = list(dict.fromkeys(ids_np.reshape(-1).tolist()))  # unique, in first-use order
        np.add.at(self.frequency[layer], ids_np.reshape(-1), 1)
        C = self.pool.num_slots
        if len(experts) <= C:
            self._make_resident(layer, experts, prefill=T > 1)
            yield self._batch(layer, topk_ids, ids, None)
            return
        # Expert-major groups: resident experts first (no load), then the rest, C at a time.
        host_map = self.pool.host_map[layer]
        experts.sort(key=lambda e: host_map[e] < 0)
        flat = ids.reshape(-1)
        for g in range(0, len(experts), C):
            group = experts[g : g + C]
            self._make_resident(layer, group, prefill=T > 1)
            pairs = torch.nonzero(torch.isin(flat, torch.tensor(group, dtype=flat.dtype))).reshape(-1)  # [P]
            yield self._batch(layer, topk_ids, ids, pairs)

    # -- internals -------------------------------------------------------------------------------
    def _batch(self, layer: int, topk_ids: torch.Tensor, ids_cpu: torch.Tensor, pairs) -> ExpertBatch:
        host_slots = torch.from_numpy(self.pool.host_map[layer][ids_cpu.numpy()])  # [T, K] int32, -1 outside group
        if self.pool.device.type == "cpu":
            slot_ids = host_slots
        else:
            slot_ids = self.pool.slot_map[layer][topk_ids]  # [T, K] gathered on the device, no sync
        if pairs is not None and self.pool.device.type != "cpu":
            pairs = pairs.to(self.pool.device)
        return ExpertBatch(self.pool.buffers, slot_ids, host_slots, pairs)

    def _make_resident(self, layer: int, experts: list[int], *, prefill: bool) -> None:
        """Count, pick victims outside `experts`, and load every missing expert of the step."""
        stats = self.stats.layers[layer]
        pool = self.pool
        protected = [(layer, e) for e in experts]
        misses = []
        for key in protected:
            self.policy.access(key)
            if pool.host_map[key] >= 0:
                stats.hits += 1
            else:
                stats.misses += 1
                misses.append(key)
        if not misses:
            return
        t0 = time.perf_counter()
        for key in misses:
            if pool.has_free():
                slot = pool.begin_load(*key)
            else:
                victim = self.policy.victim(protected)
                slot = pool.slot_of(*victim)
                pool.release(slot)
                self.policy.evict(victim)
                slot = pool.begin_load(*key, slot=slot)
            tier, nbytes = self.store.read_into(key[0], key[1], pool.views(slot))
            pool.finish_load(slot)
            self.policy.admit(key)
            if tier == "ram":
                stats.bytes_from_ram += nbytes
            else:
                stats.bytes_from_disk += nbytes
            if prefill:
                stats.expert_loads_prefill += 1
            else:
                stats.expert_loads_decode += 1
        stats.load_seconds += time.perf_counter() - t0

    # -- live retuning (between tokens, from the thread that drives generation) ------------------------
    def resize(self, num_slots: int) -> None:
        """A new pool of num_slots slots; the experts the policy ranks highest are carried over."""
        pool = self.pool
        num_slots = max(1, min(num_slots, pool.num_layers * pool.num_experts))
        if num_slots == pool.num_slots:
            return
        shapes = {name: (tuple(buf.shape[1:]), buf.dtype) for name, buf in pool.buffers.items()}
        new = SlotPool(num_slots, pool.num_layers, pool.num_experts, shapes, pool.device)
        keep = self._ranked_resident()[:num_slots]
        for key in keep:
            slot = new.begin_load(*key)
            for name, view in new.views(slot).items():
                view.copy_(pool.buffers[name][pool.slot_of(*key)])
            new.finish_load(slot)
        self.pool = new
        self._reset_policy(self.policy.name, keep)

    def set_policy(self, name: str) -> None:
        if name != self.policy.name:
            self._reset_policy(name, self._ranked_resident())

    def _ranked_resident(self) -> list[tuple[int, int]]:
        """Resident keys, most valuable first by the current policy (evicting one by one gives the order)."""
        resident = [key for key in self.pool.owner if key is not None]
        scores = self.policy.scores()
        if scores:
            return sorted(resident, key=lambda k: scores.get(k, 0.0), reverse=True)
        return resident

    def _reset_policy(self, name: str, resident: list[tuple[int, int]]) -> None:
        self.policy = make_policy(name, capacity=self.pool.num_slots)
        for key in reversed(resident):  # least valuable first, so recency-based policies keep the order
            self.policy.access(key)
            self.policy.admit(key)

    # -- for the UI and the CLI ------------------------------------------------------------------
    def snapshot(self) -> CacheSnapshot:
        total = self.stats.total()
        host_map = self.pool.host_map.copy()
        return CacheSnapshot(
            num_slots=self.pool.num_slots,
            slots_used=self.pool.used,
            policy=self.policy.name,
            resident=host_map >= 0,
            frequency=self.frequency.copy(),
            slot_map=host_map,
            hits=tuple(s.hits for s in self.stats.layers),
            misses=tuple(s.misses for s in self.stats.layers),
            bytes_from_ram=total.bytes_from_ram,
            bytes_from_disk=total.bytes_from_disk,
            load_seconds=total.load_seconds,
            expert_loads_prefill=total.expert_loads_prefill,
            expert_loads_decode=total.expert_loads_decode,
            ram_cache_bytes=getattr(self.store, "budget_bytes", 0),
            ram_cache_used_bytes=getattr(self.store, "used_bytes", 0),
        )
