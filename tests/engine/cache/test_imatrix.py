"""llama.cpp imatrix files (the legacy .dat and the GGUF format, each written here byte for byte as
llama-imatrix writes it) parsed, experts ranked per layer, and `warm_start` filling the slots with the top experts
before the first token (explicit imatrix:FILE, and an imatrix found beside the model)."""

from __future__ import annotations

import shutil
import struct

import gguf
import numpy as np
import pytest

from moechat.engine.cache.imatrix import (
    find_imatrix,
    parse_warm_start,
    read_imatrix,
    warm_start_counts,
    write_gguf_imatrix,
)
from moechat.engine.cache.provider import CacheConfig
from moechat.engine.errors import ConfigError
from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

L, E, N_IN = 3, 8, 16  # the tiny qwen3_moe: 3 layers of 8 experts (N_IN: any row size, the ranking ignores it)
CHUNK = 512

# Routing counts per layer and expert of a made-up calibration run; expert 6 of layer 1 was never routed.
COUNTS = np.array([[40, 3, 90, 7, 0, 55, 12, 1],
                   [5, 60, 2, 33, 80, 9, 0, 21],
                   [10, 20, 0, 70, 5, 5, 30, 60]], dtype=np.float64)


def _sums(rng) -> np.ndarray:
    """Raw sums of x^2 per expert row [L, E, N_IN]: proportional to the counts (mean square ~1 per row)."""
    return (COUNTS[:, :, None] * rng.uniform(0.5, 1.5, size=(L, E, N_IN))).astype(np.float32)


