"""Prefetch into the slots: predicted experts claimed and loaded by the transfer engine before a layer asks.

Prefetch (engine/cache/prefetch.py predicts, engine/cache/transfer.py moves the bytes): the model hands the
provider the residual stream entering each MoE layer (`observe`); once layer l's experts are resident and before
they compute, the predictor names the experts of layers l+1..l+depth, and those not in a slot are claimed (LOADING)
and queued on the transfer engine. A prefetch never evicts an expert of the current layer or another predicted one,
never takes a slot that is loading, and at most `prefetch_budget` are issued per predicted layer per step. When a
layer asks for an expert that is still loading it waits for that load only (the wait is stall time); a hit is a
request whose expert was in a slot or on its way, a miss a load the forward pass had to issue itself (a demand
miss). Only the forward thread claims, publishes or gives back a slot; a transfer job only writes the bytes of the
slot it was given. A mixin of `CachedProvider` (core.py), which holds the state.
"""

from __future__ import annotations

from functools import partial

from ..prefetch import Predictor, check_prefetch
from ..transfer import DONE, Job

Key = tuple[int, int]


class SlotPrefetch:
    """`CachedProvider`'s prefetch setup and the life of a prefetch job: issue, wait, publish or give back."""

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

    def _cancel_inflight(self) -> None:
        for job in list(self.inflight.values()):
            job.cancel()
        for key in list(self.inflight):
            self._complete(key)
