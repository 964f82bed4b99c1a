"""Prefetch: output identical to the resident run, counts that add up, clean cancellation, warm start."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

from moechat.app.cli.main import main
from moechat.engine.cache.prefetch import PREFETCH_MODES, Predictor, load_profile, profile_path, save_profile
from moechat.engine.cache.provider import CacheConfig
from moechat.engine.cache.slots import FREE, LOADING, READY
from moechat.engine.cache.transfer import CANCELLED, DONE, Job, ThreadTransfer
from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, do_sample=False)
PROMPT = [(7 * i + 3) % 250 for i in range(21)]


def _tokens(engine, prompt=PROMPT, n=16):
    return [t for c in engine.generate(prompt, sampling=GREEDY, max_tokens=n) for t in c.token_ids]


def _logits(engine, prompt=PROMPT, steps=6):
    seq = engine.new_sequence()
    out = []
    try:
        with torch.inference_mode():
            logits = engine._forward(seq, prompt)
            for _ in range(steps):
                out.append(logits)
                logits = engine._forward(seq, [int(logits.argmax())])
    finally:
        engine.provider.quiesce() if hasattr(engine.provider, "quiesce") else None
    return torch.stack(out)


@pytest.fixture(scope="module")
def resident(tiny_models):
    out = {}
    for name, (path, _) in tiny_models.items():
        engine = Engine.load(path, dtype="float32", prefill_chunk=8)
        out[name] = (_tokens(engine), _logits(engine))
    return out


def _check_pool(provider):
    """Every slot FREE or READY, and the maps agree with the owners."""
    pool = provider.pool
    assert not provider.inflight
    assert set(pool.state.tolist()) <= {FREE, READY}
    for slot, key in enumerate(pool.owner):
        if key is None:
            assert pool.state[slot] == FREE
        else:
            assert pool.host_map[key] == slot and int(pool.slot_map[key]) == slot
    assert int((pool.host_map >= 0).sum()) == pool.used
    assert provider.policy.resident() == {k for k in pool.owner if k is not None}


# (mode, depth, transfer): every mode, both transfer engines, depth 1 and 2
SETTINGS = [("next-layer", 1, "thread"), ("next-layer", 2, "inline"), ("previous-token", 1, "thread"),
            ("both", 2, "thread")]


def test_prefetch_matches_resident_on_every_architecture(tiny_models, resident, tiny_name):
    path, _ = tiny_models[tiny_name]
    ref_tokens, ref_logits = resident[tiny_name]
    probe = Engine.load(path, dtype="float32", prefill_chunk=8, cache=CacheConfig())
    E, K = probe.args.num_experts, probe.args.top_k
    n_moe = len(probe.provider.predictor.moe_layers)
    issued = used = 0
    for mode, depth, transfer in SETTINGS:
        for slots in sorted({1, K, 2 * K, E + K, n_moe * E}):
            config = CacheConfig(expert_slots=slots, prefetch=mode, prefetch_depth=depth, transfer=transfer)
            engine = Engine.load(path, dtype="float32", prefill_chunk=8, cache=config)
            where = f"{tiny_name} {mode} depth {depth} {transfer}, {slots} slots"
            assert _tokens(engine) == ref_tokens, where
            _check_pool(engine.provider)
            torch.testing.assert_close(_logits(engine), ref_logits, atol=1e-5, rtol=0, msg=where)
            snap = engine.cache_snapshot()
            issued += sum(snap.prefetch_issued)
            used += sum(snap.prefetch_used)
            assert sum(snap.prefetch_used) + sum(snap.prefetch_wasted) <= sum(snap.prefetch_issued), where
            assert sum(snap.prefetch_late) <= sum(snap.prefetch_used), where
            assert all(c <= p for c, p in zip(snap.predicted_correct, snap.predicted, strict=True)), where
    assert issued > 0 and used > 0  # the settings above really prefetched


def test_prefetch_off_issues_nothing_and_counts_demand_misses(tiny_models):
    path, _ = tiny_models["qwen3_moe"]
    engine = Engine.load(path, dtype="float32", prefill_chunk=8, cache=CacheConfig(expert_slots=4))
    _tokens(engine)
    snap = engine.cache_snapshot()
    assert snap.prefetch == "off" and sum(snap.prefetch_issued) == 0 and sum(snap.predicted) == 0
    assert snap.demand_misses == sum(snap.misses) > 0
    assert snap.stall_seconds >= snap.load_seconds > 0


def test_next_layer_predictor_scores_its_predictions(tiny_models):
    """Precision and recall per layer come from comparing each prediction with the routing that followed."""
    path, _ = tiny_models["qwen3_moe"]
    engine = Engine.load(path, dtype="float32", prefill_chunk=64,
                         cache=CacheConfig(prefetch="next-layer", transfer="inline"))
    _tokens(engine, n=12)
    snap = engine.cache_snapshot()
    K = engine.args.top_k
    # Layer 0 is never predicted; layers 1 and 2 once per step (1 prefill chunk + 11 decode steps; the 12th
    # token is sampled from the last step's logits without another forward). A chunk's budget is K per token.
    assert snap.predicted[0] == 0 and snap.routed[0] == 0
    for layer in (1, 2):
        assert 11 * K < snap.predicted[layer] <= 11 * K + engine.args.num_experts, snap.predicted
        assert 0 <= snap.predicted_correct[layer] <= snap.predicted[layer]
    layers = snap.to_json()["layers"]
    assert layers[1]["precision"] == round(snap.predicted_correct[1] / snap.predicted[1], 6)
    assert layers[0]["precision"] is None


class SlowStore:
    """The real store, each read held up by a delay (and optionally a gate): loads stay in flight."""

    def __init__(self, store, delay: float, gate: threading.Event | None = None, on_read=None):
        self.store = store
        self.delay = delay
        self.gate = gate
        self.on_read = on_read  # called at the start of every read, on the reading thread
        self.reads: list[float] = []
        self.disk = getattr(store, "disk", None)

    def read_into(self, layer, expert, dst):
        if self.on_read is not None:
            self.on_read()
        if self.gate is not None:
            self.gate.wait(5)
        time.sleep(self.delay)
        self.reads.append(time.perf_counter())
        return self.store.read_into(layer, expert, dst)


def _worker_running(provider) -> bool:
    """This provider's transfer thread is alive (other tests' engines are not this test's business)."""
    thread = getattr(provider.transfer, "_thread", None)
    return thread is not None and thread.is_alive()


