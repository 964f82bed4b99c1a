"""StatsTracker: rates from consecutive snapshots, recent use decaying in tokens, formatting."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from moechat.app.tui.livestats import StatsTracker, fmt_bytes, fmt_pct, fmt_rate


def snap(freq, ram=0, disk=0, hits=(0, 0), misses=(0, 0)):
    freq = np.asarray(freq)
    return SimpleNamespace(frequency=freq, resident=freq > 0, bytes_from_ram=ram, bytes_from_disk=disk,
                           hits=hits, misses=misses, num_slots=4, slots_used=3, policy="lru", ram_cache_bytes=0,
                           ram_cache_used_bytes=0)


def test_bytes_per_token_and_recent_use():
    t = StatsTracker(half_life_tokens=2.0)
    t.start_generation()
    t.observe_chunk(prompt_tokens=10, generated_tokens=1, prefill_tps=100.0, decode_tps=0.0)
    t.observe_snapshot(snap([[4, 0], [0, 0]], ram=1000, hits=(3, 0), misses=(1, 0)))
    s = t.stats()
    assert t.tokens == 10 and s.bytes_per_token_ram is None  # no previous snapshot to diff against
    assert s.hit_rate == 0.75 and s.layer_hit_rates[0] == 0.75 and math.isnan(s.layer_hit_rates[1])
    t.observe_chunk(10, 5, 100.0, 20.0)  # 4 decode steps later
    t.observe_snapshot(snap([[4, 4], [0, 2]], ram=1000 + 4 * 300, disk=4 * 50))
    s = t.stats()
    assert (s.bytes_per_token_ram, s.bytes_per_token_disk) == (300.0, 50.0)
    # recent use: the old requests decayed over 4 tokens (two half-lives), the new ones are fresh
    assert np.allclose(s.recent, np.array([[1.0, 4.0], [0.0, 2.0]]) / 4.0)
    assert s.decode_tps == 20.0 and s.prefill_tps == 100.0 and s.generated_tokens == 5
    t.sample_rate()
    assert t.stats().decode_history == (20.0,)
    # a second generation counts its tokens after the first one's
    t.start_generation()
    t.observe_chunk(3, 1, 50.0, 0.0)
    assert t.tokens == 17


def test_idle_snapshot_does_not_decay():
    t = StatsTracker()
    t.observe_snapshot(snap([[2, 0]]))
    t.observe_snapshot(snap([[2, 0]]))
    before = t.stats().recent.copy()
    t.observe_snapshot(snap([[2, 0]]))
    assert np.array_equal(t.stats().recent, before)


def test_formatting():
    assert fmt_bytes(None) == "–" and fmt_bytes(512) == "512 B" and fmt_bytes(1536) == "1.5 KiB"
    assert fmt_bytes(300 * 2**20) == "300 MiB" and fmt_bytes(12.25 * 2**30) == "12.2 GiB"
    assert fmt_rate(None) == "–" and fmt_rate(41.66) == "41.7" and fmt_rate(812.4) == "812"
    assert fmt_pct(None) == "–" and fmt_pct(float("nan")) == "–" and fmt_pct(0.8734) == "87.3%"


def test_turn_hit_rate_beside_the_session():
    """After a retune the session's rate hides what the cache does now; this reply's decode rate shows it."""
    t = StatsTracker()
    t.observe_snapshot(snap([[9, 0]], hits=(932, 0), misses=(68, 0)))  # the first replies: 93.2%
    assert t.stats().turn_hit_rate is None  # no reply yet
    t.start_generation()
    t.observe_chunk(5, 1, 100.0, 0.0)  # the first token: the prompt's prefill is done
    t.observe_snapshot(snap([[12, 0]], hits=(932 + 2, 0), misses=(68 + 10, 0)))  # the prefill: not this reply's decode
    assert t.stats().turn_hit_rate is None
    t.observe_chunk(5, 10, 100.0, 20.0)
    t.observe_snapshot(snap([[19, 0]], hits=(934 + 28, 0), misses=(78 + 72, 0)))  # decode: 28 of 100
    s = t.stats()
    assert s.turn_hit_rate == 0.28 and (s.turn_hits, s.turn_misses) == (28, 72)
    assert s.hit_rate == 962 / 1112
    t.start_generation()  # the next reply: the last one's rate stays up until its decode has numbers
    assert t.stats().turn_hit_rate == 0.28
    t.observe_chunk(3, 1, 100.0, 0.0)
    t.observe_snapshot(snap([[20, 0]], hits=(962 + 1, 0), misses=(150 + 5, 0)))
    t.observe_chunk(3, 5, 100.0, 20.0)
    t.observe_snapshot(snap([[21, 0]], hits=(963 + 3, 0), misses=(155 + 1, 0)))
    assert t.stats().turn_hit_rate == 0.75
