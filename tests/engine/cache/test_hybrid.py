"""Hybrid execution: a miss is loaded into a slot or computed on the host from the RAM tier. Output never
depends on where an expert ran; the cost model's choices follow the numbers it is given."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moechat.engine.cache.hybrid import MissCostModel
from moechat.engine.cache.provider import CacheConfig
from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, do_sample=False)


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def _greedy(engine, ids, n=12):
    return [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=n) for t in c.token_ids]


def test_output_is_the_same_wherever_experts_run(tiny_models, tiny_name):
    path, _ = tiny_models[tiny_name]
    ids = _prompt(11, seed=3)  # a prefill chunk, then decode
    want = _greedy(Engine.load(path, dtype="float32"), ids)
    probe = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=1))
    layers = len(probe.loaded.cls.moe_layers(probe.args))
    expert_bytes = probe.provider.store.expert_bytes
    probe.close()
    cases = [("load", 0, 1, None), ("host", 0, 1, None), ("auto", 0, 2, None), ("host", 0, 3, 4 * expert_bytes),
             ("load", 1, 2, None), ("auto", layers, 1, None), ("host", 0, 1, 0)]
    for on_miss, host_layers, slots, ram in cases:
        engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=slots, ram_cache_bytes=ram,
                                                                      on_miss=on_miss, host_layers=host_layers))
        assert _greedy(engine, ids) == want, (tiny_name, on_miss, host_layers, slots, ram)
        snap = engine.provider.snapshot()
        host = sum(snap.host_computed)
        if ram == 0:
            assert host == 0  # no RAM tier to compute from: every miss is loaded
        elif on_miss == "host" or host_layers == layers:
            assert host > 0 and (ram is not None or snap.expert_loads_decode == 0)
        if host_layers:
            assert all(snap.host_computed[i] > 0 for i in engine.loaded.cls.moe_layers(engine.args)[:host_layers])
            assert not snap.resident[engine.loaded.cls.moe_layers(engine.args)[:host_layers]].any()
        engine.close()


def _logits(engine, ids, steps=4):
    """Prefill logits, then `steps` greedy decode steps' logits."""
    seq = engine.new_sequence()
    out = []
    with torch.inference_mode():
        logits = engine._forward(seq, ids)
        for _ in range(steps):
            out.append(logits)
            logits = engine._forward(seq, [int(logits.argmax())])
    return torch.stack(out)


def _split_engine(path, dtype, fmt=None, on_miss="host"):
    """Half of every MoE layer's experts warm in slots, misses on the host: most steps are split. Each call of the
    provider's `batches` is recorded as the list of its batches' (slots, virtual slot ids, host buffers or None)."""
    probe = Engine.load(path, dtype=dtype)
    layers, E = probe.loaded.cls.moe_layers(probe.args), probe.args.num_experts
    engine = Engine.load(path, dtype=dtype, expert_format=fmt, prefill_chunk=8,
                         cache=CacheConfig(expert_slots=len(layers) * E // 2, on_miss=on_miss))
    provider = engine.provider
    counts = np.zeros((provider.num_layers, E))
    counts[layers, ::2] = 1  # the even experts of every MoE layer
    assert provider.warm(counts) == len(layers) * E // 2
    calls = []
    batches = provider.batches

    def recording(layer, topk_ids):
        calls.append([])
        for batch in batches(layer, topk_ids):
            calls[-1].append((provider.pool.num_slots, batch.slot_ids_cpu.clone(), batch.host_tensors))
            yield batch

    provider.batches = recording
    return engine, calls


def _split(call) -> bool:
    return any((s < C).any() and (s >= C).any() and host is not None for C, s, host in call)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_split_steps_run_in_one_pass_with_the_resident_bits(tiny_models, tiny_name, dtype):
    """On a CPU a step whose experts are split between the slots and the RAM tier is one batch (slot ids past the
    pool index the RAM tier's buffers), and its logits are the resident engine's bit for bit."""
    path, _ = tiny_models[tiny_name]
    ids = _prompt(11, seed=5)
    want = _logits(Engine.load(path, dtype=dtype, prefill_chunk=8), ids)
    for on_miss in ("host", "auto"):
        engine, calls = _split_engine(path, dtype, on_miss=on_miss)
        assert torch.equal(_logits(engine, ids), want), on_miss
        assert all(len(call) == 1 for call in calls)  # one pass per layer per forward
        assert any(_split(call) for call in calls)
        snap = engine.provider.snapshot()
        assert sum(snap.host_computed) > 0 and sum(snap.hits) > 0 and snap.expert_loads_decode == 0
        engine.close()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_split_steps_of_packed_experts_in_one_pass(tiny_models, fmt):
    path, _ = tiny_models["qwen3_moe"]
    ids = _prompt(9, seed=6)
    want = _logits(Engine.load(path, dtype="float32", expert_format=fmt, prefill_chunk=8), ids)
    engine, calls = _split_engine(path, "float32", fmt)
    assert torch.equal(_logits(engine, ids), want)
    assert all(len(call) == 1 for call in calls) and any(_split(call) for call in calls)
    engine.close()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_host_compute_from_packed_experts(tiny_models, fmt):
    path, _ = tiny_models["qwen3_moe"]
    ids = _prompt(9, seed=4)
    want = _greedy(Engine.load(path, dtype="float32", expert_format=fmt), ids)
    for on_miss in ("host", "auto"):
        engine = Engine.load(path, dtype="float32", expert_format=fmt,
                             cache=CacheConfig(expert_slots=2, on_miss=on_miss))
        assert _greedy(engine, ids) == want
        assert sum(engine.provider.snapshot().host_computed) > 0
        engine.close()


def test_host_experts_are_never_evicted_by_the_steps_loads(tiny_models):
    """A RAM cache of 3 experts: 2 may be pinned for host compute, the third carries this step's loads."""
    path, _ = tiny_models["qwen3_moe_dense_layer"]  # top-3: a step needs more than the tier holds
    ids = _prompt(6, seed=8)
    want = _greedy(Engine.load(path, dtype="float32"), ids)
    probe = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=1))
    expert_bytes = probe.provider.store.expert_bytes
    probe.close()
    engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=2, ram_cache_bytes=3 * expert_bytes,
                                                                  on_miss="host"))
    assert _greedy(engine, ids) == want
    snap = engine.provider.snapshot()
    assert sum(snap.host_computed) > 0 and snap.expert_loads_decode + snap.expert_loads_prefill > 0
    engine.close()


