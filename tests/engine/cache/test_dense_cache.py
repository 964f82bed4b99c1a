"""The int8 LM head kept between loads (engine/cache/dense_cache.py): the second load maps the first's codes instead
of quantizing again, bit for bit the same head and logits; a damaged file, a changed source or a different format is
quantized again (never used); a folder that refuses the write costs nothing but the next load's quantization."""

from __future__ import annotations

import os

import pytest
import torch

from moechat.engine.cache.dense_cache import HeadCache
from moechat.engine.load.loader import load_model

from ...conftest import build_tiny_model
from ..quant.test_dense_quant import _forced_logits
from ..test_threads import greedy


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("head_cache_qwen3_moe")
    build_tiny_model(path, "qwen3_moe", {}, seed=3)
    return path


def _head_file(repack):
    return repack / "lm_head-int8.bin"


def test_the_second_load_maps_the_first_loads_head(model_dir, tmp_path, monkeypatch):
    from moechat.engine.quant import dense_quant
    from moechat.engine.runtime.generate import Engine

    quantized = []  # the shapes dense_quant quantized: the head's only when it was not mapped
    real = dense_quant.quantize_rows
    monkeypatch.setattr(dense_quant, "quantize_rows", lambda fmt, w: quantized.append(tuple(w.shape)) or real(fmt, w))
    repack = tmp_path / "repack"
    first = load_model(model_dir, dtype="bfloat16", dense_format="int8", repack_dir=repack)
    head = tuple(first.model.lm_q.q.shape)
    assert head in quantized
    assert _head_file(repack).is_file() and _head_file(repack).with_suffix(".json").is_file()
    quantized.clear()
    second = load_model(model_dir, dtype="bfloat16", dense_format="int8", repack_dir=repack)
    assert quantized and head not in quantized  # attention quantized again, the head mapped from the file
    a, b = first.model.lm_q, second.model.lm_q
    assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale)
    e1, e2 = Engine(first, None, None, {}, 64, 16), Engine(second, None, None, {}, 64, 16)
    ids = list(range(3, 14))
    steps = greedy(e1, ids, 3)[0]
    assert torch.equal(_forced_logits(e1, ids, steps), _forced_logits(e2, ids, steps))
    int4 = load_model(model_dir, dtype="bfloat16", dense_format="int4", repack_dir=repack)  # int4 keeps an int8 head
    assert torch.equal(int4.model.lm_q.q, a.q)


def _cache_get(model_dir, repack, weight):
    cache = HeadCache(repack, model_dir / "model.safetensors")
    head = cache.get(weight, "int8")
    return cache.hit, head


def test_damage_a_changed_source_or_an_unwritable_folder_quantize_again(model_dir, tmp_path):
    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    repack = tmp_path / "repack"
    assert (model_dir / "model.safetensors").is_file()
    hit, want = _cache_get(model_dir, repack, weight)
    assert not hit
    hit, got = _cache_get(model_dir, repack, weight)
    assert hit and torch.equal(got.q, want.q) and torch.equal(got.scale, want.scale)
    before = os.stat(_head_file(repack))
    with open(_head_file(repack), "r+b") as f:  # one code flipped, the file's size and times as they were
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x40]))
    os.utime(_head_file(repack), ns=(before.st_atime_ns, before.st_mtime_ns))
    hit, got = _cache_get(model_dir, repack, weight)
    assert not hit and torch.equal(got.q, want.q)  # its CRC failed: quantized again, and rewritten
    assert _cache_get(model_dir, repack, weight)[0]
    st = os.stat(model_dir / "model.safetensors")
    os.utime(model_dir / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the source changed
    assert not _cache_get(model_dir, repack, weight)[0]
    assert not _cache_get(model_dir, repack, weight.float())[0]  # another dtype: another head
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folder would be")
    hit, got = _cache_get(model_dir, blocked / "repack", weight)  # cannot be written: still the head
    assert not hit and torch.equal(got.q, want.q)
