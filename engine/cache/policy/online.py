"""The online eviction policies, the ones the engine runs: recency (LRU, LRU-2, ARC) and frequency (LFU, LFRU, LRFU).

Each ranks resident keys by what it knows of the past accesses alone; their hit rates against Belady's on real
traces are in registry.py. LRU, LFU, LRFU and LRU-2 are `_RankedPolicy`s (base.py), so each also comes "-layered";
LFRU scores freq / age, which changes as time passes, and ARC keeps two lists, so neither fits a ranked container.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection

import numpy as np

from .base import EvictionPolicy, Key, _RankedPolicy, _RecencyList


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
