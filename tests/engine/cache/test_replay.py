"""Any policy at one slot count (engine/cache/replay.py): the real classes driven as the provider drives them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from moechat.engine.cache.mrc import lru_hit_curve
from moechat.engine.cache.policy import POLICIES, make_policy
from moechat.engine.cache.replay import replay_policy
from moechat.engine.cache.trace import DECODE, RoutingTrace

_spec = importlib.util.spec_from_file_location("_mrc_tests", Path(__file__).with_name("test_mrc.py"))
_mrc_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mrc_tests)
recorded_session, DEMO_TRACE = _mrc_tests.recorded_session, _mrc_tests.DEMO_TRACE


def brute_force(policy_name: str, steps, capacity: int) -> tuple[int, int]:
    """(decode hits, decode requests) of the provider's loop; every step here fits in `capacity`."""
    policy = make_policy(policy_name, capacity=capacity)
    resident: set = set()
    hits = requests = 0
    for phase, keys in steps:
        misses = []
        for key in keys:
            policy.access(key)
            requests += phase == DECODE
            if key in resident:
                hits += phase == DECODE
            else:
                misses.append(key)
        for key in misses:
            if len(resident) >= capacity:
                victim = policy.victim(keys)
                policy.evict(victim)
                resident.discard(victim)
            policy.admit(key)
            resident.add(key)
    return hits, requests


@pytest.mark.parametrize("policy", POLICIES)
def test_replay_equals_the_providers_loop(policy):
    trace, steps = recorded_session(3)
    largest = max(len(k) for _, k in steps)
    rates = set()
    for slots in (largest, 12, 30):
        got = replay_policy(trace, policy, slots)
        assert (got.hits, got.requests) == brute_force(policy, steps, slots)
        assert got.policy == policy
        rates.add(got.hits)
    assert len(rates) > 1  # the slot count matters on this trace


@pytest.mark.parametrize("seed", [0, 1])
def test_lru_replay_equals_the_stack_distance_curve(seed):
    trace, steps = recorded_session(seed)
    curve = lru_hit_curve(trace)
    for slots in range(curve.exact_from, curve.max_slots + 2):
        assert replay_policy(trace, "lru", slots).hits == curve.hits_at(slots)


def test_warm_rate_leaves_out_first_uses():
    trace = RoutingTrace.load(DEMO_TRACE)
    every = trace.num_layers * trace.num_experts
    full = replay_policy(trace, "lrfu-layered", every)
    assert full.warm_rate == 1.0  # every expert fits: only first uses miss
    assert full.rate == (full.requests - full.cold) / full.requests < 1.0
    small = replay_policy(trace, "lrfu-layered", 8)
    assert 0.0 < small.rate <= small.warm_rate < 1.0


def test_a_step_bigger_than_the_pool_loads_in_groups():
    # one prefill chunk of 4 tokens routed to 8 distinct experts of one layer, then decode; 3 slots
    ids = np.array([[0, 1], [2, 3], [4, 5], [6, 7]] + [[0, 1]] * 6)
    trace = RoutingTrace(1, 8, 2, layer=np.zeros(10), token=np.arange(10), phase=[0] * 4 + [1] * 6, topk_ids=ids)
    got = replay_policy(trace, "lru", 3)
    assert got.requests == 12 and got.cold == 0  # experts 0 and 1 first appeared in the prefill
    assert got.hits == 10  # the first decode step reloads 0 and 1 (evicted by later groups), then all hit


def test_bad_slot_count():
    trace, _ = recorded_session(0)
    with pytest.raises(ValueError, match="slots"):
        replay_policy(trace, "lru", 0)
