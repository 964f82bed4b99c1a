"""Cached against resident: identical greedy output at any slot count and tier set-up."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moechat.app.cli.main import main
from moechat.engine.cache.provider import CacheConfig
from moechat.engine.cache.ram_tier import RamCache, RamStore
from moechat.engine.cache.slots import READY
from moechat.engine.cache.trace import RoutingTrace
from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, do_sample=False)
PROMPT = [(7 * i + 3) % 250 for i in range(21)]


def _tokens(engine, prompt=PROMPT, n=16):
    return [t for c in engine.generate(prompt, sampling=GREEDY, max_tokens=n) for t in c.token_ids]


def _logits(engine, prompt=PROMPT, steps=4):
    """Prefill logits, then `steps` greedy decode steps' logits."""
    seq = engine.new_sequence()
    out = []
    with torch.inference_mode():
        logits = engine._forward(seq, prompt)
        for _ in range(steps):
            out.append(logits)
            logits = engine._forward(seq, [int(logits.argmax())])
    return torch.stack(out)


def _slot_counts(args, n_moe_layers):
    E, K = args.num_experts, args.top_k
    return sorted({1, K, E, n_moe_layers * E})


@pytest.fixture(scope="module")
def resident(tiny_models):
    out = {}
    for name, (path, _) in tiny_models.items():
        engine = Engine.load(path, dtype="float32", prefill_chunk=8)
        out[name] = (engine, _tokens(engine), _logits(engine))
    return out


@pytest.mark.parametrize("tier", ["ram", "ram+disk"])
def test_cached_matches_resident_at_every_slot_count(tiny_models, resident, tiny_name, tier):
    path, _ = tiny_models[tiny_name]
    ref_engine, ref_tokens, ref_logits = resident[tiny_name]
    args = ref_engine.args
    n_moe = len(ref_engine.loaded.provider.layers)
    expert_bytes = 3 * args.moe_intermediate * args.hidden_size * 4
    for slots in _slot_counts(args, n_moe):
        # "ram+disk": a RAM tier of 3 experts, far fewer than the model's, the rest read from the shards
        budget = None if tier == "ram" else 3 * expert_bytes
        engine = Engine.load(path, dtype="float32", prefill_chunk=8,
                             cache=CacheConfig(expert_slots=slots, policy="lru", ram_cache_bytes=budget))
        store = engine.provider.store
        assert isinstance(store, RamStore if tier == "ram" else RamCache)
        assert _tokens(engine) == ref_tokens, f"{slots} slots"
        err = (_logits(engine) - ref_logits).abs().max().item()
        assert err < 1e-5, f"{slots} slots: logits differ by {err:.2e}"
        snap = engine.cache_snapshot()
        assert snap.slots_used <= slots and sum(snap.misses) > 0
        if tier == "ram+disk":
            assert snap.bytes_from_disk > 0 and store.used_bytes <= store.budget_bytes
        # After every eviction path: each ready slot holds exactly its expert's bytes.
        pool = engine.provider.pool
        for slot, key in enumerate(pool.owner):
            if key is not None:
                assert pool.state[slot] == READY and pool.slot_map[key].item() == slot
                want = ref_engine.loaded.provider.expert_weights(*key)
                for name, tensor in pool.views(slot).items():
                    assert torch.equal(tensor, want[name]), (slots, key, name)
        # The device map and its host mirror agree, and -1 means absent.
        assert np.array_equal(pool.slot_map.numpy(), pool.host_map)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_bf16_cached_equals_resident_bit_for_bit(tiny_models, name):
    """In bf16 the order of additions changes the bits: the MoE output is summed in k order in fp32 whatever
    slots hold the experts, however many groups a prefill chunk needs and wherever a miss runs, so a cached
    engine's logits are the resident engine's, exactly (greedy tokens then agree on any model)."""
    path, _ = tiny_models[name]
    ref_engine = Engine.load(path, dtype="bfloat16", prefill_chunk=16)
    ref_logits, ref_tokens = _logits(ref_engine, steps=6), _tokens(ref_engine, n=24)
    args = ref_engine.args
    n_moe = len(ref_engine.loaded.provider.layers)
    for slots in _slot_counts(args, n_moe):
        for on_miss in ("load", "host"):
            engine = Engine.load(path, dtype="bfloat16", prefill_chunk=16,
                                 cache=CacheConfig(expert_slots=slots, policy="lfu", on_miss=on_miss))
            assert torch.equal(_logits(engine, steps=6), ref_logits), (slots, on_miss)
            assert _tokens(engine, n=24) == ref_tokens, (slots, on_miss)
            engine.close()


def test_prefill_loads_each_unique_expert_once(tiny_models):
    path, _ = tiny_models["qwen3_moe"]  # 8 experts, top-2, 3 layers
    prompt = list(range(40))
    for slots in (1, 3, 100):
        engine = Engine.load(path, dtype="float32", prefill_chunk=64,
                             cache=CacheConfig(expert_slots=slots, policy="lru", record_trace=True))
        seq = engine.new_sequence()
        with torch.inference_mode():
            engine._forward(seq, prompt)
        trace = engine.provider.recorder.to_trace()
        for layer, stats in enumerate(engine.provider.stats.layers):
            unique = np.unique(trace.topk_ids[trace.layer == layer]).size
            assert stats.expert_loads_prefill == unique, (slots, layer)
            assert stats.misses == unique and stats.hits == 0
            assert stats.expert_loads_decode == 0


