"""Sliding-window layers through base.py's Attention hold a ring of their window (engine/layers/kv_cache.py):
GPT-OSS (alternating sliding and full layers, sinks) and Mixtral with a window. The ring's logits are those of a
cache of the whole context (the layout before the rings) at prompts past the window, in prefill chunks that cross
the ring's wrap at every offset and in decode, fp32 and bf16 (native decode attention), and transformers'."""

from __future__ import annotations

import pytest
import torch

from moechat.engine.layers.kv_cache import KVCache
from moechat.engine.runtime.generate import Engine, SequenceState

from .test_gpt_oss import load_reference, write_tiny_gpt_oss

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_ring")
    write_tiny_gpt_oss(path, seed=3)
    return path, load_reference(path)


def _models(name, gpt_oss, tiny_models):
    return gpt_oss if name == "gpt_oss" else tiny_models[name]


def _whole_context(engine) -> SequenceState:
    a = engine.args
    heads, k_dim, v_dim = a.kv_cache_layout()
    return SequenceState(KVCache(a.num_hidden_layers, heads, k_dim, engine.context, engine.loaded.dtype,
                                 v_head_dim=v_dim))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference_logits(ref, ids):
    with torch.inference_mode():
        return ref(input_ids=torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("name, rings", [("gpt_oss", [4, None, 4, None]), ("mixtral_window", [7, 7, 7])])
def test_sliding_layers_allocate_their_window(name, rings, gpt_oss, tiny_models):
    engine = Engine.load(_models(name, gpt_oss, tiny_models)[0], dtype="float32")
    kv = engine.new_sequence().kv
    assert kv.ring == rings
    assert [t.shape[1] for t in kv.k] == [w or engine.context for w in rings]


@pytest.mark.parametrize("chunk", [1, 3, 4, 7, 64])
@pytest.mark.parametrize("name", ["gpt_oss", "mixtral_window"])
def test_the_ring_gives_the_whole_context_logits(name, chunk, gpt_oss, tiny_models):
    path, ref = _models(name, gpt_oss, tiny_models)
    engine = Engine.load(path, dtype="float32", prefill_chunk=chunk)
    ids = _prompt(19, seed=chunk)
    with torch.inference_mode():
        seq, whole = engine.new_sequence(), _whole_context(engine)
        assert any(seq.kv.ring) and not any(whole.kv.ring)
        ours, before = engine._forward(seq, ids), engine._forward(whole, ids)
        # fp32 sums over the ring's slots against the whole context's, in another order: 1.2e-5 seen on a Zen 2
        # (AVX2) core for logits of ~2; a wrong position or a stale slot is off by far more
        assert (ours - before).abs().max().item() < 5e-5
        assert (ours - _reference_logits(ref, ids)).abs().max().item() < 1e-4
        for step in range(9):  # decode on past the window's wrap
            token = [int(ours.argmax())]
            ours, before = engine._forward(seq, token), engine._forward(whole, token)
            assert (ours - before).abs().max().item() < 5e-5, step
        assert (ours - _reference_logits(ref, seq.tokens)).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["gpt_oss", "mixtral_window"])
def test_bf16_decode_on_the_ring_equals_the_whole_context(name, gpt_oss, tiny_models):
    """bf16: the native decode attention (Mixtral) and the sink path (GPT-OSS) over the whole ring, step by step."""
    engine = Engine.load(_models(name, gpt_oss, tiny_models)[0], dtype="bfloat16", prefill_chunk=5)
    with torch.inference_mode():
        seq, whole = engine.new_sequence(), _whole_context(engine)
        a, b = engine._forward(seq, _prompt(11, seed=5)), engine._forward(whole, _prompt(11, seed=5))
        diffs = [(torch.softmax(a, -1) - torch.softmax(b, -1)).abs().max().item()]
        for t in _prompt(10, seed=6):
            a, b = engine._forward(seq, [t]), engine._forward(whole, [t])
            diffs.append((torch.softmax(a, -1) - torch.softmax(b, -1)).abs().max().item())
    assert max(diffs) < 0.02, diffs


def test_a_rewind_into_overwritten_positions_starts_over(gpt_oss):
    path, _ = gpt_oss
    engine = Engine.load(path, dtype="float32", prefill_chunk=4)
    ids = _prompt(13, seed=9)
    with torch.inference_mode():
        seq = engine.new_sequence()
        engine._forward(seq, ids[:12])
        assert seq.truncate(8) == 0  # the 4-slot ring has overwritten positions 5..7
        assert (engine._forward(seq, ids[:9]) - engine._forward(engine.new_sequence(), ids[:9])).abs().max() < 1e-5
