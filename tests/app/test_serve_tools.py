"""Tool calls and reasoning through the server's HTTP layer and engine thread, with the official openai client.

The demo model's template defines no tools and no model small enough to bundle writes a tool call, so the
engine here is scripted: it yields the text a Qwen3 model writes, fed through the parser the worker built
(as `Engine.generate` does). Everything else is the real server: `build_app`, `EngineWorker`, the hermes
parser, SSE, the openai client over Starlette's ASGI test transport.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
from starlette.testclient import TestClient  # noqa: E402

_spec = importlib.util.spec_from_file_location("serveproc", Path(__file__).parents[1] / "serveproc.py")
serveproc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serveproc)

QWEN3_LIKE = "{% if tools %}<tools></tools> <tool_call>{% endif %}<think></think>{{ messages }}"
REPLY = ["<think>\n", "The user wants", " the weather.\n", "</think>\n\n", "Checking.", "\n<tool_", "call>\n{\"na",
         "me\": \"get_weather\", \"arguments\": {\"city\": ", "\"Paris\"}}\n</tool_call>"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture
def client():
    with serveproc.scripted_app(engine=serveproc.ScriptedEngine(REPLY, QWEN3_LIKE)) as (app, engine):
        with TestClient(app) as http:
            yield (openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0),
                   engine)


def test_tool_calls_and_reasoning_not_streamed(client):
    client, engine = client
    out = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Weather?"}],
                                         tools=TOOLS)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert message.content.strip() == "Checking."
    assert message.model_extra["reasoning_content"] == "The user wants the weather."
    (call,) = message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather",
                                                                         '{"city": "Paris"}')
    assert call.id.startswith("call_")
    assert engine.rendered[-1] == {"tools": TOOLS}  # passed to the chat template as given
    assert out.usage.completion_tokens == len(REPLY)


def test_tool_calls_streamed_and_tool_choice_none(client):
    client, engine = client
    chunks = list(client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "?"}],
                                                 tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in (d.tool_calls or [])]
    assert [(t.index, t.function.name, t.function.arguments) for t in calls] == [
        (0, "get_weather", '{"city": "Paris"}')]
    assert "".join(d.content or "" for d in deltas).strip() == "Checking."
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "The user wants the weather."
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "?"}], tools=TOOLS,
                                   tool_choice="none")
    assert engine.rendered[-1] == {}  # tool_choice none: the template sees no tools
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "?"}], tools=TOOLS,
                                       tool_choice="required")


def test_tool_call_arguments_in_the_history_reach_the_template_as_objects():
    from moechat.app.serve.request import BadRequest, parse_messages

    messages = parse_messages([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "raw", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}])
    calls = messages[1]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"city": "Paris"} and calls[0]["id"] == "call_1"
    assert calls[1]["function"]["arguments"] == "not json"  # left as sent: the template decides
    assert messages[1]["content"] == "" and messages[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}
    with pytest.raises(BadRequest, match="tool_calls"):
        parse_messages([{"role": "assistant", "content": None, "tool_calls": [{"function": "f"}]}])


SWITCHED = "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{{ messages }}"


def test_chat_template_kwargs_turn_thinking_off_and_unknown_keys_are_refused():
    with serveproc.scripted_app(engine=serveproc.ScriptedEngine(["Hi."], SWITCHED)) as (app, engine):
        with TestClient(app, base_url="http://127.0.0.1") as http:
            body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
            ok = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}})
            assert ok.status_code == 200, ok.text
            assert engine.rendered[-1] == {"enable_thinking": False}
            assert http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {
                "thinking": True}}).status_code == 200
            assert engine.rendered[-1] == {"enable_thinking": True}  # DeepSeek's name, the template's switch
            for bad, says in [({"bos_token": "x"}, "'bos_token' not supported"), ({"enable_thinking": "no"}, "true"),
                              ([1], "must be an object"), ({"reasoning_effort": "max"}, "reasoning_effort")]:
                r = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": bad})
                assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
                assert r.json()["error"]["param"] == "chat_template_kwargs"
            assert len(engine.rendered) == 2  # nothing refused reached the template


def test_chat_template_kwargs_on_a_template_without_a_switch_pass_nothing(client):
    client, engine = client
    client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}],
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert engine.rendered[-1] == {}
