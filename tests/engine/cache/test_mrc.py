"""The one-pass LRU curve (stack distances) against brute-force replays of the real LRUPolicy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moechat.engine.cache.mrc import _count_dominated, lru_hit_curve, stack_distances
from moechat.engine.cache.policy import make_policy
from moechat.engine.cache.trace import DECODE, PREFILL, RoutingTrace, TraceRecorder
from moechat.engine.plan import MissRatioCurve

DEMO_TRACE = Path(__file__).resolve().parents[3] / "assets" / "demo-moe" / "routing_trace.npz"


def recorded_session(seed: int, L: int = 4, E: int = 12, K: int = 3, turns: int = 3):
    """A session as the engine records it, and its steps as the provider runs them (one per record call).

    Each turn: a prefill chunk of 1..6 tokens at every layer, then 5..25 decode tokens, each visiting
    every layer. Expert popularity is skewed, so a cache of a few slots has hits; ids may repeat in a row.
    """
    rng = np.random.default_rng(seed)
    popularity = rng.zipf(1.5, size=(L, E)).astype(float)
    popularity /= popularity.sum(axis=1, keepdims=True)
    recorder = TraceRecorder(L, E, K)
    steps = []  # (phase, [(layer, expert), ...] distinct in first-use order)

    def record(layer, T, phase):
        ids = np.stack([rng.choice(E, size=K, p=popularity[layer]) for _ in range(T)])  # [T, K]
        recorder.record(layer, ids, phase)
        steps.append((phase, list(dict.fromkeys((layer, int(e)) for e in ids.reshape(-1)))))

    for _ in range(turns):
        T = int(rng.integers(1, 7))
        for layer in range(L):
            record(layer, T, PREFILL if T > 1 else DECODE)  # the provider's rule: a 1-token chunk is decode
        for _ in range(int(rng.integers(5, 26))):
            for layer in range(L):
                record(layer, 1, DECODE)
    return recorder.to_trace(), steps


def brute_force_lru(steps, capacity: int, decode_only: bool) -> int:
    """Hits of engine/cache/provider/core.py's loop over `LRUPolicy`: access the step's keys, then load misses."""
    policy = make_policy("lru", capacity=capacity)
    resident: set = set()
    hits = 0
    for phase, keys in steps:
        misses = []
        for key in keys:
            policy.access(key)
            if key in resident:
                hits += phase == DECODE or not decode_only
            else:
                misses.append(key)
        for key in misses:
            if len(resident) >= capacity:
                victim = policy.victim(keys)
                policy.evict(victim)
                resident.discard(victim)
            policy.admit(key)
            resident.add(key)
    return hits


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("decode_only", [True, False])
def test_curve_equals_brute_force_lru_at_every_size(seed, decode_only):
    trace, steps = recorded_session(seed)
    curve = lru_hit_curve(trace, decode_only=decode_only)
    largest_step = max(len(keys) for _, keys in steps)
    assert curve.exact_from == largest_step
    assert curve.requests == sum(len(k) for p, k in steps if p == DECODE or not decode_only)
    sizes = range(largest_step, 4 * 12 + 2)  # through every key resident, and past it
    got = [curve.hits_at(c) for c in sizes]
    want = [brute_force_lru(steps, c, decode_only) for c in sizes]
    assert got == want
    assert want[0] < want[-1]  # the sizes matter on this trace: not a flat, vacuous curve


def test_hand_made_distances():
    # Decode rows, K = 1, one layer: a b c a b b d a. Distances: cold x3, then a: {b, c} used since -> 3,
    # b: {c, a} -> 3, b: nothing since -> 1, d cold, a: {b, d} -> 3.
    ids = [0, 1, 2, 0, 1, 1, 3, 0]
    keys = np.array(ids)
    assert stack_distances(keys, np.arange(len(ids))).tolist() == [0, 0, 0, 3, 3, 1, 0, 3]
    trace = RoutingTrace(1, 4, 1, layer=np.zeros(8), token=np.arange(8), phase=np.ones(8), topk_ids=keys[:, None])
    curve = lru_hit_curve(trace)
    assert [curve.hits_at(c) for c in range(6)] == [0, 1, 1, 4, 4, 4]
    assert curve.hit_rate(3) == 0.5 and curve.tokens == 8 and curve.phase == "decode"


def test_a_step_sees_the_stack_as_it_began():
    # One step asking for (a, b) after a, x, b: one request at a time, a's reuse would push b down to
    # distance 2; the provider looks both up before it loads anything, so b is at distance 1 (b was the
    # last key used), and the step with 3 slots is 2 hits either way, but with 2 slots: a misses, b hits.
    keys = np.array([0, 9, 1, 0, 1])
    assert stack_distances(keys, np.array([0, 1, 2, 3, 3])).tolist() == [0, 0, 0, 3, 1]


def test_dominance_counts_match_a_direct_count():
    rng = np.random.default_rng(5)
    for n in (1, 2, 7, 64, 300):
        values = rng.integers(-1, n, n)
        x = rng.integers(0, n + 1, 200)
        v = rng.integers(-1, n + 1, 200)
        want = [int((values[:xq] <= vq).sum()) for xq, vq in zip(x, v, strict=True)]
        assert _count_dominated(values, x, v).tolist() == want


def test_curve_is_immutable_monotone_and_flat_past_every_key():
    trace, _ = recorded_session(3)
    curve = lru_hit_curve(trace)
    assert (np.diff(curve.hits) >= 0).all()
    with pytest.raises(ValueError):
        curve.hits[1] = 7
    assert curve.hits_at(10**6) == curve.hits_at(curve.max_slots) and curve.hits_at(-3) == 0
    empty = lru_hit_curve(trace.take(slice(0, 0)))
    assert empty.hit_rate(8) is None and empty.requests == 0


def test_max_rows_keeps_the_latest_rows_from_a_step_boundary():
    trace, _ = recorded_session(4, turns=4)
    tail = lru_hit_curve(trace, max_rows=40)
    # The window starts at a step's first row at or after len - 40 (here: a whole step fits)
    full_rows = len(trace)
    expected = None
    for start in range(full_rows - 40, full_rows):
        part = trace.take(slice(start, None))
        if start == 0 or not (trace.phase[start] == PREFILL and trace.phase[start - 1] == PREFILL
                              and trace.layer[start] == trace.layer[start - 1]
                              and trace.token[start] == trace.token[start - 1] + 1):
            expected = lru_hit_curve(part, max_rows=None)
            break
    assert expected is not None
    assert tail.hits.tolist() == expected.hits.tolist() and tail.requests == expected.requests


def test_bundled_demo_trace_matches_a_replay():
    trace = RoutingTrace.load(DEMO_TRACE)
    curve = lru_hit_curve(trace, source="the demo model's recorded routing")
    from moechat.engine.cache.mrc import request_steps

    keys, starts, phase = request_steps(trace)
    steps = []
    for s in np.unique(starts):
        idx = np.flatnonzero(starts == s)
        steps.append((int(phase[idx[0]]), [(int(k) // trace.num_experts, int(k) % trace.num_experts)
                                           for k in keys[idx]]))
    for c in (curve.exact_from, 24, 48, 72):
        assert curve.hits_at(c) == brute_force_lru(steps, c, decode_only=True)
    assert 0 < curve.hit_rate(24) < curve.hit_rate(72) < 1
    mrc = MissRatioCurve.from_stack_distances(curve, trace.num_layers * trace.num_experts)
    assert mrc.hit_at(0.5) == pytest.approx(curve.hit_rate(48), abs=0.02)
