"""Belady's MIN: the offline optimum, which needs the whole request sequence in advance.

Replay only (bench/replay.py, the tests): the yardstick every online policy's hit rate is measured against, never a
policy the engine can run (`make_policy("belady", future=...)`; not in `POLICIES`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .base import Key, _RankedPolicy


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
