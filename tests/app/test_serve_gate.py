"""The server's gate (app/serve/gate.py `Gate`, `GateConfig`, `gated_protocol`): Host, Origin, content type, body size
in-process over the real Starlette app and worker (a scripted engine); header deadline, idle timeout and the
connection cap with real sockets against a real uvicorn on loopback, with deadlines of a fraction of a second.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import threading
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from moechat.app.serve.gate import GateConfig, uvicorn_config
from moechat.app.serve.server import _uvicorn_server, model_info

_spec = importlib.util.spec_from_file_location("serveproc", Path(__file__).parents[1] / "serveproc.py")
serveproc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serveproc)

CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def http():
    with serveproc.scripted_app(GateConfig.for_bind("127.0.0.1")) as (app, _), TestClient(app) as client:
        yield client


def _error(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["code"] == code and error["message"]
    return error


# -- Host ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8000", "127.0.0.1.attacker.example",
                                  "localhost.attacker.example", "10.0.0.5:8000", "[::2]", "", "local host"])
def test_a_foreign_host_is_421_naming_the_option(http, host):
    error = _error(http.get("http://127.0.0.1/v1/models", headers={"Host": host}), 421, "host_not_allowed")
    assert "--allowed-host" in error["message"]


@pytest.mark.parametrize("host", ["localhost", "localhost:8000", "127.0.0.1", "127.0.0.1:1234", "[::1]",
                                  "[::1]:8000", "LOCALHOST:80", "localhost."])
def test_loopback_names_with_or_without_a_port_are_answered(http, host):
    r = http.get("http://127.0.0.1/v1/models", headers={"Host": host})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "scripted"


def test_allowed_host_and_a_network_bind():
    machine = socket.gethostname()
    lan = GateConfig.for_bind("0.0.0.0", allowed_hosts=["moe.lan"])
    assert all(lan.host_allowed(n) for n in ("moe.lan", "10.1.2.3", "192.168.0.7", "::1", "localhost",
                                             machine.lower()))
    assert not lan.host_allowed("attacker.example")
    loopback = GateConfig.for_bind("127.0.0.1")
    assert not loopback.host_allowed("10.1.2.3") and not loopback.host_allowed(machine.lower() + ".attacker")
    assert GateConfig.for_bind("127.0.0.1", allowed_hosts=["*"]).host_allowed("anything.example")
    with serveproc.scripted_app(lan) as (app, _), TestClient(app) as client:
        assert client.get("http://moe.lan:8000/health").status_code == 200
        assert client.get("http://192.168.0.7:8000/health").status_code == 200
        _error(client.get("http://evil.example:8000/health"), 421, "host_not_allowed")


def test_models_names_the_directory_not_its_path():
    info = model_info(serveproc.ScriptedEngine(), Path("/srv/private/models/demo-moe"))
    assert info["path"] == "demo-moe" and "/srv" not in json.dumps(info)


# -- Origin and content type --------------------------------------------------------------------------------
def test_a_cross_site_simple_post_does_not_generate():
    with serveproc.scripted_app(GateConfig.for_bind("127.0.0.1")) as (app, engine), TestClient(app) as http:
        _cross_site(http)
        assert engine.rendered == []  # refused before the handler: nothing reached the engine
        assert http.post("http://127.0.0.1/v1/chat/completions", json=CHAT).status_code == 200
        assert len(engine.rendered) == 1


def _cross_site(http):
    r = http.post("http://127.0.0.1/v1/chat/completions", content=json.dumps(CHAT),
                  headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
    assert "--cors-origin" in _error(r, 403, "origin_not_allowed")["message"]
    r = http.post("http://127.0.0.1/v1/chat/completions", json=CHAT, headers={"Origin": "http://evil.example"})
    _error(r, 403, "origin_not_allowed")
    _error(http.get("http://127.0.0.1/v1/models", headers={"Origin": "null"}), 403, "origin_not_allowed")


def test_posts_must_be_json(http):
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"},
                    {"Content-Type": "multipart/form-data; boundary=x"}, {}):
        r = http.post("http://127.0.0.1/v1/chat/completions", content=json.dumps(CHAT).encode(), headers=headers)
        assert "application/json" in _error(r, 415, "unsupported_media_type")["message"]
    for media in ("application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8"):
        r = http.post("http://127.0.0.1/v1/chat/completions", content=json.dumps(CHAT), headers={"Content-Type": media})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello there."


def test_same_origin_and_no_origin_keep_working(http):
    r = http.post("http://127.0.0.1:8000/v1/chat/completions", json=CHAT, headers={"Origin": "http://127.0.0.1:8000"})
    assert r.status_code == 200
    assert "access-control-allow-origin" not in r.headers
    assert http.post("http://127.0.0.1/v1/chat/completions", json=CHAT).status_code == 200


def test_a_declared_body_over_the_cap_is_413_before_the_handler():
    with serveproc.scripted_app(GateConfig(max_body_bytes=100)) as (app, _), TestClient(app) as client:
        r = client.post("http://localhost/v1/chat/completions", content=b"{" + b" " * 200 + b"}",
                        headers={"Content-Type": "application/json"})
        _error(r, 413, "request_too_large")


def test_an_allowed_origin_gets_cors_and_preflight_answers():
    gate = GateConfig.for_bind("127.0.0.1", cors_origins=["http://localhost:3000"])
    with serveproc.scripted_app(gate, api_key="k") as (app, _), TestClient(app) as client:
        pre = client.options("http://127.0.0.1/v1/chat/completions", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status_code == 200  # answered before the API key check: a preflight carries no key
        assert pre.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        r = client.post("http://127.0.0.1/v1/chat/completions", json=CHAT,
                        headers={"Origin": "http://localhost:3000", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = client.post("http://127.0.0.1/v1/chat/completions", json=CHAT, headers={"Origin": "http://localhost:3000"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = client.options("http://127.0.0.1/v1/chat/completions", headers={
            "Origin": "http://localhost:3001", "Access-Control-Request-Method": "POST"})
        _error(r, 403, "origin_not_allowed")


# -- --port and the options' types ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv, says", [
    (["--port", "70000"], "argument --port: expected a number <= 65535, got 70000"),
    (["--port", "-1"], "argument --port: expected a number >= 0, got -1"),
    (["--port", "http"], "argument --port: expected a TCP port"),
    (["--cors-origin", "evil.example"], "argument --cors-origin: expected an origin"),
    (["--cors-origin", "http://a.example/path"], "argument --cors-origin: expected an origin"),
    (["--header-timeout", "0"], "argument --header-timeout: expected a number > 0"),
    (["--allowed-host", "a/b"], "argument --allowed-host: expected a host name"),
])
def test_bad_gate_options_are_one_usage_line_at_parse_time(capsys, argv, says):
    from moechat.app.cli.main import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", *argv])
    assert e.value.code == 2
    assert says in capsys.readouterr().err.strip().splitlines()[-1]


def test_gate_options_reach_the_config():
    from moechat.app.cli.main import build_parser

    args = build_parser().parse_args(["serve", "--allowed-host", "Moe.LAN", "--allowed-host", "[fd00::1]",
                                      "--cors-origin", "HTTP://LocalHost:3000/", "--cors-origin", "https://a.example:443",
                                      "--header-timeout", "2.5", "--max-connections", "7"])
    assert args.allowed_host == ["moe.lan", "fd00::1"] and args.port == 8000
    assert args.cors_origin == ["http://localhost:3000", "https://a.example"]
    assert (args.header_timeout, args.idle_timeout, args.max_connections) == (2.5, 5.0, 7)


# -- below HTTP: real sockets against uvicorn ----------------------------------------------------------------
@pytest.fixture
def live():
    """Start a real uvicorn (the gated protocol) on loopback in a thread; yields start(gate) -> port."""
    started = []

    def start(gate: GateConfig) -> int:
        cm = serveproc.scripted_app(gate)
        app, _ = cm.__enter__()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        uv = _uvicorn_server(uvicorn_config(app, gate), worker=_NoWorker())
        thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        started.append((uv, thread, cm))
        deadline = time.monotonic() + 10
        while not uv.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert uv.started
        return sock.getsockname()[1]

    yield start
    for uv, thread, cm in started:
        uv.should_exit = True
        thread.join(10)
        cm.__exit__(None, None, None)


class _NoWorker:
    def stop(self, timeout=0):
        pass


def _response(sock: socket.socket) -> bytes:
    """One whole HTTP response (headers + Content-Length bytes of body)."""
    sock.settimeout(5)
    got = b""
    while b"\r\n\r\n" not in got:
        got += sock.recv(65536)
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> tuple[float, bytes]:
    """Send `trickle` one byte every 50 ms until the server closes; (seconds it took, what the server sent)."""
    t0, got = time.monotonic(), b""
    sock.settimeout(0.05)
    sent = 0
    while time.monotonic() - t0 < seconds:
        if sent < len(trickle):
            try:
                sock.send(trickle[sent:sent + 1])
                sent += 1
            except OSError:
                return time.monotonic() - t0, got
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - t0, got
        if not data:
            return time.monotonic() - t0, got
        got += data
    raise AssertionError(f"still open after {seconds} s; received {got!r}")


SLOW = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Padding: " + b"a" * 400


def test_slowloris_connections_are_closed_at_the_header_deadline(live):
    port = live(GateConfig.for_bind("127.0.0.1", header_timeout_s=0.6, idle_timeout_s=0.4))
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    results = []
    threads = [threading.Thread(target=lambda s=s: results.append(_closed_within(s, 5, SLOW))) for s in socks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(results) == 4
    for took, got in results:
        assert 0.5 <= took < 3  # uvicorn alone: held for as long as the client trickles
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["code"] == "request_timeout"
    for s in socks:
        s.close()
    # a silent connection too, and a complete request is answered
    with socket.create_connection(("127.0.0.1", port)) as silent:
        took, got = _closed_within(silent, 5)
        assert took < 3 and got.startswith(b"HTTP/1.1 408")
    with socket.create_connection(("127.0.0.1", port)) as ok:
        ok.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        took, got = _closed_within(ok, 5)  # answered, then closed by the idle timeout
        assert got.startswith(b"HTTP/1.1 200") and b'"status":"ok"' in got and took < 3


def test_the_deadline_rearms_after_each_response(live):
    port = live(GateConfig.for_bind("127.0.0.1", header_timeout_s=0.6, idle_timeout_s=5))
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = _response(s)
        assert first.startswith(b"HTTP/1.1 200") and first.endswith(b'"busy":false}')
        took, got = _closed_within(s, 5, SLOW)  # a keep-alive connection trickling its second request
        assert took < 3 and got.startswith(b"HTTP/1.1 408")


def test_connections_past_the_cap_get_503(live):
    port = live(GateConfig.for_bind("127.0.0.1", header_timeout_s=5, max_connections=3))
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    time.sleep(0.2)  # accepted by the loop
    with socket.create_connection(("127.0.0.1", port)) as extra:
        took, got = _closed_within(extra, 3)
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and json.loads(body)["error"]["code"] == "too_many_connections"
    for s in held:
        s.close()
    time.sleep(0.2)
    with socket.create_connection(("127.0.0.1", port)) as again:
        again.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        _, got = _closed_within(again, 3)
        assert got.startswith(b"HTTP/1.1 200")
