"""`moechat serve` as a real subprocess on loopback, driven by the official `openai` client.

One server for the module (the bundled demo model, a slot cache so the cache metrics move, an API key,
a small context so "too long" is cheap to reach); the reference is `moechat run --json` with the same
flags, in its own process.
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

_spec = importlib.util.spec_from_file_location("serveproc", Path(__file__).parents[1] / "serveproc.py")
serveproc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serveproc)

KEY = "test-key-123"
FLAGS = ["--expert-slots", "32", "--no-warm-start", "--context", "512"]
MAX_QUEUE = 8
MESSAGES = [{"role": "system", "content": "You answer in one sentence."},
            {"role": "user", "content": "What is an expert cache?"}]


@pytest.fixture(scope="module")
def xdg(tmp_path_factory):
    return tmp_path_factory.mktemp("serve_cache")


@pytest.fixture(scope="module")
def server(xdg):
    with serveproc.ServeProcess([*FLAGS, "--max-queue", str(MAX_QUEUE)], api_key=KEY, cache_dir=xdg) as s:
        yield s
    assert not s.alive()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def _post(server, path: str, body, headers=None, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", **(headers or {})}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers={"content-type": "application/json", **headers},
                      timeout=60, **kwargs)


def _metrics(server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _value(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


# -- equal to moechat run -----------------------------------------------------------------------------------
def test_chat_equals_moechat_run_streamed_and_not(server, client, xdg):
    ref = serveproc.run_reference(MESSAGES[1]["content"], *FLAGS, system=MESSAGES[0]["content"], max_tokens=40,
                                  cache_dir=xdg)
    reply = client.chat.completions.create(model="demo-moe", messages=MESSAGES, max_tokens=40, temperature=0)
    assert reply.choices[0].message.content == ref["text"]
    assert reply.choices[0].finish_reason == ("length" if ref["finish_reason"] == "length" else "stop")
    assert reply.usage.prompt_tokens == ref["prompt_tokens"]
    assert reply.usage.completion_tokens == ref["generated_tokens"]
    assert reply.usage.total_tokens == ref["prompt_tokens"] + ref["generated_tokens"]

    stream = client.chat.completions.create(model="demo-moe", messages=MESSAGES, max_completion_tokens=40,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert len([p for p in pieces if p]) > 5  # streamed token by token, not in one piece
    assert "".join(pieces) == ref["text"]
    assert finish == reply.choices[0].finish_reason
    assert (usage.prompt_tokens, usage.completion_tokens) == (ref["prompt_tokens"], ref["generated_tokens"])


def test_completions_raw_text_and_token_ids(server, client, xdg):
    prompt = "The expert cache keeps"
    ref = serveproc.run_reference(prompt, *FLAGS, "--raw", max_tokens=24, cache_dir=xdg)
    out = client.completions.create(model="demo-moe", prompt=prompt, max_tokens=24, temperature=0)
    assert out.choices[0].text == ref["text"]
    assert out.usage.prompt_tokens == ref["prompt_tokens"]
    assert out.usage.completion_tokens == ref["generated_tokens"]
    # the same prompt as token ids: the same reply
    from moechat.engine.text.tokenizer import Tokenizer

    token_ids = Tokenizer.from_model_dir(serveproc.DEMO).encode(prompt, add_special_tokens=True)
    assert len(token_ids) == ref["prompt_tokens"]
    by_ids = client.completions.create(model="demo-moe", prompt=token_ids, max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == ref["text"]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="demo-moe", prompt=prompt, max_tokens=24, temperature=0, stream=True) if c.choices)
    assert streamed == ref["text"]


def test_stop_strings_cut_the_reply_before_them(server, client):
    full = client.chat.completions.create(model="demo-moe", messages=MESSAGES, max_tokens=40, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    assert len(full) > 20
    stop = full[12:15]  # a stop string that usually spans token boundaries
    expected = full[: full.index(stop)]
    for stream in (False, True):
        out = client.chat.completions.create(model="demo-moe", messages=MESSAGES, max_tokens=40, temperature=0,
                                             stop=[stop, "never-said"], stream=stream,
                                             extra_body={"ignore_eos": True})
        if stream:
            chunks = list(out)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert finish == ["stop"]
        else:
            text, finish = out.choices[0].message.content, out.choices[0].finish_reason
            assert finish == "stop"
            assert out.usage.completion_tokens < 40
        assert text == expected


def test_seeded_sampling_repeats_and_options_are_checked(server, client):
    kw = dict(model="demo-moe", messages=MESSAGES, max_tokens=16, temperature=0.9, top_p=0.9, seed=7)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b
    with pytest.raises(openai.BadRequestError, match="repetition_penalty"):
        client.chat.completions.create(model="demo-moe", messages=MESSAGES, max_tokens=4, frequency_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match="does not define tools"):
        client.chat.completions.create(model="demo-moe", messages=MESSAGES, max_tokens=4, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="demo-moe", messages=MESSAGES, max_tokens=4, temperature=5)


# -- the queue ----------------------------------------------------------------------------------------------
def test_eight_concurrent_clients_answered_in_arrival_order(server, client):
    done: list[tuple[int, float, str]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    before = _value(_metrics(server), "moechat_requests_total", endpoint="chat", status="ok")

    def ask(i: int) -> None:
        try:
            out = client.chat.completions.create(model="demo-moe", max_tokens=12, temperature=0, messages=[
                {"role": "user", "content": f"Question number {i}: what is a slot?"}])
            with lock:
                done.append((i, time.monotonic(), out.choices[0].message.content))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = []
    for i in range(8):
        t = threading.Thread(target=ask, args=(i,))
        t.start()
        threads.append(t)
        # the next client connects only once this one is queued or running: arrival order is known
        deadline = time.monotonic() + 30
        while True:
            m = _metrics(server)
            seen = (_value(m, "moechat_queue_depth") + _value(m, "moechat_requests_running")
                    + _value(m, "moechat_requests_total", endpoint="chat", status="ok") - before)
            if seen >= i + 1 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
    for t in threads:
        t.join(120)
    assert not errors
    assert len(done) == 8 and all(text for _, _, text in done)
    assert [i for i, _, _ in sorted(done, key=lambda d: d[1])] == list(range(8))


def test_queue_full_is_429_with_retry_after(server, client):
    long = client.chat.completions.create(model="demo-moe", messages=MESSAGES, max_tokens=400, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True})
    it = iter(long)
    next(it)
    next(it)  # generating now
    waiting = []
    threads = [threading.Thread(target=lambda: waiting.append(client.chat.completions.create(
        model="demo-moe", messages=MESSAGES, max_tokens=2, temperature=0))) for _ in range(MAX_QUEUE)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while _value(_metrics(server), "moechat_queue_depth") < MAX_QUEUE and time.monotonic() < deadline:
        time.sleep(0.02)
    r = _post(server, "/v1/chat/completions", {"model": "demo-moe", "messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 429
    assert int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"
    long.close()  # the client goes away: the generation stops, the queue drains
    for t in threads:
        t.join(120)
    assert len(waiting) == MAX_QUEUE


def test_disconnect_mid_stream_cancels_the_generation(server, client):
    before = _metrics(server)
    stream = client.chat.completions.create(model="demo-moe", messages=MESSAGES, max_tokens=480, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            received += 1
            if received == 5:
                break
    stream.close()
    nxt = client.chat.completions.create(model="demo-moe", messages=MESSAGES, max_tokens=3, temperature=0)
    assert nxt.choices[0].finish_reason == "length"
    after = _metrics(server)
    cancelled = (_value(after, "moechat_requests_total", endpoint="chat", status="cancelled")
                 - _value(before, "moechat_requests_total", endpoint="chat", status="cancelled"))
    assert cancelled == 1
    # the engine stopped before its next token: at most the one it was computing when the client left
    after_cancel = (_value(after, "moechat_tokens_after_cancel_total")
                    - _value(before, "moechat_tokens_after_cancel_total"))
    assert after_cancel <= 1
    generated = _value(after, "moechat_generated_tokens_total") - _value(before, "moechat_generated_tokens_total")
    # the abandoned request stopped far short of its 480 tokens (the next one made 3)
    assert generated - 3 < 240


# -- errors -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, status, code", [
    (b"{not json", 400, "invalid_json"),
    ({"model": "gpt-4", "messages": MESSAGES}, 404, "model_not_found"),
    ({"model": "demo-moe", "messages": MESSAGES, "max_tokens": -5}, 400, None),
    ({"model": "demo-moe", "messages": MESSAGES, "max_tokens": 0}, 400, None),
    ({"model": "demo-moe", "messages": []}, 400, None),
    ({"model": "demo-moe", "messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ({"model": "demo-moe", "messages": MESSAGES, "n": 3}, 400, None),
    ([1, 2, 3], 400, None),
    (b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),
    ({"model": "demo-moe", "messages": MESSAGES, "max_tokens": "10"}, 400, None),
    ({"model": "demo-moe", "messages": MESSAGES, "temperature": "hot"}, 400, None),
    ({"model": "demo-moe", "messages": MESSAGES, "stop": [1]}, 400, None),
    ({"model": "demo-moe", "messages": MESSAGES, "stream": "yes"}, 400, None),
    ({"model": "demo-moe", "messages": [{"role": "user", "content": {"text": "hi"}}]}, 400, None),
    ({"model": "demo-moe", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, None),
    ({"model": "demo-moe", "messages": MESSAGES, "tools": "all"}, 400, None),
    ({"model": "demo-moe", "messages": MESSAGES, "logprobs": "yes"}, 400, None),
    ({"model": "demo-moe", "messages": MESSAGES, "logit_bias": {"5": 100}}, 400, None),
])
def test_bad_requests_are_openai_errors(server, body, status, code):
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if code:
        assert error["code"] == code


def test_huge_body_long_prompt_and_unknown_route_keep_the_server_up(server, client):
    r = _post(server, "/v1/chat/completions", b'{"model": "demo-moe", "messages": "' + b"x" * (10 << 20) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo-moe", prompt=[5] * 600, max_tokens=4)
    assert "600 tokens" in str(e.value) and "512" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model="demo-moe", prompt=[10**9], max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="demo-moe", input="x")
    r = httpx.get(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert client.chat.completions.create(model="demo-moe", messages=MESSAGES, max_tokens=2).choices
    assert server.alive()


# -- metrics, models, auth ----------------------------------------------------------------------------------
def test_metrics_parse_and_counters_move(server, client):
    before = _metrics(server)
    client.chat.completions.create(model="demo-moe", messages=MESSAGES, max_tokens=6, temperature=0)
    after = _metrics(server)
    assert _value(after, "moechat_generated_tokens_total") - _value(before, "moechat_generated_tokens_total") == 6
    assert _value(after, "moechat_prompt_tokens_total") > _value(before, "moechat_prompt_tokens_total")
    assert (_value(after, "moechat_request_duration_seconds_count", endpoint="chat")
            == _value(before, "moechat_request_duration_seconds_count", endpoint="chat") + 1)
    assert _value(after, "moechat_decode_tokens_per_second") > 0
    assert _value(after, "moechat_expert_cache_enabled") == 1
    assert _value(after, "moechat_expert_slots") == 32
    layers = [k for k in after if k[0] == "moechat_expert_cache_hits_total"]
    assert len(layers) == 6  # the demo model's six MoE layers
    requests = sum(_value(after, n, **dict(k[1])) for n in ("moechat_expert_cache_hits_total",
                                                             "moechat_expert_cache_misses_total")
                   for k in after if k[0] == n)
    requests_before = sum(v for k, v in before.items() if k[0] in ("moechat_expert_cache_hits_total",
                                                                    "moechat_expert_cache_misses_total"))
    assert requests > requests_before
    assert 0 <= _value(after, "moechat_expert_cache_hit_rate") <= 1
    assert ("moechat_queue_depth", ()) in after and ("moechat_expert_stall_seconds_total", ()) in after


def test_models_and_api_key(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["demo-moe"]
    info = models[0].model_extra["moechat"]
    assert client.models.retrieve("demo-moe").id == "demo-moe"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert (info["num_layers"], info["num_experts"], info["top_k"], info["context"]) == (6, 16, 2, 512)
    assert info["path"] == "demo-moe"  # the directory's name: where the files lie is not the client's business
    # issue 25 through the real server: a rebinding page's Host, a cross-site "simple" POST
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}", "Host": "attacker.example"})
    assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed"
    r = _post(server, "/v1/chat/completions", {"model": "demo-moe", "messages": MESSAGES, "max_tokens": 2},
              headers={"content-type": "text/plain", "Origin": "http://attacker.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(server.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    bad = openai.OpenAI(base_url=server.base_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="demo-moe", messages=MESSAGES, max_tokens=2)


def test_serve_and_run_share_the_load_flags():
    from moechat.app.cli.main import build_parser

    parser = build_parser()
    run_dests = {a.dest for a in parser._subparsers._group_actions[0].choices["run"]._actions}
    serve_dests = {a.dest for a in parser._subparsers._group_actions[0].choices["serve"]._actions}
    shared = {"dtype", "context", "device", "expert_slots", "policy", "ram_cache_mb", "expert_format", "on_miss",
              "host_layers", "repack_dir", "prefetch", "prefetch_depth", "warm_start"}
    assert shared <= run_dests and shared <= serve_dests
    args = parser.parse_args(["serve", "--port", "0", "--expert-slots", "4", "--api-key", "k"])
    assert (args.model_dir, args.port, args.expert_slots, args.api_key, args.host) == (None, 0, 4, "k", "127.0.0.1")


def test_a_port_in_use_is_one_line_before_the_model_loads():
    import socket
    import subprocess

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = subprocess.run([*serveproc.moechat_command(), "serve", "--port", str(port)], capture_output=True,
                             text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip() == (f"moechat: error: cannot listen on 127.0.0.1:{port}: Address already in use; "
                                  "choose another --port (0: any free one)")


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["sigint-default", "sigint-ignored-at-start"])
def test_ctrl_c_ends_every_open_response_then_exits(tmp_path, sigint_ignored):
    """Issue 26: in a full run (pytest started as a background job, SIGINT = SIG_IGN inherited by the server) this
    exited 0: uvicorn re-raised the SIGINT through the ignored disposition it restored. The exit is the server's now."""
    import signal

    with serveproc.ServeProcess(["--no-warm-start"], cache_dir=tmp_path, sigint_ignored=sigint_ignored) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0, timeout=60)
        stream = client.chat.completions.create(model="demo-moe", messages=MESSAGES, max_tokens=2000, stream=True,
                                                extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it)
        queued: list = []

        def ask() -> None:
            try:
                client.chat.completions.create(model="demo-moe", messages=MESSAGES, max_tokens=4)
            except openai.APIStatusError as e:
                queued.append(e)

        t = threading.Thread(target=ask)
        t.start()
        deadline = time.monotonic() + 30
        while _value(_metrics_of(s), "moechat_queue_depth") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _value(_metrics_of(s), "moechat_queue_depth") == 1  # one streaming, one waiting: then Ctrl+C
        s.proc.send_signal(signal.SIGINT)
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in it:
                pass
        t.join(30)
        assert [e.status_code for e in queued] == [503] and "shutting down" in queued[0].message
        assert s.proc.wait(30) == 130
        assert "".join(s.stderr).strip().splitlines()[-1] == "moechat: stopped"
        assert "ERROR" not in "".join(s.stderr)