def _held_worker(tiny_models, keys):
    """A provider whose transfer worker is held inside the load of keys[0] (until the returned gate is set)
    while the other keys' prefetch jobs wait in its queue; returns (provider, gate, jobs by key)."""
    path, _ = tiny_models["qwen3_moe"]
    provider = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=24)).provider
    assert isinstance(provider.transfer, ThreadTransfer)
    gate = threading.Event()
    provider.store = SlowStore(provider.store, delay=0.0, gate=gate)
    jobs = {}
    for key in keys:
        slot = provider.pool.begin_load(*key)
        provider.policy.admit(key)
        provider.prefetched.add(key)
        jobs[key] = provider.inflight[key] = Job(key, slot, lambda key=key, slot=slot: provider._load_bytes(key, slot))
        provider.transfer.submit(jobs[key])
    deadline = time.monotonic() + 10
    while jobs[keys[0]].state != "running" and time.monotonic() < deadline:
        time.sleep(0.01)
    return provider, gate, jobs


def test_cancel_with_loads_in_flight_stops_every_thread_and_keeps_the_cache_consistent(tiny_models, resident):
    path, _ = tiny_models["mixtral"]
    engine = Engine.load(path, dtype="float32", prefill_chunk=8,
                         cache=CacheConfig(expert_slots=6, prefetch="both", prefetch_depth=2))
    provider = engine.provider
    cancel = threading.Event()
    chunks = []
    worker_alive = []

    def on_read():  # the request is cancelled from inside a prefetch read: a load is in flight right then
        if threading.current_thread().name.startswith("moechat-prefetch") and len(chunks) >= 2 and not cancel.is_set():
            worker_alive.append(_worker_running(provider))
            cancel.set()

    slow = provider.store = SlowStore(provider.store, delay=0.02, on_read=on_read)
    for chunk in engine.generate(PROMPT, sampling=GREEDY, max_tokens=64, cancel=cancel):
        chunks.append(chunk)
    assert cancel.is_set() and worker_alive == [True], "the request was cancelled during a prefetch read"
    assert chunks[-1].finish_reason == "cancelled"
    assert not _worker_running(provider)
    _check_pool(provider)
    n = len(slow.reads)
    time.sleep(0.1)
    assert len(slow.reads) == n, "a load ran after the request ended"
    # The next request on the same cache: same output as the resident model.
    provider.store = slow.store
    assert _tokens(engine) == resident["mixtral"][0]


