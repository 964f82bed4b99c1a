"""Routing traces: moechat's .npz round trip, the recorder's execution order, and the shared real traces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moechat.engine.cache.trace import RoutingTrace, TraceRecorder

SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "traces"
DEEPSEEK = SHARED / "deepseek-v2-lite-moe-beyond" / "deepseek_v2_lite_puffin_prefill_part1.npz"
MIXTRAL = SHARED / "mixtral-8x7b-speculative-moe" / "mixtral_8x7b_instruct_fp8_decode_routing.npz"
ARRAYS = ("layer", "token", "phase", "topk_ids", "sequence")


def random_trace(seed=0, N=50, L=5, E=9, K=3) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    return RoutingTrace(L, E, K, layer=rng.integers(0, L, N), token=rng.integers(0, 1000, N),
                        phase=rng.integers(0, 2, N), topk_ids=rng.integers(0, E, (N, K)), model="tiny/model",
                        sequence=rng.integers(0, 3, N))


@pytest.mark.parametrize("name", ["trace.npz", "trace.routing"])  # numpy would append .npz to a bare name
def test_save_load_round_trip(tmp_path, name):
    trace = random_trace()
    path = tmp_path / name
    trace.save(path)
    assert path.exists()
    back = RoutingTrace.load(path)
    assert (back.num_layers, back.num_experts, back.top_k, back.model) == (5, 9, 3, "tiny/model")
    for key in ARRAYS:
        np.testing.assert_array_equal(getattr(back, key), getattr(trace, key))
        assert getattr(back, key).dtype == getattr(trace, key).dtype
    assert back.topk_ids.dtype == np.int16 and back.layer.dtype == np.int16 and back.token.dtype == np.int32
    assert back.phase.dtype == np.uint8 and back.topk_ids.shape == (50, 3)
    with np.load(path) as z:  # the documented keys, readable without pickles
        assert set(z.files) == {*ARRAYS, "meta_json"}
        meta = json.loads(str(z["meta_json"]))
    assert meta == dict(format="moechat-routing-trace", version=1, num_layers=5, num_experts=9, top_k=3,
                        model="tiny/model")


def test_requests_are_rows_in_order_each_with_its_k_experts():
    trace = RoutingTrace(4, 8, 2, layer=[1, 2, 1], token=[0, 0, 1], phase=[0, 0, 1],
                         topk_ids=[[3, 5], [0, 7], [5, 1]])
    assert trace.requests() == [(1, 3), (1, 5), (2, 0), (2, 7), (1, 5), (1, 1)]
    assert all(type(x) is int for key in trace.requests() for x in key)
    np.testing.assert_array_equal(trace.moe_layers, [1, 2])
    np.testing.assert_array_equal(trace.sequence, [0, 0, 0])
    sub = trace.take(trace.layer == 1)
    assert sub.requests() == [(1, 3), (1, 5), (1, 5), (1, 1)]


def test_bad_traces_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="expert ids"):
        RoutingTrace(2, 4, 1, layer=[0], token=[0], phase=[0], topk_ids=[[4]])
    with pytest.raises(ValueError, match="layer ids"):
        RoutingTrace(2, 4, 1, layer=[2], token=[0], phase=[0], topk_ids=[[1]])
    text = tmp_path / "notes.npz"
    text.write_text("not a zip")
    with pytest.raises(ValueError, match="cannot read"):
        RoutingTrace.load(text)
    other = tmp_path / "other.npz"
    np.savez(other, weights=np.zeros(3))
    with pytest.raises(ValueError, match="not a routing trace this version reads"):
        RoutingTrace.load(other)
    future = tmp_path / "future.npz"
    np.savez(future, meta_json=np.array(json.dumps({"format": "moechat-routing-trace", "version": 99})))
    with pytest.raises(ValueError, match="version 99"):
        RoutingTrace.load(future)


def test_recorder_keeps_execution_order_and_positions():
    # A 3-token prefill chunk (layer-major: each layer routes the whole chunk), then 2 decode steps
    # (token-major), then a new sequence.
    L, E, K = 2, 6, 2
    rec = TraceRecorder(L, E, K, model="m")
    chunk = {0: np.array([[0, 1], [2, 3], [4, 5]]), 1: np.array([[5, 4], [3, 2], [1, 0]])}
    for layer in range(L):
        rec.record(layer, chunk[layer], 0)
    buf = np.zeros((1, K), dtype=np.int64)
    for step in range(2):
        for layer in range(L):
            buf[:] = [[step, layer + 2]]
            rec.record(layer, buf, 1)  # the caller reuses its buffer
    rec.new_sequence()
    rec.record(1, [[1, 2]], 1)
    assert len(rec) == 11
    t = rec.to_trace()
    assert (t.num_layers, t.num_experts, t.top_k, t.model) == (L, E, K, "m")
    np.testing.assert_array_equal(t.layer, [0, 0, 0, 1, 1, 1, 0, 1, 0, 1, 1])
    np.testing.assert_array_equal(t.token, [0, 1, 2, 0, 1, 2, 3, 3, 4, 4, 0])
    np.testing.assert_array_equal(t.phase, [0] * 6 + [1] * 5)
    np.testing.assert_array_equal(t.sequence, [0] * 10 + [1])
    np.testing.assert_array_equal(t.topk_ids[6:10], [[0, 2], [0, 3], [1, 2], [1, 3]])
    assert t.requests()[:4] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert len(TraceRecorder(L, E, K).to_trace()) == 0


# -- the real traces in ../shared/traces ------------------------------------------------------------
needs_deepseek = pytest.mark.skipif(not DEEPSEEK.exists(), reason="../shared/traces is not here")
needs_mixtral = pytest.mark.skipif(not MIXTRAL.exists(), reason="../shared/traces is not here")


@needs_deepseek
def test_deepseek_prefill_trace():
    t = RoutingTrace.load(DEEPSEEK)
    T = 22_287
    assert (t.num_layers, t.num_experts, t.top_k) == (27, 64, 6)  # model layer 0 is dense
    assert "DeepSeek-V2-Lite" in t.model
    assert len(t) == T * 26 and t.topk_ids.shape == (T * 26, 6)
    np.testing.assert_array_equal(t.moe_layers, np.arange(1, 27))
    assert not t.phase.any()
    with np.load(DEEPSEEK) as z:
        experts, offsets = z["experts"], z["prompt_offsets"]
    # rows token-major, then layer: row t*26 + j is token t at model layer j + 1
    np.testing.assert_array_equal(t.topk_ids.reshape(T, 26, 6), experts)
    np.testing.assert_array_equal(t.layer[:27], [*range(1, 27), 1])
    assert t.sequence.max() == 299 and len(np.unique(t.sequence)) == 300  # 300 prompts
    starts = offsets[:-1] * 26
    assert (t.token[starts] == 0).all() and t.token[starts[1] - 1] == offsets[1] - 1
    # 6 distinct experts per row
    s = np.sort(t.topk_ids, axis=1)
    assert (s[:, 1:] != s[:, :-1]).all()
    assert t.take(slice(0, 52)).requests()[:7] == [(1, int(e)) for e in experts[0, 0]] + [(2, int(experts[0, 1, 0]))]


@needs_mixtral
def test_mixtral_decode_trace():
    t = RoutingTrace.load(MIXTRAL)
    assert (t.num_layers, t.num_experts, t.top_k) == (32, 8, 2)
    assert len(t) == 18_668 and (t.phase == 1).all()
    with np.load(MIXTRAL) as z:
        counts = z["per_layer_token_counts"]  # [4, 32] decode tokens per layer per generation
    assert len(np.unique(t.sequence)) == 4
    for s in range(4):
        for layer in range(32):
            assert ((t.sequence == s) & (t.layer == layer)).sum() == counts[s, layer]
    # execution order: generations one after another; within one, token-major then layer
    key = t.sequence.astype(np.int64) * 10**6 + t.token.astype(np.int64) * 100 + t.layer
    assert (np.diff(key) > 0).all()
    np.testing.assert_array_equal(t.layer[:33], [*range(32), 0])
    # the README's measured facts: consecutive decode tokens share 0.752 of 2 experts at a layer,
    # and a layer's 2 most-used experts take 31.8% of its requests
    shared, top2 = [], []
    for layer in range(32):
        for s in range(4):
            ids = t.topk_ids[(t.sequence == s) & (t.layer == layer)]
            shared += [len(set(a) & set(b)) for a, b in zip(ids[:-1].tolist(), ids[1:].tolist(), strict=True)]
        c = np.sort(np.bincount(t.topk_ids[t.layer == layer].ravel(), minlength=8))
        top2.append(c[-2:].sum() / c.sum())
    assert np.mean(shared) == pytest.approx(0.752, abs=5e-4)
    assert np.mean(top2) == pytest.approx(0.318, abs=5e-4)


def test_recorder_keeps_only_the_latest_rows_when_bounded():
    from moechat.engine.cache.trace import TraceRecorder

    rec = TraceRecorder(num_layers=2, num_experts=4, top_k=2, max_rows=10)
    for step in range(20):
        rec.record(step % 2, [[step % 4, (step + 1) % 4]], 1)
    trace = rec.to_trace()
    assert len(rec) == len(trace) == 10
    assert trace.topk_ids[-1].tolist() == [19 % 4, 20 % 4] and trace.topk_ids[0].tolist() == [10 % 4, 11 % 4]
    big = TraceRecorder(num_layers=1, num_experts=4, top_k=1, max_rows=3)
    big.record(0, [[1]] * 8, 0)  # a single record larger than the bound is kept whole
    assert len(big) == 8
