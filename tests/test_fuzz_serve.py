"""Fuzzing the server's gate (app/serve/gate.py `Gate`): random Host / Origin / Content-Type / method / path / body
combinations sent in-process to the real Starlette app and worker over a scripted engine. Whatever is sent, the
answer is one of the statuses the gate and the routes define, with an OpenAI-shaped JSON body, never a 500; and
what the gate must refuse, it refuses (a foreign Host: 421; a foreign Origin: 403; a POST that is not JSON: 415).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from moechat.app.serve.gate import GateConfig

_spec = importlib.util.spec_from_file_location("serveproc", Path(__file__).parent / "serveproc.py")
serveproc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serveproc)

ALLOWED_ORIGIN = "http://localhost:3000"
GOOD_HOSTS = ["localhost", "127.0.0.1:8000", "[::1]:8000", "LocalHost", "moe.lan"]
BAD_HOSTS = ["attacker.example", "127.0.0.1.nip.io:8000", "[::2]", "a b", "localhost:99999", "", ":80", "[::1"]
ORIGINS = [None, ALLOWED_ORIGIN, "http://evil.example", "null", "http://127.0.0.1:8000", "https://localhost:3000",
           "file://", "http://[::1]:8000", "http://localhost:3000/", "garbage"]
TYPES = [None, "application/json", "application/json; charset=utf-8", "text/plain", "APPLICATION/JSON",
         "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonx", ";", "*/*"]
PATHS = ["/health", "/v1/models", "/v1/models/scripted", "/v1/chat/completions", "/v1/completions", "/metrics",
         "/nope", "/v1/models/other"]
BODIES = [b"", b"{", json.dumps({"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}).encode(),
          json.dumps({"model": "scripted", "prompt": "hi", "max_tokens": 2}).encode(), b"[1, 2]", b"\xff\xfe",
          json.dumps({"model": "x", "messages": []}).encode(), b"x" * 3000]
# the gate's refusals, the routes' answers, a CORS preflight
EXPECTED = {200, 400, 401, 403, 404, 405, 413, 415, 421}


@pytest.fixture(scope="module")
def http():
    gate = GateConfig.for_bind("127.0.0.1", allowed_hosts=["moe.lan"], cors_origins=[ALLOWED_ORIGIN],
                               max_body_bytes=2048)
    with serveproc.scripted_app(gate, api_key=None) as (app, _), TestClient(app, raise_server_exceptions=False) as c:
        yield c


@settings(max_examples=60, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(host=st.sampled_from(GOOD_HOSTS + BAD_HOSTS), origin=st.sampled_from(ORIGINS),
       ctype=st.sampled_from(TYPES), method=st.sampled_from(["GET", "POST", "OPTIONS", "PUT", "DELETE", "HEAD"]),
       path=st.sampled_from(PATHS), body=st.sampled_from(BODIES), preflight=st.booleans())
def test_the_gate_answers_every_combination_in_json(http, host, origin, ctype, method, path, body, preflight):
    headers = {"Host": host}
    if origin is not None:
        headers["Origin"] = origin
    if ctype is not None:
        headers["Content-Type"] = ctype
    if preflight and method == "OPTIONS":
        headers["Access-Control-Request-Method"] = "POST"
    r = http.request(method, "http://127.0.0.1" + path, headers=headers,
                     content=body if method in ("POST", "PUT", "DELETE") else None)
    assert r.status_code in EXPECTED, (r.status_code, r.text[:300])

    host_ok = host in GOOD_HOSTS
    same_site = origin is not None and origin.startswith("http://") and origin[len("http://"):] == host
    cors = origin == ALLOWED_ORIGIN  # exactly as a browser writes it ("http://localhost:3000/" is not an origin)
    if not host_ok:
        assert r.status_code == 421
    elif not (origin is None or same_site or cors):
        assert r.status_code == 403  # a foreign site: refused whatever it sends
    elif method == "POST" and (ctype is None or ctype.split(";")[0].strip().lower() != "application/json"):
        assert r.status_code == 415

    if method == "HEAD":
        assert not r.content
        return
    if r.status_code == 200 and method == "OPTIONS":  # a CORS preflight of the allowed origin: Starlette's answer
        assert cors and preflight
        assert r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
        return
    if path == "/metrics" and r.status_code == 200:
        assert r.text.startswith("#") or "moechat_" in r.text
        return
    assert r.headers["content-type"].startswith("application/json"), (r.status_code, r.headers, r.text[:200])
    data = r.json()
    if r.status_code != 200:
        assert isinstance(data["error"]["message"], str) and data["error"]["message"]
    if cors and host_ok:
        assert r.headers.get("access-control-allow-origin") == ALLOWED_ORIGIN