def test_abandoned_generation_stops_loads_too(tiny_models):
    """A consumer that just stops iterating (GeneratorExit) gets the same clean stop as cancel."""
    path, _ = tiny_models["olmoe"]
    engine = Engine.load(path, dtype="float32", prefill_chunk=8, cache=CacheConfig(expert_slots=8, prefetch="both"))
    engine.provider.store = SlowStore(engine.provider.store, delay=0.02)
    stream = engine.generate(PROMPT, sampling=GREEDY, max_tokens=64)
    next(stream)
    next(stream)
    stream.close()
    assert not _worker_running(engine.provider)
    _check_pool(engine.provider)


def test_quiesce_cancels_queued_loads_and_finishes_the_running_one(tiny_models):
    """Deterministic: the worker is held inside one load while two more wait in the queue."""
    provider, gate, by_key = _held_worker(tiny_models, [(1, 0), (1, 1), (1, 2)])
    jobs = list(by_key.values())
    assert [j.state for j in jobs] == ["running", "pending", "pending"]
    assert all(provider.pool.state[j.slot] == LOADING for j in jobs)
    threading.Timer(0.1, gate.set).start()
    provider.quiesce()
    assert [j.state for j in jobs] == [DONE, CANCELLED, CANCELLED]
    assert provider.pool.host_map[1, 0] >= 0 and provider.pool.host_map[1, 1] < 0
    assert provider.stats.layers[1].prefetch_wasted == 2
    assert not _worker_running(provider)
    _check_pool(provider)


def test_a_prefetch_never_evicts_what_the_step_needs(tiny_models):
    """With slots = top-k + 1, layer l's experts are protected: at most one slot is ever free to prefetch into."""
    path, _ = tiny_models["qwen3_moe"]
    K = 2
    engine = Engine.load(path, dtype="float32", prefill_chunk=64,
                         cache=CacheConfig(expert_slots=K + 1, prefetch="next-layer", prefetch_depth=2,
                                           transfer="inline"))
    provider = engine.provider
    issued_per_step = []
    orig = provider._prefetch_after

    def spy(layer, experts):
        before = sum(s.prefetch_issued for s in provider.stats.layers)
        orig(layer, experts)
        resident = {e for (lay, e) in provider.pool.owner if lay == layer}
        assert set(experts) <= resident, "a prefetch evicted an expert the layer is about to use"
        issued_per_step.append(sum(s.prefetch_issued for s in provider.stats.layers) - before)

    provider._prefetch_after = spy
    _tokens(engine, prompt=PROMPT[:1], n=8)
    assert max(issued_per_step) <= 1 and sum(issued_per_step) > 0


