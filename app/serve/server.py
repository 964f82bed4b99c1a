"""`moechat serve [MODEL]`: the model behind an OpenAI-compatible HTTP API, with Prometheus metrics.

    GET  /health                 no key needed
    GET  /v1/models              the one served model (+ a `moechat` object: layers, experts, context)
    POST /v1/chat/completions    messages -> the chat template -> a reply; streamed (SSE) or not
    POST /v1/completions         a raw prompt (text or token ids), as `moechat run --raw`
    GET  /metrics                Prometheus text (app/serve/metrics.py)

Libraries, chosen for being small, maintained and the standard pieces of Python's ASGI stack:
Starlette (routing, requests, responses; FastAPI's own core, without pydantic), uvicorn (the ASGI
server; h11, pure Python), sse-starlette (server-sent events with disconnect detection and pings:
a client that goes away cancels its generation), prometheus_client (the reference exposition
format). Nothing in the HTTP layer is hand-written.

The engine runs one sequence at a time on its own thread (app/serve/worker.py); requests wait in a
bounded FIFO. Every error is an OpenAI-shaped JSON body `{"error": {"message", "type", "param",
"code"}}` with a 4xx/5xx status, never a traceback, and nothing a client sends stops the server.

Parts: this module is the command (its options, `run_serve`, `serve_engine`, uvicorn's Server with its signal
handling, `model_info`); app/serve/routes.py the routes and their handlers (`Server`, `build_app`);
app/serve/responses.py the replies (one JSON body or server-sent events); app/serve/gate.py who may talk to the
server (Host, Origin/CORS, content type, body size, slow clients, the API key).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from ..cli.argtypes import positive_int as _positive_int
from ..cli.engine_args import MODEL_HELP, add_load_args, add_sampling_args, sampling_overrides
from .gate import (
    HEADER_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    LOOPBACK_NAMES,
    MAX_CONNECTIONS,
    GateConfig,
    _normal_origin,
    uvicorn_config,
)
from .routes import Server, build_app

__all__ = ["DEFAULT_PORT", "GateConfig", "Server", "add_serve_parser", "build_app", "model_info", "run_serve",
           "serve_engine", "uvicorn_config"]

DEFAULT_PORT = 8000


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    serve = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API, with Prometheus metrics",
        description="Load MODEL once and serve /v1/chat/completions, /v1/completions and /v1/models (streamed or "
                    "not), /health and /metrics. One sequence at a time: requests queue in arrival order.")
    serve.add_argument("model_dir", metavar="MODEL", nargs="?", default=None, help=MODEL_HELP)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine "
                       "only; 0.0.0.0 serves the network: set --api-key)")
    serve.add_argument("--port", type=_port, default=DEFAULT_PORT, help="TCP port (default: %(default)s; 0: any "
                       "free port, printed at start)")
    serve.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on every route but "
                       "/health (default: $MOECHAT_API_KEY, else none)")
    serve.add_argument("--max-queue", type=_positive_int, default=16, metavar="N",
                       help="requests that may wait while one generates; past it, 429 with Retry-After "
                       "(default: %(default)s)")
    serve.add_argument("--prefix-cache", action="store_true", help="keep the KV cache of the previous request "
                       "and prefill only what a new one adds after their longest common prefix (a chat client "
                       "resending its history prefills only the new turn; usage.prompt_tokens_details.cached_tokens "
                       "says how many were reused). Off by default: a prefill split at another point rounds "
                       "differently, so a reply may then differ from moechat run's in a late digit")
    serve.add_argument("--served-model-name", metavar="NAME", help="the model id clients send (default: the model "
                       "directory's name)")
    gate = serve.add_argument_group("who may talk to the server (DNS rebinding, cross-site pages, slow clients)")
    gate.add_argument("--allowed-host", metavar="NAME", action="append", type=_host_name, default=[],
                      help="also answer requests whose Host header names NAME (repeatable; '*': any). By default "
                      "only localhost, 127.0.0.1, [::1] and the --host address are answered; with a non-loopback "
                      "--host also this machine's name and any IP address. Other Hosts get 421: a web page that "
                      "rebinds its own domain to this machine cannot use the server")
    gate.add_argument("--cors-origin", metavar="ORIGIN", action="append", type=_origin, default=[],
                      help="let web pages from ORIGIN (scheme://host[:port]; repeatable; '*': any site) call the "
                      "API, with CORS headers and preflight answers. By default a request with another site's "
                      "Origin header gets 403 (clients that send no Origin, such as curl, the openai client and "
                      "moechat chat --remote, are not affected)")
    gate.add_argument("--header-timeout", metavar="S", type=_seconds, default=HEADER_TIMEOUT_S,
                      help="close a connection whose request line and headers take longer than S seconds to "
                      "arrive (a slowloris client) with 408 (default: %(default)s)")
    gate.add_argument("--idle-timeout", metavar="S", type=_seconds, default=IDLE_TIMEOUT_S,
                      help="close a keep-alive connection idle for S seconds between requests (default: %(default)s)")
    gate.add_argument("--max-connections", metavar="N", type=_positive_int, default=MAX_CONNECTIONS,
                      help="open connections at most; one more is answered 503 and closed (default: %(default)s)")
    add_load_args(serve, record_trace=False)
    add_sampling_args(serve, "serve")  # the defaults of a request that leaves a field out; checked at parse time
    serve.set_defaults(handler=run_serve)
    return serve


def _port(text: str) -> int:
    from ..cli.argtypes import _number

    return _number(text, int, "a TCP port, a whole number", 0, inclusive=True, maximum=65535)


def _seconds(text: str) -> float:
    from ..cli.argtypes import _number

    return _number(text, float, "a number of seconds", 0, inclusive=False, maximum=3600)


def _host_name(text: str) -> str:
    name = text.strip().lower().rstrip(".")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if not name or any(c.isspace() or c in "/@?#" for c in name):
        raise argparse.ArgumentTypeError(f"expected a host name or address such as myserver.lan, got {text!r}")
    return name


def _origin(text: str) -> str:
    if text.strip() == "*":
        return "*"
    origin = _normal_origin(text)
    if origin is None:
        raise argparse.ArgumentTypeError(f"expected an origin scheme://host[:port] such as http://localhost:3000 "
                                         f"(no path), got {text!r}")
    return origin


def model_info(engine, model_dir: Path, sampling: dict | None = None, max_tokens: int | None = None) -> dict:
    """What /v1/models says about the model beyond OpenAI's fields (read by `moechat chat --remote`); `sampling` and
    `max_tokens` are the server's defaults for a request (moechat serve --temperature ...), over the model's."""
    args = engine.args
    try:
        moe_layers = len(engine.loaded.cls.moe_layers(args))
    except Exception:  # noqa: BLE001
        moe_layers = int(args.num_hidden_layers)
    try:
        sampling = {k: v for k, v in vars(engine.sampling(**(sampling or {}))).items()
                    if isinstance(v, (int, float, bool, type(None)))}
    except Exception:  # noqa: BLE001
        sampling = {}
    # the directory's name, not its path: a client has no use for where the files lie on the server
    return {"model_type": str(getattr(args, "model_type", "")), "path": Path(model_dir).name,
            "dtype": str(engine.loaded.dtype).removeprefix("torch."), "device": str(engine.loaded.device),
            "num_layers": int(args.num_hidden_layers), "moe_layers": moe_layers,
            "num_experts": int(args.num_experts), "top_k": int(args.top_k), "context": int(engine.context),
            "default_max_tokens": int(max_tokens or engine.default_max_tokens()), "sampling_defaults": sampling,
            "generation_config": dict(engine.generation_config or {}),
            "has_chat_template": engine.chat_template is not None,
            "reads_reasoning_effort": engine.template_reads("reasoning_effort"),
            "thinking_switch": bool(engine.thinking_kwargs(True)),
            "reads_tools": engine.template_reads("tools")}


def _check_serve_args(args, device: str) -> None:
    from moechat.engine.load.loader import resolve_device

    resolve_device(device)  # --port was checked by its argparse type, before the bind


def run_serve(args: argparse.Namespace) -> int:
    import os
    import socket

    from moechat.engine.errors import ConfigError

    if args.model_dir is None:
        from ..tui.launch import DEMO_MODEL

        args.model_dir = str(DEMO_MODEL)
    api_key = args.api_key if args.api_key is not None else os.environ.get("MOECHAT_API_KEY") or None
    if api_key is not None and not api_key.strip():
        raise ConfigError("--api-key is empty: pass a key, or leave the option out")
    # The port first: a port in use is refused before minutes of loading.
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
    except OSError as e:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}; choose another --port "
                          "(0: any free one)") from None
    gate = GateConfig.for_bind(args.host, allowed_hosts=args.allowed_host, cors_origins=args.cors_origin,
                               header_timeout_s=args.header_timeout, idle_timeout_s=args.idle_timeout,
                               max_connections=args.max_connections)
    from ..cli.engine_args import load_engine_from_args

    engine = load_engine_from_args(args, check=_check_serve_args)
    return serve_engine(engine, sock, model_name=args.served_model_name or Path(args.model_dir).name,
                        api_key=api_key, max_queue=args.max_queue, model_dir=Path(args.model_dir),
                        cache_line=_cache_line(args), prefix_cache=args.prefix_cache, gate=gate,
                        sampling=sampling_overrides(args), max_tokens=args.max_tokens)


def _cache_line(args) -> dict:
    return {"policy": str(args.policy), "expert_format": str(args.expert_format), "on_miss": str(args.on_miss)}


def serve_engine(engine, sock, *, model_name: str, api_key: str | None, max_queue: int,
                 model_dir: Path, cache_line: dict, prefix_cache: bool = False, gate: GateConfig | None = None,
                 sampling: dict | None = None, max_tokens: int | None = None) -> int:
    """Serve `engine` on a bound socket until Ctrl+C (KeyboardInterrupt once the engine is closed: exit 130) or
    SIGTERM (the process then ends by that signal, as before, but after the engine is closed). `sampling` and
    `max_tokens`: the defaults of a request that leaves them out (moechat serve --temperature ... --max-tokens)."""
    import signal

    from .metrics import ServerMetrics
    from .worker import EngineWorker

    worker = EngineWorker(engine, max_queue=max_queue, prefix_cache=prefix_cache)
    info = model_info(engine, model_dir, sampling, max_tokens)
    metrics = ServerMetrics(lambda: worker.snapshot, {"model": model_name, "model_type": info["model_type"],
                                                      "device": info["device"], "dtype": info["dtype"],
                                                      **cache_line})
    worker.metrics = metrics
    worker.start()
    sock.listen(128)  # connections made from here on wait for uvicorn instead of being refused
    host, port = sock.getsockname()[:2]
    gate = gate or GateConfig.for_bind(host)
    server = Server(worker, metrics, model_name=model_name, api_key=api_key, info=info, gate=gate,
                    sampling=sampling, max_tokens=max_tokens)
    shown = f"[{host}]" if ":" in host else host
    uv = _uvicorn_server(uvicorn_config(build_app(server), gate, timeout_graceful_shutdown=5), worker)
    if not api_key and host not in LOOPBACK_NAMES:
        print(f"moechat: warning: serving {host} without --api-key: anyone who can reach port {port} can use the model",
              file=sys.stderr, flush=True)
    uv.listening_line = (f"moechat serve: {model_name} on http://{shown}:{port}/v1 (metrics at /metrics; "
                         f"{'API key required' if api_key else 'no API key'}; up to {max_queue} requests queued)")
    try:
        uv.run(sockets=[sock])
    finally:
        worker.stop()
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - saving the routing profile is best effort
            pass
    if uv.stopped_by == signal.SIGINT:
        raise KeyboardInterrupt  # the CLI's guard: "moechat: stopped", exit 130
    if uv.stopped_by is not None:  # SIGTERM: end by it, as a process without a handler would (systemd, k8s)
        sys.stderr.flush()
        signal.signal(uv.stopped_by, signal.SIG_DFL)
        signal.raise_signal(uv.stopped_by)
    return 0


def _uvicorn_server(config, worker):
    """uvicorn's Server for serve_engine (a factory: the CLI imports this module without importing uvicorn)."""
    import uvicorn

    class _Uvicorn(uvicorn.Server):
        """uvicorn's Server, told of the worker, saying when it listens, and leaving the exit to serve_engine.

        uvicorn restores the signal handlers it found and re-raises the signal that stopped it. That made the exit
        status depend on the disposition the process inherited: started with SIGINT ignored (a background job of a
        non-interactive shell, as a test suite or CI step often is), the re-raised SIGINT vanished and Ctrl+C (or
        `kill -INT`) exited 0 instead of 130; a re-raised SIGTERM killed the process before the engine was closed
        (the routing profile unsaved). Here the handlers are installed and restored the same way but the signal
        is only recorded; serve_engine ends the process by it after cleaning up."""

        listening_line: str | None = None
        stopped_by: int | None = None

        def __init__(self, config, worker):
            super().__init__(config)
            self.worker = worker

        def handle_exit(self, sig, frame) -> None:
            self.worker.stop(timeout=0)  # every open response ends (503) before uvicorn waits for them
            if self.stopped_by is None:
                self.stopped_by = sig
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            import signal
            import threading

            if threading.current_thread() is not threading.main_thread():
                yield
                return
            wanted = [s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGBREAK", None)) if s is not None]
            original = {sig: signal.signal(sig, self.handle_exit) for sig in wanted}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            # only now: the helper that waits for this line (tests/serveproc.py) may signal at once, and must find
            # uvicorn's handlers installed
            if self.started and self.listening_line:
                print(self.listening_line, file=sys.stderr, flush=True)

    return _Uvicorn(config, worker)
