"""LRU's hit rate at every slot count from one pass over a routing trace (stack distances).

LRU is a stack algorithm (Mattson et al. 1970): a cache of C slots holds the C most recently used
keys, so a request hits at C slots iff its *stack distance* (1 + the distinct keys used since its
key's previous use) is <= C, and one pass that finds every request's distance gives the hit count at
every C at once. Replaying the trace once per candidate size instead costs a replay per slider
position: for a 48-layer x 128-expert model that is 6,144 replays.

The engine's pool works in steps (engine/cache/provider/core.py): a step (one decode token at one layer,
or a whole prefill chunk at one layer) looks up its distinct experts, then loads its misses, evicting
only keys outside the step. So a request's distance here is counted in the stack as it stood when its
step began, and the curve equals the provider running `LRUPolicy` exactly at every C >= the largest
step (decode: top-k; tested against a brute-force replay). Below that a prefill chunk is loaded in
expert-major groups, which this pass does not model.

The distances come from a dominance count done in numpy: request t with previous use p, in a step
starting at s, has distance = #{j < s : prev[j] <= p} - p (requests j in (p, s) whose previous use is
<= p are the first uses of distinct keys since p). Counting points (j, prev[j]) in the box j < s,
prev[j] <= p for every request at once takes a merge-sort tree: log2(N) levels of sorted blocks and a
`searchsorted` per level, O(N log^2 N) in C, under a second for a million requests, and no Python loop
per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .trace import DECODE, PREFILL, RoutingTrace

MAX_ROWS = 200_000  # the curve looks at most at the latest rows of a trace (24 MB of work arrays at top-8)


@dataclass(frozen=True, eq=False)
class HitCurve:
    """Hits of LRU at every slot count on a routing trace; immutable (the array is read-only).

    `hits[C]` is the number of counted requests that hit with C slots, for C = 0..len(hits) - 1 (hits[0]
    = 0; beyond the end the curve is flat: every key fits). `requests` is the denominator, `tokens`
    the tokens those requests came from, and `exact_from` the smallest C at which the curve is exactly
    the engine's LRU (the largest step's distinct experts).
    """

    hits: np.ndarray  # [S + 1] int64, non-decreasing
    requests: int
    tokens: int
    exact_from: int
    phase: str = "all"  # "decode": only decode requests counted (prefill still warms the cache)
    policy: str = "lru"
    source: str = ""  # where the routing came from, for a label ("this session's routing")

    def __post_init__(self):
        hits = np.array(self.hits, dtype=np.int64)  # a private copy
        hits.setflags(write=False)
        object.__setattr__(self, "hits", hits)

    @property
    def max_slots(self) -> int:
        """Slots past which the curve is flat (every key the trace used fits)."""
        return len(self.hits) - 1

    def hits_at(self, slots: int) -> int:
        return int(self.hits[min(max(int(slots), 0), self.max_slots)])

    def hit_rate(self, slots: int) -> float | None:
        """Predicted hit rate with `slots` slots; None when the trace has no counted request."""
        return self.hits_at(slots) / self.requests if self.requests else None


def step_starts(trace: RoutingTrace) -> np.ndarray:
    """[N] bool: row i begins a provider step (a decode row, or the first row of a prefill chunk at a layer).

    A prefill chunk at one layer is a run of prefill rows of one layer and sequence with consecutive
    token positions, as `TraceRecorder` writes it.
    """
    N = len(trace)
    new_step = np.ones(N, dtype=bool)
    if N > 1:
        prefill = trace.phase == PREFILL
        new_step[1:] = ~(prefill[1:] & prefill[:-1] & (trace.layer[1:] == trace.layer[:-1])
                         & (trace.sequence[1:] == trace.sequence[:-1]) & (trace.token[1:] == trace.token[:-1] + 1))
    return new_step


def request_steps(trace: RoutingTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The trace as the provider requests it: (keys [M], step start [M], phase [M]).

    Each step (see `step_starts`) asks for its distinct experts once, in first-use order; keys are
    layer * E + expert, and a request's step start is the index of its step's first request.
    """
    N, K = trace.topk_ids.shape
    if N == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0, dtype=np.uint8)
    layer = trace.layer.astype(np.int64)
    new_step = step_starts(trace)
    step = np.cumsum(new_step) - 1  # [N]
    keys = (layer[:, None] * trace.num_experts + trace.topk_ids.astype(np.int64)).reshape(-1)  # [N*K]
    steps = np.repeat(step, K)  # [N*K]
    # First use of each key within its step, kept in request order.
    order = np.lexsort((np.arange(N * K), keys, steps))  # by step, key, then position
    first = np.ones(N * K, dtype=bool)
    first[1:] = (steps[order[1:]] != steps[order[:-1]]) | (keys[order[1:]] != keys[order[:-1]])
    kept = np.sort(order[first])  # [M] positions of the requests, in order
    keys, steps = keys[kept], steps[kept]
    starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])  # [number of steps]
    step_start = starts[np.cumsum(np.r_[True, steps[1:] != steps[:-1]]) - 1]  # [M]
    phase = np.repeat(trace.phase, K)[kept]
    return keys, step_start.astype(np.int64), phase


