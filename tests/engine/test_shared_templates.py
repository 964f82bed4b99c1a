"""Golden tests on the real chat templates in ../shared/chat-templates (seen from the repository root).

Each template is rendered by transformers' apply_chat_template (a PreTrainedTokenizerFast over a tiny
WordLevel tokenizer, carrying the template and the model's special tokens) and by moechat's ChatTemplate,
and the two must agree byte for byte; where transformers refuses a conversation, moechat must refuse it
too, with a ChatTemplateError. gpt-oss (harmony) gets the most cases: system and developer messages,
reasoning in the history, tools with every schema shape its TypeScript renderer handles, tool calls,
reasoning_effort, builtin_tools and model_identity. The files are read in place; tests skip without them.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from moechat.engine.errors import ChatTemplateError
from moechat.engine.text.chat_template import ChatTemplate, sandbox
from moechat.engine.text.reasoning import HARMONY, THINK_TAGS, make_parser, reasoning_format

transformers = pytest.importorskip("transformers")

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "chat-templates"
GPT_OSS = SHARED / "openai-gpt-oss-120b.jinja"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/chat-templates is not here")
needs_gpt_oss = pytest.mark.skipif(not GPT_OSS.is_file(), reason="../shared/chat-templates has no gpt-oss template")

# openai/gpt-oss-120b's tokenizer_config.json special tokens.
GPT_OSS_TOKENS = {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"}


def _hf(source: str, tokens: dict[str, str]):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {word: i for i, word in enumerate(dict.fromkeys(["<unk>", *tokens.values()]))}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=source, **tokens)


def _render_both(hf, ours: ChatTemplate, messages, **kwargs) -> str:
    """moechat's rendering, checked against transformers'. Both read the clock (strftime_now), so the date may
    tick over between two calls: transformers renders before and after, and moechat must match one of them."""
    add = kwargs.pop("add_generation_prompt", True)
    before = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add, **kwargs)
    got = ours.render(messages, add_generation_prompt=add, **kwargs)
    if got != before:
        assert got == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add, **kwargs)
    return got


# ---------------------------------------------------------------------------------------------------------------
# gpt-oss: conversations

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city ☀️ (\"now\" & <today>)",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. 北京"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                "days": {"type": "integer", "description": "Forecast days", "default": 1},
            },
            "required": ["city"],
        },
    },
}
# One parameter per branch of the template's render_typescript_type macro.
EVERY_SHAPE = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search with every kind of parameter.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "scores": {"type": "array", "items": {"type": "number"}, "nullable": True},
                "ids": {"type": "array", "items": {"type": "integer"}},
                "flags": {"type": "array", "items": {"type": "boolean"}},
                "anything": {"type": "array"},
                "points": {"type": "array", "items": {"type": "object", "properties": {
                    "x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x"]}},
                "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                "either": {"type": ["string", "number"]},
                "single": {"type": ["object"]},
                "mode": {"oneOf": [{"type": "string", "description": "by name"}, {"type": "integer", "default": 3}],
                         "default": "fast"},
                "shape": {"oneOf": [{"type": "object"}, {"type": "string"}]},
                "limit": {"type": "number", "default": 10.5},
                "exact": {"type": "boolean", "default": False},
                "note": {"type": "string", "nullable": True},
                "filter": {"type": "object", "properties": {"lang": {"type": "string", "enum": ["en", "fr"]},
                                                            "year": {"type": "integer"}}, "required": ["lang"]},
                "blob": {"type": "object"},
                "untyped": {"description": "no type at all"},
            },
            "required": ["query", "filter"],
        },
    },
}
NO_PARAMETERS = {"type": "function", "function": {"name": "now", "description": "The current time."}}
TOOLS = [WEATHER, EVERY_SHAPE, NO_PARAMETERS]

SIMPLE = [{"role": "user", "content": "Hello"}]
WITH_SYSTEM = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"}]
WITH_DEVELOPER = [{"role": "developer", "content": "Be terse.\nNo lists."}, {"role": "user", "content": "Hi"}]
MULTI_TURN_THINKING = [  # reasoning of earlier turns is dropped by the template, as in inference
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "thinking": "Simple addition."},
    {"role": "user", "content": "And times 3?"},
    {"role": "assistant", "content": "12", "reasoning_content": "4 * 3."},  # the alias apply_chat_template copies
    {"role": "user", "content": "Why?"},
]
ENDS_WITH_THINKING = [  # training layout: the last turn's analysis and <|return|> without a generation prompt
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue.", "thinking": "Any colour will do."},
]
ENDS_WITH_REASONING_ALIAS = [
    {"role": "user", "content": "Pick a number."},
    {"role": "assistant", "content": "7", "reasoning": "Lucky."},
]
NON_ASCII = [
    {"role": "system", "content": "Réponds en français 🇫🇷"},
    {"role": "user", "content": "你好，世界 🌍 — naïve café \"quoted\" <b>&</b>"},
    {"role": "assistant", "content": "こんにちは 👋"},
    {"role": "user", "content": "Ça va? 🤔\n  indented\ttab  "},
]
TOOL_CALL_ANSWERED = [  # a later final answer exists, so the tool call's analysis is dropped
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "thinking": "Need the weather tool.",
     "tool_calls": [{"type": "function", "id": "c1", "function": {"name": "get_weather",
                                                               "arguments": {"city": "Paris", "days": 2}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21, \"sky\": \"晴 ☀️\"}"},
    {"role": "assistant", "content": "21°C and sunny."},
]
TOOL_CALL_PENDING = [  # no final answer yet: the analysis before the call is kept (the one CoT rendered)
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "thinking": "Need the weather tool.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "21C"},
]
TOOL_CALL_CONTENT_AS_ANALYSIS = [  # content (not thinking) beside a call is the analysis; string arguments
    {"role": "user", "content": "Time?"},
    {"role": "assistant", "content": "Call now().",
     "tool_calls": [{"name": "now", "arguments": "{}", "content_type": "json"}]},
    {"role": "tool", "content": "12:00"},
]

CONVERSATIONS = {
    "simple": SIMPLE,
    "system": WITH_SYSTEM,
    "developer": WITH_DEVELOPER,
    "multi_turn_thinking": MULTI_TURN_THINKING,
    "ends_with_thinking": ENDS_WITH_THINKING,
    "ends_with_reasoning_alias": ENDS_WITH_REASONING_ALIAS,
    "non_ascii": NON_ASCII,
    "tool_call_answered": TOOL_CALL_ANSWERED,
    "tool_call_pending": TOOL_CALL_PENDING,
    "tool_call_content_as_analysis": TOOL_CALL_CONTENT_AS_ANALYSIS,
}
VARIANTS = {
    "plain": {},
    "effort_low": {"reasoning_effort": "low"},
    "effort_medium": {"reasoning_effort": "medium"},
    "effort_high": {"reasoning_effort": "high"},
    "tools": {"tools": TOOLS},
    "browser": {"builtin_tools": ["browser"]},
    "python": {"builtin_tools": ["python"]},
    "identity": {"model_identity": "You are Oss, a tiny test model."},
    "everything": {"tools": TOOLS, "builtin_tools": ["browser", "python"], "reasoning_effort": "high",
                   "model_identity": "You are Oss."},
}


@pytest.fixture(scope="module")
def gpt_oss():
    source = GPT_OSS.read_text(encoding="utf-8")
    return _hf(source, GPT_OSS_TOKENS), ChatTemplate.from_string(source, GPT_OSS_TOKENS)


@needs_gpt_oss
@pytest.mark.parametrize("add_gen", [True, False], ids=["gen1", "gen0"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_gpt_oss_matches_transformers(gpt_oss, conversation, variant, add_gen):
    hf, ours = gpt_oss
    messages = CONVERSATIONS[conversation]
    rendered = _render_both(hf, ours, messages, add_generation_prompt=add_gen, **VARIANTS[variant])
    # Not vacuous: the conversation and the options are in the prompt.
    last = messages[-1].get("content")
    if last:
        assert last in rendered
    effort = VARIANTS[variant].get("reasoning_effort", "medium")
    assert f"Reasoning: {effort}\n\n" in rendered
    assert rendered.endswith("<|start|>assistant") == add_gen


@needs_gpt_oss
def test_gpt_oss_literal(gpt_oss, monkeypatch):
    # Written by hand from the harmony format's documentation, so a bug shared by both renderers would show.
    _, ours = gpt_oss
    monkeypatch.setitem(sandbox._ENV.globals, "strftime_now",
                        lambda fmt: datetime(2025, 8, 5).strftime(fmt))
    assert ours.render(WITH_SYSTEM, reasoning_effort="high") == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\nCurrent date: 2025-08-05\n\nReasoning: high\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nAnswer in French.\n\n<|end|>"
        "<|start|>user<|message|>Hello<|end|><|start|>assistant"
    )
    assert ours.render(ENDS_WITH_THINKING, add_generation_prompt=False).endswith(
        "<|start|>user<|message|>Name a colour.<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Any colour will do.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Blue.<|return|>"
    )
    pending = ours.render(TOOL_CALL_PENDING, tools=[WEATHER])
    assert pending.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather tool.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>"
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\"21C\"<|end|><|start|>assistant"
    )
    # The template's TypeScript-like tool signatures (a comma follows even a default's comment).
    assert ("namespace functions {\n\n// Current weather in a city ☀️ (\"now\" & <today>)\n"
            "type get_weather = (_: {\n// City name, e.g. 北京\ncity: string,\n"
            "unit?: \"celsius\" | \"fahrenheit\", // default: celsius,\n// Forecast days\n"
            "days?: number, // default: 1,\n}) => any;\n\n} // namespace functions<|end|>") in pending


@needs_gpt_oss
@pytest.mark.parametrize(("messages", "kwargs"), [
    pytest.param([*SIMPLE, {"role": "assistant", "content": "<|channel|>final<|message|>Hi"}], {},
                 id="channel-tags-in-content"),
    pytest.param([*SIMPLE, {"role": "assistant", "content": "Hi", "thinking": "<|channel|>analysis<|message|>x"}],
                 {}, id="channel-tags-in-thinking"),
    pytest.param([*SIMPLE, {"role": "tool", "content": "orphan"}], {}, id="tool-without-call"),
    pytest.param([*SIMPLE, {"role": "assistant", "content": "c", "thinking": "t",
                            "tool_calls": [{"function": {"name": "now", "arguments": {}}}]}], {},
                 id="content-and-thinking-with-call"),
])
def test_gpt_oss_refuses_what_transformers_refuses(gpt_oss, messages, kwargs):
    hf, ours = gpt_oss
    with pytest.raises(Exception) as theirs:
        hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    with pytest.raises(ChatTemplateError, match="refused the conversation") as error:
        ours.render(messages, **kwargs)
    assert str(theirs.value) in str(error.value)


@needs_gpt_oss
def test_gpt_oss_reasoning_effort_default_is_medium(gpt_oss):
    # moechat passes reasoning_effort only when the user sets it; unset, the template's default applies.
    hf, ours = gpt_oss
    assert _render_both(hf, ours, SIMPLE) == _render_both(hf, ours, SIMPLE, reasoning_effort="medium")
    assert "reasoning_effort" in ours.variables and "enable_thinking" not in ours.variables


@needs_gpt_oss
def test_gpt_oss_reply_round_trip(gpt_oss):
    # What the engine records for a harmony reply (answer as content, analysis as thinking) renders back into
    # the next prompt the way transformers renders it, with no channel tags refused.
    hf, ours = gpt_oss
    prompt = _render_both(hf, ours, SIMPLE)
    assert reasoning_format(ours.source) == HARMONY
    parser = make_parser(HARMONY, prompt[-40:])
    parser.feed("<|channel|>analysis<|message|>Greeting.<|end|><|start|>assistant<|channel|>final<|message|>Hi!")
    parser.flush()
    history = [*SIMPLE, {"role": "assistant", "content": parser.answer, "thinking": parser.thinking},
               {"role": "user", "content": "Bye"}]
    assert "<|start|>assistant<|channel|>final<|message|>Hi!<|end|><|start|>user<|message|>Bye<|end|>" in (
        _render_both(hf, ours, history))


# ---------------------------------------------------------------------------------------------------------------
# Every shared template: the usual conversations, with and without tools

SHARED_TEMPLATES = sorted(p.name for p in SHARED.glob("*.jinja")) if SHARED.is_dir() else []
GENERIC_TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}
GENERIC = {
    "simple": SIMPLE,
    "multi_turn": [{"role": "system", "content": "Be brief."}, *MULTI_TURN_THINKING[1:3],
                   {"role": "user", "content": "And times 3?"}],
    "thinking_history": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "greet"},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "Yes", "reasoning_content": "ok"},
    ],
    "non_ascii": NON_ASCII,
    "tool_calls": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [{"type": "function", "id": "call_1",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
        {"role": "assistant", "content": "21C in Paris."},
    ],
}
# The keywords each family reads: thinking on and off.
FAMILY_KWARGS = {
    "Qwen-Qwen3-0.6B.jinja": [{"enable_thinking": False}],
    "GLM-4.6.jinja": [{"enable_thinking": False}],
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": [{"enable_thinking": False}],
    "deepseek-ai-DeepSeek-V3.1.jinja": [{"thinking": True}],
    "openai-gpt-oss-120b.jinja": [{"reasoning_effort": "low"}],
}


def _cases():
    for name in SHARED_TEMPLATES:
        for kwargs in [{}, {"tools": [WEATHER]}, *FAMILY_KWARGS.get(name, [])]:
            label = "-".join(kwargs) or "plain"
            for conversation in GENERIC:
                yield pytest.param(name, conversation, kwargs,
                                   id=f"{name.removesuffix('.jinja')}-{conversation}-{label}")


@pytest.fixture(scope="module")
def shared_pairs():
    pairs = {}
    for name in SHARED_TEMPLATES:
        source = (SHARED / name).read_text(encoding="utf-8")
        pairs[name] = (_hf(source, GENERIC_TOKENS), ChatTemplate.from_string(source, GENERIC_TOKENS))
    return pairs


@needs_shared
@pytest.mark.parametrize(("name", "conversation", "kwargs"), list(_cases()))
def test_shared_template_matches_transformers(shared_pairs, name, conversation, kwargs):
    hf, ours = shared_pairs[name]
    messages = GENERIC[conversation]
    for add_gen in (True, False):
        try:
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_gen, **kwargs)
        except Exception as refused:  # Kimi-K2's tool calls use list.append, which both sandboxes refuse
            with pytest.raises(ChatTemplateError):
                ours.render(messages, add_generation_prompt=add_gen, **kwargs)
            assert "append" in str(refused)
            continue
        got = ours.render(messages, add_generation_prompt=add_gen, **kwargs)
        if got != expected:  # gpt-oss reads the clock: the date may have ticked over
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_gen, **kwargs)
        assert got == expected
        assert messages[-1]["content"] in got or not messages[-1]["content"]


@needs_shared
def test_every_shared_template_is_covered():
    assert len(SHARED_TEMPLATES) >= 9 and "openai-gpt-oss-120b.jinja" in SHARED_TEMPLATES


# Which shared templates carry reasoning, and where their generation prompt leaves the parser.
@needs_shared
@pytest.mark.parametrize(("name", "kwargs", "fmt", "starts_in_thinking"), [
    ("openai-gpt-oss-120b.jinja", {}, HARMONY, None),
    ("Qwen-Qwen3-0.6B.jinja", {}, THINK_TAGS, False),
    ("Qwen-Qwen3-0.6B.jinja", {"enable_thinking": False}, THINK_TAGS, False),
    ("deepseek-ai-DeepSeek-V3.1.jinja", {}, THINK_TAGS, False),
    ("deepseek-ai-DeepSeek-V3.1.jinja", {"thinking": True}, THINK_TAGS, True),
    ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", {}, THINK_TAGS, True),
    ("MiniMax-M2.jinja", {}, THINK_TAGS, True),
    ("GLM-4.6.jinja", {}, THINK_TAGS, False),
    ("Qwen3-Coder.jinja", {}, None, None),
    ("Kimi-K2-Instruct.jinja", {}, None, None),
    ("LFM2-8B-A1B.jinja", {}, None, None),
])
def test_reasoning_format_of_shared_templates(shared_pairs, name, kwargs, fmt, starts_in_thinking):
    _, ours = shared_pairs[name]
    assert reasoning_format(ours.source) == fmt
    if fmt == THINK_TAGS:
        parser = make_parser(fmt, ours.render(SIMPLE, **kwargs)[-30:])
        delta = parser.feed("Some words.</think>The answer.")
        delta_rest = parser.flush()
        thinking = delta.thinking + delta_rest.thinking
        assert thinking == ("Some words." if starts_in_thinking else "")