def test_warm_start_loads_the_saved_profile_and_keeps_output(tiny_models, resident, tmp_path):
    path, _ = tiny_models["qwen3_moe"]
    config = CacheConfig(expert_slots=8, prefetch="off", warm_start=True, profile_dir=str(tmp_path))
    first = Engine.load(path, dtype="float32", prefill_chunk=8, cache=config)
    assert first.cache_snapshot().warm_loaded == 0  # nothing saved yet
    assert _tokens(first) == resident["qwen3_moe"][0]
    cold = first.cache_snapshot()
    first.close()
    saved = profile_path(path, tmp_path)
    assert saved.exists()
    second = Engine.load(path, dtype="float32", prefill_chunk=8, cache=config)
    snap = second.cache_snapshot()
    assert snap.warm_loaded == 8 and snap.slots_used == 8
    counts = load_profile(saved, second.args.num_hidden_layers, second.args.num_experts)
    top = {divmod(int(i), second.args.num_experts) for i in np.argsort(-counts, axis=None, kind="stable")[:8]}
    assert {k for k in second.provider.pool.owner if k is not None} == top
    assert _tokens(second) == resident["qwen3_moe"][0]
    assert second.cache_snapshot().demand_misses < cold.demand_misses


def test_profiles_merge_and_ignore_damage(tmp_path):
    path = tmp_path / "p.json"
    save_profile(path, np.array([[1, 0], [0, 3]]))
    save_profile(path, np.array([[0, 2], [0, 1]]), decay=0.5)
    np.testing.assert_allclose(load_profile(path, 2, 2), [[0.5, 2], [0, 2.5]])
    assert load_profile(path, 3, 2) is None  # another model's shape
    path.write_text("{not json")
    assert load_profile(path, 2, 2) is None
    save_profile(path, np.array([[1, 1], [1, 1]]))  # a damaged profile is replaced, not fatal
    np.testing.assert_allclose(load_profile(path, 2, 2), np.ones((2, 2)))


def test_retune_prefetch_between_tokens(tiny_models, resident):
    path, _ = tiny_models["olmoe"]
    engine = Engine.load(path, dtype="float32", prefill_chunk=8, cache=CacheConfig(expert_slots=9))
    out = []
    for i, chunk in enumerate(engine.generate(PROMPT, sampling=GREEDY, max_tokens=16)):
        out.extend(chunk.token_ids)
        if i == 3:
            snap = engine.retune_cache(prefetch="both", prefetch_depth=2)
            assert (snap.prefetch, snap.prefetch_depth) == ("both", 2)
        if i == 9:
            engine.retune_cache(expert_slots=5, prefetch="next-layer")
    assert out == resident["olmoe"][0]
    assert sum(engine.cache_snapshot().prefetch_issued) > 0
    with pytest.raises(ValueError, match="prefetch mode"):
        engine.retune_cache(prefetch="sideways")


def test_predictor_previous_token_and_budget():
    H, E = 8, 6
    routers = {}
    torch.manual_seed(0)
    from moechat.engine.cache.prefetch import RouterWeights

    for layer in range(3):
        routers[layer] = RouterWeights(torch.randn(H), torch.randn(E, H), 1e-6)  # norm weights of both signs
    p = Predictor(routers, top_k=2, num_layers=3)
    assert p.targets(0, 1) == [1] and p.targets(0, 4) == [1, 2] and p.targets(2, 1) == []
    h = torch.randn(1, H)
    nxt = p.predict("next-layer", 1, h, budget=2)
    as_layer_1 = torch.nn.functional.rms_norm(h, (H,), routers[1].norm, eps=1e-6) @ routers[1].gate.t()  # [1, E]
    expected = torch.topk(as_layer_1, 2).indices
    assert nxt == expected[0].tolist()
    wide = torch.topk(as_layer_1, 4).indices[0].tolist()
    assert p.predict("next-layer", 1, h, budget=4) == wide  # a budget above K adds the router's runners-up
    assert p.predict("previous-token", 1, h, budget=4) == []
    p.observe_routing(1, [5, 4])
    assert p.predict("previous-token", 1, h, budget=4) == [5, 4]
    both = p.predict("both", 1, h, budget=3)
    assert both[:2] == nxt and len(both) == 3 and set(both) <= set(nxt) | {5, 4}
    prefill = p.predict("next-layer", 1, torch.randn(10, H), budget=E)
    assert len(set(prefill)) == len(prefill) <= E
    assert set(PREFETCH_MODES) == {"off", "next-layer", "previous-token", "both"}


