"""Hybrid execution: misses computed on the host, from the RAM tier's own buffers, instead of loaded into a slot.

`--on-miss host` computes every miss there, `auto` asks `MissCostModel` (engine/cache/hybrid.py) per expert whether a
copy over the link or a pass over RAM is cheaper, and `host_layers` keep all their experts on the host. The cost
model's host rates are timed on one expert of the RAM tier when the provider is built (`calibrate_host`). On a CPU
that computes misses in place the RAM tier is the fast tier: prefetch reads predicted experts from disk into it, and
a warm start fills it, rather than the slots. A mixin of `CachedProvider` (core.py), which holds the state.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial

import numpy as np
import torch

from ...layers.moe import ExpertBatch
from ..hybrid import REUSE_HORIZON, MissCostModel, check_on_miss
from ..transfer import DONE, Job

Key = tuple[int, int]


def _cost_model(store, args, device: torch.device, link_gbps: float | None) -> MissCostModel | None:
    """The auto mode's numbers: host rates timed on one expert of the RAM tier now, the link probed."""
    if not hasattr(store, "host_slot"):
        return None  # no RAM tier to compute from: every miss loads
    flops = 2.0 * (3 if args.gated_experts else 2) * args.hidden_size * args.moe_intermediate  # ungated: up, down
    host_gbps, host_gflops = calibrate_host(store, args)
    same = device.type == "cpu"
    if not same and link_gbps is None:
        from ..hybrid import ASSUMED_LINK_GBPS

        link_gbps = ASSUMED_LINK_GBPS
    return MissCostModel(store.expert_bytes, flops, None if same else link_gbps, host_gbps, host_gflops,
                         device_gbps=None if same else 1000.0, device_gflops=None if same else 50_000.0)


def calibrate_host(store, args, reps: int = 3) -> tuple[float, float]:
    """Effective host GB/s (packed bytes read while computing one token) and GFLOP/s (a 16-token chunk), timed on
    the first expert the RAM tier holds."""
    from ...layers.experts import _expert
    from ...layers.moe import RELU2, SWIGLU

    layer = next(iter(getattr(store, "tensors", {0: None})))
    got = store.host_slot(layer, 0)
    store.release_host()
    if got is None:
        return 20.0, 100.0
    buffers, idx, _, _ = got
    view = {name: t[idx] for name, t in buffers.items()}
    dtype = next((t.dtype for t in view.values() if t.is_floating_point() and t.dtype.itemsize >= 2), torch.float32)
    flops = 2.0 * (3 if args.gated_experts else 2) * args.hidden_size * args.moe_intermediate
    act = SWIGLU if args.gated_experts else RELU2  # an ungated expert's w13 is up alone: timed as it runs
    best = {}
    for n in (1, 16):
        x = torch.randn(n, args.hidden_size, dtype=dtype)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            _expert(x, store.format, view, act)
            times.append(time.perf_counter() - t0)
        best[n] = min(times)
    t1, t16 = best[1], best[16]
    per_token = max((t16 - t1) / 15, 1e-9)
    gflops = flops / per_token / 1e9
    fixed = max(t1 - per_token, t1 * 0.5)
    return store.expert_bytes / fixed / 1e9, gflops


class HostCompute:
    """`CachedProvider`'s misses on the host and its RAM-tier read-ahead."""

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
            from ...errors import ConfigError
            from ..prefetch import nothing_to_prefetch

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