GPT_OSS = dict(expert_bytes=13_236_480, expert_flops=2.0 * 3 * 2880 * 2880)


def test_cost_model_slow_link_runs_decode_misses_on_the_host():
    model = MissCostModel(**GPT_OSS, link_gbps=4.0, host_gbps=40.0, host_gflops=200.0, device_gbps=1000.0,
                          device_gflops=50_000.0)  # a PCIe 3.0 x4 eGPU
    assert model.decide(tokens=1, reuse=0.0)[0] == "host"
    assert model.decide(tokens=1, reuse=2.0)[0] == "host"


def test_cost_model_fast_link_and_reuse_load():
    model = MissCostModel(**GPT_OSS, link_gbps=50.0, host_gbps=20.0, host_gflops=100.0, device_gbps=1000.0,
                          device_gflops=50_000.0)
    assert model.decide(tokens=1, reuse=0.0)[0] == "load"  # 0.26 ms over the link vs 1.2 ms on a slow host
    hot = MissCostModel(**GPT_OSS, link_gbps=25.0, host_gbps=60.0, host_gflops=400.0, device_gbps=1000.0,
                        device_gflops=50_000.0)  # 0.53 ms over the link vs 0.39 ms on the host, once
    cold_choice, why = hot.decide(tokens=1, reuse=0.0)
    assert cold_choice == "host" and "ms" in why
    assert hot.decide(tokens=1, reuse=4.0)[0] == "load"  # used again soon: worth a slot


def test_cost_model_prefill_loads():
    model = MissCostModel(**GPT_OSS, link_gbps=25.0, host_gbps=40.0, host_gflops=200.0, device_gbps=1000.0,
                          device_gflops=50_000.0)
    assert model.decide(tokens=512, reuse=0.0)[0] == "load"


def test_cost_model_on_a_cpu_only_machine_never_copies():
    model = MissCostModel(**GPT_OSS, link_gbps=None, host_gbps=20.0, host_gflops=100.0)
    for tokens, reuse in ((1, 0.0), (1, 8.0), (512, 8.0)):
        assert model.decide(tokens, reuse)[0] == "host"


def test_cost_model_pays_the_host_pass_once_per_layer():
    """A layer's host experts share one pass (on CUDA two activation copies): a miss a little cheaper on the host
    alone does not pay for the pass, several together do."""
    model = MissCostModel(**GPT_OSS, link_gbps=25.0, host_gbps=24.83, host_gflops=1e6, device_gbps=1000.0,
                          device_gflops=50_000.0)
    margin = model.margin(1, 0.0)
    assert 0 < margin < model.host_pass_s < 5 * margin
    assert model.decide(1, 0.0)[0] == "load"
    assert model.place([(1, 0.0)]) == [False]
    assert model.place([(1, 0.0)] * 5) == [True] * 5
    assert model.place([(1, 0.0)] * 5 + [(1, 8.0)]) == [True] * 5 + [False]  # a hot one still loads
    cpu = MissCostModel(**GPT_OSS, link_gbps=None, host_gbps=20.0, host_gflops=100.0)
    assert cpu.host_pass_s == 0 and cpu.place([(1, 0.0), (64, 8.0)]) == [True, True]


def test_cost_model_learns_the_host_rate():
    model = MissCostModel(**GPT_OSS, link_gbps=25.0, host_gbps=10.0, host_gflops=50.0)
    slow = model.t_host(1)
    for _ in range(10):
        model.observe_host(1, slow / 4)  # the host turns out 4x faster than assumed
    assert model.t_host(1) < slow / 2


def test_cli_reports_where_experts_ran(tiny_models, capsys):
    from moechat.app.cli.main import main

    path, _ = tiny_models["mixtral"]
    rc = main(["run", str(path), "--prompt-ids", "1,2,3", "--max-tokens", "4", "--temperature", "0", "--dtype",
               "float32", "--expert-slots", "1", "--on-miss", "host", "--host-layers", "1", "--json"])
    assert rc == 0
    cache = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cache"]
    assert cache["on_miss"] == "host" and cache["host_layers"] == 1 and cache["host_computed"] > 0
    assert cache["layers"][0]["host_computed"] > 0
