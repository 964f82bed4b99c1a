"""`moechat serve [MODEL]`: the model behind an OpenAI-compatible HTTP API, with Prometheus metrics.

    GET  /health                 no key needed
    GET  /v1/models              the one served model (+ a `moechat` object: layers, experts, context)
    POST /v1/chat/completions    messages -> the chat template -> a reply; streamed (SSE) or not
    POST /v1/completions         a raw prompt (text or token ids), as `moechat run --raw`
    GET  /metrics                Prometheus text (app/serve_metrics.py)

Libraries, chosen for being small, maintained and the standard pieces of Python's ASGI stack:
Starlette (routing, requests, responses; FastAPI's own core, without pydantic), uvicorn (the ASGI
server; h11, pure Python), sse-starlette (server-sent events with disconnect detection and pings:
a client that goes away cancels its generation), prometheus_client (the reference exposition
format). Nothing in the HTTP layer is hand-written.

The engine runs one sequence at a time on its own thread (app/serve_worker.py); requests wait in a
bounded FIFO. Every error is an OpenAI-shaped JSON body `{"error": {"message", "type", "param",
"code"}}` with a 4xx/5xx status, never a traceback, and nothing a client sends stops the server.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .argtypes import positive_int as _positive_int
from .engine_args import add_load_args
from .serve_request import (
    BadRequest,
    error_body,
    parse_common,
    parse_logprobs,
    parse_messages,
    parse_prompt,
)

DEFAULT_PORT = 8000
MAX_BODY_BYTES = 4 << 20  # a chat that fills a 128k context is ~0.5 MB of JSON; 10 MB is a mistake or an attack
_DISCONNECT_POLL_S = 0.25  # how often a request still waiting (queued, or not streamed) checks its client


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    serve = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API, with Prometheus metrics",
        description="Load MODEL once and serve /v1/chat/completions, /v1/completions and /v1/models (streamed or "
                    "not), /health and /metrics. One sequence at a time: requests queue in arrival order.")
    serve.add_argument("model_dir", metavar="MODEL", nargs="?", default=None,
                       help="directory with config.json and *.safetensors, or a downloaded Hub repo id (default: "
                       "the bundled demo model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine "
                       "only; 0.0.0.0 serves the network: set --api-key)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port (default: %(default)s; 0: any "
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
    add_load_args(serve, record_trace=False)
    serve.set_defaults(handler=run_serve)
    return serve


# -- errors ------------------------------------------------------------------------------------------------
def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


# -- the app -----------------------------------------------------------------------------------------------
class Server:
    def __init__(self, worker, metrics, *, model_name: str, api_key: str | None, info: dict):
        self.worker = worker
        self.metrics = metrics
        self.model_name = model_name
        self.api_key = api_key
        self.info = info
        self.created = int(time.time())

    # -- plumbing --------------------------------------------------------------------------------------
    def _count_error(self, status: int) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(str(status)).inc()

    async def _read_json(self, request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            raise BadRequest(f"the request body is {length} bytes; at most {MAX_BODY_BYTES:,} are accepted", None,
                             413, "request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise BadRequest(f"the request body is over {MAX_BODY_BYTES:,} bytes", None, 413, "request_too_large")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as e:
            raise BadRequest(f"the body is not valid JSON: {str(e).splitlines()[0][:200]}", None, 400,
                             "invalid_json") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object", None)
        return body

    def _sampling(self, fields: dict):
        from moechat.engine.errors import MoechatError

        try:
            return self.worker.engine.sampling(**fields["sampling"])
        except (MoechatError, ValueError) as e:
            raise BadRequest(str(e), None) from None

    # -- routes ----------------------------------------------------------------------------------------
    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok", "model": self.model_name, "queue_depth": self.worker.queue_depth,
                             "busy": self.worker.busy})

    async def models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "moechat",
             "moechat": self.info}]})

    async def model(self, request):
        from starlette.responses import JSONResponse

        name = request.path_params["model_id"]
        if name != self.model_name:
            self._count_error(404)
            return _error(404, f"the model {name!r} does not exist: this server serves {self.model_name!r}",
                          param="model", code="model_not_found")
        return JSONResponse({"id": self.model_name, "object": "model", "created": self.created, "owned_by": "moechat",
                             "moechat": self.info})

    async def metrics_route(self, request):
        from starlette.responses import Response

        from .serve_metrics import CONTENT_TYPE

        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def chat(self, request):
        return await self._completion(request, "chat")

    async def completions(self, request):
        return await self._completion(request, "completion")

    async def _completion(self, request, kind: str):
        import uuid

        from .serve_worker import Job, QueueFull

        try:
            body = await self._read_json(request)
            fields = parse_common(body, self.model_name)
            job = Job(kind=kind, endpoint=kind, max_tokens=fields["max_tokens"], stop=fields["stop"],
                      ignore_eos=fields["ignore_eos"], sampling=self._sampling(fields),
                      logprobs=parse_logprobs(body, kind))
            if kind == "chat":
                job.messages = parse_messages(body.get("messages"))
                job.template_kwargs = self._template_kwargs(body)
            else:
                job.prompt = parse_prompt(body.get("prompt"))
                if body.get("echo"):
                    raise BadRequest("echo is not supported", "echo")
                if body.get("suffix"):
                    raise BadRequest("suffix is not supported", "suffix")
        except BadRequest as e:
            self._count_error(e.status)
            return _error(e.status, str(e), e.type, e.param, e.code)
        job.bind()
        try:
            self.worker.submit(job)
        except QueueFull as e:
            self._count_error(429)
            return _error(429, f"the server is busy: {self.worker.max_queue} requests are already waiting; retry "
                          f"in {e.retry_after} s", "rate_limit_error", None, "queue_full",
                          headers={"Retry-After": str(e.retry_after)})
        first = await self._first_event(job, request)
        if first is None:  # the client left while the request waited
            return _error(499, "client closed the request", "cancelled")
        from .serve_worker import Failed

        if isinstance(first, Failed):
            e = first.error
            self._count_error(e.status)
            return _error(e.status, str(e), e.type, e.param, e.code)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24] + f"-{job.number}"
        if fields["stream"]:
            return self._stream(job, rid, kind, fields["include_usage"])
        return await self._collect(job, rid, kind, request)

    def _template_kwargs(self, body: dict) -> dict:
        engine = self.worker.engine
        kwargs = {}
        tools, choice = body.get("tools"), body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise BadRequest("tool_choice must be 'auto' or 'none': moechat does not force a call (no constrained "
                             "decoding)", "tool_choice")
        if tools and choice != "none":
            if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function"
                                                      and isinstance(t.get("function"), dict)
                                                      and isinstance(t["function"].get("name"), str) for t in tools):
                raise BadRequest("tools must be a list of {type: 'function', function: {name, ...}}", "tools")
            if not engine.template_reads("tools"):
                raise BadRequest(f"this model's chat template ({self.model_name}) does not define tools", "tools")
            kwargs["tools"] = tools
        fmt = body.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise BadRequest("response_format other than text is not supported (no constrained decoding)",
                             "response_format")
        effort = body.get("reasoning_effort")
        if effort is not None:
            from moechat.engine.reasoning import REASONING_EFFORTS

            if effort not in REASONING_EFFORTS:
                raise BadRequest(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}",
                                 "reasoning_effort")
            if engine.template_reads("reasoning_effort"):
                kwargs["reasoning_effort"] = effort
        return kwargs

    async def _first_event(self, job, request):
        """The job's first event (Start or Failed), or None if the client disconnected while it waited."""
        import asyncio
        while True:
            try:
                return await asyncio.wait_for(job.next(), _DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    job.cancel.set()
                    return None

    async def _collect(self, job, rid: str, kind: str, request):
        import asyncio

        from starlette.responses import JSONResponse

        from .serve_worker import Calls, Delta, Done, Failed

        text, thinking, calls, entries = [], [], [], []
        while True:
            try:
                event = await asyncio.wait_for(job.next(), _DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    job.cancel.set()  # the engine stops within one token
                    return _error(499, "client closed the request", "cancelled")
                continue
            if isinstance(event, Delta):
                text.append(event.text)
                thinking.append(event.thinking)
                entries.extend(event.logprobs)
            elif isinstance(event, Calls):
                calls.extend(event.calls)
            elif isinstance(event, Failed):
                e = event.error
                return _error(e.status, str(e), e.type, e.param, e.code)
            elif isinstance(event, Done):
                break
        usage = _usage(event)
        timings = {"prefill_tokens_per_s": round(event.prefill_tokens_per_s, 3),
                   "decode_tokens_per_s": round(event.decode_tokens_per_s, 3),
                   "time_to_first_token_s": round(event.first_token_s, 6)}
        content = "".join(text)
        if kind == "completion":
            choice = {"index": 0, "text": content, "logprobs": _completion_logprobs(entries, job),
                      "finish_reason": event.finish_reason}
            return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()),
                                 "model": self.model_name, "choices": [choice], "usage": usage, "timings": timings})
        message = {"role": "assistant", "content": content if content.strip() or not calls else None}
        if any(thinking):
            message["reasoning_content"] = "".join(thinking)
        if calls:
            message["tool_calls"] = [_tool_call(c) for c in calls]
        logprobs = {"content": entries} if job.logprobs is not None else None
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": event.finish_reason}
        return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()),
                             "model": self.model_name, "choices": [choice], "usage": usage, "timings": timings})

    def _stream(self, job, rid: str, kind: str, include_usage: bool):
        from sse_starlette.sse import EventSourceResponse

        from .serve_worker import Calls, Delta, Done, Failed

        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(choice: dict | None, **extra) -> dict:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                    "choices": [] if choice is None else [choice], **extra}
            return {"data": json.dumps(body, ensure_ascii=False)}

        def choice(delta: dict | None = None, text: str | None = None, finish=None, entries=()) -> dict:
            if kind == "chat":
                logprobs = {"content": list(entries)} if entries else None
                return {"index": 0, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": _completion_logprobs(entries, job) if entries else None,
                    "finish_reason": finish}

        async def events():
            try:
                if kind == "chat":
                    yield chunk(choice({"role": "assistant", "content": ""}))
                n_calls = 0
                while True:
                    event = await job.next()
                    if isinstance(event, Delta):
                        if kind == "chat":
                            delta = {}
                            if event.thinking:
                                delta["reasoning_content"] = event.thinking
                            if event.text:
                                delta["content"] = event.text
                            yield chunk(choice(delta, entries=event.logprobs))
                        elif event.text or event.logprobs:
                            yield chunk(choice(text=event.text, entries=event.logprobs))
                    elif isinstance(event, Calls):
                        tool_calls = []
                        for c in event.calls:
                            tool_calls.append({"index": n_calls, **_tool_call(c)})
                            n_calls += 1
                        yield chunk(choice({"tool_calls": tool_calls}))
                    elif isinstance(event, Failed):
                        e = event.error
                        yield {"data": json.dumps(error_body(str(e), e.type, e.param, e.code))}
                        break
                    elif isinstance(event, Done):
                        yield chunk(choice(finish=event.finish_reason))
                        if include_usage:
                            yield chunk(None, usage=_usage(event))
                        break
                yield {"data": "[DONE]"}
            finally:
                job.cancel.set()  # normal end: a no-op; a disconnect: the engine stops before its next token

        return EventSourceResponse(events(), ping=15, send_timeout=30)


