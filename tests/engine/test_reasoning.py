"""Reasoning parsers: thinking and answer split the same whatever the chunking, markers included."""

from __future__ import annotations

import itertools

import pytest

from moechat.engine.text.reasoning import (
    CHANNEL_TAGS,
    HARMONY,
    THINK_TAGS,
    HarmonyParser,
    ReasoningDelta,
    ThinkTagParser,
    make_parser,
    reasoning_format,
)

HARMONY_MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")

# (format, prompt tail, generated text, expected thinking, expected answer)
CASES = {
    "harmony": (
        HARMONY, "<|start|>user<|message|>2+2?<|end|><|start|>assistant",
        "<|channel|>analysis<|message|>User asks 2+2. Answer 4.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = **4**.",
        "User asks 2+2. Answer 4.", "2 + 2 = **4**.",
    ),
    "harmony-final-end": (  # <|end|> after the answer (a stop token would have ended it before)
        HARMONY, "<|start|>assistant",
        "<|channel|>analysis<|message|>a<b and |x|<|end|><|start|>assistant<|channel|>final<|message|>ok<|end|>",
        "a<b and |x|", "ok",
    ),
    "harmony-two-analysis": (
        HARMONY, "<|start|>assistant",
        "<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis<|message|>Second."
        "<|end|><|start|>assistant<|channel|>final<|message|>Done 你好 🙂",
        "First.\n\nSecond.", "Done 你好 🙂",
    ),
    "harmony-tool-call": (  # commentary to a tool is thinking; the call ends the turn (<|call|> is a stop token)
        HARMONY, "<|start|>assistant",
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather"
        "<|channel|>commentary <|constrain|>json<|message|>{\"city\": \"Paris\"}",
        "Need weather.\n\n{\"city\": \"Paris\"}", "",
    ),
    "harmony-final-only": (
        HARMONY, "<|start|>assistant", "<|channel|>final<|message|>Just the answer.", "", "Just the answer.",
    ),
    "harmony-no-end-between": (  # a new channel straight after a body, as some gpt-oss outputs do
        HARMONY, "<|start|>assistant", "<|channel|>analysis<|message|>Think<|channel|>final<|message|>Say",
        "Think", "Say",
    ),
    "harmony-plain-text": (  # a model ignoring the format: its text is the answer, nothing is lost
        HARMONY, "<|start|>assistant", "Hello there, no channels here.", "", "Hello there, no channels here.",
    ),
    "harmony-prefilled-analysis": (  # the prompt already opened the analysis message
        HARMONY, "<|start|>assistant<|channel|>analysis<|message|>",
        "Thinking on.<|end|><|start|>assistant<|channel|>final<|message|>Answer.", "Thinking on.", "Answer.",
    ),
    "qwen3": (
        THINK_TAGS, "<|im_start|>assistant\n",
        "<think>\nThe user greets me.\n\nReply politely.\n</think>\n\nHello! How can I help?",
        "The user greets me.\n\nReply politely.", "Hello! How can I help?",
    ),
    "qwen3-empty-think": (
        THINK_TAGS, "<|im_start|>assistant\n", "<think>\n\n</think>\n\nHi.", "", "Hi.",
    ),
    "qwen3-no-think": (  # enable_thinking=False: the prompt closed the block already
        THINK_TAGS, "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Plain answer <think> is literal here.",
        "", "Plain answer <think> is literal here.",
    ),
    "opened-in-prompt": (  # DeepSeek-V3.1 thinking, Nemotron, MiniMax-M2: the prompt ends in <think>
        THINK_TAGS, "<｜Assistant｜><think>", "Let me see.</think>It is 4. </think> stays.",
        "Let me see.", "It is 4. </think> stays.",
    ),
    "think-tags-in-thinking": (
        THINK_TAGS, "", "<think>I could write <think> here</think>\nAnswer\n", "I could write <think> here",
        "Answer\n",
    ),
    "answer-mentions-tag": (
        THINK_TAGS, "", "Use <think> tags like this.", "", "Use <think> tags like this.",
    ),
    "cut-off-while-thinking": (  # max tokens hit inside the block: the thinking so far, no answer
        THINK_TAGS, "", "<think>\nStep 1.\nStep 2.\n</thi", "Step 1.\nStep 2.\n</thi", "",
    ),
    "gemma4": (  # enable_thinking=True: the prompt ends in <|turn>model, the model opens the thought channel
        CHANNEL_TAGS, "<|turn>user\nhi<turn|>\n<|turn>model\n",
        "<|channel>thought\nThe user greets me.\n\nBe warm.\n<channel|>Hello! 👋",
        "The user greets me.\n\nBe warm.", "Hello! 👋",
    ),
    "gemma4-thinking-off": (  # the template's default: an empty thought channel closes the prompt
        CHANNEL_TAGS, "<|turn>model\n<|channel>thought\n<channel|>", "Plain answer.", "", "Plain answer.",
    ),
    "gemma4-no-name-line": (  # a channel with no name line: what it holds is still thinking, nothing lost
        CHANNEL_TAGS, "", "<|channel>Just this<channel|>\nAnswer", "Just this", "Answer",
    ),
    "gemma4-opened-in-prompt": (
        CHANNEL_TAGS, "<|turn>model\n<|channel>thought\n", "Go on.<channel|>Done.", "Go on.", "Done.",
    ),
    "gemma4-cut-off": (
        CHANNEL_TAGS, "", "<|channel>thought\nStep 1.\n<chan", "Step 1.\n<chan", "",
    ),
}


