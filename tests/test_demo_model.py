"""The bundled demo model: loads fast, matches transformers, answers in the chat format."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

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


@pytest.fixture(scope="module")
def corpus_recipe():
    """packaging/demo_model/build_corpus.py (the chat answers come from this interpreter's stdlib)."""
    import importlib
    import sys

    sys.path.insert(0, str(DEMO.parents[1] / "packaging" / "demo_model"))
    try:
        return importlib.import_module("build_corpus")
    finally:
        sys.path.pop(0)


def _greedy_reply(engine, question, sampling=GREEDY):
    chunks = list(engine.conversation().send(question, sampling=sampling, max_tokens=64))
    return "".join(c.text for c in chunks).strip()


# Names the model card quotes as answered word for word (len was answered with str.count's docstring before),
# and a fixed sample of the other core names (every 12th). json.dumps is one of the card's few misses.
CARD_NAMES = ["len", "math.sqrt", "str.count", "str.split", "os.path.join", "collections.Counter", "re.sub"]


def test_demo_model_answers_core_names_word_for_word(corpus_recipe):
    """Issue 26: asked "What does X do?" about a core name, the reply is X's own docstring answer word for
    word (it was `str.count`'s for len): every name the card quotes, as `moechat run --temperature 0` says it,
    and at least 9 in 10 of a fixed sample with plain greedy decoding (the card gives that rate over all 238
    from analyze.py's chat_eval)."""
    core = dict(corpus_recipe.core_pairs())
    engine = Engine.load(DEMO, dtype="float32")
    as_run = engine.sampling(temperature=0.0)  # `moechat run --temperature 0`: the shipped repetition penalty
    for name in CARD_NAMES:
        assert _greedy_reply(engine, f"What does {name} do?", as_run) == core[name], name
    sample = [n for n in sorted(core)[::12] if n not in CARD_NAMES]
    wrong = {n: r for n in sample if (r := _greedy_reply(engine, f"What does {n} do?")) != core[n]}
    assert len(wrong) <= len(sample) // 10, wrong


def test_demo_model_says_it_does_not_know_untrained_names(corpus_recipe):
    """Names no training conversation is about (made-up ones, and real stdlib names of the evaluated
    quarter of build_corpus.unknown_names) get "I don't know", not another name's docstring."""
    evaluated = corpus_recipe.unknown_names()[1]
    names = ["os.fizzle"] + [n for n, _ in evaluated[::40]]
    engine = Engine.load(DEMO, dtype="float32")
    replies = {n: _greedy_reply(engine, f"What does {n} do?") for n in names}
    assert replies["os.fizzle"].startswith("I don't know what "), replies["os.fizzle"]
    knows = {n: r for n, r in replies.items() if not r.startswith("I don't know")}
    assert len(knows) <= len(names) // 5, knows


def test_continued_training_set_keeps_its_evaluation_sets_apart(corpus_recipe):
    """finetune.jsonl teaches every core name in all five wordings and "I don't know" only for names no
    other chat question is about; the names it evaluates "don't know" on, and the wording the card uses to
    test generalisation, appear in no training document."""
    b = corpus_recipe
    taught, evaluated = b.unknown_names()
    docs = list(b.finetune_docs())
    questions = {q for d in docs for q in d["questions"]}
    core = b.CORE_NAMES
    assert {f.format(n=n) for n in core for f in b.QUESTION_FORMS} <= questions
    known = {q for q, _, _ in b.docstring_pairs()} | set(core)
    taught_names, eval_names = {n for n, _ in taught}, {n for n, _ in evaluated}
    assert not taught_names & eval_names and not (taught_names | eval_names) & known
    assert "os.fizzle" not in taught_names
    assert {k for _, k in evaluated} == {"real", "made-up"} and len(evaluated) >= 200
    forms = b.QUESTION_FORMS + [b.UNSEEN_FORM]
    assert not {f.format(n=n) for n in eval_names for f in forms} & questions
    unseen_pre = b.UNSEEN_FORM.split("{n}")[0]
    assert all(unseen_pre not in f for f in b.QUESTION_FORMS + b.MODULE_FORMS + b.JARGON_FORMS + b.ARITH_FORMS)
    dont = [d for d in docs if d["source"] == "chat-dontknow"]
    assert len(dont) == len(taught) and all("I don't know what " in d["text"] for d in dont)
