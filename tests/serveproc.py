"""`moechat serve` as a real subprocess on loopback, for the server's tests and bench/serve.py.

    with ServeProcess(["--expert-slots", "32"], cache_dir=tmp) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key=server.api_key or "none")

The server binds port 0 and prints the port it got on stderr ("... on http://127.0.0.1:PORT/v1"); the
helper reads that line, so parallel test runs never fight over a port.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "assets" / "demo-moe"
_LISTENING = re.compile(r"on http://(\[[^\]]+\]|[^:/]+):(\d+)/v1")


def moechat_command() -> list[str]:
    """The installed `moechat` entry point (the same one users run)."""
    exe = Path(sys.executable).with_name("moechat")
    return [str(exe)] if exe.exists() else [sys.executable, "-P", "-m", "moechat.app.cli"]


class ServeProcess:
    def __init__(self, extra: list[str] = (), *, model: str | os.PathLike = DEMO, api_key: str | None = None,
                 cache_dir: str | os.PathLike | None = None, timeout: float = 120.0, env: dict | None = None):
        self.api_key = api_key
        args = [*moechat_command(), "serve", str(model), "--port", "0", *extra]
        if api_key:
            args += ["--api-key", api_key]
        full_env = {**os.environ, **(env or {})}
        full_env.pop("MOECHAT_API_KEY", None)
        if cache_dir is not None:
            full_env["XDG_CACHE_HOME"] = str(cache_dir)
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env)
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