def _run(fmt, tail, pieces) -> tuple[str, str, list[ReasoningDelta]]:
    parser = make_parser(fmt, tail)
    deltas = [parser.feed(p) for p in pieces]
    deltas.append(parser.flush())
    thinking = "".join(d.thinking for d in deltas)
    answer = "".join(d.answer for d in deltas)
    assert (parser.thinking, parser.answer) == (thinking, answer)
    return thinking, answer, deltas


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_split_in_two_and_three(case):
    fmt, tail, text, thinking, answer = CASES[case]
    assert _run(fmt, tail, [text])[:2] == (thinking, answer)
    assert _run(fmt, tail, list(text))[:2] == (thinking, answer)  # one character at a time
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        assert _run(fmt, tail, [text[:i], text[i:j], text[j:]])[:2] == (thinking, answer), (i, j)


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_marker_leaks_into_a_delta(case):
    fmt, tail, text, _, answer = CASES[case]
    for i in range(len(text) + 1):
        _, _, deltas = _run(fmt, tail, [text[:i], text[i:]])
        for d in deltas:
            for marker in {HARMONY: HARMONY_MARKERS, CHANNEL_TAGS: ("<|channel>", "<channel|>")}.get(fmt, ()):
                assert marker not in d.thinking and marker not in d.answer


def test_text_is_not_held_back_longer_than_a_marker():
    parser = HarmonyParser()
    assert parser.feed("<|channel|>analysis<|message|>Let me think") == ReasoningDelta("Let me think", "")
    assert parser.feed(" more <|") == ReasoningDelta(" more ", "")  # "<|" could start <|end|>
    assert parser.feed("en") == ReasoningDelta()
    assert parser.feed("d|><|start|>assistant<|channel|>fi") == ReasoningDelta()
    assert parser.feed("nal<|message|>Four") == ReasoningDelta("", "Four")
    assert parser.feed(" <|c") == ReasoningDelta("", " ")  # <|call|>, <|channel|> or <|constrain|>?
    assert parser.feed("x") == ReasoningDelta("", "<|cx")  # none of them after all
    assert parser.feed(" <|x") == ReasoningDelta("", " <|x")  # never a marker: not held
    assert parser.flush() == ReasoningDelta()


