"""`moechat serve --temperature ... --max-tokens N`: the defaults of a request that leaves a field out; a field a
request sends wins; /v1/models says the defaults (issue 26). In process, over the scripted engine."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

_spec = importlib.util.spec_from_file_location("serveproc", Path(__file__).parents[1] / "serveproc.py")
serveproc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serveproc)

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


class RecordingEngine(serveproc.ScriptedEngine):
    """The scripted engine, recording the sampling and max_tokens each generation was given."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def generate(self, ids, *, sampling=None, max_tokens=None, **kwargs):
        self.calls.append((vars(sampling), max_tokens))
        return super().generate(ids, sampling=sampling, max_tokens=max_tokens, **kwargs)


@contextlib.contextmanager
def _served(argv):
    from moechat.app.cli import main as cli
    from moechat.app.cli.engine_args import sampling_overrides
    from moechat.app.serve.metrics import ServerMetrics
    from moechat.app.serve.server import Server, build_app, model_info
    from moechat.app.serve.worker import EngineWorker

    args = cli.build_parser().parse_args(["serve", *argv])  # the flags as the command parses them
    defaults = sampling_overrides(args)
    engine = RecordingEngine()
    worker = EngineWorker(engine, max_queue=4)
    metrics = ServerMetrics(lambda: worker.snapshot, {"model": "scripted"})
    worker.metrics = metrics
    worker.start()
    info = model_info(engine, Path("/m/scripted"), defaults, args.max_tokens)
    try:
        app = build_app(Server(worker, metrics, model_name="scripted", api_key=None, info=info,
                               sampling=defaults, max_tokens=args.max_tokens))
        with TestClient(app) as client:
            yield client, engine
    finally:
        worker.stop()


def test_the_flags_are_the_defaults_and_a_request_overrides_them():
    with _served(["--temperature", "0.3", "--top-p", "0.9", "--seed", "11", "--max-tokens", "7"]) as (http, engine):
        assert http.post("http://127.0.0.1/v1/chat/completions", json=CHAT).status_code == 200
        r = http.post("http://127.0.0.1/v1/chat/completions", json={**CHAT, "temperature": 0.8, "max_tokens": 3})
        assert r.status_code == 200
        r = http.post("http://127.0.0.1/v1/completions", json={"prompt": "x", "top_p": 0.5})
        assert r.status_code == 200
        models = http.get("http://127.0.0.1/v1/models").json()["data"][0]["moechat"]
    assert engine.calls == [({"temperature": 0.3, "top_p": 0.9, "seed": 11}, 7),
                            ({"temperature": 0.8, "top_p": 0.9, "seed": 11}, 3),
                            ({"temperature": 0.3, "top_p": 0.5, "seed": 11}, 7)]
    assert models["sampling_defaults"] == {"temperature": 0.3, "top_p": 0.9, "seed": 11}
    assert models["default_max_tokens"] == 7


def test_without_flags_a_request_gets_the_models_own():
    with _served([]) as (http, engine):
        assert http.post("http://127.0.0.1/v1/chat/completions", json=CHAT).status_code == 200
        models = http.get("http://127.0.0.1/v1/models").json()["data"][0]["moechat"]
    assert engine.calls == [({}, None)]  # the engine's generation_config and max_new_tokens apply
    assert models["default_max_tokens"] == 64


def test_run_serve_passes_the_flags_to_the_server(monkeypatch, tmp_path):
    """run_serve -> serve_engine with the parsed defaults (the engine load itself is the real one's contract)."""
    from moechat.app.cli import main as cli
    from moechat.app.serve import server as serve

    seen = {}
    monkeypatch.setattr("moechat.app.cli.engine_args.load_engine_from_args", lambda args, check=None: object())
    monkeypatch.setattr(serve, "serve_engine", lambda engine, sock, **kw: seen.update(kw) or sock.close() or 0)
    args = cli.build_parser().parse_args(["serve", str(tmp_path), "--port", "0", "--min-p", "0.1", "--top-k", "5",
                                          "--max-tokens", "9"])
    assert serve.run_serve(args) == 0
    assert seen["sampling"] == {"min_p": 0.1, "top_k": 5} and seen["max_tokens"] == 9


@pytest.mark.parametrize("body, message", [
    ({"max_tokens": 0}, "max_tokens must be between 1 and 1,073,741,824, got 0"),
    ({"max_completion_tokens": 2**31}, "max_completion_tokens must be between 1 and 1,073,741,824, got 2,147,483,648"),
    ({"top_k": -1}, "top_k must be between 0 and 1,048,576, got -1"),
    ({"temperature": 2.5}, "temperature must be between 0 and 2, got 2.5"),
    ({"top_p": 1.5}, "top_p must be between 0 and 1, got 1.5"),
])
def test_a_range_reads_as_numbers_a_person_writes(body, message):
    from moechat.app.serve.request import BadRequest, parse_common

    with pytest.raises(BadRequest) as e:
        parse_common(body, "scripted")
    assert str(e.value) == message  # never 1.07374e+09
