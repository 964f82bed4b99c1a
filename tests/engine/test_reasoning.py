"""Reasoning parsers: thinking and answer split the same whatever the chunking, markers included."""

from __future__ import annotations

import itertools

import pytest

from moechat.engine.reasoning import (
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
            for marker in HARMONY_MARKERS if fmt == HARMONY else ():
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
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    (None, None),
])
def test_reasoning_format_of_a_template(source, fmt):
    assert reasoning_format(source) == fmt


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning format"):
        make_parser("xml")
