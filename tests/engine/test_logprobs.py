"""generate(logprobs=k): each token's log-probability and the k best, against transformers' own logits."""

from __future__ import annotations

import pytest
import torch

from moechat.engine.errors import MoechatError
from moechat.engine.runtime.generate import Engine

PROMPT = [3, 17, 42, 99, 7]


@pytest.mark.parametrize("cached", [False, True])
def test_logprobs_equal_transformers_log_softmax(tiny_models, cached):
    from moechat.engine.cache.provider import CacheConfig

    path, reference = tiny_models["qwen3_moe"]
    engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=4) if cached else None)
    sampling = engine.sampling(temperature=0, repetition_penalty=1.0)
    chunks = list(engine.generate(PROMPT, sampling=sampling, max_tokens=6, stop_on_eos=False, logprobs=3))
    tokens = [c.token_ids[0] for c in chunks]
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPT + tokens])).logits[0].float()  # [T, V]
    expected = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)  # [6, V]: the step that chose each token
    for step, chunk in enumerate(chunks):
        assert chunk.logprob == pytest.approx(expected[step, tokens[step]].item(), abs=1e-4)
        top_v, top_i = torch.topk(expected[step], 3)
        assert [i for i, _ in chunk.top_logprobs] == top_i.tolist()
        assert [v for _, v in chunk.top_logprobs] == pytest.approx(top_v.tolist(), abs=1e-4)
        assert chunk.top_logprobs[0][0] == tokens[step]  # greedy picks the best


def test_sampled_tokens_and_no_logprobs_by_default(tiny_models):
    engine = Engine.load(tiny_models["qwen3_moe"][0], dtype="float32")
    sampling = engine.sampling(temperature=1.0, top_k=0, top_p=1.0, seed=5)
    plain = list(engine.generate(PROMPT, sampling=sampling, max_tokens=8, stop_on_eos=False))
    assert all(c.logprob is None and c.top_logprobs == () for c in plain)
    sampling = engine.sampling(temperature=1.0, top_k=0, top_p=1.0, seed=5)
    scored = list(engine.generate(PROMPT, sampling=sampling, max_tokens=8, stop_on_eos=False, logprobs=0))
    assert [c.token_ids for c in scored] == [c.token_ids for c in plain]  # scoring does not change sampling
    assert all(c.logprob <= 0 and c.top_logprobs == () for c in scored)
    with pytest.raises(MoechatError, match="logprobs must be 0..20"):
        list(engine.generate(PROMPT, logprobs=21))
