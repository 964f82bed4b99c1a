"""The server's one door: who may talk to `moechat serve`, checked before any route runs.

`Gate` (pure ASGI middleware) checks Host (DNS rebinding), Origin (cross-site pages; allowed ones get CORS),
Content-Type and the declared body size; `gated_protocol` (uvicorn's h11 protocol) bounds slow clients below HTTP
(header deadline, idle timeout, connection cap); `_ApiKey` checks `Authorization: Bearer KEY`. Every refusal is an
OpenAI-shaped JSON error (`_error`) naming the option that would allow the request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .request import error_body

MAX_BODY_BYTES = 4 << 20  # a chat that fills a 128k context is ~0.5 MB of JSON; 10 MB is a mistake or an attack
HEADER_TIMEOUT_S = 10.0  # a request line + headers is < 2 KB: 10 s is generous on any link, and bounds slowloris
IDLE_TIMEOUT_S = 5.0  # uvicorn's own keep-alive default; the openai client reconnects transparently
MAX_CONNECTIONS = 100  # --max-queue 16 waiting + 1 streaming + scrapers, with room; each costs ~10 KB
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


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


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


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