def test_sigterm_closes_the_engine_before_the_process_ends(tmp_path):
    """uvicorn re-raised SIGTERM with the default disposition inside uv.run: the process died before
    serve_engine's cleanup, so the routing profile (--warm-start) was never saved."""
    import signal

    with serveproc.ServeProcess(["--expert-slots", "32"], cache_dir=tmp_path) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0, timeout=60)
        assert client.chat.completions.create(model="demo-moe", messages=MESSAGES, max_tokens=4).choices
        assert not list(tmp_path.glob("moechat/profiles/*.json"))
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == -signal.SIGTERM  # still ended by the signal, as a service manager expects
    assert list(tmp_path.glob("moechat/profiles/*.json")), sorted(str(p) for p in tmp_path.rglob("*"))


def _metrics_of(s) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(s.url + "/metrics", timeout=30).text
    return {(x.name, tuple(sorted(x.labels.items()))): x.value for f in text_string_to_metric_families(text)
            for x in f.samples}


def test_logprobs_chat_completions_and_streamed(server, client):
    kw = dict(model="demo-moe", messages=MESSAGES, max_tokens=12, temperature=0,
              extra_body={"repetition_penalty": 1.0})
    out = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3)
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.logprob == e.top_logprobs[0].logprob  # greedy without penalty: the best token
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    assert out.choices[0].message.content.startswith(entries[0].token.strip() or "")
    plain = client.chat.completions.create(**kw)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == out.choices[0].message.content
    streamed = [e for c in client.chat.completions.create(**kw, logprobs=True, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries])
    legacy = client.completions.create(model="demo-moe", prompt="The cache", max_tokens=6, temperature=0,
                                       logprobs=2, extra_body={"repetition_penalty": 1.0})
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == legacy.usage.completion_tokens
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v) for top, v in zip(
        lp.top_logprobs, lp.token_logprobs, strict=True))
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="demo-moe", messages=MESSAGES, max_tokens=2, top_logprobs=30,
                                       logprobs=True)


def test_prefix_cache_prefills_only_the_new_turn(tmp_path, server, client):
    plain = client.chat.completions.create(model="demo-moe", messages=MESSAGES, max_tokens=4, temperature=0)
    assert plain.usage.prompt_tokens_details.cached_tokens == 0  # off by default: stateless, as moechat run
    with serveproc.ServeProcess(["--no-warm-start", "--prefix-cache"], cache_dir=tmp_path) as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0, timeout=120)
        first = c.chat.completions.create(model="demo-moe", messages=MESSAGES, max_tokens=16, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        history = MESSAGES + [{"role": "assistant", "content": first.choices[0].message.content},
                              {"role": "user", "content": "And a slot?"}]
        second = c.chat.completions.create(model="demo-moe", messages=history, max_tokens=8, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        usage = [x.usage for x in second if x.usage is not None][0]
        # the whole first prompt (and the reply's tokens as far as they re-tokenize the same) came from the cache
        assert first.usage.prompt_tokens <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
        other = c.chat.completions.create(model="demo-moe", max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "Something else entirely"}])
        assert other.usage.prompt_tokens_details.cached_tokens < other.usage.prompt_tokens - 3
        assert other.choices[0].message.content
