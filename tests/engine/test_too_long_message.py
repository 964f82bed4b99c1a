"""A message the context cannot hold is refused in a sentence that reads right, with the numbers a person can act
on: the message's tokens, the room the conversation so far leaves it, and --context's ceiling (issue 26)."""

from __future__ import annotations

import pytest

from moechat.engine.errors import PromptTooLongError
from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, do_sample=False)
LONG = "zq xv jk " * 40


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    return Engine.load(tiny_chat_model[0], dtype="float32", context=96)


def test_the_message_its_room_and_the_ceiling_are_the_real_numbers(engine):
    chat = engine.conversation(system="Be brief.")
    prompt = engine.encode_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": LONG}],
                                add_generation_prompt=True)
    message = len(engine.encode(LONG))
    room = 96 - 1 - (len(prompt) - message)  # the system prompt and the template take the rest
    most = engine.args.max_position_embeddings
    assert most > 96 and 0 < room < message
    with pytest.raises(PromptTooLongError) as e:
        list(chat.send(LONG, sampling=GREEDY))
    assert str(e.value) == (f"this message is {message:,} tokens; the context of 96 leaves room for {room:,} after "
                            f"the conversation so far: raise --context (the model allows {most:,}) or shorten it")


def test_at_the_models_ceiling_only_shortening_is_offered(tiny_chat_model):
    most = Engine.load(tiny_chat_model[0], dtype="float32", context=96).args.max_position_embeddings
    full = Engine.load(tiny_chat_model[0], dtype="float32", context=most)
    text = "zq xv jk " * (most // 2)
    with pytest.raises(PromptTooLongError, match=rf"; the context of {most:,} leaves room for [\d,]+ after the "
                       rf"conversation so far: shorten it \({most:,} tokens is this model's maximum\)$"):
        list(full.conversation().send(text, sampling=GREEDY))


def test_an_api_callers_conversation_says_what_the_context_holds(engine):
    api = engine.conversation(overflow="error")
    with pytest.raises(PromptTooLongError, match=r"^the conversation is [\d,]+ tokens; the context of 96 holds 95 "
                       r"with a token of reply: raise --context \(the model allows [\d,]+\) or shorten it$"):
        list(api.send(LONG, sampling=GREEDY))
