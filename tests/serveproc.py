"""`moechat serve` as a real subprocess on loopback, for the server's tests and bench/serve.py.

    with ServeProcess(["--expert-slots", "32"], cache_dir=tmp) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key=server.api_key or "none")

The server binds port 0 and prints the port it got on stderr ("... on http://127.0.0.1:PORT/v1") once uvicorn
listens and handles signals; the helper reads that line, so parallel test runs never fight over a port.

In-process, `scripted_app()` is the real Starlette app and EngineWorker over `ScriptedEngine`, an engine that
yields scripted text in no time (for the HTTP layer's tests: tool calls, the gate, its fuzzing).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "assets" / "demo-moe"
_LISTENING = re.compile(r"on http://(\[[^\]]+\]|[^:/]+):(\d+)/v1")


def moechat_command() -> list[str]:
    """The installed `moechat` entry point (the same one users run)."""
    exe = Path(sys.executable).with_name("moechat")
    return [str(exe)] if exe.exists() else [sys.executable, "-P", "-m", "moechat.app.cli.main"]


class ServeProcess:
    def __init__(self, extra: list[str] = (), *, model: str | os.PathLike = DEMO, api_key: str | None = None,
                 cache_dir: str | os.PathLike | None = None, timeout: float = 120.0, env: dict | None = None,
                 sigint_ignored: bool = False):
        """`sigint_ignored`: start it as a background job of a non-interactive shell is (SIGINT = SIG_IGN inherited,
        as a test suite run with `&` or from many CI runners passes on to every child)."""
        self.api_key = api_key
        args = [*moechat_command(), "serve", str(model), "--port", "0", *extra]
        if api_key:
            args += ["--api-key", api_key]
        full_env = {**os.environ, **(env or {})}
        full_env.pop("MOECHAT_API_KEY", None)
        if cache_dir is not None:
            full_env["XDG_CACHE_HOME"] = str(cache_dir)
        ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                                     preexec_fn=ignore)
        self.stderr: list[str] = []
        self._port = threading.Event()
        self.host, self.port = "127.0.0.1", 0
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # never let a full pipe block it
        end = time.monotonic() + timeout
        while not self._port.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError("moechat serve did not start:\n" + "".join(self.stderr))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)
            match = _LISTENING.search(line)
            if match and not self._port.is_set():
                self.host, self.port = match.group(1).strip("[]"), int(match.group(2))
                self._port.set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_reference(prompt: str, *extra: str, system: str | None = None, max_tokens: int = 40,
                  cache_dir: str | os.PathLike | None = None) -> dict:
    """`moechat run DEMO --json` greedy: what the server must reproduce."""
    import json

    args = [*moechat_command(), "run", str(DEMO), "--prompt", prompt, "--max-tokens", str(max_tokens),
            "--temperature", "0", "--json", *extra]
    if system:
        args += ["--system", system]
    env = dict(os.environ)
    if cache_dir is not None:
        env["XDG_CACHE_HOME"] = str(cache_dir)
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# -- in-process: the real HTTP layer over a scripted engine ----------------------------------------------
class Chunk(NamedTuple):  # not a dataclass: this file is loaded by path, outside sys.modules
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
    """The engine's interface as the worker uses it; `generate` runs the real parser (when the worker made one)
    over the scripted pieces of text `reply`."""

    def __init__(self, reply=("Hello", " there."), template: str = "{{ messages }}"):
        self.reply = list(reply)
        self.args = SimpleNamespace(vocab_size=1000, num_hidden_layers=2, num_experts=4, top_k=2,
                                    model_type="qwen3_moe")
        self.context = 4096
        self.chat_template = SimpleNamespace(source=template)
        self.tokenizer = SimpleNamespace(decode=lambda ids: "<|im_start|>assistant\n")
        self.loaded = SimpleNamespace(dtype="torch.float32", device="cpu", cls=None)
        self.generation_config = {}
        self.rendered: list[dict] = []

    def encode_chat(self, messages, cancel=None, **kwargs):
        self.rendered.append(kwargs)
        return [1, 2, 3, 4]

    def encode(self, text):
        return [1, 2, 3]

    def new_sequence(self):
        return SimpleNamespace(truncate=lambda n: None, tokens=[])

    def sampling(self, **overrides):
        return SimpleNamespace(**overrides)

    def default_max_tokens(self):
        return 64

    def template_reads(self, name):
        return name == "tools"

    def thinking_kwargs(self, on):  # as Engine.thinking_kwargs: the switch where the template reads one
        return {} if on is None or "enable_thinking" not in self.chat_template.source else {"enable_thinking": on}

    def cache_snapshot(self):
        return None

    def generate(self, ids, *, sampling=None, max_tokens=None, cancel=None, sequence=None, stop_on_eos=True,
                 reasoning=None, logprobs=None):
        for i, raw in enumerate(self.reply):
            last = i == len(self.reply) - 1
            text, thinking = raw, ""
            if reasoning is not None:
                d = reasoning.feed(raw)
                text, thinking = d.answer, d.thinking
                if last:
                    rest = reasoning.flush()
                    text, thinking = text + rest.answer, thinking + rest.thinking
            yield Chunk(text, (i,), "stop" if last else None, len(ids), i + 1, thinking=thinking)


@contextlib.contextmanager
def scripted_app(gate=None, *, api_key: str | None = None, engine: ScriptedEngine | None = None):
    """(the ASGI app, its engine) for `moechat serve` over a ScriptedEngine; the worker thread stops at exit."""
    from moechat.app.serve.metrics import ServerMetrics
    from moechat.app.serve.server import Server, build_app
    from moechat.app.serve.worker import EngineWorker

    engine = engine or ScriptedEngine()
    worker = EngineWorker(engine, max_queue=4)
    metrics = ServerMetrics(lambda: worker.snapshot, {"model": "scripted"})
    worker.metrics = metrics
    worker.start()
    try:
        yield build_app(Server(worker, metrics, model_name="scripted", api_key=api_key, info={"path": "scripted"},
                               gate=gate)), engine
    finally:
        worker.stop()
