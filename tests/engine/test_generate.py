"""The streaming API and conversations."""

from __future__ import annotations

import threading

import pytest
import torch

from moechat.engine.errors import PromptTooLongError
from moechat.engine.runtime.generate import Engine, GenerationChunk
from moechat.engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, do_sample=False)


def _tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_chunks_are_immutable_and_carry_rates(tiny_models):
    engine = Engine.load(tiny_models["qwen3_moe"][0], dtype="float32")
    chunks = list(engine.generate([1, 2, 3, 4], sampling=GREEDY, max_tokens=6))
    assert len(chunks) == 6 and all(isinstance(c, GenerationChunk) for c in chunks)
    assert [c.finish_reason for c in chunks] == [None] * 5 + ["length"]
    assert [c.generated_tokens for c in chunks] == [1, 2, 3, 4, 5, 6]
    assert chunks[-1].prefill_tokens_per_s > 0 and chunks[-1].decode_tokens_per_s > 0
    with pytest.raises(AttributeError):
        chunks[0].text = "x"


def test_cancel_stops_within_one_token(tiny_models):
    engine = Engine.load(tiny_models["qwen3_moe"][0], dtype="float32")
    cancel = threading.Event()
    chunks = []
    for chunk in engine.generate([1, 2, 3], sampling=GREEDY, max_tokens=100, cancel=cancel):
        chunks.append(chunk)
        if len(chunks) == 3:
            cancel.set()
    assert chunks[-1].finish_reason == "cancelled"
    assert len(_tokens(chunks)) == 3


def test_eos_stops_and_is_not_in_text(tiny_chat_model):
    path, _, fast = tiny_chat_model
    engine = Engine.load(path, dtype="float32")
    assert fast.convert_tokens_to_ids("<|im_end|>") in engine.eos_token_ids
    ids = engine.encode_chat([{"role": "user", "content": "Hello world"}])
    free = [t for c in engine.generate(ids, sampling=SamplingParams(temperature=0.0, do_sample=False),
                                       max_tokens=8, stop_on_eos=False) for t in c.token_ids]
    # Make the 4th greedy token a stop id (with its text), whatever the random weights prefer.
    engine.eos_token_ids = frozenset({free[3]})
    chunks = list(engine.generate(ids, sampling=SamplingParams(temperature=0.0, do_sample=False), max_tokens=8))
    assert chunks[-1].finish_reason == "stop"
    assert [t for c in chunks for t in c.token_ids] == free[: free.index(free[3]) + 1]
    text = "".join(c.text for c in chunks)
    assert text == fast.decode(free[: free.index(free[3])], skip_special_tokens=True)  # the stop token's text is not


def test_prompt_longer_than_context_is_refused_before_compute(tiny_models):
    engine = Engine.load(tiny_models["qwen3_moe"][0], dtype="float32", context=32)
    with pytest.raises(PromptTooLongError, match="do not fit the context of 32"):
        next(engine.generate(list(range(40)), sampling=GREEDY))


def test_generation_stops_at_full_context(tiny_models):
    engine = Engine.load(tiny_models["qwen3_moe"][0], dtype="float32", context=16)
    chunks = list(engine.generate(list(range(10)), sampling=GREEDY, max_tokens=100))
    assert chunks[-1].finish_reason == "length" and len(_tokens(chunks)) == 7  # 10 + 6 fed + 1 unfed


def test_multi_turn_conversation_equals_full_reprefill(tiny_chat_model):
    path, _, _ = tiny_chat_model
    engine = Engine.load(path, dtype="float32")
    chat = engine.conversation(system="You are terse.")
    turns = ["Hello world", "How are you?", "Experts route tokens. 🙂"]
    previous_prompt = 0
    for i, user in enumerate(turns):
        got = _tokens(chat.send(user, sampling=GREEDY, max_tokens=12))
        full = engine.encode_chat(chat.messages[:-1])  # everything up to this turn's user message
        fresh = _tokens(engine.generate(full, sampling=GREEDY, max_tokens=12))
        assert got == fresh, f"turn {i}"
        # At least the previous turn's whole prompt came from the cache (the reply itself may re-tokenize
        # differently from the sampled ids, random weights produce odd byte sequences).
        assert len(full) - chat.last_prefill_tokens >= previous_prompt, f"turn {i} re-prefilled the history"
        previous_prompt = len(full)
    assert [m["role"] for m in chat.messages] == ["system"] + ["user", "assistant"] * 3


