"""`CachedProvider`: the ExpertProvider over a fixed slot pool, an eviction policy and a tiered store.

`batches(layer, topk_ids)` reads the routing to the host once (the one sync a layer makes),
deduplicates the experts, counts hits and misses, picks victims through the policy (never an expert the
current step needs), copies the misses in from RAM or disk, and yields `ExpertBatch`es whose slot ids
the expert compute uses. When a prefill chunk needs more distinct experts than there are slots (C may
be 1), it yields them expert-major in groups of at most C: load a group, let every token routed to it
compute, move on. Each needed expert is loaded at most once per layer per chunk either way, so a
512-token chunk of Qwen3-30B-A3B moves <= 128 experts per layer instead of 512 x 8.

The pieces beside the slots live in sibling modules, as mixins of the one class: misses computed on the host
(`host.py`), prefetch into the slots (`prefetching.py`) and the snapshot (`snapshot.py`). Only the forward thread
changes the slot pool and the policy; a transfer job only writes the bytes of a slot it was given.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import torch

from ...layers.moe import ExpertBatch
from ...quant.dense import DENSE
from ..hybrid import MissCostModel
from ..policy import EvictionPolicy, make_policy
from ..prefetch import Predictor
from ..slots import SlotPool
from ..stats import CacheStats
from ..transfer import DONE, InlineTransfer, Job, make_copy_stream
from .host import HostCompute
from .prefetching import SlotPrefetch
from .snapshot import Snapshots

Key = tuple[int, int]


def _pairs(flat: torch.Tensor, experts: list[int]) -> torch.Tensor:
    """The flat (t, k) pairs [P] routed to any of `experts`."""
    return torch.nonzero(torch.isin(flat, torch.tensor(experts, dtype=flat.dtype))).reshape(-1)


class CachedProvider(HostCompute, SlotPrefetch, Snapshots):
    """The ExpertProvider over a slot pool (see the module docstring). Every attribute is set here; the mixins
    (host.py, prefetching.py, snapshot.py) only add methods over this state."""

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
