"""`CacheConfig` and `build_cached_provider`: how to hold a loaded model's experts, and the `CachedProvider` built
from it (a disk store, repacked when the tiers hold another format; a RAM tier, whole or a bounded cache; C slots on
the compute device; the policy; the transfer engine; prefetch and the on-miss mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...quant.base import ExpertFormat
from ...quant.dense import DENSE
from ..hybrid import check_on_miss
from ..policy import DEFAULT_POLICY, make_policy
from ..prefetch import check_prefetch
from ..ram_tier import RamCache, RamStore
from ..repacked import RepackedStore, default_repack_dir
from ..slots import SlotPool
from ..store import DiskStore
from ..trace import TraceRecorder
from ..transfer import make_transfer
from .core import CachedProvider
from .host import _cost_model


@dataclass(frozen=True)
class CacheConfig:
    """How to hold the experts: C slots on the compute device, a policy, and the RAM tier's budget."""

    expert_slots: int | None = None  # None: every expert, except on a CPU with a bounded RAM tier (2 steps' worth)
    policy: str = DEFAULT_POLICY
    ram_cache_bytes: int | None = None  # None: every expert in RAM; else a bounded RAM cache over disk
    record_trace: bool = False
    repack_dir: str | None = None  # read the disk tier from a repacked per-expert file kept here
    prefetch: str = "off"  # one of prefetch.PREFETCH_MODES
    prefetch_depth: int = 1  # predict this many MoE layers ahead
    prefetch_budget: int | None = None  # prefetches per predicted layer per step; None: top-k
    transfer: str = "thread"  # "thread": loads overlap compute; "inline": on the forward thread
    trace_max_rows: int | None = None  # with record_trace: keep only about the latest N routing rows
    warm_start: bool | str = False  # fill the slots at load: True the saved profile, "imatrix:FILE" that ranking
    profile_dir: str | None = None  # where routing profiles live (default: XDG cache dir)
    on_miss: str = "load"  # where a miss runs: load (into a slot), host (computed from the RAM tier), auto
    host_layers: int = 0  # the first N MoE layers keep every expert on the host, never slotted
    link_gbps: float | None = None  # host->device GB/s for the auto cost model (None: probed / assumed)
    embeddings: str = "device"  # "host": the input embedding table in RAM, its VRAM left to the slots

    def __post_init__(self):
        check_prefetch(self.prefetch, self.prefetch_depth)
        check_on_miss(self.on_miss)
        if self.embeddings not in ("host", "device"):
            raise ValueError(f"embeddings {self.embeddings!r}: use host or device")
        if self.host_layers < 0:
            raise ValueError(f"host layers must be >= 0, got {self.host_layers}")
        if self.prefetch_budget is not None and self.prefetch_budget < 1:
            raise ValueError(f"prefetch budget must be at least 1, got {self.prefetch_budget}")


def build_cached_provider(cls, args, ckpt, dtype: torch.dtype, device: torch.device,
                          config: CacheConfig, fmt: ExpertFormat = DENSE,
                          native: ExpertFormat | None = None) -> CachedProvider:
    """Slot pool + store + policy for a loaded model's experts, as `config` asks. The checkpoint ships them
    as `native` (default: `fmt`); every tier holds them as `fmt` (converted once into a repacked file)."""
    native = native or fmt
    disk = DiskStore(cls, args, ckpt, dtype, native)
    layers = cls.moe_layers(args)
    E = args.num_experts
    if fmt is not native:
        directory = config.repack_dir or default_repack_dir(ckpt.model_dir, fmt.name)
        disk = RepackedStore(disk, layers, E, Path(directory), fmt)
    elif config.repack_dir is not None:
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
    recorder = (TraceRecorder(args.num_hidden_layers, E, args.top_k, max_rows=config.trace_max_rows)
                if config.record_trace else None)
    provider = CachedProvider(pool, store, make_policy(config.policy, capacity=slots), recorder,
                              transfer=make_transfer(config.transfer, device))
    provider.set_prefetch(config.prefetch, config.prefetch_depth, config.prefetch_budget)
    provider.set_hybrid(config.on_miss, layers[: config.host_layers],
                        _cost_model(store, args, device, config.link_gbps) if config.on_miss == "auto" else None)
    return provider
