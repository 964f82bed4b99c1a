"""`DeviceResidentProvider`: the zero-copy protocol, the MoE half of the device-resident decode step (issue 32).

A decode step through it makes no host read inside it. Each MoE layer's `batches(layer, topk_ids)`:

    record[layer, :T] = topk_ids                   # the routing record [L, T_max, K] on the device
    slot_ids = residency.map[layer][topk_ids]      # [T, K] slot s, or C + host index (engine/cache/residency.py)
    -> MapBatch(slot buffers, RAM-tier buffers, slot_ids)   # computed by engine/layers/moe_device.py

After the last MoE layer the record goes to the host in ONE copy (non-blocking into pinned memory on CUDA), and
between tokens `finish_step()` reads it and runs, layer by layer in the step's order, the admission and eviction
`CachedProvider` runs in a decode step today: the same policy calls (access every request, a victim outside the
layer's own experts, admit what is loaded), the same counters (hits, misses, bytes, loads, the heatmap's frequency
and where-ran, the trace recorder), the same hybrid choice (`--on-miss host / auto`, host layers stay on the host).
A request is a hit when the step read its expert from a slot, a miss when it read it from the RAM tier, which is what
the UI's hit rate then says. Fills are issued on the copy stream after the compute that may still read the victims'
slots; the map is published on the same stream after them, and the compute stream waits for that event, so the
next step sees the new slots only once their bytes are in. On a CPU the copies are plain and in order.

With every miss loaded after the step instead of before its layer, the slots hold after each token exactly what
`CachedProvider` would hold (tests/engine/test_device_step_protocol.py): same policy state, one token later for
the bytes. Prefill chunks (T > `max_tokens`) take `CachedProvider`'s path unchanged and the map is rebuilt after
each; prefetch, which predicts inside the step from the host, is refused (`device_step_reason`). A disk tier cannot
be read by a kernel: a store without every expert in RAM is refused too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import torch

from ...errors import ConfigError
from ...layers.moe import ExpertBatch
from ...layers.moe_device import MapBatch
from ..residency import ResidencyMap, host_index, host_mapped, unsupported_reason
from .core import CachedProvider

Key = tuple[int, int]
PREFETCH_REASON = ("prefetch predicts the next layers' experts on the host inside the step; the device-resident "
                   "step does not yet: use --prefetch off with it, or keep the cached step")


def device_step_reason(provider: CachedProvider) -> str | None:
    """None when this cached provider's set-up can run the device-resident step; else why not, in one line."""
    reason = unsupported_reason(provider.store, provider.pool)
    if reason is None and provider.prefetch_mode != "off":
        reason = PREFETCH_REASON
    return reason


