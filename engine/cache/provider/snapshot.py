"""`CachedProvider.snapshot()`: the cache as an immutable `CacheSnapshot` (engine/cache/stats.py) for the UI and the
CLI: slots, residency, per-layer hits and misses, bytes by tier, prefetch and host-compute counts, the RAM tier.
"""

from __future__ import annotations

import numpy as np

from ..stats import CacheSnapshot


class Snapshots:
    """A mixin of `CachedProvider` (core.py), which holds the counters."""

    # -- for the UI and the CLI ------------------------------------------------------------------
    def snapshot(self) -> CacheSnapshot:
        total = self.stats.total()
        layers = self.stats.layers
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
            prefetch=self.prefetch_mode if self.predictor is not None else "off",
            prefetch_depth=self.prefetch_depth,
            stall_seconds=total.stall_seconds,
            prefetch_issued=tuple(s.prefetch_issued for s in layers),
            prefetch_used=tuple(s.prefetch_used for s in layers),
            prefetch_late=tuple(s.prefetch_late for s in layers),
            prefetch_wasted=tuple(s.prefetch_wasted for s in layers),
            predicted=tuple(s.predicted for s in layers),
            predicted_correct=tuple(s.predicted_correct for s in layers),
            routed=tuple(s.routed for s in layers),
            warm_loaded=self.warm_loaded,
            on_miss=self.on_miss,
            host_computed=tuple(s.host_computed for s in layers),
            host_seconds=total.host_seconds,
            host_layers=len(self.host_layers),
            where_ran=self.where_ran.copy(),
            cost_model=self.cost.to_json() if self.cost is not None else None,
            fast_tier=self.fast_tier,
            ram_hits=tuple(s.ram_hits for s in layers) if self.pool.device.type == "cpu" else (),
            disk_reads=tuple(s.disk_reads for s in layers) if self.pool.device.type == "cpu" else (),
            ram_resident=self._ram_resident(),
            ram_tier_experts=self._ram_tier_experts(),
            expert_bytes=int(getattr(self.store, "expert_bytes", 0)),
        )

    def _ram_resident(self) -> np.ndarray:
        """[L, E] bool: the experts the RAM tier holds now."""
        out = np.zeros((self.num_layers, self.num_experts), dtype=bool)
        entry = getattr(self.store, "entry", None)
        if entry is None:
            for layer in getattr(self.store, "tensors", {}):
                out[layer] = True
        else:
            for layer, e in list(entry):
                out[layer, e] = True
        return out

    def _ram_tier_experts(self) -> int:
        if self._all_in_ram():
            return sum(self.num_experts for _ in getattr(self.store, "tensors", {}))
        return int(getattr(self.store, "capacity", 0))
