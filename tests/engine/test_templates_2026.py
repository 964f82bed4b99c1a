"""Golden tests on the 2026 families' real chat templates: Qwen3.5 (Qwen3.5/3.6-MoE), Gemma 4 and GLM-4.7-Flash.

../shared/chat-templates lacks them; llama.cpp keeps the Hub's own copies in its `models/templates/` (the
llama-cpp-python sdist vendors that tree). They are read in place from MOECHAT_LLAMA_CPP_SRC (a llama.cpp source
tree), or from a llama-cpp-python sdist unpacked beside this repository; the tests skip without one. Each is rendered
by transformers' apply_chat_template and by moechat's ChatTemplate, byte for byte, with the thinking switch on, off and
unset, tools, content parts and reasoning in the history; then where each generation prompt leaves the reasoning parser.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from moechat.engine.text.chat_template import ChatTemplate
from moechat.engine.text.reasoning import CHANNEL_TAGS, THINK_TAGS, make_parser, reasoning_format

transformers = pytest.importorskip("transformers")

from .test_shared_templates import GENERIC, SIMPLE, WEATHER, _hf  # noqa: E402


def _templates_dir() -> Path | None:
    roots = [Path(os.environ["MOECHAT_LLAMA_CPP_SRC"])] if os.environ.get("MOECHAT_LLAMA_CPP_SRC") else []
    beside = Path(__file__).resolve().parents[2].parent
    roots += sorted(beside.glob("*/llama_cpp_python-*/vendor/llama.cpp"), reverse=True)
    for root in roots:
        if (root / "models" / "templates").is_dir():
            return root / "models" / "templates"
    return None


TEMPLATES = _templates_dir()
# name -> the special tokens of the model's tokenizer_config.json the template reads
FAMILIES = {
    "Qwen3.5-4B.jinja": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "google-gemma-4-31B-it.jinja": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
    "google-gemma-4-31B-it-interleaved.jinja": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
    "GLM-4.7-Flash.jinja": {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
}
needs = pytest.mark.skipif(TEMPLATES is None, reason="no llama.cpp source tree (set MOECHAT_LLAMA_CPP_SRC) with "
                           "models/templates: the 2026 families' chat templates are not in ../shared")

CONVERSATIONS = {
    **GENERIC,
    "content_parts": [  # OpenAI-style content lists, as multimodal clients send them
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Describe "}, {"type": "text", "text": "Paris."}]},
    ],
    "thinking_in_content": [  # a reply that kept its own markers: templates strip them from history
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\ngreet\n</think>\n\nHello"},
        {"role": "user", "content": "Again"},
    ],
}
SWITCHES = {"unset": {}, "on": {"enable_thinking": True}, "off": {"enable_thinking": False},
            "tools": {"tools": [WEATHER]}, "tools_on": {"tools": [WEATHER], "enable_thinking": True}}


@pytest.fixture(scope="module")
def pairs():
    out = {}
    for name, tokens in FAMILIES.items():
        path = TEMPLATES / name
        if path.is_file():
            source = path.read_text(encoding="utf-8")
            out[name] = (_hf(source, tokens), ChatTemplate.from_string(source, tokens))
    return out


@needs
def test_every_family_is_there(pairs):
    assert sorted(pairs) == sorted(FAMILIES), f"{TEMPLATES} lacks {sorted(set(FAMILIES) - set(pairs))}"


@needs
@pytest.mark.parametrize("switch", sorted(SWITCHES))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_matches_transformers(pairs, name, conversation, switch):
    if name not in pairs:
        pytest.skip(f"{TEMPLATES} has no {name}")
    hf, ours = pairs[name]
    messages, kwargs = CONVERSATIONS[conversation], SWITCHES[switch]
    for add_gen in (True, False):
        try:
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_gen, **kwargs)
        except Exception as refused:  # a conversation the template raises on: moechat refuses it as well
            with pytest.raises(Exception, match=str(refused)[:40].replace("(", r"\(").replace(")", r"\)")):
                ours.render(messages, add_generation_prompt=add_gen, **kwargs)
            continue
        got = ours.render(messages, add_generation_prompt=add_gen, **kwargs)
        assert got == expected
        last = messages[-1]["content"]
        assert (last if isinstance(last, str) else last[-1]["text"]).strip() in got  # templates trim content


@needs
@pytest.mark.parametrize(("name", "kwargs", "fmt", "in_thinking"), [
    ("Qwen3.5-4B.jinja", {}, THINK_TAGS, True),  # thinking by default: the prompt opens <think>
    ("Qwen3.5-4B.jinja", {"enable_thinking": False}, THINK_TAGS, False),
    ("google-gemma-4-31B-it.jinja", {}, CHANNEL_TAGS, False),  # off by default: an empty thought channel
    ("google-gemma-4-31B-it.jinja", {"enable_thinking": True}, CHANNEL_TAGS, False),  # the model opens it
    ("google-gemma-4-31B-it-interleaved.jinja", {"enable_thinking": True}, CHANNEL_TAGS, False),
    ("GLM-4.7-Flash.jinja", {}, THINK_TAGS, True),
    ("GLM-4.7-Flash.jinja", {"enable_thinking": False}, THINK_TAGS, False),
])
def test_where_the_generation_prompt_leaves_the_parser(pairs, name, kwargs, fmt, in_thinking):
    if name not in pairs:
        pytest.skip(f"{TEMPLATES} has no {name}")
    _, ours = pairs[name]
    assert reasoning_format(ours.source) == fmt
    assert "enable_thinking" in ours.variables  # the switch moechat's --thinking sets
    prompt = ours.render(SIMPLE, **kwargs)
    opener = {THINK_TAGS: "<think>", CHANNEL_TAGS: "<|channel>thought\n"}[fmt]
    closer = {THINK_TAGS: "</think>", CHANNEL_TAGS: "<channel|>"}[fmt]
    reply = f"Some words.{closer}The answer." if in_thinking else f"{opener}Some words.{closer}The answer."
    if not in_thinking and not kwargs.get("enable_thinking", fmt == THINK_TAGS):
        reply = "The answer."  # thinking off: the prompt closed the block, the model answers
    parser = make_parser(fmt, prompt[-40:])
    first, rest = parser.feed(reply), parser.flush()
    assert (first.thinking + rest.thinking, first.answer + rest.answer) == (
        "Some words." if "Some words." in reply else "", "The answer.")


ARGUMENTS = [
    {"city": "Paris, FR", "days": 2},
    {"query": "weather \"now\" 🌦", "filters": {"lang": "fr", "year": 2026, "exact": True}, "tags": ["a", "b c"],
     "limit": 10.5, "grid": [[1, 2], [3]], "empty": {}, "none": []},
    {},
]


@needs
@pytest.mark.parametrize("name", ["google-gemma-4-31B-it.jinja", "google-gemma-4-31B-it-interleaved.jinja"])
@pytest.mark.parametrize("case", range(len(ARGUMENTS)))
def test_gemma4_tool_calls_the_template_writes_parse_back(pairs, name, case):
    """What Gemma 4's own template writes for a tool call (its argument notation) reads back as the same call."""
    from moechat.engine.text.tool_calls import GEMMA, make_tool_parser, tool_call_format

    hf, ours = pairs[name]
    call = {"type": "function", "id": "c1", "function": {"name": "get_weather", "arguments": ARGUMENTS[case]}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    rendered = hf.apply_chat_template(messages, tokenize=False, tools=[WEATHER])
    assert ours.render(messages, add_generation_prompt=False, tools=[WEATHER]) == rendered
    start = rendered.index("<|tool_call>")
    block = rendered[start:rendered.index("<tool_call|>", start) + len("<tool_call|>")]
    assert tool_call_format(ours.source) == GEMMA
    parser = make_tool_parser(ours.source, "<|turn>model\n")
    delta, rest = parser.feed("Checking." + block), parser.flush()
    assert delta.answer + rest.answer == "Checking."
    (got,) = parser.take_calls()
    assert got.name == "get_weather" and json.loads(got.arguments) == ARGUMENTS[case]
