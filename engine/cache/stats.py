"""Cache counters and the immutable snapshot the UI reads.

Counters are plain Python ints and floats updated on the host by the provider (it already holds the
routing decision there), so counting costs no device work. `CacheSnapshot` is a frozen copy: the UI
and the CLI read snapshots, never the live cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class LayerStats:
    hits: int = 0
    misses: int = 0
    bytes_from_ram: int = 0
    bytes_from_disk: int = 0
    load_seconds: float = 0.0  # time the forward pass spent on its own (demand) expert loads
    stall_seconds: float = 0.0  # all time the forward pass waited for expert bytes: demand loads + late prefetches
    expert_loads_prefill: int = 0
    expert_loads_decode: int = 0
    prefetch_issued: int = 0  # loads started ahead of need for this layer
    prefetch_used: int = 0  # requests served by a prefetched expert (its first use)
    prefetch_late: int = 0  # of those, still loading when needed (the wait is in stall_seconds)
    prefetch_wasted: int = 0  # prefetched experts evicted or cancelled before any use
    predicted: int = 0  # experts the predictor named for this layer
    predicted_correct: int = 0  # of those, experts the layer then used
    routed: int = 0  # distinct experts the layer used in steps that had a prediction
    host_computed: int = 0  # misses computed on the host from the RAM tier instead of loaded (hybrid)
    host_seconds: float = 0.0  # time the host spent computing them
    # On a CPU the slots and the RAM tier are both RAM: what a request costs is whether it read the disk.
    ram_hits: int = 0  # requests served from RAM (a slot or the RAM tier), CPU only
    disk_reads: int = 0  # requests that read their expert from disk, CPU only


@dataclass
class CacheStats:
    num_layers: int
    layers: list[LayerStats] = field(default_factory=list)

    def __post_init__(self):
        if not self.layers:
            self.layers = [LayerStats() for _ in range(self.num_layers)]

    def total(self) -> LayerStats:
        out = LayerStats()
        for s in self.layers:
            for name in vars(out):
                setattr(out, name, getattr(out, name) + getattr(s, name))
        return out

    def reset(self) -> None:
        self.layers = [LayerStats() for _ in range(self.num_layers)]


@dataclass(frozen=True)
class CacheSnapshot:
    """What the expert cache looks like at one instant, for display.

    `resident` [L, E] bool: expert in a slot; `frequency` [L, E]: requests since start; `slot_map`
    [L, E] int32 slot index or -1. Per-layer hit rates are hits / (hits + misses), NaN before any
    request. Arrays are copies: holding a snapshot never blocks or changes the cache.
    """

    num_slots: int
    slots_used: int
    policy: str
    resident: np.ndarray
    frequency: np.ndarray
    slot_map: np.ndarray
    hits: tuple[int, ...]
    misses: tuple[int, ...]
    bytes_from_ram: int
    bytes_from_disk: int
    load_seconds: float
    expert_loads_prefill: int
    expert_loads_decode: int
    ram_cache_bytes: int  # budget of the RAM tier (0: every expert is in RAM)
    ram_cache_used_bytes: int
    prefetch: str = "off"
    prefetch_depth: int = 0
    stall_seconds: float = 0.0
    prefetch_issued: tuple[int, ...] = ()  # per layer, like hits
    prefetch_used: tuple[int, ...] = ()
    prefetch_late: tuple[int, ...] = ()
    prefetch_wasted: tuple[int, ...] = ()
    predicted: tuple[int, ...] = ()
    predicted_correct: tuple[int, ...] = ()
    routed: tuple[int, ...] = ()
    warm_loaded: int = 0  # experts loaded at start from the saved routing profile
    on_miss: str = "load"  # load | host | auto: where a miss runs
    host_computed: tuple[int, ...] = ()  # per layer: misses computed on the host
    host_seconds: float = 0.0
    host_layers: int = 0  # the first N MoE layers always run on the host
    where_ran: np.ndarray | None = None  # [L, E] int8: 0 never, 1 device (slot), 2 host, 3 both (this session)
    cost_model: dict | None = None  # the hybrid cost model's current numbers (auto)
    # "slots": hits are slot hits (a GPU, or load on a CPU); "ram": a CPU computing misses in place, where the
    # cache that exists is the RAM tier over the disk, and hits are `ram_hits` (no disk read) of ram + disk.
    fast_tier: str = "slots"
    ram_hits: tuple[int, ...] = ()  # per layer, CPU only
    disk_reads: tuple[int, ...] = ()
    ram_resident: np.ndarray | None = None  # [L, E] bool: in the RAM tier now (every MoE expert when all in RAM)
    ram_tier_experts: int = 0  # experts the RAM tier holds at most (every MoE expert when all in RAM)
    expert_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        h, m = sum(self.hits), sum(self.misses)
        return h / (h + m) if h + m else float("nan")

    @property
    def layer_hit_rates(self) -> tuple[float, ...]:
        return tuple(h / (h + m) if h + m else float("nan") for h, m in zip(self.hits, self.misses, strict=True))

    @property
    def ram_hit_rate(self) -> float:
        """Requests that read nothing from disk, of all (CPU; NaN before any request or off a CPU)."""
        h, m = sum(self.ram_hits), sum(self.disk_reads)
        return h / (h + m) if h + m else float("nan")

    @property
    def demand_misses(self) -> int:
        """Requests that found their expert neither in a slot nor on its way: loads the forward pass issued."""
        return sum(self.misses)

    @property
    def prefetch_precision(self) -> float:
        """Share of predicted experts the layer then used (NaN before any prediction)."""
        p = sum(self.predicted)
        return sum(self.predicted_correct) / p if p else float("nan")

    @property
    def prefetch_recall(self) -> float:
        """Share of used experts the predictor had named (NaN before any prediction)."""
        r = sum(self.routed)
        return sum(self.predicted_correct) / r if r else float("nan")

    def to_json(self) -> dict:
        def rate(x: float):
            return None if np.isnan(x) else round(x, 6)

        layers = [{"hits": h, "misses": m} for h, m in zip(self.hits, self.misses, strict=True)]
        if self.prefetch_issued:
            for i, layer in enumerate(layers):
                layer.update(prefetch_issued=self.prefetch_issued[i], prefetch_used=self.prefetch_used[i],
                             prefetch_late=self.prefetch_late[i], prefetch_wasted=self.prefetch_wasted[i],
                             precision=_ratio(self.predicted_correct[i], self.predicted[i]),
                             recall=_ratio(self.predicted_correct[i], self.routed[i]))
        if self.host_computed:
            for i, layer in enumerate(layers):
                layer["host_computed"] = self.host_computed[i]
        if self.ram_hits:
            for i, layer in enumerate(layers):
                layer.update(ram_hits=self.ram_hits[i], disk_reads=self.disk_reads[i])
        return {
            "slots": self.num_slots,
            "slots_used": self.slots_used,
            "policy": self.policy,
            "hits": sum(self.hits),
            "misses": sum(self.misses),
            "hit_rate": None if np.isnan(self.hit_rate) else round(self.hit_rate, 6),
            "bytes_from_ram": self.bytes_from_ram,
            "bytes_from_disk": self.bytes_from_disk,
            "load_seconds": round(self.load_seconds, 6),
            "expert_loads_prefill": self.expert_loads_prefill,
            "expert_loads_decode": self.expert_loads_decode,
            "ram_cache_bytes": self.ram_cache_bytes,
            "ram_cache_used_bytes": self.ram_cache_used_bytes,
            "prefetch": self.prefetch,
            "prefetch_depth": self.prefetch_depth,
            "stall_seconds": round(self.stall_seconds, 6),
            "demand_misses": self.demand_misses,
            "prefetch_issued": sum(self.prefetch_issued),
            "prefetch_used": sum(self.prefetch_used),
            "prefetch_late": sum(self.prefetch_late),
            "prefetch_wasted": sum(self.prefetch_wasted),
            "prefetch_precision": rate(self.prefetch_precision),
            "prefetch_recall": rate(self.prefetch_recall),
            "warm_loaded": self.warm_loaded,
            "on_miss": self.on_miss,
            "host_layers": self.host_layers,
            "host_computed": sum(self.host_computed),
            "host_seconds": round(self.host_seconds, 6),
            "cost_model": self.cost_model,
            "fast_tier": self.fast_tier,
            "ram_hits": sum(self.ram_hits),
            "disk_reads": sum(self.disk_reads),
            "ram_hit_rate": rate(self.ram_hit_rate),
            "ram_tier_experts": self.ram_tier_experts,
            "layers": layers,
        }


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 6) if b else None
