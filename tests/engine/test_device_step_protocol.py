"""The zero-copy protocol (issue 32): the residency map's slot and host entries, admission between tokens, eviction,
retuning, the copy-stream order of fills before the map, and where the device-resident step is refused.

Driven through `DeviceResidentProvider.batches` with chosen routing over a real tiny model's RAM tier."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moechat.engine.cache.provider import CacheConfig, CachedProvider
from moechat.engine.cache.provider.device import (
    PREFETCH_REASON,
    DeviceResidentProvider,
    device_step_or_reason,
    device_step_reason,
)
from moechat.engine.cache.residency import ResidencyMap, host_index, host_mapped
from moechat.engine.cache.transfer import RecordingStream
from moechat.engine.errors import ConfigError
from moechat.engine.layers.moe_device import MapBatch
from moechat.engine.runtime.generate import Engine

from ..conftest import TINY_MODELS, build_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_protocol")
    build_tiny_model(path, *TINY_MODELS["qwen3_moe"], seed=2)  # 3 MoE layers of 8 experts, top-2
    return path


def _cached(path, slots, **cache) -> CachedProvider:
    return Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=slots, policy="lru", **cache)).provider


def _device(path, slots, **kw) -> DeviceResidentProvider:
    return DeviceResidentProvider.from_cached(_cached(path, slots), **kw)


def _step(provider, routing: dict[int, list[int]]) -> dict[int, torch.Tensor]:
    """One decode step's MoE layers with these experts (one token): each layer's batch slot ids."""
    out = {}
    for layer, experts in routing.items():
        (batch,) = list(provider.batches(layer, torch.tensor([experts], device=provider.pool.device)))
        out[layer] = batch.slot_ids.clone()
        assert isinstance(batch, MapBatch)
    return out


def test_misses_read_the_host_tier_and_are_admitted_between_tokens(model):
    p = _device(model, 2)
    C = p.pool.num_slots
    layer = min(p.host_views)
    assert all(p.residency.entry(layer, e) == ("host", e) for e in range(p.num_experts))  # nothing slotted yet
    ids = _step(p, {layer: [3, 5]})[layer]
    assert ids.tolist() == [[C + 3, C + 5]]  # read from the RAM tier in place
    assert p.pool.used == 0  # nothing moves inside the step
    p.finish_step()
    s3, s5 = p.pool.slot_of(layer, 3), p.pool.slot_of(layer, 5)
    assert {s3, s5} == {0, 1}
    assert p.residency.entry(layer, 3) == ("slot", s3) and p.residency.entry(layer, 5) == ("slot", s5)
    assert p.residency.map[layer, 3].item() == s3  # published to the device map, in place
    stats = p.stats.layers[layer]
    assert (stats.hits, stats.misses, stats.expert_loads_decode) == (0, 2, 2)
    assert p.frequency[layer, 3] == p.frequency[layer, 5] == 1
    ids = _step(p, {layer: [5, 3]})[layer]  # the next token finds them in their slots
    assert ids.tolist() == [[s5, s3]]
    p.finish_step()
    assert (stats.hits, stats.misses, stats.expert_loads_decode) == (2, 2, 2)


def test_eviction_turns_the_victims_entries_back_to_host_indices(model):
    p = _device(model, 2)
    C = p.pool.num_slots
    layer = min(p.host_views)
    _step(p, {layer: [3, 5]})
    p.finish_step()
    _step(p, {layer: [5]})  # 5 used more recently than 3 (LRU)
    p.finish_step()
    _step(p, {layer: [6]})
    p.finish_step()
    assert p.residency.entry(layer, 3) == ("host", 3)  # the LRU victim: read from RAM again
    assert p.residency.map[layer, 3].item() == C + 3
    assert p.residency.entry(layer, 5)[0] == "slot" and p.residency.entry(layer, 6)[0] == "slot"
    assert p.residency.mismatches(p.pool) == []
    assert torch.equal(p.residency.map, torch.from_numpy(p.residency.mirror))


def test_the_slots_after_each_token_are_todays_slots(model):
    """Admission after the step runs the policy calls today's provider makes during it, in the same order: after
    every token the two pools hold the same experts in the same slots and the same loads were made."""
    for slots in (2, 4, 10):
        today, dev = _cached(model, slots, record_trace=True), DeviceResidentProvider.from_cached(
            _cached(model, slots, record_trace=True))
        layers = sorted(dev.host_views)
        g = np.random.default_rng(slots)
        for _ in range(12):
            routing = {layer: g.choice(dev.num_experts, 2, replace=False).tolist() for layer in layers}
            for layer, experts in routing.items():
                list(today.batches(layer, torch.tensor([experts])))
            _step(dev, routing)
            dev.finish_step()
            np.testing.assert_array_equal(dev.pool.host_map, today.pool.host_map)
        a, b = dev.snapshot(), today.snapshot()
        assert sum(a.hits) + sum(a.misses) == sum(b.hits) + sum(b.misses) == 12 * 2 * len(layers)
        assert a.expert_loads_decode == b.expert_loads_decode and a.bytes_from_ram == b.bytes_from_ram
        # a hit is what the step read from a slot: at least today's (an earlier layer's admission may evict a
        # later layer's expert after the step read it from its slot; today's path then counts a miss)
        assert sum(a.hits) >= sum(b.hits)
        # the heatmap's counters and the routing trace are fed as today's
        np.testing.assert_array_equal(dev.frequency, today.frequency)
        np.testing.assert_array_equal(dev.where_ran, today.where_ran)
        got, want = dev.recorder.to_trace(), today.recorder.to_trace()
        np.testing.assert_array_equal(got.topk_ids, want.topk_ids)


def test_a_retune_rebuilds_the_map_for_the_new_slot_count(model):
    p = _device(model, 2)
    layer = min(p.host_views)
    _step(p, {layer: [1, 2]})
    p.finish_step()
    address = p.residency.map.data_ptr()
    p.resize(5)
    assert p.residency.num_slots == 5 and p.residency.map.data_ptr() == address  # in place
    assert p.residency.entry(layer, 1)[0] == "slot" and p.residency.entry(layer, 2)[0] == "slot"
    assert p.residency.entry(layer, 7) == ("host", 7) and p.residency.map[layer, 7].item() == 5 + 7
    assert p.residency.mismatches(p.pool) == []
    ids = _step(p, {layer: [2, 7]})[layer]
    assert ids.tolist() == [[p.pool.slot_of(layer, 2), 5 + 7]]
    p.resize(1)  # fewer slots than the step's experts: the rest stay in the RAM tier
    ids = _step(p, {layer: [3, 4]})[layer]
    p.finish_step()
    assert p.pool.used == 1 and p.residency.mismatches(p.pool) == []
    assert sorted(e for e in (3, 4) if p.residency.entry(layer, e)[0] == "slot") in ([3], [4])


def test_a_prefill_chunk_takes_todays_path_and_the_map_follows(model):
    p = _device(model, 3)
    layer = min(p.host_views)
    batches = list(p.batches(layer, torch.tensor([[1, 2], [2, 6]])))  # two tokens > max_tokens = 1
    assert not any(isinstance(b, MapBatch) for b in batches)
    assert p.residency.mismatches(p.pool) == [] and p.residency.entry(layer, 6)[0] == "slot"


def test_fills_then_the_map_are_ordered_before_the_next_step(model):
    """The copy-stream protocol on a CPU (RecordingStream logs it; the `gpu` test runs CUDA's): the step's compute is
    waited for first, then each fill, then the map, and the compute stream waits for the map's event."""
    cached = _cached(model, 2)
    cached.copies = RecordingStream()
    p = DeviceResidentProvider.from_cached(cached)
    layer = min(p.host_views)
    _step(p, {layer: [3, 5]})
    p.finish_step()
    log = p.copies.log
    assert log[0] == ("begin",)
    assert [e[0] for e in log[1:5]] == ["copy", "record", "copy", "record"]
    assert log[5:] == [("record", "residency"), ("wait", "residency")]
    _step(p, {layer: [3, 5]})  # all hits: no fill, no map change, nothing waited for
    p.finish_step()
    assert log[7:] == [("begin",)]


def test_a_disk_tier_or_prefetch_refuses_the_device_step(model):
    bounded = _cached(model, 2, ram_cache_bytes=3 * 3 * 32 * 64 * 4)
    reason = device_step_reason(bounded)
    assert reason is not None and "RAM tier" in reason
    with pytest.raises(ConfigError, match="RAM tier"):
        DeviceResidentProvider.from_cached(bounded)
    assert device_step_or_reason(bounded)[0] is bounded
    p = _device(model, 2)
    with pytest.raises(ConfigError, match="prefetch"):
        p.set_prefetch("next-layer")
    fetching = _cached(model, 2, prefetch="next-layer")
    assert device_step_reason(fetching) == PREFETCH_REASON


def test_the_env_switch_selects_the_device_step_or_says_why_not(model, monkeypatch):
    monkeypatch.setenv("MOECHAT_DEVICE_STEP", "1")
    engine = Engine.load(model, dtype="float32", cache=CacheConfig(expert_slots=3))
    assert isinstance(engine.provider, DeviceResidentProvider)
    tokens = [t for c in engine.generate([1, 2, 3], max_tokens=3) for t in c.token_ids]
    assert len(tokens) == 3 and engine.provider.steps_settled >= 2
    engine = Engine.load(model, dtype="float32", cache=CacheConfig(expert_slots=3, ram_cache_bytes=10_000))
    assert type(engine.provider) is CachedProvider
    assert any("device-resident MoE step off" in n for n in engine.notices)


def test_host_index_covers_only_layers_with_a_ram_tier(model):
    p = _device(model, 2)
    index = host_index(p.store, p.num_layers, p.num_experts)
    moe = sorted(p.host_views)
    assert (index[moe] == np.arange(p.num_experts)).all()
    rest = [layer for layer in range(p.num_layers) if layer not in moe]
    assert (index[rest] == -1).all() if rest else True
    assert ResidencyMap(p.pool, index).mismatches(p.pool) == []


@pytest.mark.gpu
def test_cuda_reads_the_pinned_host_tier_in_place_and_orders_fills_by_events(model):
    """On CUDA: the host-mapped view reads pinned RAM without a copy, and a step through the copy stream gives the
    same slots and map as the CPU's protocol, with the compute stream waiting for the map's event."""
    raw = torch.arange(256, dtype=torch.uint8).repeat(4, 1).pin_memory()  # [4, 256]
    mapped = host_mapped(raw, torch.device("cuda"))
    assert mapped.is_cuda and mapped.data_ptr() == raw.data_ptr()
    assert torch.equal(mapped.index_select(0, torch.tensor([2], device="cuda")).cpu(), raw[2:3])
    engine = Engine.load(model, dtype="float32", device="cuda", cache=CacheConfig(expert_slots=2, policy="lru"))
    p = DeviceResidentProvider.from_cached(engine.provider)
    layer = min(p.host_views)
    C = p.pool.num_slots
    ids = _step(p, {layer: [3, 5]})[layer]
    assert ids.tolist() == [[C + 3, C + 5]]
    p.finish_step()
    torch.cuda.current_stream().synchronize()
    assert p.residency.map[layer, 3].item() == p.pool.slot_of(layer, 3)
    assert p.residency.mismatches(p.pool) == []


def test_a_new_ram_tier_is_taken_when_it_holds_every_expert_and_refused_otherwise(model):
    engine = Engine.load(model, dtype="float32", cache=CacheConfig(expert_slots=2, policy="lru"))
    engine.provider = DeviceResidentProvider.from_cached(engine.provider)
    p = engine.provider
    old = p.store
    engine.retune_cache(ram_cache_bytes=1 << 40)  # a new RAM tier with every expert: the map follows it
    assert p.store is not old and p.host_views[min(p.host_views)]["w13"].data_ptr() == \
        p.store.tensors[min(p.host_views)]["w13"].data_ptr()
    assert p.residency.mismatches(p.pool) == []
    with pytest.raises(ConfigError, match="device-resident MoE step cannot use this RAM tier"):
        engine.retune_cache(ram_cache_bytes=20_000)
    assert isinstance(p.store, type(old))
