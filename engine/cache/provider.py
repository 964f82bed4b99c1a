"""`CachedProvider`: the ExpertProvider over a fixed slot pool, an eviction policy and a tiered store.

`batches(layer, topk_ids)` reads the routing to the host once (the one sync a layer makes),
deduplicates the experts, counts hits and misses, picks victims through the policy (never an expert the
current step needs), copies the misses in from RAM or disk, and yields `ExpertBatch`es whose slot ids
the expert compute uses. When a prefill chunk needs more distinct experts than there are slots (C may
be 1), it yields them expert-major in groups of at most C: load a group, let every token routed to it
compute, move on. Each needed expert is loaded at most once per layer per chunk either way, so a
512-token chunk of Qwen3-30B-A3B moves <= 128 experts per layer instead of 512 x 8.

Prefetch (`prefetch.py`, `transfer.py`): the model hands the provider the residual stream entering
each MoE layer (`observe`); once layer l's experts are resident and before they compute, the
predictor names the experts of layers l+1..l+depth, and those not in a slot are claimed (LOADING) and
queued on the transfer engine. A prefetch never evicts an expert of the current layer or another
predicted one, never takes a slot that is loading, and at most `prefetch_budget` are issued per
predicted layer per step. When a layer asks for an expert that is still loading it waits for that load
only (the wait is stall time); a hit is a request whose expert was in a slot or on its way, a miss a
load the forward pass had to issue itself (a demand miss). Only the forward thread changes the slot
pool and the policy; a transfer job only writes the bytes of a slot it was given.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ..layers.moe import ExpertBatch
from ..quant.base import ExpertFormat
from ..quant.dense import DENSE
from .hybrid import REUSE_HORIZON, MissCostModel, check_on_miss
from .policy import DEFAULT_POLICY, EvictionPolicy, make_policy
from .prefetch import Predictor, check_prefetch
from .slots import SlotPool
from .stats import CacheSnapshot, CacheStats
from .store import DiskStore, RamCache, RamStore, RepackedStore, default_repack_dir
from .trace import TraceRecorder
from .transfer import DONE, InlineTransfer, Job, make_copy_stream, make_transfer

Key = tuple[int, int]


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


def _cost_model(store, args, device: torch.device, link_gbps: float | None) -> MissCostModel | None:
    """The auto mode's numbers: host rates timed on one expert of the RAM tier now, the link probed."""
    if not hasattr(store, "host_slot"):
        return None  # no RAM tier to compute from: every miss loads
    flops = 2.0 * 3 * args.hidden_size * args.moe_intermediate
    host_gbps, host_gflops = calibrate_host(store, args)
    same = device.type == "cpu"
    if not same and link_gbps is None:
        from .hybrid import ASSUMED_LINK_GBPS

        link_gbps = ASSUMED_LINK_GBPS
    return MissCostModel(store.expert_bytes, flops, None if same else link_gbps, host_gbps, host_gflops,
                         device_gbps=None if same else 1000.0, device_gflops=None if same else 50_000.0)


def calibrate_host(store, args, reps: int = 3) -> tuple[float, float]:
    """Effective host GB/s (packed bytes read while computing one token) and GFLOP/s (a 16-token chunk), timed on
    the first expert the RAM tier holds."""
    from ..layers.experts import _expert
    from ..layers.moe import SWIGLU

    layer = next(iter(getattr(store, "tensors", {0: None})))
    got = store.host_slot(layer, 0)
    store.release_host()
    if got is None:
        return 20.0, 100.0
    buffers, idx, _, _ = got
    view = {name: t[idx] for name, t in buffers.items()}
    dtype = next((t.dtype for t in view.values() if t.is_floating_point() and t.dtype.itemsize >= 2), torch.float32)
    flops = 2.0 * 3 * args.hidden_size * args.moe_intermediate
    best = {}
    for n in (1, 16):
        x = torch.randn(n, args.hidden_size, dtype=dtype)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            _expert(x, store.format, view, SWIGLU)
            times.append(time.perf_counter() - t0)
        best[n] = min(times)
    t1, t16 = best[1], best[16]
    per_token = max((t16 - t1) / 15, 1e-9)
    gflops = flops / per_token / 1e9
    fixed = max(t1 - per_token, t1 * 0.5)
    return store.expert_bytes / fixed / 1e9, gflops