def _write_llama_gguf(path, counts, sums, *, extra_dense=True):
    """What llama-imatrix's save_imatrix writes: general.type, the three imatrix keys, and per matrix
    `<name>.in_sum2` [n_mat, n_in] and `<name>.counts` [n_mat, 1] (ggml ne = [n_in, n_mat] and [1, n_mat])."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["calibration.txt"])
    w.add_uint32("imatrix.chunk_count", 10)
    w.add_uint32("imatrix.chunk_size", CHUNK)
    names = []
    for layer in range(L):
        for kind in ("down", "gate", "up"):
            names.append((f"blk.{layer}.ffn_{kind}_exps.weight", sums[layer], counts[layer]))
        if extra_dense:
            names.append((f"blk.{layer}.attn_q.weight", np.ones((1, N_IN), np.float32), np.array([999.0])))
    for name, s, c in sorted(names, key=lambda n: n[0]):
        w.add_tensor(f"{name}.in_sum2", np.ascontiguousarray(s, np.float32))
        w.add_tensor(f"{name}.counts", np.ascontiguousarray(np.asarray(c, np.float32).reshape(-1, 1)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_llama_dat(path, counts, sums, *, tail=True):
    """save_imatrix_legacy: int32 n_entries; per entry (sorted names) int32 len, name, int32 ncall, int32 nval,
    nval floats = (sum / count) * ncall, an expert never routed stored as 1.0 * ncall; then int32 chunks and the
    dataset name."""
    entries = []
    for layer in range(L):
        for kind in ("gate", "up", "down"):
            entries.append((f"blk.{layer}.ffn_{kind}_exps.weight", sums[layer], counts[layer]))
        entries.append((f"blk.{layer}.attn_q.weight", np.ones((1, N_IN), np.float32) * 7, np.array([999.0])))
    out = [struct.pack("<i", len(entries))]
    for name, s, c in sorted(entries, key=lambda e: e[0]):
        ncall = int((c.max() + CHUNK - 1) // CHUNK)
        values = []
        for row, count in zip(s, c):
            values.append(np.full(row.shape, ncall, np.float32) if count == 0 else row / count * ncall)
        flat = np.concatenate(values).astype("<f4")
        out += [struct.pack("<i", len(name)), name.encode(), struct.pack("<ii", ncall, flat.size), flat.tobytes()]
    if tail:
        out += [struct.pack("<i", 10), struct.pack("<i", 15), b"calibration.txt"]
    path.write_bytes(b"".join(out))


def test_gguf_imatrix_ranks_by_counts(tmp_path):
    _write_llama_gguf(tmp_path / "imatrix.gguf", COUNTS, _sums(np.random.default_rng(0)))
    im = read_imatrix(tmp_path / "imatrix.gguf")
    assert im.format == "gguf" and im.chunks == 10 and im.datasets == ("calibration.txt",)
    assert im.entries["blk.0.ffn_gate_exps.weight"].sums.shape == (E, N_IN)
    scores = im.expert_scores(L, E)
    np.testing.assert_allclose(scores, COUNTS / COUNTS.sum(axis=1, keepdims=True), rtol=1e-6)
    assert im.ranking(0, L, E) == [2, 5, 0, 6, 3, 1, 7, 4]
    assert im.ranking(1, L, E) == [4, 1, 3, 7, 5, 0, 2, 6]
    with pytest.raises(ConfigError, match="statistics for 8 experts in layer 0, but the model has 6 experts"):
        im.expert_scores(L, 6)
    with pytest.raises(ConfigError, match="in layer 1, but the model has 8 experts in 1 layers"):
        im.expert_scores(1, E)
    assert im.ranking(2, L, E)[:4] == [3, 7, 6, 1]


def test_dat_imatrix_ranks_without_counts(tmp_path):
    """The .dat keeps per-expert means only: with sums growing faster than counts the mean order is the count
    order here; a never-routed expert (stored as ncall) ranks last with score 0."""
    rng = np.random.default_rng(1)
    sums = (COUNTS[:, :, None] ** 1.5 * rng.uniform(0.9, 1.1, size=(L, E, N_IN))).astype(np.float32)
    _write_llama_dat(tmp_path / "imatrix.dat", COUNTS, sums)
    im = read_imatrix(tmp_path / "imatrix.dat")
    assert im.format == "dat" and im.chunks == 10 and im.datasets == ("calibration.txt",)
    assert im.ncall["blk.0.ffn_gate_exps.weight"] == 1
    scores = im.expert_scores(L, E)
    assert scores[0, 4] == 0 and scores[1, 6] == 0 and scores[2, 2] == 0
    assert im.ranking(0, L, E)[:7] == [2, 5, 0, 6, 3, 1, 7]
    assert im.ranking(1, L, E)[:7] == [4, 1, 3, 7, 5, 0, 2]
    assert "keeps no counts" in im.describe()
    # without the optional tail (older files) it reads the same
    _write_llama_dat(tmp_path / "old.dat", COUNTS, sums, tail=False)
    np.testing.assert_array_equal(read_imatrix(tmp_path / "old.dat").expert_scores(L, E), scores)
    with pytest.raises(ConfigError, match="not a multiple of the model's 5 experts"):
        im.expert_scores(L, 5)


@pytest.mark.parametrize("cut", [3, 9, 200])
def test_damaged_files_are_one_typed_line(tmp_path, cut):
    _write_llama_dat(tmp_path / "imatrix.dat", COUNTS, _sums(np.random.default_rng(0)))
    data = (tmp_path / "imatrix.dat").read_bytes()
    (tmp_path / "bad.dat").write_bytes(data[:cut])
    with pytest.raises(ConfigError) as info:
        read_imatrix(tmp_path / "bad.dat")
    assert "not a readable llama.cpp imatrix" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="cannot read the imatrix"):
        read_imatrix(tmp_path / "missing.dat")


def test_a_model_gguf_is_not_an_imatrix(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "model.gguf"), arch="qwen3moe")
    w.add_type("model")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="a GGUF model file, not an imatrix"):
        read_imatrix(tmp_path / "model.gguf")


def test_writer_round_trips(tmp_path):
    write_gguf_imatrix(tmp_path / "x.imatrix.gguf", COUNTS, n_in=4)
    np.testing.assert_allclose(read_imatrix(tmp_path / "x.imatrix.gguf").expert_scores(L, E),
                               COUNTS / COUNTS.sum(axis=1, keepdims=True), rtol=1e-6)


def test_flag_values():
    assert parse_warm_start(True) is True and parse_warm_start("imatrix:a.dat") == "imatrix:a.dat"
    for bad in ("imatrix:", "assets/demo-moe", "profile.json"):
        with pytest.raises(ConfigError, match="put MODEL before the flag"):
            parse_warm_start(bad)


def _resident_keys(engine) -> set[tuple[int, int]]:
    return {k for k in engine.provider.pool.owner if k is not None}


def _top(scores: np.ndarray, n: int) -> set[tuple[int, int]]:
    return {divmod(int(i), scores.shape[1]) for i in np.argsort(-scores, axis=None, kind="stable")[:n]}


@pytest.mark.parametrize("fmt", ["gguf", "dat"])
def test_warm_start_fills_the_slots_with_the_top_experts(tiny_models, tmp_path, fmt):
    path, _ = tiny_models["qwen3_moe"]
    imatrix = tmp_path / f"imatrix.{fmt}"
    sums = (COUNTS[:, :, None] ** 1.5 * np.ones((L, E, N_IN))).astype(np.float32)
    (_write_llama_gguf if fmt == "gguf" else _write_llama_dat)(imatrix, COUNTS, sums)
    config = CacheConfig(expert_slots=9, prefetch="off", warm_start=f"imatrix:{imatrix}", profile_dir=str(tmp_path))
    engine = Engine.load(path, dtype="float32", cache=config)
    try:
        assert engine.args.num_hidden_layers == L and engine.args.num_experts == E
        assert engine.cache_snapshot().warm_loaded == 9
        # the top 3 of each layer: the layers' shares interleave in one sort
        assert _resident_keys(engine) == {(0, 2), (0, 5), (0, 0), (1, 4), (1, 1), (1, 3), (2, 3), (2, 7), (2, 6)}
        assert any(n.startswith("warm start from imatrix") for n in engine.notices)
    finally:
        engine.close()


def test_an_imatrix_beside_the_model_is_used_when_no_profile_exists(tiny_models, tmp_path):
    src, _ = tiny_models["qwen3_moe"]
    model = tmp_path / "model"
    shutil.copytree(src, model)
    _write_llama_gguf(model / "imatrix_unsloth.gguf", COUNTS, _sums(np.random.default_rng(2)))
    assert find_imatrix(model) == model / "imatrix_unsloth.gguf"
    assert find_imatrix(model / "config.json") == model / "imatrix_unsloth.gguf"  # beside a file too
    config = CacheConfig(expert_slots=4, prefetch="off", warm_start=True, profile_dir=str(tmp_path / "profiles"))
    engine = Engine.load(model, dtype="float32", cache=config)
    try:
        scores = COUNTS / COUNTS.sum(axis=1, keepdims=True)
        assert _resident_keys(engine) == _top(scores, 4)
        assert any("imatrix beside the model" in n for n in engine.notices)
        greedy = SamplingParams(temperature=0.0, do_sample=False)
        assert sum(len(c.token_ids) for c in engine.generate([3, 10, 17, 24], sampling=greedy, max_tokens=4)) == 4
    finally:
        engine.close()  # saves this run's routing profile
    # the saved profile now wins over the imatrix
    counts, note = warm_start_counts(True, engine.profile_path, model, L, E)
    assert note is None and counts is not None and not np.allclose(counts, scores)


def test_a_wrong_imatrix_beside_the_model_is_said_and_skipped(tmp_path):
    (tmp_path / "imatrix.dat").write_bytes(b"\x01\x00")
    counts, note = warm_start_counts(True, None, tmp_path, L, E)
    assert counts is None and note.startswith("not warm-started from imatrix.dat:")
    assert warm_start_counts(False, None, tmp_path, L, E) == (None, None)
    with pytest.raises(ConfigError):
        warm_start_counts(f"imatrix:{tmp_path / 'imatrix.dat'}", None, tmp_path, L, E)
