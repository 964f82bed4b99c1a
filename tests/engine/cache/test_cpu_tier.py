"""The cache that exists on a CPU: with misses computed in place (on-miss auto or host) the slots are never filled by
a miss, so hits are counted where they happen, in the RAM tier over the disk (`fast_tier` "ram", `ram_hits` /
`disk_reads`); a warm start warms the RAM tier; prefetch reads ahead from disk into it, or is refused with its
reason when every expert is already in RAM. Output never depends on any of it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moechat.app.cli.main import main
from moechat.engine.cache.provider import CacheConfig
from moechat.engine.errors import ConfigError
from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, do_sample=False)


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def _greedy(engine, ids, n=16):
    return [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=n) for t in c.token_ids]


@pytest.fixture
def qwen(tiny_models):
    path, _ = tiny_models["qwen3_moe"]
    probe = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=1, on_miss='load'))
    layers = len(probe.loaded.cls.moe_layers(probe.args))
    info = dict(path=path, expert_bytes=probe.provider.store.expert_bytes, experts=layers * probe.args.num_experts,
                want=_greedy(Engine.load(path, dtype="float32"), _prompt(9, 1)))
    probe.close()
    return info


def _auto(**kw) -> CacheConfig:
    return CacheConfig(on_miss="auto", **kw)  # what moechat run and the app use (CacheConfig's own default: load)


def _requests(snap) -> int:
    return sum(snap.hits) + sum(snap.misses)


def test_every_expert_in_ram_is_every_request_a_ram_hit(qwen):
    engine = Engine.load(qwen["path"], dtype="float32", cache=_auto(expert_slots=qwen["experts"]))
    assert _greedy(engine, _prompt(9, 1)) == qwen["want"]
    snap = engine.cache_snapshot()
    assert snap.fast_tier == "ram" and snap.on_miss == "auto"
    assert snap.slots_used == 0  # the slots never fill on a CPU that computes misses in place...
    assert sum(snap.disk_reads) == 0 and sum(snap.ram_hits) == _requests(snap) > 0  # ...and nothing was missed
    assert snap.ram_hit_rate == 1.0 and snap.ram_resident.sum() == qwen["experts"] == snap.ram_tier_experts
    data = snap.to_json()
    assert data["fast_tier"] == "ram" and data["ram_hit_rate"] == 1.0 and data["disk_reads"] == 0
    engine.close()


def test_a_bounded_ram_tier_counts_disk_reads_and_a_bigger_one_fewer(qwen):
    rates = []
    for share in (0.25, 0.5, 0.9):
        budget = int(qwen["experts"] * share) * qwen["expert_bytes"]
        engine = Engine.load(qwen["path"], dtype="float32", cache=_auto(ram_cache_bytes=budget))
        assert _greedy(engine, _prompt(9, 1)) == qwen["want"]
        snap = engine.cache_snapshot()
        assert snap.fast_tier == "ram"
        assert sum(snap.ram_hits) + sum(snap.disk_reads) == _requests(snap)
        assert sum(snap.disk_reads) > 0 and snap.bytes_from_disk >= sum(snap.disk_reads) * qwen["expert_bytes"]
        assert snap.ram_tier_experts == int(qwen["experts"] * share)
        assert snap.ram_resident.sum() <= snap.ram_tier_experts
        rates.append(snap.ram_hit_rate)
        engine.close()
    assert rates[0] < rates[2], rates


def test_load_mode_on_a_cpu_keeps_slot_hits(qwen):
    engine = Engine.load(qwen["path"], dtype="float32", cache=CacheConfig(expert_slots=4, on_miss='load'))
    assert _greedy(engine, _prompt(9, 1)) == qwen["want"]
    snap = engine.cache_snapshot()
    assert snap.fast_tier == "slots" and sum(snap.hits) > 0
    assert sum(snap.ram_hits) + sum(snap.disk_reads) == _requests(snap)  # slots are RAM here: all RAM hits
    engine.close()


def test_prefetch_with_every_expert_in_ram_is_refused_with_the_reason(qwen):
    with pytest.raises(ConfigError, match="every expert is already in RAM; bound the RAM tier"):
        Engine.load(qwen["path"], dtype="float32", cache=_auto(expert_slots=6, prefetch="next-layer"))


def test_the_cli_refuses_it_in_one_line(qwen, capsys):
    argv = ["run", str(qwen["path"]), "--prompt-ids", "1,2,3", "--max-tokens", "3", "--expert-slots", "6",
            "--prefetch", "next-layer"]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "--prefetch next-layer has nothing to do here" in err and "Traceback" not in err


@pytest.mark.parametrize("transfer", ["inline", "thread"])
def test_prefetch_reads_ahead_into_a_bounded_ram_tier(qwen, transfer):
    budget = (qwen["experts"] // 2) * qwen["expert_bytes"]
    engine = Engine.load(qwen["path"], dtype="float32",
                         cache=_auto(ram_cache_bytes=budget, prefetch="next-layer", transfer=transfer))
    assert _greedy(engine, _prompt(9, 1)) == qwen["want"]
    engine.provider.quiesce()
    snap = engine.cache_snapshot()
    assert snap.prefetch == "next-layer" and sum(snap.prefetch_issued) > 0
    assert sum(snap.prefetch_used) + sum(snap.prefetch_wasted) <= sum(snap.prefetch_issued)
    assert sum(snap.prefetch_used) > 0  # a read ahead that a layer then found in RAM
    engine.close()


def test_a_warm_start_fills_the_ram_tier_not_the_slots(qwen, tmp_path):
    budget = (qwen["experts"] // 2) * qwen["expert_bytes"]
    config = _auto(ram_cache_bytes=budget, warm_start=True, profile_dir=str(tmp_path))
    engine = Engine.load(qwen["path"], dtype="float32", cache=config)
    _greedy(engine, _prompt(9, 1))
    assert engine.save_routing_profile() is not None
    cold = engine.cache_snapshot().ram_hit_rate
    engine.close()
    warm = Engine.load(qwen["path"], dtype="float32", cache=config)
    snap = warm.cache_snapshot()
    assert snap.warm_loaded == qwen["experts"] // 2 - 1 and snap.slots_used == 0
    assert snap.ram_resident.sum() == snap.warm_loaded
    assert _greedy(warm, _prompt(9, 1)) == qwen["want"]
    assert warm.cache_snapshot().ram_hit_rate > cold
    warm.close()


def test_a_warm_start_with_every_expert_in_ram_loads_nothing(qwen, tmp_path):
    config = _auto(expert_slots=4, warm_start=True, profile_dir=str(tmp_path))
    engine = Engine.load(qwen["path"], dtype="float32", cache=config)
    _greedy(engine, _prompt(9, 1))
    engine.save_routing_profile()
    engine.close()
    again = Engine.load(qwen["path"], dtype="float32", cache=config)
    assert again.cache_snapshot().warm_loaded == 0 and again.cache_snapshot().slots_used == 0
    again.close()


def test_retuning_the_ram_budget_moves_the_figures(qwen):
    engine = Engine.load(qwen["path"], dtype="float32",
                         cache=_auto(ram_cache_bytes=2 * qwen["expert_bytes"], prefetch="next-layer"))
    _greedy(engine, _prompt(9, 1))
    before = engine.cache_snapshot()
    snap = engine.retune_cache(ram_cache_bytes=qwen["experts"] * qwen["expert_bytes"])  # every expert in RAM
    assert snap.ram_tier_experts == qwen["experts"] == snap.ram_resident.sum()
    assert snap.prefetch == "off"  # nothing left to read ahead: switched off, and the snapshot says so
    _greedy(engine, _prompt(9, 1))
    after = engine.cache_snapshot()
    new_disk = sum(after.disk_reads) - sum(before.disk_reads)
    assert new_disk == 0 and sum(after.ram_hits) > sum(before.ram_hits)
    engine.close()


def test_run_json_says_where_hits_came_from(qwen, capsys):
    budget_mb = max(1, (qwen["experts"] // 2) * qwen["expert_bytes"] >> 20)
    argv = ["run", str(qwen["path"]), "--prompt-ids", "1,2,3,4", "--max-tokens", "4", "--json", "--ram-cache-mb",
            str(budget_mb), "--no-warm-start"]
    assert main(argv) == 0
    cache = json.loads(capsys.readouterr().out)["cache"]
    assert cache["fast_tier"] == "ram"
    assert cache["ram_hits"] + cache["disk_reads"] == cache["hits"] + cache["misses"]
    assert all("ram_hits" in layer for layer in cache["layers"])
    assert np.isclose(cache["ram_hit_rate"], cache["ram_hits"] / max(cache["ram_hits"] + cache["disk_reads"], 1))
