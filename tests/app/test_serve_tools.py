"""Tool calls and reasoning through the server's HTTP layer and engine thread, with the official openai client.

The demo model's template defines no tools and no model small enough to bundle writes a tool call, so the
engine here is scripted: it yields the text a Qwen3 model writes, fed through the parser the worker built
(as `Engine.generate` does). Everything else is the real server: `build_app`, `EngineWorker`, the hermes
parser, SSE, the openai client over Starlette's ASGI test transport.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
from starlette.testclient import TestClient  # noqa: E402

from moechat.app.serve import Server, build_app  # noqa: E402
from moechat.app.serve_metrics import ServerMetrics  # noqa: E402
from moechat.app.serve_worker import EngineWorker  # noqa: E402

QWEN3_LIKE = "{% if tools %}<tools></tools> <tool_call>{% endif %}<think></think>{{ messages }}"
REPLY = ["<think>\n", "The user wants", " the weather.\n", "</think>\n\n", "Checking.", "\n<tool_", "call>\n{\"na",
         "me\": \"get_weather\", \"arguments\": {\"city\": ", "\"Paris\"}}\n</tool_call>"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@dataclass(frozen=True)
class Chunk:
    text: str
    token_ids: tuple
    finish_reason: str | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_tokens_per_s: float = 100.0
    decode_tokens_per_s: float = 50.0
    cache: object = None
    thinking: str = ""


class ScriptedEngine:
    """The engine's interface as the worker uses it; `generate` runs the real parser over scripted text."""

    def __init__(self):
        self.args = SimpleNamespace(vocab_size=1000, num_hidden_layers=2, num_experts=4, top_k=2,
                                    model_type="qwen3_moe")
        self.context = 4096
        self.chat_template = SimpleNamespace(source=QWEN3_LIKE)
        self.tokenizer = SimpleNamespace(decode=lambda ids: "<|im_start|>assistant\n")
        self.loaded = SimpleNamespace(dtype="torch.float32", device="cpu", cls=None)
        self.generation_config = {}
        self.rendered: list[dict] = []

    def encode_chat(self, messages, cancel=None, **kwargs):
        self.rendered.append(kwargs)
        return [1, 2, 3, 4]

    def new_sequence(self):
        return SimpleNamespace(truncate=lambda n: None)

    def sampling(self, **overrides):
        return SimpleNamespace(**overrides)

    def default_max_tokens(self):
        return 64

    def template_reads(self, name):
        return name == "tools"

    def cache_snapshot(self):
        return None

    def generate(self, ids, *, sampling=None, max_tokens=None, cancel=None, sequence=None, stop_on_eos=True,
                 reasoning=None, logprobs=None):
        for i, raw in enumerate(REPLY):
            last = i == len(REPLY) - 1
            d = reasoning.feed(raw)
            text, thinking = d.answer, d.thinking
            if last:
                rest = reasoning.flush()
                text, thinking = text + rest.answer, thinking + rest.thinking
            yield Chunk(text, (i,), "stop" if last else None, len(ids), i + 1, thinking=thinking)


@pytest.fixture
def client():
    engine = ScriptedEngine()
    worker = EngineWorker(engine, max_queue=4)
    metrics = ServerMetrics(lambda: worker.snapshot, {"model": "scripted"})
    worker.metrics = metrics
    worker.start()
    app = build_app(Server(worker, metrics, model_name="scripted", api_key=None, info={}))
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0), engine
    worker.stop()


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
    from moechat.app.serve_request import BadRequest, parse_messages

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