def test_think_tags_hold_back_only_whitespace_and_partial_tags():
    parser = ThinkTagParser()
    assert parser.feed("\n<thi") == ReasoningDelta()
    assert parser.feed("nk>\nStep one.\n") == ReasoningDelta("Step one.", "")
    assert parser.feed("\nStep two.</") == ReasoningDelta("\n\nStep two.", "")
    assert parser.feed("think>\n\n") == ReasoningDelta()
    assert parser.feed("Answer") == ReasoningDelta("", "Answer")
    assert parser.feed(" and\n") == ReasoningDelta("", " and\n")
    assert parser.flush() == ReasoningDelta()


def test_plain_text_before_any_tag_streams_as_answer_at_once():
    parser = ThinkTagParser()
    assert parser.feed("  Hello") == ReasoningDelta("", "Hello")
    assert parser.feed(" <think>") == ReasoningDelta("", " <think>")


@pytest.mark.parametrize(("source", "fmt"), [
    ("{{ '<|start|>assistant<|channel|>final<|message|>' }}", HARMONY),
    ("{{ '<think>\\n' }}", THINK_TAGS),
    ("{{ content.split('</think>')[-1] }}", THINK_TAGS),
    ("{{ text.split('<channel|>') }}{{ '<|channel>thought\\n<channel|>' }}", CHANNEL_TAGS),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    (None, None),
])
def test_reasoning_format_of_a_template(source, fmt):
    assert reasoning_format(source) == fmt


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning format"):
        make_parser("xml")


# ---------------------------------------------------------------------------------------------------------------
# Wired into the engine: a tiny model whose tokenizer has harmony's special tokens, sampling scripted ids.

GREEDY = {"temperature": 0.0}
QWEN3_LIKE = (  # enough of Qwen3's template for the engine: <think> in the template, reasoning_content read back
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{% if m.reasoning_content is defined %}"
    "<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant<|message|>{% endif %}"
)


@pytest.fixture(scope="module")
def harmony_engine(tiny_harmony_model):
    from moechat.engine.runtime.generate import Engine

    path, fast = tiny_harmony_model
    return Engine.load(path, dtype="float32"), fast  # loading takes seconds: one engine for the module


def _script(fast, text: str, stop: str = "<|return|>") -> list[int]:
    return fast.encode(text, add_special_tokens=False) + [fast.convert_tokens_to_ids(stop)]


def test_engine_splits_harmony_and_records_thinking(harmony_engine, script_sampler):
    engine, fast = harmony_engine
    generated = ("<|channel|>analysis<|message|>The user says hi. Be warm.<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>Hello, friend!")
    ids = _script(fast, generated)
    assert fast.convert_tokens_to_ids("<|channel|>") in ids  # the markers are single special tokens
    script_sampler(ids + _script(fast, "<|channel|>final<|message|>Again!"))
    conversation = engine.conversation()
    chunks = list(conversation.send("hi", sampling=engine.sampling(**GREEDY), max_tokens=100))
    assert [t for c in chunks for t in c.token_ids] == ids and chunks[-1].finish_reason == "stop"
    assert "".join(c.thinking for c in chunks) == "The user says hi. Be warm."
    assert "".join(c.text for c in chunks) == "Hello, friend!"
    # The answer streams token by token, not at the end; no chunk carries a marker.
    assert sum(1 for c in chunks if c.text) > 3
    assert not any("<|" in c.text + c.thinking for c in chunks)
    assert conversation.messages[-1] == {"role": "assistant", "content": "Hello, friend!",
                                         "thinking": "The user says hi. Be warm."}
    # The next turn renders (the template refuses channel tags in content, so they must not be there).
    second = list(conversation.send("again", sampling=engine.sampling(**GREEDY), max_tokens=100))
    assert "".join(c.text for c in second) == "Again!" and not any(c.thinking for c in second)
    assert conversation.messages[-1] == {"role": "assistant", "content": "Again!"}