def test_conversation_prefix_survives_a_rewritten_history(tiny_chat_model):
    """Editing an earlier message makes the cache rewind to the shared prefix, not reuse stale KV."""
    path, _, _ = tiny_chat_model
    engine = Engine.load(path, dtype="float32")
    chat = engine.conversation()
    _tokens(chat.send("Hello world", sampling=GREEDY, max_tokens=5))
    chat.messages[0]["content"] = "Goodbye world"
    got = _tokens(chat.send("again", sampling=GREEDY, max_tokens=8))
    fresh = _tokens(engine.generate(engine.encode_chat(chat.messages[:-1]), sampling=GREEDY, max_tokens=8))
    assert got == fresh


def test_failed_turn_leaves_the_conversation_intact(tiny_chat_model):
    path, _, _ = tiny_chat_model
    engine = Engine.load(path, dtype="float32", context=96)
    chat = engine.conversation()
    _tokens(chat.send("Hi", sampling=GREEDY, max_tokens=4))
    before = [dict(m) for m in chat.messages]
    with pytest.raises(PromptTooLongError):
        _tokens(chat.send("zq xv jk " * 40, sampling=GREEDY))
    assert chat.messages == before
    assert _tokens(chat.send("Hi", sampling=GREEDY, max_tokens=3))  # still usable


def test_sampling_is_reproducible_with_a_seed(tiny_models):
    engine = Engine.load(tiny_models["olmoe"][0], dtype="float32")
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=123)
    a = _tokens(engine.generate([3, 1, 4], sampling=params, max_tokens=20))
    b = _tokens(engine.generate([3, 1, 4], sampling=params, max_tokens=20))
    assert a == b
    assert torch.tensor(a).unique().numel() > 1


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_greedy_with_repetition_penalty_matches_transformers(tiny_models, penalty):
    """The penalty sees the prompt and every generated token, as transformers' processor does."""
    path, hf = tiny_models["qwen3_moe"]
    engine = Engine.load(path, dtype="float32")
    prompt = [5, 9, 5, 17, 9, 5]
    ours = _tokens(engine.generate(prompt, sampling=SamplingParams(do_sample=False, repetition_penalty=penalty),
                                   max_tokens=24, stop_on_eos=False))
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, repetition_penalty=penalty, max_new_tokens=24,
                          min_new_tokens=24)[0, len(prompt):].tolist()
    assert ours == ref


def test_a_full_conversation_goes_on_without_its_oldest_turns(tiny_chat_model):
    """Issue 19: the turn that fills the context ends "length"; the next one ("hi") leaves the oldest whole turns
    out of the prompt (never the system prompt or the new message), says how many, and its reply equals a fresh
    generation on what the model now sees."""
    path, _, _ = tiny_chat_model
    engine = Engine.load(path, dtype="float32", context=128)
    chat = engine.conversation(system="Be brief.")
    chunks = list(chat.send("Tell me a long story about experts " * 3, sampling=GREEDY, max_tokens=400))
    assert chunks[-1].finish_reason == "length"  # the reply ran into the end of the context
    assert chat.dropped_turns == 0 and chat.sequence.kv.free == 0
    drops = []
    for n in range(3):
        got = _tokens(chat.send("hi", sampling=GREEDY, max_tokens=8))
        drops.append(chat.dropped_turns)
        assert got, f"turn {n}"
        assert chat.messages[0] == {"role": "system", "content": "Be brief."}
        assert chat.messages[-2]["content"] == "hi" and chat.messages[-1]["role"] == "assistant"
        fresh = _tokens(engine.generate(engine.encode_chat(chat.messages[:-1]), sampling=GREEDY, max_tokens=8))
        assert got == fresh
    assert chat.forgotten[0]["content"].startswith("Tell me a long story")
    assert drops[0] == 1 and sum(drops) * 2 == len(chat.forgotten)  # whole turns only, counted


def test_a_message_that_cannot_fit_alone_says_so_and_how(tiny_chat_model):
    path, _, _ = tiny_chat_model
    engine = Engine.load(path, dtype="float32", context=96)
    chat = engine.conversation()
    _tokens(chat.send("Hi", sampling=GREEDY, max_tokens=4))
    before = [dict(m) for m in chat.messages]
    most = engine.args.max_position_embeddings
    with pytest.raises(PromptTooLongError, match=rf"^this message is [\d,]+ tokens; the context of 96 leaves room "
                       rf"for [\d,]+ after the conversation so far: raise --context \(the model allows {most:,}\) or "
                       rf"shorten it$"):
        _tokens(chat.send("zq xv jk " * 40, sampling=GREEDY))
    assert chat.messages == before and chat.forgotten == []  # nothing dropped for a turn that never ran
    api = engine.conversation(overflow="error")
    with pytest.raises(PromptTooLongError, match="^the conversation is"):
        _tokens(api.send("zq xv jk " * 40, sampling=GREEDY))
    with pytest.raises(ValueError):
        engine.conversation(overflow="truncate")