def test_ram_tier_never_exceeds_its_budget(tiny_models):
    path, _ = tiny_models["olmoe"]
    engine = Engine.load(path, dtype="float32",
                         cache=CacheConfig(expert_slots=2, policy="lru", ram_cache_bytes=50_000))
    store = engine.provider.store
    slab_bytes = sum(t.numel() * t.element_size() for t in store.slab.values())
    assert store.raw.numel() <= 50_000 and slab_bytes <= 50_000
    assert store.capacity == 50_000 // store.layout.nbytes  # whole entries, alignment padding included
    _tokens(engine, n=24)
    assert 0 < store.used_bytes <= store.budget_bytes


def test_cli_cache_flags_and_trace(tiny_models, tmp_path, capsys):
    path, ref = tiny_models["mixtral"]
    trace_path = tmp_path / "trace.npz"
    argv = ["run", str(path), "--prompt-ids", "5,6,7,8,9", "--max-tokens", "10", "--temperature", "0",
            "--dtype", "float32", "--json"]
    assert main(argv) == 0
    resident = json.loads(capsys.readouterr().out)
    assert main([*argv, "--expert-slots", "2", "--policy", "lru", "--ram-cache-mb", "0",
                 "--record-trace", str(trace_path)]) == 0
    cached = json.loads(capsys.readouterr().out)
    assert cached["token_ids"] == resident["token_ids"]
    cache = cached["cache"]
    assert cache["slots"] == 2 and cache["policy"] == "lru"
    assert cache["hits"] + cache["misses"] > 0 and cache["bytes_from_ram"] == 0 and cache["bytes_from_disk"] > 0
    assert cache["expert_loads_prefill"] > 0
    assert resident["cache"]["mode"] == "resident"
    assert main([*argv, "--expert-slots", "1", "--ram-cache-mb", "0", "--repack-dir", str(tmp_path / "rp")]) == 0
    repacked = json.loads(capsys.readouterr().out)
    assert repacked["token_ids"] == resident["token_ids"] and (tmp_path / "rp" / "experts.bin").is_file()
    trace = RoutingTrace.load(trace_path)
    assert trace.num_layers == 3 and trace.top_k == 2
    # 5 prompt tokens prefilled, then 9 decode steps (the 10th token is never fed), at each of 3 layers
    assert (trace.phase == 0).sum() == 5 * 3 and (trace.phase == 1).sum() == 9 * 3


def test_retune_between_tokens_keeps_output_identical(tiny_models, resident):
    """Resize the pool, switch policy and bound the RAM tier mid-generation: same greedy tokens."""
    path, _ = tiny_models["qwen3_moe"]
    _, ref_tokens, _ = resident["qwen3_moe"]
    engine = Engine.load(path, dtype="float32", prefill_chunk=8)
    got = []
    changes = {3: dict(expert_slots=4), 6: dict(policy="lfu"), 9: dict(expert_slots=1, ram_cache_bytes=20_000),
               12: dict(expert_slots=24, ram_cache_bytes=10**9)}
    for i, chunk in enumerate(engine.generate(PROMPT, sampling=GREEDY, max_tokens=16)):
        got.extend(chunk.token_ids)
        if i in changes:
            snap = engine.retune_cache(**changes[i])
            assert snap.num_slots == changes[i].get("expert_slots", snap.num_slots)
    assert got == ref_tokens
    snap = engine.cache_snapshot()
    assert snap.policy == "lfu" and snap.num_slots == 24 and isinstance(engine.provider.store, RamStore)
    pool = engine.provider.pool
    source = resident["qwen3_moe"][0].loaded.provider
    for slot, key in enumerate(pool.owner):
        if key is not None:
            assert torch.equal(pool.views(slot)["w2"], source.expert_weights(*key)["w2"])


def test_repacked_disk_tier_matches_resident_and_is_reused(tiny_models, resident, tmp_path):
    from moechat.engine.cache.repacked import RepackedStore

    path, _ = tiny_models["mixtral"]
    ref_engine, ref_tokens, ref_logits = resident["mixtral"]
    config = CacheConfig(expert_slots=2, policy="lru", ram_cache_bytes=20_000, repack_dir=str(tmp_path / "rp"))
    engine = Engine.load(path, dtype="float32", prefill_chunk=8, cache=config)
    repacked = engine.provider.store.disk
    assert isinstance(repacked, RepackedStore)
    assert repacked.path.stat().st_size == 3 * 4 * repacked.expert_bytes  # 3 layers x 4 experts
    assert _tokens(engine) == ref_tokens
    assert (_logits(engine) - ref_logits).abs().max().item() < 1e-5
    assert engine.cache_snapshot().bytes_from_disk > 0
    # Record k of the file is expert k's w13 then w2, exactly.
    raw = torch.from_file(str(repacked.path), size=repacked.path.stat().st_size // 4, dtype=torch.float32)
    w = ref_engine.loaded.provider.expert_weights(2, 3)
    k = repacked.index[(2, 3)] * repacked.expert_bytes // 4
    assert torch.equal(raw[k : k + w["w13"].numel()], w["w13"].reshape(-1))
    # A second load reuses the file; a sidecar that no longer matches makes it write a fresh one.
    mtime = repacked.path.stat().st_mtime_ns
    Engine.load(path, dtype="float32", cache=config)
    assert repacked.path.stat().st_mtime_ns == mtime
    repacked.path.with_suffix(".json").write_text("{}")
    again = Engine.load(path, dtype="float32", cache=config)
    assert _tokens(again) == ref_tokens
