"""Eviction policies against tiny obviously-correct references, known answers, and Belady's optimality.

The references re-derive every rank from the raw history of calls with O(n) scans (exact fractions
for LFRU, 80-digit decimals for LRFU), so they share no bookkeeping with the fast policies.
"""

from __future__ import annotations

import collections
import decimal
import functools
import random
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from moechat.engine.cache.policy import (
    DEFAULT_POLICY,
    POLICIES,
    BeladyPolicy,
    EvictionPolicy,
    LFRUPolicy,
    LRFUPolicy,
    make_policy,
)

# name -> make_policy kwargs; every online policy with its options, plus belady (future added later)
VARIANTS = {
    "lru": ("lru", {}),
    "lfu": ("lfu", {}),
    "lfu-in-cache": ("lfu", {"history": False}),
    "lfru": ("lfru", {}),
    "lfru-history": ("lfru", {"history": True}),
    "lfru-tick3": ("lfru", {"accesses_per_tick": 3}),
    "lrfu": ("lrfu", {"half_life": 3}),
    "lru2": ("lru2", {}),
    "lru3": ("lru2", {"k": 3}),
    "arc": ("arc", {}),
    "lru-layered": ("lru-layered", {}),
    "lfu-layered": ("lfu-layered", {}),
    "lrfu-layered": ("lrfu-layered", {}),  # half-life 4 x capacity, settled at the first victim()
    "lru2-layered": ("lru2-layered", {}),
    "belady": ("belady", {}),
}


