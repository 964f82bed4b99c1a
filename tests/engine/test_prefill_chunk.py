"""The prefill chunk size: chosen from the CPU's last-level cache (quant/prefill.machine_chunk_size), and exact:
any chunk size gives the same tokens, and logits within fp32 rounding of one pass and of transformers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moechat.engine.quant import prefill
from moechat.engine.runtime.generate import DEFAULT_PREFILL_CHUNK, Engine, default_prefill_chunk
from moechat.engine.runtime.sampling import SamplingParams

from ..conftest import TINY_MODELS, build_tiny_model

GREEDY = SamplingParams(temperature=0.0, do_sample=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("chunked")
    model_type, overrides = TINY_MODELS["qwen3_moe"]
    return path, build_tiny_model(path, model_type, overrides, seed=3)


def _prompt(n: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(3, 256, (n,), generator=g).tolist()


@pytest.mark.parametrize("expert_format", [None, "int4"])
def test_chunked_prefill_is_exact(tiny, expert_format):
    path, ref = tiny
    ids = _prompt(45)
    engine = Engine.load(path, dtype="float32", expert_format=expert_format)
    logits, tokens = {}, {}
    for c in (7, 64):  # 7: seven chunks; 64: one pass
        engine.prefill_chunk = c
        with torch.inference_mode():
            logits[c] = engine._forward(engine.new_sequence(), ids)
        tokens[c] = [t for ch in engine.generate(ids, sampling=GREEDY, max_tokens=10, stop_on_eos=False)
                     for t in ch.token_ids]
    err = (logits[7] - logits[64]).abs().max().item()
    assert err < 1e-4, f"chunks of 7 vs one pass: max |logit diff| {err:.2e}"
    if expert_format is None:
        with torch.inference_mode():
            theirs = ref(torch.tensor([ids])).logits[0, -1]
        assert (logits[7] - theirs).abs().max().item() < 1e-4
    assert tokens[7] == tokens[64] and len(tokens[7]) == 10
    engine.close()


def test_cpu_engine_sizes_its_chunk_from_the_cache(tiny):
    path, _ = tiny
    engine = Engine.load(path, dtype="float32")
    a = engine.args
    assert engine.prefill_chunk == default_prefill_chunk(engine.loaded) == prefill.machine_chunk_size(
        a.hidden_size, a.moe_intermediate_size)
    assert Engine.load(path, dtype="float32", prefill_chunk=5).prefill_chunk == 5  # a given size is kept
    engine.close()


def _cache_dir(root, entries):
    """A sysfs cache directory: (level, type, size text) per index."""
    for i, (level, kind, size) in enumerate(entries):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return root


def test_last_level_cache_is_read_from_sysfs(tmp_path):
    zen4 = _cache_dir(tmp_path / "zen4", [(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"),
                                          (3, "Unified", "32768K")])
    assert prefill.last_level_cache_bytes(zen4) == 32 << 20
    assert prefill.machine_chunk_size(2048, 768, zen4) == 1024
    no_l3 = _cache_dir(tmp_path / "no_l3", [(1, "Data", "48K"), (2, "Unified", "2M"), (3, "Instruction", "64M")])
    assert prefill.last_level_cache_bytes(no_l3) == 2 << 20  # an instruction cache is not where activations live
    assert prefill.machine_chunk_size(2048, 768, no_l3) == 64  # half of 2 MB holds 93 tokens: the floor
    big = _cache_dir(tmp_path / "big", [(3, "Unified", "8M")])
    assert prefill.machine_chunk_size(2048, 768, big) == 256  # 11 KB a token: half of 8 MB holds 372
    missing = tmp_path / "absent"
    assert prefill.last_level_cache_bytes(missing) is None
    assert prefill.machine_chunk_size(2048, 768, missing) == prefill.chunk_size(2048, prefill.DEFAULT_CACHE_BYTES, 768)
    broken = _cache_dir(tmp_path / "broken", [(2, "Unified", "lots")])
    assert prefill.last_level_cache_bytes(broken) is None


@settings(max_examples=60, deadline=None)
@given(hidden=st.integers(1, 1 << 14), inter=st.integers(0, 1 << 14), cache=st.integers(0, 1 << 30))
def test_chunk_is_the_largest_choice_that_fits(hidden, inter, cache):
    c = prefill.chunk_size(hidden, cache, inter)
    per_token = 4 * (hidden + inter)
    assert c in prefill.CHUNK_CHOICES
    fits = [k for k in prefill.CHUNK_CHOICES if k * per_token <= cache // 2]
    assert c == (max(fits) if fits else min(prefill.CHUNK_CHOICES))
    assert prefill.chunk_size(hidden, cache * 2, inter) >= c  # a bigger cache never gives a smaller chunk


def test_gpu_keeps_the_planned_chunk():
    class _Loaded:
        device = torch.device("meta")  # anything but the CPU
        args = None

    assert default_prefill_chunk(_Loaded()) == DEFAULT_PREFILL_CHUNK