def _pairs(flat: torch.Tensor, experts: list[int]) -> torch.Tensor:
    """The flat (t, k) pairs [P] routed to any of `experts`."""
    return torch.nonzero(torch.isin(flat, torch.tensor(experts, dtype=flat.dtype))).reshape(-1)


class CachedProvider:
    def __init__(self, pool: SlotPool, store, policy: EvictionPolicy, recorder=None, *, transfer=None, copies=None):
        self.pool = pool
        self.store = store
        self.format = getattr(store, "format", DENSE)  # how the slots hold an expert (opaque to the cache)
        self.policy = policy
        self.recorder = recorder
        self.num_layers = pool.num_layers
        self.num_experts = pool.num_experts
        self.stats = CacheStats(pool.num_layers)
        self.frequency = np.zeros((pool.num_layers, pool.num_experts), dtype=np.int64)  # requests since start
        self.transfer = transfer if transfer is not None else InlineTransfer(pool.device)
        self.store_lock = threading.Lock()  # the store (RAM cache policy, staging buffers) is one-thread-at-a-time
        self.predictor: Predictor | None = None
        self.prefetch_mode = "off"
        self.prefetch_depth = 1
        self.prefetch_budget: int | None = None
        self.inflight: dict[Key, Job] = {}  # claimed slots whose bytes a transfer job is writing
        # Demand misses: one copy stream (CUDA), a layer's misses issued together, each joined by its own event
        self.copies = copies if copies is not None else make_copy_stream(pool.device)
        self.pending: dict[Key, Job] = {}  # published prefetches whose device copy no compute has waited for yet
        self.copies_issued = 0  # host->device (or RAM->slot) copies: one per expert in the slot layout
        self.prefetched: set[Key] = set()  # loaded ahead of need and not used since
        self.warm_loaded = 0
        self._hidden: tuple[int, torch.Tensor] | None = None  # (layer, residual stream at its MoE)
        self._predicted: dict[int, set[int]] = {}  # layer -> the experts last predicted for it
        self.on_miss = "load"
        self.host_layers: frozenset[int] = frozenset()
        self.cost: MissCostModel | None = None
        self.recent = np.zeros((pool.num_layers, pool.num_experts), dtype=np.float32)  # decayed use per step
        self.where_ran = np.zeros((pool.num_layers, pool.num_experts), dtype=np.int8)  # 1 device, 2 host, 3 both
        # A CPU computing misses in place: prefetch reads predicted experts from disk into the RAM tier
        self.ram_inflight: dict[Key, Job] = {}
        self.ram_prefetched: set[Key] = set()  # read ahead into the RAM tier and not requested since

    @property
    def fast_tier(self) -> str:
        """Where hits come from: "slots", or "ram" on a CPU that computes every miss in place from the RAM tier
        (the slots then only hold what a warm start put there, and the cache that matters is RAM over disk)."""
        return "ram" if self.pool.device.type == "cpu" and self.on_miss != "load" else "slots"

    def _all_in_ram(self) -> bool:
        return not hasattr(self.store, "entry")  # a RamStore: every expert in RAM, nothing read from disk

    # -- hybrid execution ------------------------------------------------------------------------------------
    def set_hybrid(self, on_miss: str, host_layers=(), cost: MissCostModel | None = None) -> None:
        """Where misses run (between tokens): load, host (from the RAM tier, in place) or auto (cost model);
        `host_layers` keep all their experts on the host."""
        check_on_miss(on_miss)
        self.quiesce()
        if (on_miss != "load" or host_layers) and not hasattr(self.store, "host_slot"):
            on_miss, host_layers = "load", ()  # experts stream from disk: there is no RAM tier to compute from
        self.on_miss, self.host_layers, self.cost = on_miss, frozenset(host_layers), cost
        if on_miss == "auto" and cost is None:
            self.on_miss = "load"
        self._check_prefetch_target(self.prefetch_mode)
        for layer in self.host_layers:  # their slotted experts are no longer needed
            for e in range(self.pool.num_experts):
                slot = self.pool.slot_of(layer, e)
                if slot >= 0:
                    self._drain((layer, e))
                    self.pool.release(slot)
                    self.policy.evict((layer, e))

    def _host_choice(self, layer: int, experts: list[int], ids_np: np.ndarray) -> list[int]:
        """The misses of this step that run on the host (none in load mode)."""
        recent = self.recent[layer]
        recent *= 0.8  # an exponential average of "used this step"
        recent[experts] += 1.0
        if self.on_miss == "load" and layer not in self.host_layers:
            return []
        host_map = self.pool.host_map[layer]
        misses = [e for e in experts if host_map[e] < 0 and (layer, e) not in self.inflight]
        if layer in self.host_layers or self.on_miss == "host" or self.cost.same_machine:
            return misses  # on a CPU a load is a memcpy before the same compute: the cost model never loads there
        counts = np.bincount(ids_np.reshape(-1), minlength=self.pool.num_experts)
        # the average's steady state is 1 / (1 - 0.8) for an every-step expert
        needs = [(int(counts[e]), float(recent[e]) * 0.2 * REUSE_HORIZON) for e in misses]
        return [e for e, host in zip(misses, self.cost.place(needs), strict=True) if host]

    def _check_prefetch_target(self, mode: str) -> None:
        """Refuse a prefetch that could do nothing: a CPU computing misses in place with every expert in RAM."""
        if mode != "off" and self.fast_tier == "ram" and self._all_in_ram():
            from ..errors import ConfigError
            from .prefetch import nothing_to_prefetch

            raise ConfigError(nothing_to_prefetch(mode))

    def _pin_host(self, layer: int, host: list[int]) -> tuple[dict | None, np.ndarray, list[int], list[int]]:
        """Pin the host experts the RAM tier can hold this step (a small RAM cache may not hold them all: the rest
        are returned, to be loaded): (its buffers, [E] index into them or -1, pinned, rest). Pinned entries stay
        until the next step."""
        stats = self.stats.layers[layer]
        index = np.full(self.pool.num_experts, -1, dtype=np.int64)
        group, rest, buffers = [], [], None
        with self.store_lock:
            for e in host:
                got = self.store.host_slot(layer, e) if not rest else None
                if got is None:
                    rest.append(e)
                    continue
                buffers, index[e], tier, nbytes = got
                group.append(e)
                if nbytes:
                    self._count_bytes(stats, tier, nbytes)
                self._count_tier(stats, (layer, e), tier)
        stats.misses += len(group)
        stats.host_computed += len(group)
        for e in group:
            self.policy.access((layer, e))
            self.where_ran[layer, e] |= 2
        return buffers, index, group, rest

    def _host_batch(self, ids: torch.Tensor, buffers, index: np.ndarray, group: list[int]) -> ExpertBatch:
        """A batch of only the pinned host experts' pairs, over the RAM tier's own buffers."""
        flat = ids.reshape(-1)
        pairs = torch.nonzero(torch.isin(flat, torch.tensor(group, dtype=flat.dtype))).reshape(-1)  # [P]
        slot_ids = torch.from_numpy(index[ids.numpy()])  # [T, K] index into the host buffers, -1 elsewhere
        return ExpertBatch(buffers, slot_ids, slot_ids, pairs, self.format, on_host=True)

    # -- prefetch setup --------------------------------------------------------------------------------
    def set_predictor(self, predictor: Predictor | None) -> None:
        self.predictor = predictor

    def set_prefetch(self, mode: str, depth: int | None = None, budget: int | None = None) -> None:
        """Change prediction at a safe point (between tokens): in-flight loads finish first."""
        depth = self.prefetch_depth if depth is None else depth
        check_prefetch(mode, depth)
        self._check_prefetch_target(mode)
        self.quiesce()
        self.prefetch_mode, self.prefetch_depth = mode, depth
        if budget is not None:
            self.prefetch_budget = budget
        self._predicted.clear()

    @property
    def prefetching(self) -> bool:
        return self.prefetch_mode != "off" and self.predictor is not None

    # -- the ExpertProvider protocol ---------------------------------------------------------------
    def prepare(self, layer: int, topk_ids: torch.Tensor) -> ExpertBatch:
        """One batch for every requested expert; only when they fit the pool (else use `batches`)."""
        batches = list(self.batches(layer, topk_ids))
        if len(batches) != 1:
            raise RuntimeError(f"layer {layer} needs more experts than the {self.pool.num_slots} slots at once; "
                               "iterate CachedProvider.batches() instead")
        return batches[0]

    def observe(self, layer: int, hidden_states: torch.Tensor) -> None:
        """The residual stream [T, H] entering `layer`'s MoE, before `batches(layer, ...)`: prefetch input."""
        if self.prefetching:
            self._hidden = (layer, hidden_states)

    def batches(self, layer: int, topk_ids: torch.Tensor) -> Iterator[ExpertBatch]:
        ids = topk_ids.cpu() if topk_ids.device.type != "cpu" else topk_ids  # [T, K] host copy: the one sync
        T = ids.shape[0]
        ids_np = ids.numpy()
        if self.recorder is not None:
            self.recorder.record(layer, ids_np, 0 if T > 1 else 1)
        experts = list(dict.fromkeys(ids_np.reshape(-1).tolist()))  # unique, in first-use order
        np.add.at(self.frequency[layer], ids_np.reshape(-1), 1)
        if self.inflight:
            self._reap()
            self._drop_superseded(layer, experts)
        if self.ram_inflight:
            self._settle_ram(layer, experts)
        if self.prefetching:
            self._score_prediction(layer, experts)
            self.predictor.observe_routing(layer, ids_np[-1].tolist())
        if self.on_miss != "load" or self.host_layers:
            with self.store_lock:
                self.store.release_host()  # the previous step's host computations are done
        host = self._host_choice(layer, experts, ids_np)
        if host:
            buffers, index, group, rest = self._pin_host(layer, host)
            if group:
                chosen = set(group)
                experts = [e for e in experts if e not in chosen]
                if self.pool.device.type == "cpu" and len(experts) <= self.pool.num_slots:
                    # The slots and the RAM tier are both host memory: one pass over every expert of the step
                    # wherever it lives (a second pass costs a second round of per-batch work).
                    yield from self._joint(layer, ids_np, experts, buffers, index)
                    return
                # first, so that the host starts on them while the device computes the resident ones
                batch = self._host_batch(ids, buffers, index, group)
                t0 = time.perf_counter()
                yield batch
                if self.pool.device.type == "cpu":  # computed while we were suspended: the host's time
                    dt = time.perf_counter() - t0
                    self.stats.layers[layer].host_seconds += dt
                    if self.cost is not None:
                        self.cost.observe_host(int(batch.pairs.numel()), dt)
                if not experts:
                    self._hidden = None
                    return
        for e in experts:
            self.where_ran[layer, e] |= 1
        C = self.pool.num_slots
        flat = ids.reshape(-1)
        if len(experts) <= C:
            issued = self._make_resident(layer, experts, prefill=T > 1)
            if self._hidden is not None:
                self._prefetch_after(layer, experts)
            if issued and len(issued) < len(experts):
                # The hits compute first, while the misses cross the link; then the compute stream waits for exactly
                # the missed experts' copies and computes them.
                missed = [e for e, _ in issued]
                skip = set(missed)
                yield self._batch(layer, topk_ids, ids, _pairs(flat, [e for e in experts if e not in skip]))
                self._join(layer, issued)
                yield self._batch(layer, topk_ids, ids, _pairs(flat, missed))
                return
            self._join(layer, issued)
            yield self._batch(layer, topk_ids, ids, _pairs(flat, experts) if host else None)
            return
        self._hidden = None  # a chunk that overflows the pool has no slots to spare for prefetching
        # Expert-major groups: resident experts first (no load), then the rest, C at a time.
        host_map = self.pool.host_map[layer]
        experts.sort(key=lambda e: host_map[e] < 0)
        for g in range(0, len(experts), C):
            group = experts[g : g + C]
            self._join(layer, self._make_resident(layer, group, prefill=T > 1))
            yield self._batch(layer, topk_ids, ids, _pairs(flat, group))

    def _joint(self, layer: int, ids_np: np.ndarray, experts: list[int], buffers, index: np.ndarray
               ) -> Iterator[ExpertBatch]:
        """A CPU step with host experts in one pass: `experts` (the rest) made resident, then one batch whose slot
        ids are the slotted experts' slots and C + the RAM-tier index of the pinned host experts."""
        if experts:
            for e in experts:
                self.where_ran[layer, e] |= 1
            self._make_resident(layer, experts, prefill=ids_np.shape[0] > 1)
            if self._hidden is not None:
                self._prefetch_after(layer, experts)
        if self._hidden is not None and self.fast_tier == "ram":
            self._prefetch_ram(layer)
        self._hidden = None
        on_host = index[ids_np]  # [T, K] RAM-tier index, -1 for a slotted expert
        if experts:
            slot_ids = self.pool.host_map[layer][ids_np].astype(np.int64)  # [T, K]
            host_pairs = on_host >= 0
            slot_ids[host_pairs] = on_host[host_pairs] + self.pool.num_slots
        else:
            slot_ids = on_host + self.pool.num_slots
        slot_ids = torch.from_numpy(slot_ids)  # [T, K] virtual slots
        t0 = time.perf_counter()
        yield ExpertBatch(self.pool.buffers, slot_ids, slot_ids, None, self.format, host_tensors=buffers)
        # the host's share of the pass, by pairs (one pass is not timed per expert)
        share = 1.0 if not experts else np.count_nonzero(host_pairs) / host_pairs.size
        self.stats.layers[layer].host_seconds += (time.perf_counter() - t0) * share

    # -- internals -------------------------------------------------------------------------------
    def _batch(self, layer: int, topk_ids: torch.Tensor, ids_cpu: torch.Tensor, pairs) -> ExpertBatch:
        host_slots = torch.from_numpy(self.pool.host_map[layer][ids_cpu.numpy()])  # [T, K] int32, -1 outside group
        if self.pool.device.type == "cpu":
            return ExpertBatch(self.pool.buffers, host_slots, host_slots, pairs, self.format)
        if pairs is None and topk_ids.device.type == self.pool.device.type:
            # every expert of the step is in a slot: the fused kernels read slot_map[layer, topk_ids] themselves
            # (no gather op); map writes after this are stream-ordered behind the layer's kernels
            return ExpertBatch(self.pool.buffers, host_slots, host_slots, None, self.format,
                               slot_map=self.pool.slot_map[layer], topk_ids=topk_ids)
        slot_ids = self.pool.slot_map[layer][topk_ids]  # [T, K] gathered on the device, no sync
        if pairs is not None:
            pairs = pairs.to(self.pool.device)
        return ExpertBatch(self.pool.buffers, slot_ids, host_slots, pairs, self.format)

    def _join(self, layer: int, issued: list[tuple[int, object]]) -> None:
        """The compute stream waits for these experts' copies (their own events: nothing else in flight)."""
        for e, event in issued:
            self.copies.wait(event, (layer, e))

    def _drain(self, key: Key) -> None:
        """A published prefetch no compute has waited for: the compute stream waits for its copy now (it is used,
        or its slot is about to be reused, and a later copy into the slot must not overtake it)."""
        job = self.pending.pop(key, None)
        if job is not None:
            job.wait_device()

    def _make_resident(self, layer: int, experts: list[int], *, prefill: bool) -> list[tuple[int, object]]:
        """Count, pick victims outside `experts`, and load every missing expert of the step: all the victims first,
        then the copies, issued together on the copy stream where there is one. Returns the (expert, event) of
        each copy still in flight, which the caller joins before the expert computes (none on a CPU)."""
        stats = self.stats.layers[layer]
        pool = self.pool
        protected = {(layer, e) for e in experts}
        stall = 0.0
        for key in protected & self.inflight.keys():  # on their way: wait for exactly these
            stall += self._complete(key, needed=True)
        misses = []
        for e in experts:
            key = (layer, e)
            self.policy.access(key)
            if pool.host_map[key] >= 0:
                stats.hits += 1
                if pool.device.type == "cpu":
                    stats.ram_hits += 1  # a slot on a CPU is RAM
                if key in self.prefetched:
                    self.prefetched.discard(key)
                    stats.prefetch_used += 1
                self._drain(key)  # a prefetch this layer uses: wait for its copy (and only then: never unused ones)
            else:
                stats.misses += 1
                misses.append(key)
        if not misses:
            stats.stall_seconds += stall
            return []
        t0 = time.perf_counter()
        slots = [self._claim(key, protected, allow_cancel=True) for key in misses]
        copies = self.copies
        if copies is not None:
            copies.begin()  # after the compute work that may still read the victims' slots
        issued = []
        for key, slot in zip(misses, slots, strict=True):
            tier, nbytes, event = self._fill_slot(key, slot, copies)
            if event is not None:
                issued.append((key[1], event))
            pool.finish_load(slot)  # published now: the batch that reads it waits for the event first
            self.policy.admit(key)
            self._count_bytes(stats, tier, nbytes)
            if pool.device.type == "cpu":
                self._count_tier(stats, key, tier)
            if prefill:
                stats.expert_loads_prefill += 1
            else:
                stats.expert_loads_decode += 1
        dt = time.perf_counter() - t0
        stats.load_seconds += dt
        stats.stall_seconds += dt + stall
        return issued

    def _fill_slot(self, key: Key, slot: int, copies=None) -> tuple[str, int, object]:
        """One expert's bytes into a slot (any thread): ONE copy of its row when the store keeps the slots' layout
        (the RAM tier does), else tensor by tensor. On `copies` the copy is enqueued on the copy stream and its
        event returned; else it is enqueued on the current stream (the compute stream, or a transfer job's)."""
        store, pool = self.store, self.pool
        with self.store_lock:
            got = store.raw_row(*key) if getattr(store, "layout", None) == pool.layout else None
            if got is None:
                tier, nbytes = store.read_into(key[0], key[1], pool.views(slot))
                self.copies_issued += len(pool.buffers)
                return tier, nbytes, None
            row, tier, nbytes = got
            dst = pool.raw_of(slot)  # [slot_bytes]
            event = None
            if copies is not None:
                copies.copy(dst, row)
                event = copies.record(key)
                stream = getattr(copies, "stream", None)
            else:
                dst.copy_(row, non_blocking=True)
                stream = torch.cuda.current_stream(dst.device) if dst.is_cuda else None
            if stream is not None and hasattr(store, "copied_from"):
                store.copied_from(key[0], key[1], stream)  # a refill of that RAM entry waits for this copy
            self.copies_issued += 1
        return tier, nbytes, event

    def _count_tier(self, stats, key: Key, tier: str) -> None:
        """A CPU request: served from RAM, or read from disk (the RAM tier's miss)."""
        if tier == "ram":
            stats.ram_hits += 1
            if key in self.ram_prefetched:
                self.ram_prefetched.discard(key)
                stats.prefetch_used += 1
        else:
            stats.disk_reads += 1
            if key in self.ram_prefetched:  # read ahead, then evicted from the RAM tier before its use
                self.ram_prefetched.discard(key)
                stats.prefetch_wasted += 1

    @staticmethod
    def _count_bytes(stats, tier: str, nbytes: int) -> None:
        if tier == "ram":
            stats.bytes_from_ram += nbytes
        else:
            stats.bytes_from_disk += nbytes

    def _claim(self, key: Key, protected: set[Key], *, allow_cancel: bool) -> int | None:
        """A slot for `key` (state LOADING): a free one, else the policy's victim outside `protected` and
        outside loads in flight. A demand load (`allow_cancel`) cancels prefetches rather than fail; a
        prefetch gets None when there is nothing it may evict."""
        pool = self.pool
        while not pool.has_free():
            try:
                victim = self.policy.victim(protected | self.inflight.keys() if self.inflight else protected)
            except RuntimeError:
                if not allow_cancel:
                    return None  # nothing a prefetch may evict
                if not self.inflight:
                    raise
                self._cancel_inflight()  # loads in flight hold the slots this step needs: give them up
                continue
            slot = pool.slot_of(*victim)
            self._drain(victim)
            pool.release(slot)
            self.policy.evict(victim)
            if victim in self.prefetched:
                self.prefetched.discard(victim)
                self.stats.layers[victim[0]].prefetch_wasted += 1
            return pool.begin_load(*key, slot=slot)
        return pool.begin_load(*key)

    # -- prefetch ----------------------------------------------------------------------------------------
    def _score_prediction(self, layer: int, experts: list[int]) -> None:
        predicted = self._predicted.pop(layer, None)
        if predicted is None:
            return
        s = self.stats.layers[layer]
        s.predicted += len(predicted)
        s.predicted_correct += len(predicted.intersection(experts))
        s.routed += len(experts)

    def _prefetch_after(self, layer: int, experts: list[int]) -> None:
        """Layer `layer`'s experts are resident: queue the predicted misses of the next layers."""
        if self.fast_tier == "ram":  # a CPU computing misses in place: read ahead into the RAM tier, not slots
            self._prefetch_ram(layer)
            self._hidden = None
            return
        source, hidden = self._hidden
        self._hidden = None
        if source != layer:
            return
        predictor = self.predictor
        budget = self.prefetch_budget or predictor.top_k
        if hidden.shape[0] > 1:  # a prefill chunk will load most of its experts anyway: predict them all
            budget *= hidden.shape[0]
        protected = {(layer, e) for e in experts}
        plan = []
        for target in predictor.targets(layer, self.prefetch_depth):
            predicted = predictor.predict(self.prefetch_mode, target, hidden, budget)
            self._predicted[target] = set(predicted)
            protected.update((target, e) for e in predicted)
            plan.extend((target, e) for e in predicted)
        host_map = self.pool.host_map
        for key in plan:
            if host_map[key] >= 0 or key in self.inflight or key[0] in self.host_layers:
                continue
            slot = self._claim(key, protected, allow_cancel=False)
            if slot is None:
                return  # every slot is needed now or already loading: prefetch no further
            self.policy.admit(key)
            self.prefetched.add(key)
            self.stats.layers[key[0]].prefetch_issued += 1
            job = Job(key, slot, partial(self._load_bytes, key, slot))
            self.inflight[key] = job
            self.transfer.submit(job)

    def _load_bytes(self, key: Key, slot: int) -> tuple[str, int]:
        """A transfer job's work (any thread): the expert's bytes into the slot, on the job's stream."""
        return self._fill_slot(key, slot)[:2]

    def _complete(self, key: Key, *, needed: bool = False) -> float:
        """Wait for the load of `key` and publish its slot (or free it if the job never ran or failed)."""
        job = self.inflight.pop(key)
        late = not job.done()
        waited = job.wait()
        if needed and late:
            self.stats.layers[key[0]].prefetch_late += 1
        self._settle(job)
        return waited

    def _settle(self, job: Job) -> None:
        key = job.key
        if job.state == DONE:
            if job._copy_event is not None:
                self.pending[key] = job  # waited for by the first layer that uses it, never by another
            self.pool.finish_load(job.slot)
            tier, nbytes = job.result
            self._count_bytes(self.stats.layers[key[0]], tier, nbytes)
            return
        # Cancelled, or failed (a read error): the slot is given back; a demand load re-reads and reports.
        self.pool.release(job.slot)
        self.policy.evict(key)
        if key in self.prefetched:
            self.prefetched.discard(key)
            self.stats.layers[key[0]].prefetch_wasted += 1

    def _reap(self) -> None:
        """Publish prefetches that have finished (no waiting)."""
        for key, job in list(self.inflight.items()):
            if job.done():
                del self.inflight[key]
                self._settle(job)

    def _drop_superseded(self, layer: int, experts: list[int]) -> None:
        """`layer` has routed without these queued prefetches: cancel the ones that have not started (their
        slots go back; they count as wasted) so the worker moves on to what the next layers need."""
        needed = set(experts)
        for key, job in list(self.inflight.items()):
            if key[0] == layer and key[1] not in needed and job.cancel():
                del self.inflight[key]
                self._settle(job)

    # -- prefetch into the RAM tier (a CPU computing misses in place, the RAM tier bounded) ---------------------
    def _prefetch_ram(self, layer: int) -> None:
        """Queue disk reads of the experts the next layers are predicted to use into the RAM tier (no slot: on a
        CPU the RAM tier is where they are computed). The read holds the store's lock; the forward thread only
        computes from entries it pinned, which a read never evicts."""
        source, hidden = self._hidden
        if source != layer or self._all_in_ram():
            return
        predictor = self.predictor
        budget = (self.prefetch_budget or predictor.top_k) * max(hidden.shape[0], 1)
        entry = self.store.entry
        room = max(getattr(self.store, "capacity", 0) - 2, 0)  # leave the entries this step's reads pass through
        issued = 0
        for target in predictor.targets(layer, self.prefetch_depth):
            predicted = predictor.predict(self.prefetch_mode, target, hidden, budget)
            self._predicted[target] = set(predicted)
            for e in predicted:
                key = (target, e)
                if key in entry or key in self.ram_inflight or issued >= room:
                    continue
                job = Job(key, -1, partial(self._ram_read, key))
                self.ram_inflight[key] = job
                self.ram_prefetched.add(key)
                self.stats.layers[target].prefetch_issued += 1
                self.transfer.submit(job)
                issued += 1

    def _ram_read(self, key: Key) -> tuple[str, int]:
        with self.store_lock:
            return self.store.read_into(key[0], key[1], {})

    def _settle_ram(self, layer: int, experts: list[int]) -> None:
        """Before `layer` computes: its predicted reads that have not started are cancelled (this step reads them
        itself), the running ones waited for (late: the wait is stall time); finished reads of any layer counted."""
        needed = set(experts)
        for key, job in list(self.ram_inflight.items()):
            if key[0] == layer:
                if job.cancel():
                    self.ram_prefetched.discard(key)
                    if key[1] not in needed:
                        self.stats.layers[layer].prefetch_wasted += 1
                elif key[1] in needed:
                    late = not job.done()
                    waited = job.wait()
                    if late:
                        self.stats.layers[layer].prefetch_late += 1
                        self.stats.layers[layer].stall_seconds += waited
            if job.done():
                del self.ram_inflight[key]
                if job.state == DONE:
                    if job.result[0] != "ram":  # a read that found its expert already there moved nothing
                        self._count_bytes(self.stats.layers[key[0]], *job.result)
                else:
                    self.ram_prefetched.discard(key)

    def _cancel_inflight(self) -> None:
        for job in list(self.inflight.values()):
            job.cancel()
        for key in list(self.inflight):
            self._complete(key)

    def quiesce(self) -> None:
        """Stop prefetching: cancel queued loads, wait for the running one, stop the worker, settle slots.

        Called when generation ends or is cancelled and before any retuning: afterwards no thread works
        on the cache and every slot is FREE or READY.
        """
        self.transfer.quiesce()
        for key in list(self.inflight):
            self._complete(key)
        for key, job in list(self.ram_inflight.items()):
            job.wait()
            del self.ram_inflight[key]
            if job.state == DONE:
                if job.result[0] != "ram":
                    self._count_bytes(self.stats.layers[key[0]], *job.result)
            else:
                self.ram_prefetched.discard(key)
        self._hidden = None

    def close(self) -> None:
        self.quiesce()
        self.transfer.close()

    # -- warm start ----------------------------------------------------------------------------------
    def warm(self, counts: np.ndarray) -> int:
        """Fill free slots with the most used experts of a saved profile [L, E]; returns how many loaded."""
        pool = self.pool
        flat = np.asarray(counts, dtype=np.float64).reshape(-1)
        free = pool.num_slots - pool.used
        keys: list[Key] = []
        for idx in np.argsort(-flat, kind="stable"):  # most used first
            if flat[idx] <= 0 or len(keys) >= free:
                break
            key = divmod(int(idx), pool.num_experts)  # (layer, expert)
            if pool.host_map[key] < 0 and key not in self.inflight:
                keys.append(key)
        for key in reversed(keys):  # least used first, so recency-based policies rank the most used highest
            slot = pool.begin_load(*key)
            with self.store_lock:
                self.store.read_into(key[0], key[1], pool.views(slot))
            pool.finish_load(slot)
            self.policy.admit(key)
        self.warm_loaded += len(keys)
        return len(keys)

    def warm_start(self, counts: np.ndarray) -> int:
        """The start of a run: warm the tier hits come from. On a CPU computing misses in place the slots are never
        filled by a miss, so the RAM tier is warmed instead (nothing to do when every expert is in RAM)."""
        return self._warm_ram(counts) if self.fast_tier == "ram" else self.warm(counts)

    def _warm_ram(self, counts: np.ndarray) -> int:
        """Read the most used experts of a profile from disk into the bounded RAM tier (all but one entry)."""
        if self._all_in_ram():
            return 0
        flat = np.asarray(counts, dtype=np.float64).reshape(-1)
        room = max(getattr(self.store, "capacity", 0) - 1, 0)  # one entry stays free for the first reads
        keys: list[Key] = []
        for idx in np.argsort(-flat, kind="stable"):
            if flat[idx] <= 0 or len(keys) >= room:
                break
            keys.append(divmod(int(idx), self.pool.num_experts))
        with self.store_lock:
            for key in reversed(keys):  # least used first: recency-based policies rank the most used highest
                self.store.read_into(key[0], key[1], {})
        self.warm_loaded += len(keys)
        return len(keys)

    # -- live retuning (between tokens, from the thread that drives generation) ------------------------
    def resize(self, num_slots: int) -> None:
        """A new pool of num_slots slots; the experts the policy ranks highest are carried over."""
        self.quiesce()
        pool = self.pool
        num_slots = max(1, min(num_slots, pool.num_layers * pool.num_experts))
        if num_slots == pool.num_slots:
            return
        for key in list(self.pending):
            self._drain(key)
        new = SlotPool(num_slots, pool.num_layers, pool.num_experts, pool.layout.shapes, pool.device)
        keep = self._ranked_resident()[:num_slots]
        for key in keep:
            slot = new.begin_load(*key)
            new.raw_of(slot).copy_(pool.raw_of(pool.slot_of(*key)))
            new.finish_load(slot)
        self.pool = new
        self.prefetched.intersection_update(keep)
        self._reset_policy(self.policy.name, keep)

    def set_policy(self, name: str) -> None:
        self.quiesce()
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
