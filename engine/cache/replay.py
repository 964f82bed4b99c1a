"""Any eviction policy's hit rate at one slot count, by replaying a routing trace through the real class.

`mrc.lru_hit_curve` gives LRU at every slot count in one pass (LRU is a stack algorithm); the other
policies (LFU, LFRU, LRFU, ARC, the layered ones) are not, so they are replayed once per slot count, in
Python, as the provider drives them (engine/cache/provider/core.py): a step (one decode token at one layer, or a
prefill chunk at one layer) accesses its distinct experts, then admits its misses, each evicting the
policy's victim outside the step. A step with more distinct experts than slots is loaded in groups of at
most C, as the provider does. Cost: ~2 us a request; the latest `MAX_ROWS` rows (20,000 x top-8 = 160k
requests, ~0.3 s in a worker thread) bound it.

`warm_rate` leaves out each key's first request (a miss at any size, paid once per session): it is the
rate a cache that has already run a while keeps, which is what a retune in the middle of a chat gets.
At C = every expert it is 1.0, where the session's measured rate stays a little under (its cold misses).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .mrc import request_steps, step_starts
from .policy import make_policy
from .trace import DECODE, RoutingTrace

MAX_ROWS = 20_000


@dataclass(frozen=True)
class PolicyReplay:
    policy: str
    slots: int
    hits: int  # counted requests that hit
    requests: int  # counted requests (decode ones when the trace has decode rows)
    cold: int  # counted requests that were a key's first use in the trace
    tokens: int

    @property
    def rate(self) -> float | None:
        """Hit rate over every counted request, first uses included (what a cold cache measures)."""
        return self.hits / self.requests if self.requests else None

    @property
    def warm_rate(self) -> float | None:
        """Hit rate once the cache is warm: first uses left out."""
        warm = self.requests - self.cold
        return self.hits / warm if warm > 0 else None


def replay_policy(trace: RoutingTrace, policy: str, slots: int, *, decode_only: bool | None = None,
                  max_rows: int | None = MAX_ROWS) -> PolicyReplay:
    """Drive `policy` (a name of policy.POLICIES) with `slots` slots through `trace`'s latest `max_rows` rows.

    decode_only: count only decode requests (prefill ones still warm the cache); None: when there are any.
    """
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    if max_rows is not None and len(trace) > max_rows:
        starts = np.flatnonzero(step_starts(trace)[len(trace) - max_rows:])  # never begin inside a step
        trace = trace.take(slice(len(trace) - max_rows + (int(starts[0]) if len(starts) else 0), None))
    keys, step_start, phase = request_steps(trace)
    if decode_only is None:
        decode_only = bool((phase == DECODE).any())
    counted = (phase == DECODE) if decode_only else np.ones(len(keys), dtype=bool)
    E = trace.num_experts
    pairs = list(zip((keys // E).tolist(), (keys % E).tolist(), strict=True))  # (layer, expert) per request
    bounds = np.flatnonzero(np.r_[True, step_start[1:] != step_start[:-1]]).tolist() + [len(keys)]
    counted_l = counted.tolist()
    p = make_policy(policy, capacity=slots)
    resident: set = set()
    seen: set = set()
    hits = cold = 0
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        step = pairs[a:b]
        misses = []
        for i, key in enumerate(step, a):
            p.access(key)
            if key in resident:
                hits += counted_l[i]
            else:
                misses.append(key)
                if key not in seen:
                    cold += counted_l[i]
            seen.add(key)
        big = len(step) > slots  # more distinct experts than slots: loaded in groups of <= slots
        for n, key in enumerate(misses):
            if len(resident) >= slots:
                protected = misses[n - n % slots:n + 1] if big else step  # the group being loaded
                victim = p.victim(protected)
                p.evict(victim)
                resident.discard(victim)
            p.admit(key)
            resident.add(key)
    rows = trace.phase == DECODE if decode_only else np.ones(len(trace), dtype=bool)
    layers = max(len(np.unique(trace.layer)), 1)
    return PolicyReplay(p.name, slots, hits, int(counted.sum()), cold, int(rows.sum()) // layers)