def _usage(done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


def _completion_logprobs(entries, job) -> dict | None:
    """The legacy completions shape: parallel lists, top alternatives as {token: logprob}."""
    if job.logprobs is None:
        return None
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def _tool_call(call) -> dict:
    import uuid

    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def build_app(server: Server):
    """The Starlette app: routes, the API-key check and OpenAI-shaped errors for everything else."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.routing import Route

    async def not_found(request, exc):
        if isinstance(exc, HTTPException):
            server._count_error(exc.status_code)
            message = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
                       else str(exc.detail))
            return _error(exc.status_code, message, "invalid_request_error", None,
                          {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code))
        return _error(500, "internal error", "server_error")

    async def crashed(request, exc):
        server._count_error(500)
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return _error(500, f"internal error: {type(exc).__name__}" + (f": {first}" if first else ""), "server_error")

    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", server.model, methods=["GET"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/metrics", server.metrics_route, methods=["GET"]),
    ]
    middleware = [Middleware(_ApiKey, key=server.api_key, on_reject=server._count_error)] if server.api_key else []
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={HTTPException: not_found, Exception: crashed})


class _ApiKey:
    """Pure ASGI middleware: every route but /health needs `Authorization: Bearer KEY` (compared in constant
    time)."""

    def __init__(self, app, key: str, on_reject=None):
        self.app, self.key, self.on_reject = app, key.encode(), on_reject

    async def __call__(self, scope, receive, send):
        import hmac

        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        if self.on_reject is not None:
            self.on_reject(401)
        response = _error(401, "missing or wrong API key: send 'Authorization: Bearer KEY' (moechat serve "
                          "--api-key)", "authentication_error", None, "invalid_api_key")
        await response(scope, receive, send)


def model_info(engine, model_dir: Path) -> dict:
    """What /v1/models says about the model beyond OpenAI's fields (read by `moechat chat --remote`)."""
    args = engine.args
    try:
        moe_layers = len(engine.loaded.cls.moe_layers(args))
    except Exception:  # noqa: BLE001
        moe_layers = int(args.num_hidden_layers)
    try:
        sampling = {k: v for k, v in vars(engine.sampling()).items() if isinstance(v, (int, float, bool, type(None)))}
    except Exception:  # noqa: BLE001
        sampling = {}
    return {"model_type": str(getattr(args, "model_type", "")), "path": str(model_dir),
            "dtype": str(engine.loaded.dtype).removeprefix("torch."), "device": str(engine.loaded.device),
            "num_layers": int(args.num_hidden_layers), "moe_layers": moe_layers,
            "num_experts": int(args.num_experts), "top_k": int(args.top_k), "context": int(engine.context),
            "default_max_tokens": int(engine.default_max_tokens()), "sampling_defaults": sampling,
            "generation_config": dict(engine.generation_config or {}),
            "has_chat_template": engine.chat_template is not None,
            "reads_reasoning_effort": engine.template_reads("reasoning_effort"),
            "reads_tools": engine.template_reads("tools")}


def _check_serve_args(args, device: str) -> None:
    from moechat.engine.errors import ConfigError
    from moechat.engine.loader import resolve_device

    resolve_device(device)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: a TCP port is 0..65535")


def run_serve(args: argparse.Namespace) -> int:
    import os
    import socket

    from moechat.engine.errors import ConfigError

    if args.model_dir is None:
        from .launch import DEMO_MODEL

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
    from .engine_args import load_engine_from_args

    engine = load_engine_from_args(args, check=_check_serve_args)
    return serve_engine(engine, sock, model_name=args.served_model_name or Path(args.model_dir).name,
                        api_key=api_key, max_queue=args.max_queue, model_dir=Path(args.model_dir),
                        cache_line=_cache_line(args), prefix_cache=args.prefix_cache)


def _cache_line(args) -> dict:
    return {"policy": str(args.policy), "expert_format": str(args.expert_format), "on_miss": str(args.on_miss)}


def serve_engine(engine, sock, *, model_name: str, api_key: str | None, max_queue: int,
                 model_dir: Path, cache_line: dict, prefix_cache: bool = False) -> int:
    """Serve `engine` on a bound socket until Ctrl+C / SIGTERM."""
    import uvicorn

    from .serve_metrics import ServerMetrics
    from .serve_worker import EngineWorker

    worker = EngineWorker(engine, max_queue=max_queue, prefix_cache=prefix_cache)
    info = model_info(engine, model_dir)
    metrics = ServerMetrics(lambda: worker.snapshot, {"model": model_name, "model_type": info["model_type"],
                                                      "device": info["device"], "dtype": info["dtype"],
                                                      **cache_line})
    worker.metrics = metrics
    worker.start()
    server = Server(worker, metrics, model_name=model_name, api_key=api_key, info=info)
    sock.listen(128)  # connections made from here on wait for uvicorn instead of being refused
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    config = uvicorn.Config(build_app(server), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=5)
    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            worker.stop(timeout=0)  # every open response ends (503) before uvicorn waits for them
            super().handle_exit(sig, frame)

    uv = _Server(config)
    if not api_key and host not in ("127.0.0.1", "::1", "localhost"):
        print(f"moechat: warning: serving {host} without --api-key: anyone who can reach port {port} can use the model",
              file=sys.stderr, flush=True)
    print(f"moechat serve: {model_name} on http://{shown}:{port}/v1 (metrics at /metrics; "
          f"{'API key required' if api_key else 'no API key'}; up to {max_queue} requests queued)",
          file=sys.stderr, flush=True)
    try:
        uv.run(sockets=[sock])
    finally:
        worker.stop()
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - saving the routing profile is best effort
            pass
    return 0
