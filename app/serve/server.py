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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..cli.argtypes import positive_int as _positive_int
from ..cli.engine_args import MODEL_HELP, add_load_args, add_sampling_args, sampling_overrides
from .request import (
    BadRequest,
    error_body,
    parse_common,
    parse_logprobs,
    parse_messages,
    parse_prompt,
)

DEFAULT_PORT = 8000
MAX_BODY_BYTES = 4 << 20  # a chat that fills a 128k context is ~0.5 MB of JSON; 10 MB is a mistake or an attack
HEADER_TIMEOUT_S = 10.0  # a request line + headers is < 2 KB: 10 s is generous on any link, and bounds slowloris
IDLE_TIMEOUT_S = 5.0  # uvicorn's own keep-alive default; the openai client reconnects transparently
MAX_CONNECTIONS = 100  # --max-queue 16 waiting + 1 streaming + scrapers, with room; each costs ~10 KB
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_DISCONNECT_POLL_S = 0.25  # how often a request still waiting (queued, or not streamed) checks its client


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


# -- the gate ----------------------------------------------------------------------------------------------
def _split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header (or an origin's authority) -> (lowercased name, port or None); None if malformed."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6]:port
        name, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port = rest[1:] if rest else None
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
    elif ":" in value:  # a bare IPv6 address is not a valid Host, and is not what a browser sends
        return None
    else:
        name, port = value, None
    name = name.rstrip(".")
    if not name or any(c.isspace() or c in "/@?#\\[]" for c in name):
        return None
    if port is not None and not (port.isdigit() and len(port) <= 5 and int(port) <= 65535):
        return None
    return name, None if port is None else int(port)


def _normal_origin(text: str) -> str | None:
    """`scheme://host[:port]` lowercased, the scheme's default port dropped; None if it is not an origin."""
    scheme, sep, authority = text.strip().lower().rstrip("/").partition("://")
    if not sep or scheme not in ("http", "https") or not authority:
        return None
    split = _split_host(authority)
    if split is None:
        return None
    name, port = split
    shown = f"[{name}]" if ":" in name else name
    default = {"http": 80, "https": 443}[scheme]
    return f"{scheme}://{shown}" + (f":{port}" if port not in (None, default) else "")


def _is_ip(name: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class GateConfig:
    """What the gate lets in; `for_bind` derives the default from the address the server listens on."""

    allowed_hosts: frozenset = frozenset(LOOPBACK_NAMES)  # Host names (lowercased, no port); "*": any
    any_ip_host: bool = False  # also any IP literal: a non-loopback bind, reached by its addresses
    cors_origins: frozenset = frozenset()  # normalised origins; "*": any site
    max_body_bytes: int = MAX_BODY_BYTES
    header_timeout_s: float = HEADER_TIMEOUT_S
    idle_timeout_s: float = IDLE_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS

    @classmethod
    def for_bind(cls, host: str, *, allowed_hosts=(), cors_origins=(), **limits) -> GateConfig:
        """Loopback names and the bound address always; a non-loopback bind also answers to this machine's name and
        to any IP literal (an address cannot be rebound to another site, a name can)."""
        import socket

        bound = host.strip().lower().strip("[]")
        names = {*LOOPBACK_NAMES, bound, *(h.lower() for h in allowed_hosts)}
        loopback = bound in LOOPBACK_NAMES or bound.startswith("127.")
        if not loopback:
            machine = socket.gethostname().lower().rstrip(".")
            names |= {machine, machine.split(".")[0], machine.split(".")[0] + ".local"}
        return cls(allowed_hosts=frozenset(names), any_ip_host=not loopback, cors_origins=frozenset(cors_origins),
                   **limits)

    def host_allowed(self, name: str) -> bool:
        return "*" in self.allowed_hosts or name in self.allowed_hosts or (self.any_ip_host and _is_ip(name))

    def cors_allowed(self, origin: str) -> bool:
        return "*" in self.cors_origins or origin in self.cors_origins


class Gate:
    """Pure ASGI middleware, the server's one door: every request passes these checks, in order, before a route.

        Host          a name in GateConfig.allowed_hosts (port ignored), else 421. A DNS-rebinding page reaches
                      127.0.0.1 under its own name, so its Host header names it: refused (--allowed-host adds names).
                      No Host at all (HTTP/1.0 tools) is let in: browsers always send one.
        Origin        absent, same-origin (scheme://Host), or in --cors-origin, else 403. Browsers send Origin
                      on every cross-site POST, including the "simple" ones CORS never preflights, so refusing
                      here, before the handler, is what stops a page from generating; CORSMiddleware alone only
                      hides the answer. An allowed origin goes through Starlette's CORSMiddleware (headers,
                      preflight OPTIONS answers).
        Content-Type  a POST must be application/json (any parameters, e.g. charset), else 415: a page can only
                      send text/plain, form data or no type without a preflight.
        Body size     a declared Content-Length over max_body_bytes is 413 here; a chunked body is counted against
                      the same cap as it is read (Server._read_json).

    Below HTTP (GatedH11Protocol, uvicorn's h11 protocol): the request line and headers must arrive within
    header_timeout_s of the connection opening or the previous response ending (408, closed); a keep-alive
    connection idle for idle_timeout_s is closed (uvicorn's timeout_keep_alive); past max_connections a new one gets
    503 and is closed. Refusals are OpenAI-shaped JSON errors naming the option that would allow the request.
    """

    def __init__(self, app, config: GateConfig, on_reject=None):
        self.app, self.config, self.on_reject = app, config, on_reject
        self.cors = None
        if config.cors_origins:
            from starlette.middleware.cors import CORSMiddleware

            self.cors = CORSMiddleware(self._checked, allow_origins=sorted(config.cors_origins),
                                       allow_methods=["GET", "POST"], allow_headers=["*"],
                                       expose_headers=["Retry-After"], max_age=600)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for key, value in scope.get("headers") or ():
            headers.setdefault(key.lower(), []).append(value.decode("latin-1"))
        hosts = headers.get(b"host", [])
        for host in hosts:
            split = _split_host(host)
            if split is None or not self.config.host_allowed(split[0]):
                shown = split[0] if split else host[:100]
                return await self._refuse(scope, receive, send, 421, f"the Host {shown!r} is not one this server "
                                          f"answers to; if you reach it by that name, restart it with "
                                          f"--allowed-host {shown or 'NAME'}", "host_not_allowed")
        origins = headers.get(b"origin", [])
        cors = False
        for value in origins:
            origin = _normal_origin(value)
            same = (origin is not None and len(hosts) == 1
                    and origin == _normal_origin(f"{scope.get('scheme', 'http')}://{hosts[0]}"))
            if same:
                continue
            if origin == value and self.config.cors_allowed(origin):  # as browsers write it: CORSMiddleware compares
                cors = True                                             # the header itself with its list
                continue
            shown = origin or value[:100]
            return await self._refuse(scope, receive, send, 403, f"requests from web pages on {shown!r} are not "
                                      f"allowed; to let that site use this server, restart it with --cors-origin "
                                      f"{shown if origin else 'ORIGIN'}", "origin_not_allowed")
        if cors and self.cors is not None:
            return await self.cors(scope, receive, send)
        return await self._checked(scope, receive, send)

    async def _checked(self, scope, receive, send):
        if scope["method"] == "POST":
            headers = dict((k.lower(), v.decode("latin-1")) for k, v in scope.get("headers") or ())
            media = headers.get(b"content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                got = f"got {media!r}" if media else "none was sent"
                return await self._refuse(scope, receive, send, 415, f"the body must be JSON with Content-Type: "
                                          f"application/json ({got})", "unsupported_media_type")
            length = headers.get(b"content-length")
            if length is not None and length.strip().isdigit() and int(length) > self.config.max_body_bytes:
                return await self._refuse(scope, receive, send, 413, f"the request body is {int(length):,} bytes; at "
                                          f"most {self.config.max_body_bytes:,} are accepted", "request_too_large")
        return await self.app(scope, receive, send)

    async def _refuse(self, scope, receive, send, status: int, message: str, code: str):
        if self.on_reject is not None:
            self.on_reject(status)
        await _error(status, message, "invalid_request_error", None, code)(scope, receive, send)


def _raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response written straight to a socket the gate is closing (no request was parsed)."""
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def gated_protocol(config: GateConfig):
    """uvicorn's h11 protocol with a header deadline and a connection cap (uvicorn has neither: its keep-alive timer
    starts only after a first response, and its limit_concurrency answers 503 only to a request whose headers
    arrived, so a connection that trickles its headers one byte at a time was held forever)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GatedH11Protocol(H11Protocol):
        _deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > config.max_connections:
                transport.write(_raw_error(503, "Service Unavailable", f"the server has {config.max_connections} "
                                           "connections open; retry later (moechat serve --max-connections)",
                                           "too_many_connections"))
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(config.header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a request's headers are in (or the connection is ending)
                self._disarm()

        def on_response_complete(self) -> None:
            self._arm()  # before uvicorn parses a pipelined request, which disarms it again
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _headers_late(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return
            self.transport.write(_raw_error(408, "Request Timeout", f"the request headers did not arrive within "
                                            f"{config.header_timeout_s:g} s (moechat serve --header-timeout)",
                                            "request_timeout"))
            self.transport.close()

    return GatedH11Protocol


def uvicorn_config(app, config: GateConfig, **kwargs):
    """uvicorn's Config for the gated app: the h11 protocol above, the idle timeout, quiet logs."""
    import uvicorn

    return uvicorn.Config(app, http=gated_protocol(config), timeout_keep_alive=config.idle_timeout_s,
                          log_level="warning", access_log=False, lifespan="off", **kwargs)


# -- errors ------------------------------------------------------------------------------------------------
def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


# -- the app -----------------------------------------------------------------------------------------------
class Server:
    def __init__(self, worker, metrics, *, model_name: str, api_key: str | None, info: dict,
                 gate: GateConfig | None = None, sampling: dict | None = None, max_tokens: int | None = None):
        self.worker = worker
        # `moechat serve --temperature ... --max-tokens`: what a request that leaves the field out gets
        self.sampling_defaults = dict(sampling or {})
        self.default_max_tokens = max_tokens
        self.gate = gate or GateConfig()
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
        cap = self.gate.max_body_bytes  # a declared Content-Length over it was refused by the Gate
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise BadRequest(f"the request body is over {cap:,} bytes", None, 413, "request_too_large")
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
            given = {k: v for k, v in fields["sampling"].items() if v is not None}
            return self.worker.engine.sampling(**{**self.sampling_defaults, **given})
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

        from .metrics import CONTENT_TYPE

        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def chat(self, request):
        return await self._completion(request, "chat")

    async def completions(self, request):
        return await self._completion(request, "completion")

    async def _completion(self, request, kind: str):
        import uuid

        from .worker import Job, QueueFull

        try:
            body = await self._read_json(request)
            fields = parse_common(body, self.model_name)
            max_tokens = self.default_max_tokens if fields["max_tokens"] is None else fields["max_tokens"]
            job = Job(kind=kind, endpoint=kind, max_tokens=max_tokens, stop=fields["stop"],
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
        from .worker import Failed

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
            from moechat.engine.text.reasoning import REASONING_EFFORTS

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

        from .worker import Calls, Delta, Done, Failed

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

        from .worker import Calls, Delta, Done, Failed

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
    """The Starlette app: the Gate (Host, Origin, content type, body size), routes, the API-key check and
    OpenAI-shaped errors for everything else."""
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
    middleware = [Middleware(Gate, config=server.gate, on_reject=server._count_error)]
    if server.api_key:  # inside the gate: a CORS preflight, which carries no key, is answered before it
        middleware.append(Middleware(_ApiKey, key=server.api_key, on_reject=server._count_error))
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
