"""`moechat chat --remote`: the chat app on a real `moechat serve` subprocess (loopback), in a Pilot test."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from moechat.app.tui.remote import RemoteEngine, api_base, snapshot_from_metrics
from moechat.app.tui.screens.chat import ChatScreen
from moechat.app.tui.settings import Settings
from moechat.app.tui.widgets.prompt import PromptInput
from moechat.app.tui.widgets.transcript import AssistantMessage
from moechat.engine.errors import MoechatError

openai = pytest.importorskip("openai")

_spec = importlib.util.spec_from_file_location("serveproc", Path(__file__).parents[1] / "serveproc.py")
serveproc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serveproc)

KEY = "remote-key"
SIZE = (120, 36)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serveproc.ServeProcess(["--expert-slots", "32", "--no-warm-start"], api_key=KEY,
                                cache_dir=tmp_path_factory.mktemp("remote_cache")) as s:
        yield s


@pytest.mark.anyio
async def test_chat_app_on_a_served_model_shows_its_metrics(server, build_app, app_env, fakes):
    engine = RemoteEngine.connect(server.url, api_key=KEY)  # http://host:port: /v1 is added
    assert engine.is_moechat and engine.model == "demo-moe"
    settings = Settings(path=app_env / "settings.toml")
    settings.sampling = {"temperature": 0}  # greedy, to compare with the server's own answer
    app, store = build_app(engine, model=engine.label, settings=settings)
    app.startup_notices.append(engine.panel_note)
    async with app.run_test(size=SIZE) as pilot:
        screen = pilot.app.screen
        assert isinstance(screen, ChatScreen)
        await fakes.wait_for(pilot, lambda: screen.info is not None, timeout=30, what="the remote model")
        info = screen.info
        assert (info.name, info.num_layers, info.num_experts, info.top_k) == ("demo-moe", 6, 16, 2)
        assert info.cache is not None and info.cache.slots == 32
        assert any("/metrics" in n.message for n in pilot.app._notifications)
        prompt = screen.query_one(PromptInput)
        prompt.focus()
        prompt.load_text("What is an expert cache?")
        await pilot.press("enter")
        await fakes.wait_for(pilot, lambda: screen.gen_id is None and screen.session.turns
                             and screen.session.turns[-1].status != "streaming", timeout=60, what="the reply")
        (reply,) = screen.query(AssistantMessage)
        assert reply.status == "done" and reply.text
        direct = openai.OpenAI(base_url=server.base_url, api_key=KEY).chat.completions.create(
            model="demo-moe", messages=[{"role": "user", "content": "What is an expert cache?"}], temperature=0,
            max_tokens=screen.info.default_max_tokens)
        assert reply.text == direct.choices[0].message.content
        saved = store.load(screen.session.conversation_id)
        assert [(m.role, m.status) for m in saved.messages] == [("user", "done"), ("assistant", "done")]
        # the panel's numbers are the server's: hits and misses from its /metrics
        await fakes.wait_for(pilot, lambda: screen.last_stats is not None and screen.last_stats.hits
                             + screen.last_stats.misses > 0, timeout=10, what="the server's cache stats")
        snap = engine.cache_snapshot()
        assert snap.num_slots == 32 and len(snap.hits) == 6 and not math.isnan(snap.hit_rate)
        # retuning is refused with a notice, the app stays up
        with pytest.raises(MoechatError, match="tuned where it runs"):
            engine.retune_cache(expert_slots=8)
    engine.close()


def test_metrics_rebuild_the_snapshot_and_bad_servers_are_one_line(server):
    import httpx

    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    snap = snapshot_from_metrics(text)
    assert snap.num_slots == 32 and snap.policy and snap.resident.shape == (6, 16)
    with pytest.raises(MoechatError, match="HTTP 401.*--api-key"):
        RemoteEngine.connect(server.base_url)
    with pytest.raises(MoechatError, match="does not serve 'gpt-4'; it serves: demo-moe"):
        RemoteEngine.connect(server.base_url, model="gpt-4", api_key=KEY)
    with pytest.raises(MoechatError, match="expected a URL"):
        api_base("localhost:8000")
    assert api_base("http://h:1/") == api_base("http://h:1/v1") == "http://h:1/v1"
    plain = RemoteEngine("http://h:1/v1", "some-model", None)  # what a vLLM or llama-server says: no moechat info
    assert plain.cache_snapshot() is None and "not a moechat server" in plain.panel_note
    plain.close()


def test_stop_closes_the_stream_and_the_server_cancels(server):
    import threading
    import time

    import httpx

    def cancelled() -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "moechat_requests_total" and s.labels.get("status") == "cancelled")

    engine = RemoteEngine.connect(server.base_url, api_key=KEY)
    before = cancelled()
    conversation = engine.conversation()
    cancel = threading.Event()
    chunks = []
    for chunk in conversation.send("Explain how apt works, step by step, in detail.",
                                   sampling=engine.sampling(temperature=0), max_tokens=400, cancel=cancel):
        chunks.append(chunk)
        if len(chunks) == 3:
            cancel.set()  # what the app's Stop does
    assert chunks[-1].finish_reason == "cancelled" and len(chunks) == 4
    assert conversation.messages[-1]["role"] == "assistant"
    assert conversation.messages[-1]["content"] == "".join(c.text for c in chunks)
    deadline = time.monotonic() + 10
    while cancelled() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cancelled() == before + 1  # the server stopped generating: nobody was listening
    engine.close()


@pytest.fixture
def plain_server():
    """A server that speaks only OpenAI's fields, as vLLM or llama-server do: no `moechat` object, no /metrics,
    thinking in `reasoning`, no usage chunk. Real HTTP on loopback (uvicorn in a thread)."""
    import json
    import socket
    import threading

    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    seen: list[dict] = []

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "org/other-model", "object": "model"},
                                                        {"id": "org/plain-model", "object": "model"}]})

    async def chat(request: Request):
        seen.append(await request.json())

        def events():
            for delta in ({"role": "assistant"}, {"reasoning": "Think."}, {"content": "Hello"}, {"content": " you"}):
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", seen
    server.should_exit = True
    thread.join(10)


def test_any_openai_compatible_server(plain_server):
    url, seen = plain_server
    engine = RemoteEngine.connect(url, model="org/plain-model")
    assert not engine.is_moechat and engine.cache_snapshot() is None and "tok/s only" in engine.panel_note
    conversation = engine.conversation(system="Be brief.")
    chunks = list(conversation.send("Hi", sampling=engine.sampling(temperature=0.5, top_k=5), max_tokens=9))
    assert "".join(c.text for c in chunks) == "Hello you" and "".join(c.thinking for c in chunks) == "Think."
    assert chunks[-1].finish_reason == "stop" and chunks[-1].cache is None
    body = seen[-1]
    assert body["model"] == "org/plain-model" and body["max_tokens"] == 9 and body["temperature"] == 0.5
    assert "top_k" not in body  # an extension only moechat serve (and vLLM) take: not sent to an unknown server
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert conversation.messages[-1] == {"role": "assistant", "content": "Hello you", "thinking": "Think."}
    engine.close()


def test_cli_remote_errors_are_one_line(capsys):
    import socket

    from moechat.app.cli.main import main

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["chat", "--remote", f"http://127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"moechat: error: cannot reach http://127.0.0.1:{port}/v1:") and "\n" not in err
    assert main(["chat", "some/model", "--remote", f"http://127.0.0.1:{port}"]) == 1
    assert "exclude each other" in capsys.readouterr().err
    assert main(["chat", "--api-key", "k"]) == 1
    assert "use them with --remote URL" in capsys.readouterr().err


@pytest.mark.anyio
async def test_chat_app_on_a_plain_server_says_what_the_panel_cannot_show(plain_server, build_app, fakes):
    url, seen = plain_server
    engine = RemoteEngine.connect(url)  # the first model listed
    app, store = build_app(engine, model=engine.label)
    app.startup_notices.append(engine.panel_note)
    async with app.run_test(size=SIZE) as pilot:
        screen = pilot.app.screen
        await fakes.wait_for(pilot, lambda: screen.info is not None, timeout=30, what="the remote model")
        assert screen.info.name == "other-model" and screen.info.cache is None
        assert any("not a moechat server" in n.message for n in pilot.app._notifications)
        prompt = screen.query_one(PromptInput)
        prompt.focus()
        prompt.load_text("Hi")
        await pilot.press("enter")
        await fakes.wait_for(pilot, lambda: screen.gen_id is None and screen.session.turns
                             and screen.session.turns[-1].status != "streaming", timeout=30, what="the reply")
        (reply,) = screen.query(AssistantMessage)
        assert (reply.status, reply.text) == ("done", "Hello you")
        assert seen[-1]["model"] == "org/other-model"
    engine.close()


def test_thinking_switch_travels_as_chat_template_kwargs():
    from moechat.app.tui.remote import RemoteConversation

    switched = RemoteEngine("http://h:1/v1", "m", {"thinking_switch": True})
    assert switched.thinking_kwargs(False) == {"enable_thinking": False} and switched.thinking_kwargs(None) == {}
    body = RemoteConversation(switched)._body(None, None, {"enable_thinking": False})
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert "chat_template_kwargs" not in RemoteConversation(switched)._body(None, None, {})
    # A server that does not say it has the switch (not moechat, or a template without one) is sent nothing.
    assert RemoteEngine("http://h:1/v1", "m", None).thinking_kwargs(True) == {}
