"""The bundled demo model: loads fast, matches transformers, answers in the chat format."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from moechat.engine.generate import Engine
from moechat.engine.sampling import SamplingParams

DEMO = Path(__file__).resolve().parents[1] / "assets" / "demo-moe"
GREEDY = SamplingParams(temperature=0.0, do_sample=False)
QUESTIONS = ["What does json.dumps do?", "What is 12 + 7?", "What does os.path.join do?"]


def test_demo_model_is_small_and_loads_fast():
    total = sum(f.stat().st_size for f in DEMO.iterdir() if f.is_file())
    assert total < 30_000_000, f"assets/demo-moe is {total / 1e6:.1f} MB"
    t0 = time.perf_counter()
    engine = Engine.load(DEMO)
    assert time.perf_counter() - t0 < 2.0 * 3  # 2 s on a quiet machine; CI shares its cores
    assert engine.loaded.args.model_type == "qwen3_moe" and engine.chat_template is not None


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(DEMO))


def test_demo_model_matches_transformers(reference):
    model, tok = reference
    engine = Engine.load(DEMO, dtype="float32")
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        ids = engine.encode_chat(messages)
        assert ids == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
        ours = [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=24) for t in c.token_ids]
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24,
                                 eos_token_id=sorted(engine.eos_token_ids), repetition_penalty=1.0)
        assert ours == out[0, len(ids):].tolist(), question


def test_demo_model_answers_in_chat_format():
    engine = Engine.load(DEMO, dtype="float32")
    chunks = list(engine.conversation().send("What is 12 + 7?", sampling=GREEDY, max_tokens=40))
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop" and "12 + 7" in text and "<|im_end|>" not in text


def test_demo_model_answers_stdlib_questions_on_topic():
    """The model card's claim, checked on every run: asked (in a training wording) what a few everyday
    standard-library names do, moechat's greedy reply on the bundled model is about that name: it carries
    the key term of the object's docstring. (The card also shows the questions it gets wrong, and the
    rates over all 238 core names.)"""
    engine = Engine.load(DEMO, dtype="float32")
    expected = {"What does json.dumps do?": "JSON",  # Serialize ``obj`` to a JSON formatted ``str``.
                "What does str.split do?": "substrings",  # Return a list of the substrings in the string, ...
                "What does collections.Counter do?": "counting"}  # Dict subclass for counting hashable items.
    for question, term in expected.items():
        chunks = list(engine.conversation().send(question, sampling=GREEDY, max_tokens=48))
        text = "".join(c.text for c in chunks)
        assert chunks[-1].finish_reason == "stop" and term in text, (question, text)


def test_bundled_routing_trace_is_the_shipped_models_routing(monkeypatch):
    """routing_trace.npz was recorded from these weights: re-recording its first sequence (the chat
    prompt, prefill + greedy decode) gives the same expert ids row for row."""
    from moechat.engine.cache.provider import CacheConfig
    from moechat.engine.cache.trace import RoutingTrace

    monkeypatch.syspath_prepend(str(DEMO.parents[1] / "packaging" / "demo_model"))
    from record_trace import NEW_TOKENS, PROMPTS

    stored = RoutingTrace.load(DEMO / "routing_trace.npz")
    first = stored.take(np.flatnonzero(stored.sequence == stored.sequence[0]))
    engine = Engine.load(DEMO, dtype="float32", cache=CacheConfig(record_trace=True))
    domain, text = PROMPTS[0]
    assert domain == "chat"
    ids = engine.encode_chat([{"role": "user", "content": text}])
    list(engine.generate(ids, sampling=GREEDY, max_tokens=NEW_TOKENS, stop_on_eos=False))
    now = engine.provider.recorder.to_trace()
    assert len(now) == len(first)
    np.testing.assert_array_equal(now.layer, first.layer)
    np.testing.assert_array_equal(now.topk_ids, first.topk_ids)