def test_cli_prefetch_flags_and_json(tiny_models, capsys):
    path, _ = tiny_models["qwen3_moe"]
    argv = ["run", str(path), "--prompt-ids", "1,2,3,4,5", "--max-tokens", "6", "--temperature", "0", "--json",
            "--expert-slots", "6", "--on-miss", "load", "--prefetch", "both", "--prefetch-depth", "2"]
    assert main(argv) == 0  # misses loaded into slots (on a CPU computing them in place, see test_cpu_tier.py)
    cache = json.loads(capsys.readouterr().out)["cache"]
    assert cache["prefetch"] == "both" and cache["prefetch_depth"] == 2
    for field in ("prefetch_issued", "prefetch_used", "prefetch_wasted", "demand_misses", "stall_seconds",
                  "prefetch_precision", "prefetch_recall", "warm_loaded"):
        assert field in cache
    assert "prefetch_issued" in cache["layers"][1] and "recall" in cache["layers"][1]
    assert cache["warm_loaded"] == 0
    assert main(argv) == 0  # the second run starts warm from the profile the first one saved
    assert json.loads(capsys.readouterr().out)["cache"]["warm_loaded"] > 0
    assert main(argv + ["--no-warm-start"]) == 0
    assert json.loads(capsys.readouterr().out)["cache"]["warm_loaded"] == 0
    with pytest.raises(SystemExit) as exit_:  # a usage error (2) in run as in chat
        main(argv[:-2] + ["--prefetch-depth", "9"])
    assert exit_.value.code == 2 and "--prefetch-depth: expected a number <= 4, got 9" in capsys.readouterr().err


def test_default_mode_is_off_on_a_cpu_and_next_layer_across_a_link(tiny_models, capsys):
    from moechat.engine.cache.prefetch import default_prefetch

    assert default_prefetch("cpu") == "off"  # loads cost the CPU's own time
    assert default_prefetch("cuda:0") == "next-layer"  # misses cross PCIe on the copy engine
    path, _ = tiny_models["qwen3_moe"]
    argv = ["run", str(path), "--prompt-ids", "1,2,3", "--max-tokens", "3", "--json", "--expert-slots", "6"]
    for extra in ([], ["--ram-cache-mb", "0"]):  # every expert in RAM; misses read the disk
        assert main(argv + extra) == 0
        assert json.loads(capsys.readouterr().out)["cache"]["prefetch"] == "off"


def test_a_job_reads_as_done_only_after_its_after_step():
    """On CUDA the copy event is recorded in `after`: a job seen done must already have it."""
    seen = []
    job = Job((0, 0), 0, lambda: "bytes")
    assert job.run(after=lambda: seen.append(job.done())) and seen == [False]
    assert job.done() and job.state == DONE and job.result == "bytes"
    cancelled = Job((0, 1), 1, lambda: seen.append("ran"))
    assert cancelled.cancel() and not cancelled.run() and seen == [False]
    failed = Job((0, 2), 2, lambda: 1 / 0)
    assert failed.run() and failed.state == "failed" and isinstance(failed.error, ZeroDivisionError)


def test_prefetches_a_layer_routed_without_are_superseded(tiny_models):
    """Queued loads for a layer that has already routed elsewhere are cancelled when it runs."""
    provider, gate, jobs = _held_worker(tiny_models, [(1, 0), (2, 3), (2, 5)])  # (1, 0) holds the worker
    threading.Timer(0.2, gate.set).start()
    with torch.inference_mode():
        list(provider.batches(2, torch.tensor([[4, 6]])))
    assert jobs[(2, 3)].state == jobs[(2, 5)].state == CANCELLED
    assert provider.stats.layers[2].prefetch_wasted == 2 and provider.stats.layers[2].misses == 2
    provider.quiesce()
    assert jobs[(1, 0)].state == DONE and provider.pool.host_map[1, 0] >= 0
    _check_pool(provider)
