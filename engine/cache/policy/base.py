"""The eviction policy interface (`EvictionPolicy`) and the machinery the policies share.

The slot pool owns the slots; a policy only ranks keys. For each step the pool calls `access(key)`
once per requested key (hit or miss, in order), then for each miss `victim(protected)` when full,
`evict(victim)` and `admit(key)`. Time is the count of `access` calls; recency is a key's last access.
`victim()` never changes what the policy believes. Pure Python and numpy, so `bench/replay.py` runs
these very classes over real routing traces.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Collection, Hashable

Key = tuple[int, int]  # (layer, expert)


class EvictionPolicy(ABC):
    """Ranks resident keys; the pool asks it for a victim on a miss when every slot is taken.

    Recency is the time of a key's last access, so a miss filled after the other keys of its step were
    accessed still ranks by when it was asked for; a key admitted without an access (a prefetch) counts
    as used when admitted. `capacity` is the pool's slot count; policies that size internal lists by it
    (ARC) learn it as the most keys ever resident when not given (the pool fills up before it evicts).
    """

    name: str = ""

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self._now = 0  # access calls so far: the policy's time
        self._clock = 0  # accesses and admissions: orders recency without ties
        self._missed: dict[Key, tuple[int, int]] = {}  # accessed while not resident -> (now, clock) then
        self._layer: int | None = None  # layer of the latest access

    @abstractmethod
    def access(self, key: Key) -> None:
        """`key` was requested now (hit or miss); called before `admit` on a miss."""

    @abstractmethod
    def admit(self, key: Key) -> None:
        """`key` became resident."""

    @abstractmethod
    def evict(self, key: Key) -> None:
        """`key` stopped being resident (chosen as a victim, or invalidated by the pool)."""

    @abstractmethod
    def victim(self, protected: Collection[Key]) -> Key:
        """The resident key to evict, never one in `protected`; RuntimeError if all are protected."""

    @abstractmethod
    def resident(self) -> set[Key]:
        """The keys the policy believes are resident."""

    def scores(self) -> dict[Key, float]:
        """Rank value per resident key (higher = kept longer), for heatmaps."""
        return {}

    def __len__(self) -> int:
        return len(self.resident())

    # -- helpers for subclasses --------------------------------------------------------------------
    def _tick_access(self, key: Key, resident: bool) -> int:
        """Advance time for an access; returns its clock."""
        self._now += 1
        self._clock += 1
        self._layer = key[0]
        if not resident:
            self._missed[key] = (self._now, self._clock)
        return self._clock

    def _tick_admit(self, key: Key) -> tuple[int, int]:
        """(now, clock) of the use an admission stands for: the access that missed, else this admission."""
        self._clock += 1
        return self._missed.pop(key, (self._now, self._clock))

    def _no_victim(self, protected: Collection[Key]) -> RuntimeError:
        return RuntimeError(f"{self.name}: no victim: all {len(self)} resident keys are protected "
                            f"({len(protected)} protected); the step needs more slots than the pool has")

    def _check_admit(self, key: Key, resident: Collection) -> None:
        if key in resident:
            raise ValueError(f"{self.name}: admit({key}): already resident")

    def _check_evict(self, key: Key, resident: Collection) -> None:
        if key not in resident:
            raise ValueError(f"{self.name}: evict({key}): not resident")


class _RecencyList:
    """Keys in order of last use (an OrderedDict of clocks): the container of LRU."""

    def __init__(self) -> None:
        self.rank: OrderedDict[Key, int] = OrderedDict()  # key -> clock of last use, oldest first

    def __contains__(self, key) -> bool:
        return key in self.rank

    def __len__(self) -> int:
        return len(self.rank)

    def set(self, key: Key, clock: int) -> None:
        """Place `key` as used at `clock`: at the end, before any key of its step used later (K - 1 at most)."""
        order = self.rank
        order.pop(key, None)
        newer = []
        for k in reversed(order):
            if order[k] <= clock:
                break
            newer.append(k)
        order[key] = clock
        for k in reversed(newer):
            order.move_to_end(k)

    def remove(self, key: Key) -> None:
        del self.rank[key]

    def min_excluding(self, protected: Collection) -> tuple | None:
        for key, clock in self.rank.items():  # oldest first; stops after at most |protected| + 1 keys
            if key not in protected:
                return (clock,), key
        return None

    def items(self):
        return ((k, (c,)) for k, c in self.rank.items())


class _LazyHeap:
    """Min-heap of `(rank, key)` where a key's rank can change: stale entries are skipped, not removed.

    `rank[key]` is the current rank of each member; an entry is live iff it carries that rank. Ranks
    are unique per key over time (they end with a clock), so a stale entry never looks live.
    """

    def __init__(self) -> None:
        self.rank: dict[Hashable, tuple] = {}
        self._heap: list[tuple[tuple, Hashable]] = []

    def __contains__(self, key) -> bool:
        return key in self.rank

    def __len__(self) -> int:
        return len(self.rank)

    def set(self, key, rank: tuple) -> None:
        self.rank[key] = rank
        heapq.heappush(self._heap, (rank, key))
        if len(self._heap) > 4 * len(self.rank) + 64:  # compact: memory stays O(members)
            self._heap = [(r, k) for k, r in self.rank.items()]
            heapq.heapify(self._heap)

    def remove(self, key) -> None:
        del self.rank[key]

    def min_excluding(self, protected: Collection) -> tuple | None:
        """(rank, key) of the lowest-ranked member not in `protected`, or None; O((1 + |protected|) log n)."""
        heap, rank = self._heap, self.rank
        held = []
        found = None
        while heap:
            r, k = heap[0]
            if rank.get(k) != r:
                heapq.heappop(heap)  # stale: dropping it changes nothing the policy believes
            elif k in protected:
                held.append(heapq.heappop(heap))
            else:
                found = (r, k)
                break
        for entry in held:
            heapq.heappush(heap, entry)
        return found

    def items(self):
        return self.rank.items()


class _RankedPolicy(EvictionPolicy):
    """Evicts the resident key of lowest rank; ranks end with the clock of last use (the tie-break).

    `layered=True` sizes a pool over all layers per layer: each layer seen gets an equal share,
    C / layers, and a miss evicts the lowest-ranked key of its own layer while that layer holds its
    share, else the lowest-ranked key of a layer above its share, else any. The pool then acts like one
    cache per layer without being told the layer count or the capacity (both learnt), and a step that
    needs more than its layer's share borrows slots. Why: the engine runs the layers in a cycle, so in
    one global ranking the keys of the layer that just ran look fresh and those of the next layer,
    needed first, look stale; within one layer every key's next possible use is equally far away, so
    ranks compare like with like. Per-layer caches beat a global one on both shared traces.
    """

    _container = _LazyHeap
    supports_layered = True

    def __init__(self, capacity: int | None = None, layered: bool = False):
        super().__init__(capacity)
        self.layered = layered
        self._groups: dict[int, _LazyHeap | _RecencyList] = {}  # layer (or 0) -> resident keys by rank
        self._n = 0
        self._max_resident = 0
        self._layers_seen: set[int] = set()
        if layered:
            self.name = f"{self.name}-layered"

    def _group(self, key: Key):
        g = key[0] if self.layered else 0
        c = self._groups.get(g)
        if c is None:
            c = self._groups[g] = self._container()
        return c

    def _is_resident(self, key: Key) -> bool:
        c = self._groups.get(key[0] if self.layered else 0)
        return c is not None and key in c

    def _rerank(self, key: Key, rank) -> None:
        self._group(key).set(key, rank)

    def _add(self, key: Key, rank) -> None:
        c = self._group(key)
        c.set(key, rank)
        self._n += 1
        self._max_resident = max(self._max_resident, self._n)
        self._layers_seen.add(key[0])

    def _check_new(self, key: Key) -> None:
        if self._is_resident(key):
            raise ValueError(f"{self.name}: admit({key}): already resident")

    def evict(self, key: Key) -> None:
        if not self._is_resident(key):
            raise ValueError(f"{self.name}: evict({key}): not resident")
        self._group(key).remove(key)
        self._n -= 1

    def victim(self, protected: Collection[Key]) -> Key:
        if not self.layered:
            c = self._groups.get(0)
            found = c.min_excluding(protected) if c is not None else None
        else:
            found = self._layered_victim(protected)
        if found is None:
            raise self._no_victim(protected)
        return found[1]

    def _layered_victim(self, protected: Collection[Key]):
        n_layers = len(self._layers_seen) + (self._layer is not None and self._layer not in self._layers_seen)
        share = (self.capacity or self._max_resident) / max(1, n_layers)
        own = self._groups.get(self._layer)
        if own is not None and len(own) >= int(share):  # holds its share (rounded down: no scan when C % L)
            found = own.min_excluding(protected)
            if found is not None:
                return found
        best = None
        for g, c in self._groups.items():  # layers above their share; O(layers), once the shares settle rare
            if g != self._layer and len(c) > share:
                found = c.min_excluding(protected)
                if found is not None and (best is None or found[0] < best[0]):
                    best = found
        if best is None:
            for c in self._groups.values():
                found = c.min_excluding(protected)
                if found is not None and (best is None or found[0] < best[0]):
                    best = found
        return best

    def resident(self) -> set[Key]:
        return {k for c in self._groups.values() for k in c.rank}

    def scores(self) -> dict[Key, float]:
        return {k: float(r[0]) for c in self._groups.values() for k, r in c.items()}

    def __len__(self) -> int:
        return self._n
