"""The same greedy tokens and decode logits at 1, 2 and 3 threads with int8 and int4 experts (issue 27), on a
qwen3_moe wide enough that native.c's pool splits the expert layer call, the attention projections and the LM head
(every matrix past the 256 KB a share needs): the layer call's rows split, never a sum; --dense-format int8 too."""

from __future__ import annotations

import pytest
import torch

from moechat.engine.runtime.generate import Engine

from ..conftest import build_tiny_model
from .test_threads import assert_same_logits, at_each_count

WIDE = dict(vocab_size=1024, hidden_size=512, num_hidden_layers=1, num_attention_heads=8, head_dim=64,
            num_key_value_heads=2, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=512,
            intermediate_size=1024, norm_topk_prob=True, initializer_range=0.05)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("wide_qwen3_moe")
    build_tiny_model(path, "qwen3_moe", WIDE)
    return path


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("expert_format,dense_format", [("int8", None), ("int4", "int8")])
def test_quantized_experts_same_tokens_and_logits_at_1_2_3_threads(wide_model, expert_format, dense_format):
    engine = Engine.load(wide_model, dtype="bfloat16", expert_format=expert_format, dense_format=dense_format)
    runs = at_each_count(engine, list(range(5, 21)), steps=6)
    assert_same_logits(runs, "bfloat16")