def test_engine_passes_reasoning_effort_and_knows_who_reads_it(harmony_engine):
    engine, fast = harmony_engine
    assert engine.template_reads("reasoning_effort") and not engine.template_reads("enable_thinking")
    messages = [{"role": "user", "content": "hi"}]
    high = engine.encode_chat(messages, reasoning_effort="high")
    assert fast.decode(high).startswith("<|start|>system<|message|>Reasoning: high<|end|>")
    # Not given: the template's own default, which for gpt-oss is "medium".
    assert engine.encode_chat(messages) == engine.encode_chat(messages, reasoning_effort="medium")


def test_engine_cut_off_while_thinking_keeps_the_thinking(harmony_engine, script_sampler):
    engine, fast = harmony_engine
    ids = fast.encode("<|channel|>analysis<|message|>Long thought that never ends", add_special_tokens=False)
    script_sampler(ids)
    prompt = engine.encode_chat([{"role": "user", "content": "hi"}])
    chunks = list(engine.generate(prompt, sampling=engine.sampling(**GREEDY), max_tokens=len(ids),
                                  reasoning=engine.reasoning_parser(prompt)))
    assert chunks[-1].finish_reason == "length"
    assert "".join(c.thinking for c in chunks) == "Long thought that never ends"
    assert "".join(c.text for c in chunks) == ""


def test_engine_without_a_parser_keeps_plain_text(harmony_engine, script_sampler):
    engine, fast = harmony_engine
    ids = _script(fast, "<|channel|>final<|message|>Hi")
    script_sampler(ids)
    chunks = list(engine.generate([1, 2, 3], sampling=engine.sampling(**GREEDY), max_tokens=50))
    # A raw completion: special tokens skipped as always, nothing split off.
    assert "".join(c.text for c in chunks) == fast.decode(ids[:-1], skip_special_tokens=True) == "finalHi"
    assert not any(c.thinking for c in chunks)


def test_engine_splits_think_tags(harmony_engine, script_sampler, monkeypatch):
    from moechat.engine.text.chat_template import ChatTemplate
    engine, fast = harmony_engine
    engine.chat_template = ChatTemplate.from_string(QWEN3_LIKE)
    script_sampler(_script(fast, "<think>\nHmm, a greeting.\n</think>\n\nHey!"))
    conversation = engine.conversation()
    chunks = list(conversation.send("hi", sampling=engine.sampling(**GREEDY), max_tokens=100))
    assert "".join(c.thinking for c in chunks) == "Hmm, a greeting."
    assert "".join(c.text for c in chunks) == "Hey!"
    assert conversation.messages[-1] == {"role": "assistant", "content": "Hey!", "thinking": "Hmm, a greeting."}


def test_engine_splits_gemma_channel_tags(harmony_engine, script_sampler):
    # Gemma 4's markers are special tokens: the engine keeps them visible to the parser and out of the text.
    from moechat.engine.text.chat_template import ChatTemplate
    engine, fast = harmony_engine
    gemma_like = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
                  "{% if add_generation_prompt %}<|start|>model<|message|>"
                  "{% if not enable_thinking | default(false) %}<|channel>thought\n<channel|>{% endif %}{% endif %}")
    engine.chat_template = ChatTemplate.from_string(gemma_like)
    try:
        ids = _script(fast, "<|channel>thought\nA greeting.\n<channel|>Hi there!")
        assert fast.convert_tokens_to_ids("<|channel>") in ids
        script_sampler(ids + _script(fast, "Plain."))
        conversation = engine.conversation()
        chunks = list(conversation.send("hi", sampling=engine.sampling(**GREEDY), max_tokens=100,
                                        enable_thinking=True))
        assert "".join(c.thinking for c in chunks) == "A greeting."
        assert "".join(c.text for c in chunks) == "Hi there!"
        assert not any("channel" in c.text + c.thinking for c in chunks)
        # Thinking off (the template's default): the prompt closes the channel, the reply is all answer.
        second = list(conversation.send("again", sampling=engine.sampling(**GREEDY), max_tokens=100))
        assert "".join(c.text for c in second) == "Plain." and not any(c.thinking for c in second)
    finally:
        engine.chat_template = ChatTemplate.from_string(fast.chat_template)
