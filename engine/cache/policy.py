"""Eviction policies: which resident `(layer, expert)` key gives up its slot on a miss.

The slot pool owns the slots; a policy only ranks keys. For each step the pool calls `access(key)`
once per requested key (hit or miss, in order), then for each miss `victim(protected)` when full,
`evict(victim)` and `admit(key)`. Time is the count of `access` calls; recency is a key's last access.
`victim()` never changes what the policy believes. Pure Python and numpy, so `bench/replay.py` runs
these very classes over real routing traces.

| name         | evicts                                                           | victim()        |
|--------------|------------------------------------------------------------------|-----------------|
| lru          | least recently used                                              | O(1)            |
| lfu          | fewest accesses since start, ties least recent                   | O(log n) heap   |
| lfru         | lowest freq / age (the vLLM RFC's and tinyserve's LFRU)          | O(n) numpy scan |
| lrfu         | lowest decayed count, sum of 2^-(age / h), h = 4 x C (Lee 2001)  | O(log n) heap   |
| lru2         | oldest second-to-last access (LRU-K, O'Neil 1993)                | O(log n) heap   |
| arc          | LRU of the recency or frequency list, adaptive split (ARC 2003)  | O(1)            |
| X-layered    | X, within the missing layer's equal share of a global pool       | + O(L) rarely   |
| belady       | next use furthest in the future (offline optimum, MIN)           | O(log n) heap   |

Hit rate as a fraction of Belady's, measured by bench/replay.py on the full traces of ../shared/traces
(DeepSeek-V2-Lite prefill, 22,287 tokens; Mixtral-8x7B decode, 585 tokens): per-layer caches of C
experts / one global pool of C x layers. At C = top-k all per-layer policies tie (= Belady).

  C per layer     DeepSeek 25%  DeepSeek 50%  DeepSeek 75%  Mixtral 50%  Mixtral 75%
  lru              .710/.626     .814/.786     .931/.926     .828/.685    .905/.860
  lfu              .678/.483     .781/.683     .899/.853     .850/.714    .923/.876
  lfru             .684/.420     .785/.672     .910/.861     .843/.666    .920/.875
  lrfu             .750/.646     .850/.814     .940/.932     .848/.727    .922/.887
  lru2             .720/.607     .835/.798     .935/.926     .832/.690    .910/.862
  arc              .710/.626     .814/.786     .931/.926     .827/.685    .905/.860
  lru-layered          /.663         /.799         /.925         /.756        /.880
  lrfu-layered         /.701         /.835         /.934         /.775        /.897

DEFAULT_POLICY = "lrfu-layered": in a global pool (the engine's) the best online policy in every cell,
except at C = top-k where it ties LRU (.561 / .623 of Belady, 1 hit in 10^4 apart) while plain LRFU
falls to .464 / .492 and LFRU to .025 / .097; per layer it is within .002 of the best. h = 4 x C was
tuned on a 1,500-token prefix of the DeepSeek trace and on Mixtral (2 x C and 8 x C are within 1%).
The RFC's LFRU loses to LRU on the prefill trace. Every online policy stays well below Belady: the
room left is in prediction (prefetch), not in eviction.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Collection, Hashable, Sequence

import numpy as np

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


class LRUPolicy(_RankedPolicy):
    """Least recently used: the resident keys in order of last use (OrderedDicts, O(1) per call)."""

    name = "lru"
    _container = _RecencyList

    def access(self, key: Key) -> None:
        resident = self._is_resident(key)
        clock = self._tick_access(key, resident)
        if resident:
            self._rerank(key, clock)

    def admit(self, key: Key) -> None:
        self._check_new(key)
        self._add(key, self._tick_admit(key)[1])


class LFUPolicy(_RankedPolicy):
    """Least frequently used: accesses counted since start (kept across evictions), ties least recent.

    `history=False` counts only the accesses since the key was last admitted (the access that missed
    included): the "LFU" whose numbers ../shared/traces/README.md section 3 reports.
    """

    name = "lfu"

    def __init__(self, capacity: int | None = None, history: bool = True, layered: bool = False):
        super().__init__(capacity, layered)
        self.history = history
        self._freq: dict[Key, int] = {}

    def access(self, key: Key) -> None:
        resident = self._is_resident(key)
        clock = self._tick_access(key, resident)
        if self.history or resident:
            self._freq[key] = self._freq.get(key, 0) + 1
        else:
            self._freq[key] = 1  # the access that misses starts the count
        if resident:
            self._rerank(key, (self._freq[key], clock))

    def admit(self, key: Key) -> None:
        self._check_new(key)
        clock = self._tick_admit(key)[1]
        self._add(key, (self._freq.get(key, 0), clock))

    def evict(self, key: Key) -> None:
        super().evict(key)
        if not self.history:
            self._freq[key] = 0


class LFRUPolicy(EvictionPolicy):
    """LFRU as in the vLLM expert-offloading RFC and tinyserve: evict the lowest score = freq / age.

    age = now - last access + 1 (now = accesses so far), freq = accesses since the key was admitted (the
    access that missed counts as 1), ties least recent first. Why freq / age rather than age alone: a
    "hub" expert that many tokens route to builds up a large freq, so a burst of tokens routed
    elsewhere (a domain shift) must last about freq times longer than under LRU before it loses its
    slot, while a key used once long ago still decays like 1/age.
    `history=True` counts freq over all accesses since start instead; `accesses_per_tick=K` measures age
    in steps of K accesses (one token at one layer), as ../shared/traces/README.md section 3 does.
    The ranking changes as time passes, so no heap keeps it: victim() is a vectorised numpy scan, O(n).
    """

    name = "lfru"

    def __init__(self, capacity: int | None = None, history: bool = False, accesses_per_tick: int = 1):
        super().__init__(capacity)
        self.history = history
        self.accesses_per_tick = accesses_per_tick
        self._count: dict[Key, int] = {}  # accesses since start
        self._index: dict[Key, int] = {}  # resident key -> its row in the arrays below
        self._keys: list[Key] = []
        self._freq = np.zeros(64, dtype=np.float64)  # [n]
        self._last = np.zeros(64, dtype=np.float64)  # [n] tick of last access
        self._used = np.zeros(64, dtype=np.int64)  # [n] clock of last use: the tie-break

    def _tick(self, now: int) -> int:
        return -(-now // self.accesses_per_tick)  # ceil: accesses 1..K are tick 1

    def access(self, key: Key) -> None:
        i = self._index.get(key)
        clock = self._tick_access(key, i is not None)
        self._count[key] = self._count.get(key, 0) + 1
        if i is not None:
            self._freq[i] = self._count[key] if self.history else self._freq[i] + 1
            self._last[i] = self._tick(self._now)
            self._used[i] = clock

    def admit(self, key: Key) -> None:
        self._check_admit(key, self._index)
        now, clock = self._tick_admit(key)
        i = len(self._keys)
        if i == len(self._freq):
            self._freq, self._last, self._used = (np.concatenate([a, np.zeros_like(a)])
                                                  for a in (self._freq, self._last, self._used))
        self._index[key] = i
        self._keys.append(key)
        self._freq[i] = max(self._count.get(key, 0), 1) if self.history else 1
        self._last[i] = self._tick(now)
        self._used[i] = clock

    def evict(self, key: Key) -> None:
        self._check_evict(key, self._index)
        i = self._index.pop(key)
        j = len(self._keys) - 1
        last_key = self._keys.pop()
        if i != j:  # the last row fills the hole
            self._keys[i] = last_key
            self._index[last_key] = i
            self._freq[i], self._last[i], self._used[i] = self._freq[j], self._last[j], self._used[j]

    def _score(self) -> np.ndarray:
        n = len(self._keys)
        return self._freq[:n] / (self._tick(self._now) - self._last[:n] + 1.0)  # [n]

    def victim(self, protected: Collection[Key]) -> Key:
        score = self._score()  # [n] a fresh array: masking it changes nothing
        if protected:
            score[[i for i in map(self._index.get, protected) if i is not None]] = np.inf
        best = score.min() if len(score) else np.inf
        if best == np.inf:
            raise self._no_victim(protected)
        ties = np.flatnonzero(score == best)  # equal rationals divide to equal doubles
        i = ties[0] if len(ties) == 1 else ties[np.argmin(self._used[ties])]
        return self._keys[int(i)]

    def resident(self) -> set[Key]:
        return set(self._keys)

    def scores(self) -> dict[Key, float]:
        return dict(zip(self._keys, self._score().tolist(), strict=True))

    def __len__(self) -> int:
        return len(self._keys)


class LRFUPolicy(_RankedPolicy):
    """LRFU (Lee et al., 2001): evict the lowest decayed frequency CRF = sum over accesses of 2^-(age/h).

    One parameter spans LRU (small half-life h) to LFU (h -> infinity): an expert the router keeps
    returning to builds up weight (the hub that LFRU wants to keep), and that weight halves every h
    accesses once the routing moves on (which LFU never forgets). Unlike freq / age, the order of two
    untouched keys never changes as time passes, so a heap keeps it: a key's rank is
    log2(sum_i 2^(t_i / h)), which does not depend on now. Accesses count from start (kept across
    evictions); an admission without any access counts as one.
    h = `half_life` accesses, by default `half_life_per_slot` (4) x the pool's capacity: so a global
    pool and a per-layer pool age alike. Without a capacity, h is settled at the first victim() call
    (the pool is full then: capacity = keys resident) from the accesses logged until then.
    """

    name = "lrfu"
    SETTLE_AFTER = 1 << 18  # accesses logged at most while the capacity is unknown (a pool that never fills)

    def __init__(self, capacity: int | None = None, half_life: float | None = None,
                 half_life_per_slot: float = 4.0, layered: bool = False):
        super().__init__(capacity, layered)
        self.half_life_per_slot = half_life_per_slot
        if half_life is None and capacity:
            half_life = half_life_per_slot * capacity
        self.half_life = None if half_life is None else float(half_life)
        self._h = self.half_life or 1.0  # provisional until settled: no victim is asked for before then
        self._log: list[tuple[Key, int]] | None = [] if half_life is None else None  # (key, time) until settled
        self._crf: dict[Key, float] = {}  # log2(sum_i 2^(t_i / h))

    def _bump(self, key: Key, t: int) -> float:
        x = t / self._h
        old = self._crf.get(key)
        new = x if old is None else max(old, x) + math.log2(1.0 + 2.0 ** -abs(old - x))
        self._crf[key] = new
        if self._log is not None:
            self._log.append((key, t))
            if len(self._log) > self.SETTLE_AFTER:
                self._settle()
                return self._crf[key]
        return new

    def _settle(self) -> None:
        """Fix h from the capacity now known and recompute every rank from the logged accesses."""
        log, self._log = self._log, None
        self.half_life = self._h = self.half_life_per_slot * max(1, self._max_resident)
        self._crf = {}
        for key, t in log:
            self._bump(key, t)
        for c in self._groups.values():
            for key, rank in list(c.items()):
                c.set(key, (self._crf[key], rank[1]))

    def access(self, key: Key) -> None:
        resident = self._is_resident(key)
        clock = self._tick_access(key, resident)
        crf = self._bump(key, self._now)
        if resident:
            self._rerank(key, (crf, clock))

    def admit(self, key: Key) -> None:
        self._check_new(key)
        clock = self._tick_admit(key)[1]
        crf = self._crf[key] if key in self._crf else self._bump(key, self._now)
        self._add(key, (crf, clock))

    def victim(self, protected: Collection[Key]) -> Key:
        if self._log is not None:
            self._settle()  # once: the ranks were provisional, and no victim was asked for until now
        return super().victim(protected)

    def scores(self) -> dict[Key, float]:
        return {k: 2.0 ** (v - self._now / self._h) for k, v in super().scores().items()}


class LRUKPolicy(_RankedPolicy):
    """LRU-K (O'Neil et al., 1993), K=2 by default: evict the oldest K-th most recent access.

    A key with fewer than K accesses since start ranks as infinitely old (evicted first, least recent
    first), so an expert touched once by an odd token cannot push out one the model keeps returning to.
    Access history is kept across evictions.
    """

    name = "lru2"

    def __init__(self, capacity: int | None = None, k: int = 2, layered: bool = False):
        super().__init__(capacity, layered)
        if k < 1:
            raise ValueError(f"LRU-K needs k >= 1, got {k}")
        self.k = k
        self._times: dict[Key, tuple[int, ...]] = {}  # last k access times, oldest first

    def _kth(self, key: Key) -> int:
        times = self._times.get(key, ())
        return times[0] if len(times) == self.k else 0

    def access(self, key: Key) -> None:
        resident = self._is_resident(key)
        clock = self._tick_access(key, resident)
        self._times[key] = (*self._times.get(key, ()), self._now)[-self.k:]
        if resident:
            self._rerank(key, (self._kth(key), clock))

    def admit(self, key: Key) -> None:
        self._check_new(key)
        self._add(key, (self._kth(key), self._tick_admit(key)[1]))


class ARCPolicy(EvictionPolicy):
    """ARC (Megiddo and Modha, 2003), split into the pool's access/victim/evict/admit calls.

    T1 holds keys used once since they came in, T2 keys used again; B1/B2 remember keys evicted from
    each (ghosts, no slot). A miss that hits ghost B1 says T1 was too small: T1's target size p grows;
    a hit in B2 shrinks it. victim() takes T1's LRU when |T1| > p, else T2's LRU (the other list's when
    all of one is protected). Ghosts are trimmed to |T1| + |B1| <= c and |T1 T2 B1 B2| <= 2c.
    """

    name = "arc"

    def __init__(self, capacity: int | None = None):
        super().__init__(capacity)
        self._t1 = _RecencyList()  # LRU first
        self._t2 = _RecencyList()
        self._b1: OrderedDict[Key, None] = OrderedDict()  # ghosts, oldest first
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._to_t2: set[Key] = set()  # ghost hits waiting for their admission
        self.p = 0
        self._max_resident = 0

    @property
    def c(self) -> int:
        return self.capacity if self.capacity is not None else self._max_resident

    def access(self, key: Key) -> None:
        resident = key in self._t1 or key in self._t2
        clock = self._tick_access(key, resident)
        if key in self._t1:
            self._t1.remove(key)
            self._t2.set(key, clock)
        elif key in self._t2:
            self._t2.set(key, clock)
        elif key in self._b1:
            self.p = min(self.c, self.p + max(1, len(self._b2) // len(self._b1)))
            del self._b1[key]
            self._to_t2.add(key)
        elif key in self._b2:
            self.p = max(0, self.p - max(1, len(self._b1) // len(self._b2)))
            del self._b2[key]
            self._to_t2.add(key)

    def admit(self, key: Key) -> None:
        if key in self._t1 or key in self._t2:
            raise ValueError(f"{self.name}: admit({key}): already resident")
        clock = self._tick_admit(key)[1]
        if key in self._to_t2:
            self._to_t2.discard(key)
            self._t2.set(key, clock)
        else:
            self._b1.pop(key, None)  # admitted without an access (a prefetch): no longer a ghost
            self._b2.pop(key, None)
            self._t1.set(key, clock)
        self._max_resident = max(self._max_resident, len(self._t1) + len(self._t2))
        self._trim()

    def evict(self, key: Key) -> None:
        if key in self._t1:
            self._t1.remove(key)
            self._b1[key] = None
        elif key in self._t2:
            self._t2.remove(key)
            self._b2[key] = None
        else:
            raise ValueError(f"{self.name}: evict({key}): not resident")
        self._trim()

    def _trim(self) -> None:
        c = self.c
        while len(self._t1) + len(self._b1) > c and self._b1:
            self._b1.popitem(last=False)
        while len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c and self._b2:
            self._b2.popitem(last=False)

    def victim(self, protected: Collection[Key]) -> Key:
        lists = (self._t1, self._t2) if len(self._t1) > self.p else (self._t2, self._t1)
        for lst in lists:
            found = lst.min_excluding(protected)
            if found is not None:
                return found[1]
        raise self._no_victim(protected)

    def resident(self) -> set[Key]:
        return set(self._t1.rank) | set(self._t2.rank)

    def scores(self) -> dict[Key, float]:
        return {**{k: 0.0 for k in self._t1.rank}, **{k: 1.0 for k in self._t2.rank}}  # 1: used again

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


class BeladyPolicy(_RankedPolicy):
    """Belady's MIN, offline: evict the resident key whose next use is furthest in the future.

    Built with the whole request sequence; `access` walks it and checks each key against it. No
    eviction policy gets more hits on that sequence (the protected keys, the current step's, are
    needed now, so sparing them costs nothing). Keys never used again tie; the least recently used of
    them goes first. Next uses are precomputed with numpy, O(N log N); then each call is O(log n).
    """

    name = "belady"
    supports_layered = False

    def __init__(self, future: Sequence[Key], capacity: int | None = None):
        super().__init__(capacity)
        keys = np.asarray(future, dtype=np.int64).reshape(-1, 2)  # [N, 2] (layer, expert)
        N = len(keys)
        self._future = keys
        self._size = N
        width = int(keys[:, 1].max()) + 1 if N else 1
        codes = keys[:, 0] * width + keys[:, 1]  # [N]
        order = np.lexsort((np.arange(N), codes))  # [N] by key, then position
        same = codes[order[1:]] == codes[order[:-1]]  # [N-1]
        next_use = np.full(N, N, dtype=np.int64)  # [N] position of the same key's next request, N if none
        next_use[order[:-1][same]] = order[1:][same]
        self._next_use = next_use
        firsts = order[np.concatenate([[True], ~same])] if N else order
        self._first = {(int(keys[i, 0]), int(keys[i, 1])): int(i) for i in firsts}
        self._next: dict[Key, int] = {}  # next use of each key accessed so far (a position not reached yet)

    def next_use(self, key: Key) -> int:
        """Position of the next request for `key` in the sequence (len(sequence) if none)."""
        nxt = self._next.get(key)
        return nxt if nxt is not None else self._first.get(key, self._size)

    def access(self, key: Key) -> None:
        pos = self._now
        if pos >= self._size:
            raise ValueError(f"belady: access #{pos} of {key}, past the {self._size} requests of the future sequence")
        expected = (int(self._future[pos, 0]), int(self._future[pos, 1]))
        if key != expected:
            raise ValueError(f"belady: access #{pos} is {key}, but the future sequence says {expected}")
        resident = self._is_resident(key)
        clock = self._tick_access(key, resident)
        self._next[key] = int(self._next_use[pos])
        if resident:
            self._rerank(key, (-self._next[key], clock))

    def admit(self, key: Key) -> None:
        self._check_new(key)
        self._add(key, (-self.next_use(key), self._tick_admit(key)[1]))

    def scores(self) -> dict[Key, float]:
        return {k: r + self._now for k, r in super().scores().items()}  # -(requests until next use)


_ONLINE: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, LFUPolicy, LFRUPolicy, LRFUPolicy, LRUKPolicy, ARCPolicy)
}
LAYERED = "-layered"  # suffix: the policy with per-layer sizing (policies with supports_layered)
POLICIES: tuple[str, ...] = (*_ONLINE, "lru-layered", "lrfu-layered")  # usable online; Belady needs the future
DEFAULT_POLICY: str = "lrfu-layered"


def make_policy(name: str, **kwargs) -> EvictionPolicy:
    """A policy by name: one of POLICIES (any "<name>-layered" whose class supports it), or "belady"
    with `future=` the whole request sequence. `capacity=` (the pool's slots) is accepted by all."""
    if name == "belady":
        if "future" not in kwargs:
            raise ValueError("the belady policy is offline: pass future=<the whole list of (layer, expert) requests>")
        return BeladyPolicy(**kwargs)
    base = name.removesuffix(LAYERED)
    cls = _ONLINE.get(base)
    if cls is None or (base != name and not getattr(cls, "supports_layered", False)):
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)} (or belady, offline)")
    if base != name:
        kwargs["layered"] = True
    return cls(**kwargs)
