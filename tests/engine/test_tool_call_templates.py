"""Tool calls as each family's real chat template writes them, read back by moechat's parsers: an assistant turn
with tool_calls rendered by transformers' apply_chat_template, its call block fed to make_tool_parser (with the
request's tools, whose schemas type the XML forms' values), and the same name and arguments must come out.

Templates are read in place: ../shared/chat-templates (Qwen3, Qwen3-Coder, Nemotron 3, GLM-4.6, MiniMax-M2,
gpt-oss) and llama.cpp's models/templates (Qwen3.5, GLM-4.7-Flash, Gemma 4; see test_templates_2026.py); each case
skips when its file is absent."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from moechat.engine.text.chat_template import ChatTemplate
from moechat.engine.text.tool_calls import GEMMA, HERMES, MINIMAX, ToolCall, make_tool_parser, tool_call_format

from .test_shared_templates import _hf
from .test_templates_2026 import TEMPLATES

transformers = pytest.importorskip("transformers")

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "chat-templates"
TOOL = {"type": "function", "function": {"name": "search", "description": "Search.", "parameters": {
    "type": "object", "properties": {
        "query": {"type": "string"}, "days": {"type": "integer"}, "limit": {"type": "number"},
        "exact": {"type": "boolean"}, "filters": {"type": "object"}, "tags": {"type": "array"},
        "code": {"type": "string"}}, "required": ["query"]}}}
ARGUMENTS = [
    {"query": "weather in Paris, FR 🌦"},
    {"query": "multi\nline \"quoted\" <b>", "days": 3, "limit": 10.5, "exact": True, "filters": {"lang": "fr"},
     "tags": ["a", "b c"], "code": "42"},
    {"query": "x", "exact": False, "tags": [], "filters": {"nested": {"n": [1, 2]}}},
]
# file -> (where, the special tokens its template reads, the call block's markers, the format)
FAMILIES = {
    "Qwen3-Coder.jinja": (SHARED, {"eos_token": "<|im_end|>"}, ("<tool_call>", "</tool_call>"), HERMES),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": (SHARED, {"eos_token": "<|im_end|>"}, ("<tool_call>", "</tool_call>"),
                                                  HERMES),
    "GLM-4.6.jinja": (SHARED, {"eos_token": "<|endoftext|>"}, ("<tool_call>", "</tool_call>"), HERMES),
    "MiniMax-M2.jinja": (SHARED, {"bos_token": "]~!b[", "eos_token": "[e~["}, ("<minimax:tool_call>",
                                                                               "</minimax:tool_call>"), MINIMAX),
    "Qwen-Qwen3-0.6B.jinja": (SHARED, {"eos_token": "<|im_end|>"}, ("<tool_call>", "</tool_call>"), HERMES),
    "Qwen3.5-4B.jinja": (TEMPLATES, {"eos_token": "<|im_end|>"}, ("<tool_call>", "</tool_call>"), HERMES),
    "GLM-4.7-Flash.jinja": (TEMPLATES, {"eos_token": "<|endoftext|>"}, ("<tool_call>", "</tool_call>"), HERMES),
    "google-gemma-4-31B-it.jinja": (TEMPLATES, {"bos_token": "<bos>", "eos_token": "<eos>"},
                                    ("<|tool_call>", "<tool_call|>"), GEMMA),
}


def _source(name: str) -> str:
    where = FAMILIES[name][0]
    if where is None or not (where / name).is_file():
        pytest.skip(f"{name} is not here (../shared/chat-templates, or a llama.cpp tree: MOECHAT_LLAMA_CPP_SRC)")
    return (where / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("case", range(len(ARGUMENTS)))
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_calls_a_template_writes_parse_back(name, case):
    source = _source(name)
    _, tokens, (open_, close), fmt = FAMILIES[name]
    hf = _hf(source, tokens)
    call = {"type": "function", "id": "call_1", "function": {"name": "search", "arguments": ARGUMENTS[case]}}
    messages = [{"role": "user", "content": "Find it."}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "found"}]
    rendered = hf.apply_chat_template(messages, tokenize=False, tools=[TOOL])
    assert ChatTemplate.from_string(source, tokens).render(messages, add_generation_prompt=False,
                                                           tools=[TOOL]) == rendered
    blocks = re.findall(re.escape(open_) + ".*?" + re.escape(close), rendered, re.S)
    assert blocks, rendered[-600:]
    block = blocks[-1]  # the call (a template's tool instructions may show an example block before)
    assert tool_call_format(source) == fmt
    parser = make_tool_parser(source, "", tools=[TOOL])
    delta, rest = parser.feed("Let me look." + block), parser.flush()
    assert (delta.answer + rest.answer).strip() == "Let me look."
    (got,) = parser.take_calls()
    assert got.name == "search" and json.loads(got.arguments) == ARGUMENTS[case], block


def test_xml_forms_streamed_in_every_split():
    text = ("Checking.<tool_call>\n<function=search>\n<parameter=query>\nParis\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n</function>\n</tool_call><tool_call>search<arg_key>query</arg_key><arg_value>Rome"
            "</arg_value><arg_key>exact</arg_key><arg_value>true</arg_value></tool_call>")
    want = [ToolCall("search", json.dumps({"query": "Paris", "days": 2})),
            ToolCall("search", json.dumps({"query": "Rome", "exact": True}))]
    for step in (1, 3, 17, 1000):
        parser = make_tool_parser("<tool_call>", "", tools=[TOOL])
        answer, calls = [], []
        for i in range(0, len(text), step):
            answer.append(parser.feed(text[i:i + step]).answer)
            calls += parser.take_calls()
        answer.append(parser.flush().answer)
        calls += parser.take_calls()
        assert ("".join(answer), calls) == ("Checking.", want)


def test_minimax_block_with_two_invokes_and_what_is_not_a_call():
    parser = make_tool_parser("<minimax:tool_call>", "", tools=[TOOL])
    text = ('<minimax:tool_call>\n<invoke name="search"><parameter name="query">a</parameter></invoke>\n'
            '<invoke name="now"></invoke>\n</minimax:tool_call>')
    delta, rest = parser.feed(text), parser.flush()
    assert delta.answer + rest.answer == ""
    assert parser.take_calls() == [ToolCall("search", '{"query": "a"}'), ToolCall("now", "{}")]
    for not_a_call in ("<minimax:tool_call>plain words</minimax:tool_call>",
                       '<minimax:tool_call><invoke name="x">unclosed</minimax:tool_call>'):
        parser = make_tool_parser("<minimax:tool_call>", "")
        delta, rest = parser.feed(not_a_call), parser.flush()
        assert delta.answer + rest.answer == not_a_call and parser.take_calls() == []


def test_xml_call_to_a_function_the_request_lacks_stays_text():
    parser = make_tool_parser("<tool_call>", "", tools=[TOOL])
    text = "<tool_call>\n<function=rm_rf>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>"
    delta, rest = parser.feed(text), parser.flush()
    assert delta.answer + rest.answer == text and parser.take_calls() == []