class DeviceResidentProvider(CachedProvider):
    """The ExpertProvider whose decode batches are looked up on the device (see the module docstring)."""

    def __init__(self, pool, store, policy, recorder=None, *, transfer=None, copies=None, max_tokens: int = 1):
        reason = unsupported_reason(store, pool)
        if reason is not None:
            raise ConfigError(reason)
        super().__init__(pool, store, policy, recorder, transfer=transfer, copies=copies)
        self.max_tokens = max_tokens  # T_max: steps of up to this many tokens take the device path
        self.residency = ResidencyMap(pool, host_index(store, pool.num_layers, pool.num_experts))
        self._attach(store)
        self._record: torch.Tensor | None = None  # [L, T_max, K] int64 on the device
        self._record_host: torch.Tensor | None = None  # [L, T_max, K] pinned on CUDA: the one copy's target
        self._copied = None  # CUDA: the event of this step's record copy
        self._step_layers: list[int] = []  # MoE layers of the step not yet settled, in order
        self._step_tokens = 0
        self.steps_settled = 0

    @property
    def store(self):
        return self._store

    @store.setter
    def store(self, store) -> None:
        """A new RAM tier (a retune): kept only when the map can cover it; else a ConfigError saying why."""
        if hasattr(self, "residency"):
            reason = unsupported_reason(store, self.pool)
            if reason is not None:
                raise ConfigError(f"the device-resident MoE step cannot use this RAM tier: {reason}")
            self._store = store
            self._attach(store)
        else:
            self._store = store  # CachedProvider.__init__'s

    def _attach(self, store) -> None:
        """The host side of the map: each MoE layer's RAM-tier buffers by name [E, ...], readable by the device
        (host-mapped on CUDA), and the map rebuilt over them."""
        pool = self.pool
        self.host_views = {layer: pool.layout.views(host_mapped(raw, pool.device)) for layer, raw in store.raw.items()}
        self.last_moe_layer = max(store.raw)
        self.residency.index = host_index(store, pool.num_layers, pool.num_experts)
        self.residency.rebuild(pool)

    @classmethod
    def from_cached(cls, cached: CachedProvider, max_tokens: int = 1) -> DeviceResidentProvider:
        """The same pool, store, policy, recorder, transfer and hybrid set-up behind the device-resident step;
        ConfigError (saying why) where it cannot run it."""
        reason = device_step_reason(cached)
        if reason is not None:
            raise ConfigError(reason)
        cached.quiesce()
        provider = cls(cached.pool, cached.store, cached.policy, cached.recorder, transfer=cached.transfer,
                       copies=cached.copies, max_tokens=max_tokens)
        provider.predictor = cached.predictor
        provider.set_hybrid(cached.on_miss, cached.host_layers, cached.cost)
        return provider

    # -- the ExpertProvider protocol ---------------------------------------------------------------
    def batches(self, layer: int, topk_ids: torch.Tensor) -> Iterator[ExpertBatch]:
        T = topk_ids.shape[0]
        if T > self.max_tokens or topk_ids.device != self.pool.device:
            # a prefill chunk: CachedProvider's path (it reads the ids on the host; a prefill is not the graph step)
            self.finish_step()
            yield from super().batches(layer, topk_ids)
            self.residency.rebuild(self.pool)  # on the compute stream, after what read the old map
            return
        if layer in self._step_layers:  # a new step began and nobody settled the last one: settle it first
            self.finish_step()
        self._step_layers.append(layer)
        self._step_tokens = T
        record = self._record_for(topk_ids)
        record[layer, :T].copy_(topk_ids)  # no host read: the host reads the whole record once, after the step
        row = self.residency.map[layer]  # [E] int32
        yield MapBatch(self.pool.buffers, row[topk_ids], None, None, self.format,
                       host_tensors=self.host_views.get(layer), topk_ids=topk_ids, num_slots=self.pool.num_slots,
                       residency=row)
        if layer == self.last_moe_layer and self._record_host is not None:
            # the step's routing leaves for the host now, under the step's remaining work (lm_head, sampling)
            self._record_host.copy_(record, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.pool.device))

    def _record_for(self, topk_ids: torch.Tensor) -> torch.Tensor:
        K = topk_ids.shape[1]
        if self._record is None or self._record.shape[2] != K:
            shape = (self.pool.num_layers, self.max_tokens, K)
            self._record = torch.zeros(shape, dtype=topk_ids.dtype, device=self.pool.device)  # [L, T_max, K]
            if self.pool.device.type == "cuda":
                self._record_host = torch.zeros(shape, dtype=topk_ids.dtype, pin_memory=True)  # [L, T_max, K]
        return self._record

    # -- between tokens ------------------------------------------------------------------------------
    def finish_step(self) -> None:
        """Settle the last device-resident step (a no-op when there is none): read its routing (the one host read),
        admit and evict layer by layer, fill slots, publish the residency map ordered after the fills."""
        if not self._step_layers:
            return
        layers, T = self._step_layers, self._step_tokens
        self._step_layers = []
        if self._record_host is not None:
            if self._copied is None:  # the step ended before its last MoE layer (a cancelled forward)
                self._record_host.copy_(self._record)  # blocking: nothing to overlap with
            else:
                self._copied.synchronize()
            ids = self._record_host.numpy()  # [L, T_max, K]
        else:
            ids = self._record.numpy()  # a CPU: the record is host memory
        self._copied = None
        was = self.pool.host_map.copy()  # [L, E] where each expert was while the step read it
        copies = self.copies
        if copies is not None:
            copies.begin()  # fills and the map wait for the step's compute (it may still read victims' slots)
        changed: list[Key] = []
        for layer in layers:
            changed += self._admit(layer, ids[layer, :T], was[layer], copies)
        if changed:
            self.residency.update(self.pool, changed)
            self.residency.publish(getattr(copies, "stream", None))
            if copies is not None:
                copies.wait(copies.record("residency"), "residency")  # the next step's compute waits for both
        self.steps_settled += 1

    def _admit(self, layer: int, ids_np: np.ndarray, was: np.ndarray, copies) -> list[Key]:
        """One layer of a settled step: CachedProvider's counting, hybrid choice and demand loads, by the step's
        routing; returns the keys whose residency changed (loaded and evicted)."""
        T = ids_np.shape[0]
        stats = self.stats.layers[layer]
        pool = self.pool
        if self.recorder is not None:
            self.recorder.record(layer, ids_np, 0 if T > 1 else 1)
        experts = list(dict.fromkeys(ids_np.reshape(-1).tolist()))  # unique, in first-use order
        np.add.at(self.frequency[layer], ids_np.reshape(-1), 1)
        host = self._host_choice(layer, experts, ids_np)  # misses that stay on the host (none in load mode)
        if host:
            _, _, group, _ = self._pin_host(layer, host)  # counted as today's host-computed misses
            chosen = set(group)
            experts = [e for e in experts if e not in chosen]
        cpu = pool.device.type == "cpu"
        loads = []
        for e in experts:
            key = (layer, e)
            self.where_ran[layer, e] |= 1
            self.policy.access(key)
            if was[e] >= 0:
                stats.hits += 1
            else:
                stats.misses += 1
            if cpu:
                stats.ram_hits += 1  # a CPU read it from RAM either way (a slot or the RAM tier)
            if pool.host_map[key] < 0:
                loads.append(key)
        changed: list[Key] = []
        t0 = time.perf_counter()
        protected = {(layer, e) for e in experts}
        for key in loads:
            slot = self._claim_slot(key, protected, changed)
            if slot is None:
                break  # every slot holds an expert of this layer: the rest stay in the RAM tier (read over the link)
            tier, nbytes, _ = self._fill_slot(key, slot, copies)
            pool.finish_load(slot)
            self.policy.admit(key)
            self._count_bytes(stats, tier, nbytes)
            if T > 1:
                stats.expert_loads_prefill += 1
            else:
                stats.expert_loads_decode += 1
            changed.append(key)
        stats.load_seconds += time.perf_counter() - t0
        return changed

    def _claim_slot(self, key: Key, protected: set[Key], changed: list[Key]) -> int | None:
        """A free slot, else the policy's victim outside `protected` (evicted, its key added to `changed`); None when
        every resident expert is protected."""
        pool = self.pool
        if pool.has_free():
            return pool.begin_load(*key)
        try:
            victim = self.policy.victim(protected)
        except RuntimeError:
            return None
        slot = pool.slot_of(*victim)
        pool.release(slot)
        self.policy.evict(victim)
        changed.append(victim)
        return pool.begin_load(*key, slot=slot)

    # -- safe points: every change of the pool settles the step first and rebuilds the map after ---------------
    def quiesce(self) -> None:
        self.finish_step()
        super().quiesce()

    def resize(self, num_slots: int) -> None:
        super().resize(num_slots)  # quiesces first
        self.residency.rebuild(self.pool)  # on the compute stream, after what read the old map

    def set_hybrid(self, on_miss: str, host_layers=(), cost=None) -> None:
        super().set_hybrid(on_miss, host_layers, cost)
        self.residency.rebuild(self.pool)  # on the compute stream, after what read the old map

    def set_prefetch(self, mode: str, depth: int | None = None, budget: int | None = None) -> None:
        if mode != "off":
            raise ConfigError(PREFETCH_REASON)
        super().set_prefetch(mode, depth, budget)

    def warm(self, counts: np.ndarray) -> int:
        n = super().warm(counts)
        self.residency.rebuild(self.pool)  # on the compute stream, after what read the old map
        return n


def device_step_or_reason(provider: CachedProvider) -> tuple[CachedProvider, str | None]:
    """The device-resident provider over this cached provider's parts, or the provider itself and a notice saying
    why the device-resident step is off (never silently)."""
    reason = device_step_reason(provider)
    if reason is not None:
        return provider, f"device-resident MoE step off: {reason}"
    return DeviceResidentProvider.from_cached(provider), None