def _count_dominated(values: np.ndarray, x: np.ndarray, v: np.ndarray) -> np.ndarray:
    """For each query q: #{j < x[q] : values[j] <= v[q]}. values [N] >= -1, x [Q] in 0..N, v [Q]."""
    n = len(values)
    levels = max(n - 1, 0).bit_length()
    size = 1 << levels
    shifted = np.full(size, n + 1, dtype=np.int64)  # padding never counts (threshold <= n)
    shifted[:n] = values + 1  # [0, n]
    threshold = v + 1
    span = n + 2  # block b's values live in [b * span, (b + 1) * span)
    out = np.zeros(len(x), dtype=np.int64)
    blocks = shifted.copy()  # sorted within blocks of 2^level
    for level in range(levels + 1):
        width = 1 << level
        if level:
            blocks = np.sort(blocks.reshape(-1, width), axis=1).reshape(-1)
        # The prefix [0, x) is the union, over the set bits l of x, of the block of width 2^l starting at x
        # with bits 0..l cleared.
        has = ((x >> level) & 1).astype(bool)
        if not has.any():
            continue
        block = (x[has] >> (level + 1)) << 1  # index in blocks of this width
        flat = np.repeat(np.arange(size // width, dtype=np.int64) * span, width) + blocks  # globally sorted
        out[has] += np.searchsorted(flat, block * span + threshold[has], side="right") - block * width
    return out


def stack_distances(keys: np.ndarray, step_start: np.ndarray) -> np.ndarray:
    """Each request's LRU stack distance at the start of its step (>= 1), or 0 for a key's first use."""
    keys = np.asarray(keys, dtype=np.int64)
    M = len(keys)
    prev = np.full(M, -1, dtype=np.int64)  # previous request of the same key
    if M > 1:
        order = np.argsort(keys, kind="stable")
        same = keys[order[1:]] == keys[order[:-1]]
        prev[order[1:][same]] = order[:-1][same]
    out = np.zeros(M, dtype=np.int64)
    seen = np.flatnonzero(prev >= 0)
    if len(seen):
        p = prev[seen]
        out[seen] = _count_dominated(prev, np.asarray(step_start, dtype=np.int64)[seen], p) - p
    return out


def lru_hit_curve(trace: RoutingTrace, *, decode_only: bool | None = None, max_rows: int | None = MAX_ROWS,
                  source: str = "") -> HitCurve:
    """LRU's hits at every slot count on `trace` (its latest `max_rows` rows, replayed from a cold cache).

    decode_only: count only decode requests (prefill requests still move the stack); None: when the
    trace has any decode rows, since decode speed is what the slot count buys.
    """
    if max_rows is not None and len(trace) > max_rows:
        starts = np.flatnonzero(step_starts(trace)[len(trace) - max_rows :])  # never begin inside a step
        trace = trace.take(slice(len(trace) - max_rows + (int(starts[0]) if len(starts) else 0), None))
    keys, step_start, phase = request_steps(trace)
    if decode_only is None:
        decode_only = bool((phase == DECODE).any())
    distances = stack_distances(keys, step_start)
    counted = phase == DECODE if decode_only else np.ones(len(keys), dtype=bool)
    num_keys = len(np.unique(keys))
    hist = np.bincount(distances[counted], minlength=num_keys + 1)[: num_keys + 1]  # [S + 1]; index 0: cold
    hist[0] = 0
    steps = np.diff(np.r_[np.flatnonzero(np.r_[True, step_start[1:] != step_start[:-1]]), len(keys)])
    rows = trace.phase == DECODE if decode_only else np.ones(len(trace), dtype=bool)
    layers = max(len(np.unique(trace.layer)), 1)
    return HitCurve(hits=np.cumsum(hist), requests=int(counted.sum()), tokens=int(rows.sum()) // layers,
                    exact_from=int(steps.max()) if len(steps) else 1,
                    phase="decode" if decode_only else "all", source=source)