# -- the references ------------------------------------------------------------------------------
class Reference:
    """Records the raw history; each policy's victim is a scan over the resident keys.

    Semantics spelled out: time `now` counts accesses; `clock` counts accesses and admissions. A key's
    last use is its last access, or its admission when it was not accessed since it was last resident
    (a prefetch). Ties go to the least recent last use.
    """

    def __init__(self, variant: str, capacity: int, future=None):
        self.variant = variant
        name, self.kw = VARIANTS[variant]
        self.kind = name.removesuffix("-layered")
        self.layered = name.endswith("-layered")
        self.layers_seen: set = set()  # layers of the keys admitted so far
        self.layer = None  # layer of the latest access
        self.capacity = capacity
        self.future = list(future or [])
        self.now = 0
        self.clock = 0
        self.accesses: dict = {}  # key -> [(now, clock), ...] every access since start
        self.res: dict = {}  # resident key -> dict(admit_now, admit_clock, via_miss)
        self.missing: dict = {}  # key -> (now, clock) of an access while not resident, until admitted
        # ARC lists, plain Python lists, LRU first
        self.t1, self.t2, self.b1, self.b2 = [], [], [], []
        self.to_t2: set = set()
        self.p = 0
        self.max_res = 0
        self.lrfu_extra: dict = {}  # key -> admission time counted as an access (admitted never accessed)
        self.h = self.kw.get("half_life")

    # events
    def access(self, key):
        self.now += 1
        self.clock += 1
        self.layer = key[0]
        if self.kind == "belady":
            assert self.future[self.now - 1] == key
        self.accesses.setdefault(key, []).append((self.now, self.clock))
        if key not in self.res:
            self.missing[key] = (self.now, self.clock)
        if self.kind == "arc":
            self._arc_access(key)

    def admit(self, key):
        assert key not in self.res
        self.clock += 1
        via_miss = key in self.missing
        self.missing.pop(key, None)
        if self.kind == "lrfu" and key not in self.accesses and key not in self.lrfu_extra:
            self.lrfu_extra[key] = self.now
        self.res[key] = dict(admit_now=self.now, admit_clock=self.clock, via_miss=via_miss)
        self.layers_seen.add(key[0])
        self.max_res = max(self.max_res, len(self.res))
        if self.kind == "arc":
            if key in self.to_t2:
                self.to_t2.discard(key)
                self.t2.append(key)
            else:
                for ghost in (self.b1, self.b2):
                    if key in ghost:
                        ghost.remove(key)
                self.t1.append(key)
            self.t1.sort(key=self.last_clock)
            self.t2.sort(key=self.last_clock)
            self.max_res = max(self.max_res, len(self.res))
            self._arc_trim()

    def evict(self, key):
        del self.res[key]
        if self.kind == "arc":
            if key in self.t1:
                self.t1.remove(key)
                self.b1.append(key)
            else:
                self.t2.remove(key)
                self.b2.append(key)
            self._arc_trim()

    def resident(self):
        return set(self.res)

    # ranks
    def accesses_since_admit(self, key):
        info = self.res[key]
        return sum(1 for n, _ in self.accesses.get(key, []) if n > info["admit_now"]) + (1 if info["via_miss"] else 0)

    def last_use(self, key):
        """(now, clock) of the last use."""
        info = self.res[key]
        acc = self.accesses.get(key, [])
        if info["via_miss"] or (acc and acc[-1][1] > info["admit_clock"]):
            return acc[-1]
        return (info["admit_now"], info["admit_clock"])

    def last_clock(self, key):
        return self.last_use(key)[1]

    def rank(self, key):
        kind, kw = self.kind, self.kw
        tie = self.last_clock(key)
        if kind == "lru":
            return (tie,)
        if kind == "lfu":
            if kw.get("history", True):
                return (len(self.accesses.get(key, [])), tie)
            return (self.accesses_since_admit(key), tie)
        if kind == "lfru":
            per = kw.get("accesses_per_tick", 1)
            tick = lambda n: -(-n // per)  # noqa: E731
            if kw.get("history"):
                f = max(len(self.accesses.get(key, [])), 1)
            else:
                info = self.res[key]
                f = 1 + sum(1 for n, _ in self.accesses.get(key, []) if n > info["admit_now"])
            return (Fraction(f, tick(self.now) - tick(self.last_use(key)[0]) + 1), tie)
        if kind == "lrfu":
            h = decimal.Decimal(self.h)
            times = [n for n, _ in self.accesses.get(key, [])]
            if key in self.lrfu_extra:
                times.append(self.lrfu_extra[key])
            with decimal.localcontext() as ctx:
                ctx.prec = 80
                crf = sum((decimal.Decimal(2) ** ((t - self.now) / h) for t in times), decimal.Decimal(0))
            return (crf, tie)
        if kind == "lru2":
            k = kw.get("k", 2)
            times = [n for n, _ in self.accesses.get(key, [])]
            return (times[-k] if len(times) >= k else 0, tie)
        if kind == "belady":
            later = [i for i in range(self.now, len(self.future)) if self.future[i] == key]
            return (-(later[0] if later else len(self.future)), tie)
        raise AssertionError(kind)

    def victim(self, protected):
        if self.kind == "lrfu" and self.h is None:
            self.h = 4 * self.max_res  # the capacity: the pool is full when it first asks
        cands = [k for k in self.res if k not in protected]
        if not cands:
            raise RuntimeError("all protected")
        if self.kind == "arc":
            lists = (self.t1, self.t2) if len(self.t1) > self.p else (self.t2, self.t1)
            for lst in lists:
                for k in lst:
                    if k not in protected:
                        return k
        if self.layered:  # own layer while it holds its share, else a layer above its share, else any
            own = self.layer
            share = self.max_res / len(self.layers_seen | {own})
            count = collections.Counter(k[0] for k in self.res)
            tiers = ([k for k in cands if k[0] == own] if count[own] >= int(share) else [],
                     [k for k in cands if k[0] != own and count[k[0]] > share])
            for tier in tiers:
                if tier:
                    return min(tier, key=self.rank)
        return min(cands, key=self.rank)

    # ARC bookkeeping, written from the paper's cases
    def _c(self):
        return self.max_res

    def _arc_access(self, key):
        if key in self.t1:
            self.t1.remove(key)
            self.t2.append(key)
        elif key in self.t2:
            self.t2.remove(key)
            self.t2.append(key)
        elif key in self.b1:
            self.p = min(self._c(), self.p + max(1, len(self.b2) // len(self.b1)))
            self.b1.remove(key)
            self.to_t2.add(key)
        elif key in self.b2:
            self.p = max(0, self.p - max(1, len(self.b1) // len(self.b2)))
            self.b2.remove(key)
            self.to_t2.add(key)

    def _arc_trim(self):
        c = self._c()
        while len(self.t1) + len(self.b1) > c and self.b1:
            self.b1.pop(0)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c and self.b2:
            self.b2.pop(0)


def build(variant: str, capacity: int, future=None) -> EvictionPolicy:
    name, kw = VARIANTS[variant]
    if name == "belady":
        return make_policy("belady", future=future)
    return make_policy(name, **kw)


# -- the simulated pool --------------------------------------------------------------------------
KEYS = [(layer, e) for layer in range(3) for e in range(4)]


@st.composite
def workloads(draw):
    """Capacity, steps (distinct keys, at most C each) and per-step choices of the pool."""
    capacity = draw(st.integers(2, 5))
    n_steps = draw(st.integers(1, 40))
    hot = draw(st.lists(st.sampled_from(KEYS), min_size=capacity + 1, max_size=len(KEYS), unique=True))
    steps = []
    for _ in range(n_steps):
        size = draw(st.integers(1, min(3, capacity)))
        steps.append(draw(st.lists(st.sampled_from(hot), min_size=1, max_size=size, unique=True)))
    choices = draw(st.lists(st.tuples(st.booleans(), st.integers(0, 9), st.integers(0, 2**16)),
                            min_size=n_steps, max_size=n_steps))
    return capacity, steps, choices


def drive(variant, capacity, steps, choices):
    """Run the policy and its reference, each with its own pool, through the same calls; compare."""
    future = [k for step in steps for k in step]
    policy = build(variant, capacity, future)
    ref = Reference(variant, capacity, future)
    pool: set = set()
    ref_pool: set = set()
    hits = ref_hits = 0

    def make_room(step, extra):
        protected = set(step) | extra
        if all(k in protected for k in pool):
            with pytest.raises(RuntimeError):
                policy.victim(protected)
            with pytest.raises(RuntimeError):
                ref.victim(protected)
            protected = set(step)
        v = policy.victim(protected)
        assert v not in protected and v in pool
        assert policy.victim(protected) == v  # victim() does not change the policy
        rv = ref.victim(protected)
        assert v == rv, (variant, v, rv, protected)
        policy.evict(v)
        pool.remove(v)
        ref.evict(rv)
        ref_pool.remove(rv)

    def fill(key):
        policy.admit(key)
        pool.add(key)
        ref.admit(key)
        ref_pool.add(key)

    for step, (interleave, action, seed) in zip(steps, choices, strict=True):
        # now and then the pool protects more than the step (a random subset of the resident keys)
        extra = {k for i, k in enumerate(sorted(pool)) if (seed >> i) & 1} if action in (2, 3) else set()
        misses = []
        for key in step:
            policy.access(key)
            ref.access(key)
            hits += key in pool
            ref_hits += key in ref_pool
            if key in pool:
                continue
            if interleave:  # fill each miss at once (the README's simulator)
                if len(pool) >= capacity:
                    make_room(step, extra)
                fill(key)
            else:
                misses.append(key)
        for key in misses:  # the whole step accessed first (the provider)
            if len(pool) >= capacity:
                make_room(step, extra)
            fill(key)
        if action == 0 and pool:  # the pool invalidates a key
            k = sorted(pool)[seed % len(pool)]
            policy.evict(k)
            pool.remove(k)
            ref.evict(k)
            ref_pool.remove(k)
        elif action == 1 and len(pool) < capacity:  # a prefetch fills a free slot
            outside = [k for k in KEYS if k not in pool]
            fill(outside[seed % len(outside)])
        assert policy.resident() == pool == ref.resident() == ref_pool
        assert len(policy) == len(pool)
        assert set(policy.scores()) == pool
        assert hits == ref_hits
    return hits


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(work=workloads())
def test_policy_matches_reference(work):
    # every variant on each drawn workload: drawing the workload costs more than replaying it
    for variant in VARIANTS:
        note(f"variant: {variant}")
        drive(variant, *work)


# -- known answers -------------------------------------------------------------------------------
def run(policy: EvictionPolicy, requests, capacity: int) -> tuple[int, list]:
    """Per-request pool (access, then fill the miss); returns hits and the victims in order."""
    pool, hits, victims = set(), 0, []
    for key in requests:
        policy.access(key)
        if key in pool:
            hits += 1
            continue
        if len(pool) >= capacity:
            v = policy.victim({key})
            victims.append(v)
            policy.evict(v)
            pool.remove(v)
        policy.admit(key)
        pool.add(key)
    return hits, victims


A, B, C, D, X, Y, Z = ((0, i) for i in range(7))


def test_lru_known():
    assert run(make_policy("lru"), [A, B, A, C, B, D], 2) == (1, [B, A, C])


@pytest.mark.parametrize("name", ["lru", "lfu", "lru2", "arc"])
def test_a_miss_ranks_by_its_access_not_its_admission(name):
    # The provider accesses a whole step, then fills its misses: X (missed) and A (hit) in one step.
    # X was asked for first, so it is the older of the two, whatever the fill order.
    p = make_policy(name)
    p.access(A)
    p.admit(A)
    p.access(X)
    p.access(A)
    p.admit(X)
    p.access(Y)
    assert p.victim({Y}) == X


def test_in_cache_lfu_counts_the_missing_access():
    p = make_policy("lfu", history=False)
    p.access(A)
    p.admit(A)  # a miss filled: count 1
    p.admit(B)  # a prefetch: count 0, though newer
    p.access(C)
    assert p.victim({C}) == B


def test_lfu_counts_since_start_and_breaks_ties_by_recency():
    # A 3x, B 4x; C evicts A (3 < 4). A comes back (evicting C, 1): its count goes on, 4 = B's, and the
    # tie is broken by recency: D evicts B (last used at 7) rather than A (9). Counted since admission
    # instead, A is back at 1 and D evicts it.
    reqs = [A, A, A, B, B, B, B, C, A, D]
    assert run(make_policy("lfu"), reqs, 2) == (5, [A, C, B])
    assert run(make_policy("lfu", history=False), reqs, 2) == (5, [A, C, A])


def test_lfru_keeps_the_hub_through_a_burst():
    # The hub is used 8 times, then a burst of one-off experts: LRU drops the hub, LFRU keeps it.
    reqs = [A] * 8 + [X, Y, Z, B, C, D] + [A]
    lru_hits, lru_victims = run(make_policy("lru"), reqs, 2)
    lfru_hits, lfru_victims = run(make_policy("lfru"), reqs, 2)
    assert A in lru_victims and A not in lfru_victims
    assert lfru_hits == lru_hits + 1
    # the scores by hand: after A x8 (times 1..8) and X at 9, at now=9: A = 8 / (9-8+1) = 4, X = 1 / 1
    p = make_policy("lfru")
    run(p, [A] * 8 + [X], 2)
    assert p.scores() == {A: 4.0, X: 1.0}
    p.access(Y)
    assert p.victim({Y}) == X  # X = 1/2 < A = 8/3


def test_lfru_ties_go_to_least_recent():
    p = LFRUPolicy()
    p.access(B)
    p.admit(B)  # t=1
    p.access(B)  # t=2: B freq 2
    for k in (C, A):  # t=3, 4
        p.access(k)
        p.admit(k)
    p.access(D)  # now 5: A 1/2, B 2/4, C 1/3
    assert p.scores() == {A: 0.5, B: 0.5, C: 1 / 3}
    assert p.victim({D}) == C
    assert p.victim({C, D}) == B  # A and B tie at 1/2; B's last use (2) is older than A's (4)


def test_lru2_prefers_keys_seen_once():
    # B is used twice, then a scan of one-off keys: LRU-2 evicts the scan, not B.
    hits, victims = run(make_policy("lru2"), [B, B, X, Y, Z, B], 2)
    assert B not in victims and hits == 2


def test_lrfu_spans_lru_and_lfu():
    reqs = [A, A, A, B, C, A, B, D, B, C, A, D, D, C, B, A]
    lru, lfu = run(make_policy("lru"), reqs, 2), run(make_policy("lfu"), reqs, 2)
    assert lru != lfu
    assert run(make_policy("lrfu", half_life=0.5), reqs, 2) == lru  # 4^t: the last access decides
    assert run(make_policy("lrfu", half_life=1e4), reqs, 2) == lfu  # ~ the count decides


def test_lrfu_learns_its_half_life_from_the_pool():
    rng = random.Random(1)
    reqs = [(rng.randrange(3), min(int(rng.expovariate(0.4)), 7)) for _ in range(3000)]
    for name in ("lrfu", "lrfu-layered"):
        told, learnt = make_policy(name, capacity=9), make_policy(name)
        assert run(learnt, reqs, 9) == run(told, reqs, 9)
        assert learnt.half_life == told.half_life == 36


def test_lrfu_settles_when_the_pool_never_fills(monkeypatch):
    monkeypatch.setattr(LRFUPolicy, "SETTLE_AFTER", 20)
    reqs = [(0, i % 3) for i in range(30)] + [(0, i % 7) for i in range(200)]
    learnt = LRFUPolicy()
    hits = run(learnt, reqs, 5)
    assert learnt.half_life == 12  # 3 keys resident when the 21st access was logged
    assert hits == run(LRFUPolicy(half_life=12), reqs, 5)


def test_arc_adapts_to_ghost_hits():
    p = make_policy("arc", capacity=2)
    # A twice (T2), then B (T1); C evicts T1's LRU, B, into ghost B1. B's return is a ghost hit: T1's
    # target p grows to 1, so with |T1| = 1 = p the victim comes from T2 (A), and B enters T2.
    assert run(p, [A, A, B, C, B], 2) == (1, [B, A])
    assert p.p == 1
    assert p.scores() == {C: 0.0, B: 1.0}


def test_belady_known_and_checks_the_sequence():
    reqs = [A, B, C, A, B, D, A, D, B, C]
    # D (pos 5) evicts C, next used at 9 (A at 6, B at 8); C (pos 9) finds A, B, D all dead: the least
    # recently used, A (6), goes.
    assert run(make_policy("belady", future=reqs), reqs, 3) == (5, [C, A])
    p = make_policy("belady", future=[A, B])
    p.access(A)
    with pytest.raises(ValueError, match="future sequence says"):
        p.access(C)
    with pytest.raises(ValueError, match="offline"):
        make_policy("belady")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_all_protected_raises_and_bad_calls(variant):
    future = [A, B, C]
    p = build(variant, 2, future)
    with pytest.raises(RuntimeError):
        p.victim(())  # nothing resident
    p.access(A)
    p.admit(A)
    p.access(B)
    p.admit(B)
    with pytest.raises(RuntimeError, match="protected"):
        p.victim([A, B])
    assert p.victim([A]) == B
    with pytest.raises(ValueError):
        p.admit(A)
    with pytest.raises(ValueError):
        p.evict(C)


def test_registry():
    assert set(POLICIES) >= {"lru", "lfu", "lfru"} and "belady" not in POLICIES
    assert DEFAULT_POLICY in POLICIES
    for name in POLICIES:
        assert make_policy(name).name == name
        assert make_policy(name, capacity=8).capacity == 8
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("mru")


# -- Belady is optimal -----------------------------------------------------------------------------
def best_hits(steps, capacity: int) -> int:
    """Most hits any eviction choice gets: exhaustive search over victims (never the step's keys)."""
    flat = [(i, k) for i, step in enumerate(steps) for k in step]

    @functools.cache
    def go(pos: int, cache: frozenset) -> int:
        if pos == len(flat):
            return 0
        i, key = flat[pos]
        if key in cache:
            return 1 + go(pos + 1, cache)
        if len(cache) < capacity:
            return go(pos + 1, cache | {key})
        protected = set(steps[i])
        return max(go(pos + 1, (cache - {v}) | {key}) for v in cache if v not in protected)

    return go(0, frozenset())


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(2, 3),
       steps=st.lists(st.lists(st.sampled_from([(0, e) for e in range(5)]), min_size=1, max_size=2, unique=True),
                      min_size=1, max_size=10))
def test_belady_is_optimal(capacity, steps):
    future = [k for step in steps for k in step]
    policy = BeladyPolicy(future)
    pool, hits = set(), 0
    for step in steps:  # per request, as the brute force does
        for key in step:
            policy.access(key)
            if key in pool:
                hits += 1
                continue
            if len(pool) >= capacity:
                v = policy.victim(step)
                policy.evict(v)
                pool.remove(v)
            policy.admit(key)
            pool.add(key)
    assert hits == best_hits(steps, capacity)


def test_belady_beats_every_online_policy_on_a_skewed_stream():
    rng = random.Random(0)
    reqs = [(rng.randrange(2), min(int(rng.expovariate(0.3)), 11)) for _ in range(2000)]
    opt = run(make_policy("belady", future=reqs), reqs, 6)[0]
    online = {name: run(make_policy(name), reqs, 6)[0] for name in POLICIES}
    assert max(online.values()) < opt
