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
    load_seconds: float = 0.0  # time the forward pass waited on expert loads
    expert_loads_prefill: int = 0
    expert_loads_decode: int = 0


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

    @property
    def hit_rate(self) -> float:
        h, m = sum(self.hits), sum(self.misses)
        return h / (h + m) if h + m else float("nan")

    @property
    def layer_hit_rates(self) -> tuple[float, ...]:
        return tuple(h / (h + m) if h + m else float("nan") for h, m in zip(self.hits, self.misses, strict=True))

    def to_json(self) -> dict:
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
            "layers": [{"hits": h, "misses": m} for h, m in zip(self.hits, self.misses, strict=True)],
        }
