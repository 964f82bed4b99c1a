"""The routes of `moechat serve` and their handlers: `Server` (one per served engine) and `build_app`, the Starlette
app that puts the gate (app/serve/gate.py) in front of them.

A completion request is read (the body capped as it arrives), parsed (app/serve/request.py), queued on the engine
worker as a Job (429 with Retry-After when the queue is full), then answered by app/serve/responses.py.
"""

from __future__ import annotations

import json
import time

from .gate import Gate, GateConfig, _ApiKey, _error
from .request import BadRequest, parse_common, parse_logprobs, parse_messages, parse_prompt
from .responses import collect, first_event, stream


class Server:
    """The routes' handlers over one EngineWorker: health, models, metrics, and the two completion endpoints (a
    request parsed, queued as a Job, answered as JSON or a stream); every refusal counted in the metrics."""

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
        first = await first_event(job, request)
        if first is None:  # the client left while the request waited
            return _error(499, "client closed the request", "cancelled")
        from .worker import Failed

        if isinstance(first, Failed):
            e = first.error
            self._count_error(e.status)
            return _error(e.status, str(e), e.type, e.param, e.code)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24] + f"-{job.number}"
        if fields["stream"]:
            return stream(job, rid, kind, fields["include_usage"], self.model_name)
        return await collect(job, rid, kind, request, self.model_name)

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
        extra = self._chat_template_kwargs(body.get("chat_template_kwargs"))
        effort, param = body.get("reasoning_effort"), "reasoning_effort"
        if "reasoning_effort" in extra:  # the same variable may come in either field, once
            if effort is not None and effort != extra["reasoning_effort"]:
                raise BadRequest("reasoning_effort and chat_template_kwargs.reasoning_effort differ",
                                 "chat_template_kwargs")
            effort, param = extra.pop("reasoning_effort"), "chat_template_kwargs"
        if effort is not None:
            from moechat.engine.text.reasoning import REASONING_EFFORTS

            if effort not in REASONING_EFFORTS:
                raise BadRequest(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}", param)
            if engine.template_reads("reasoning_effort"):
                kwargs["reasoning_effort"] = effort
        kwargs.update(extra)
        return kwargs

    def _chat_template_kwargs(self, extra) -> dict:
        """`chat_template_kwargs` (as vLLM, SGLang and llama-server take it): the thinking switch, as the variable
        this template reads, and the reasoning effort (checked with the top-level field's). Other variables are
        refused by name: a client sets no template variable (bos_token, messages...) moechat does not know."""
        from moechat.engine.text.reasoning import THINKING_SWITCHES

        if extra is None:
            return {}
        where = "chat_template_kwargs"
        if not isinstance(extra, dict):
            raise BadRequest(f"{where} must be an object, e.g. {{\"enable_thinking\": false}}", where)
        known = (*THINKING_SWITCHES, "reasoning_effort")
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise BadRequest(f"{where}: {', '.join(map(repr, unknown))} not supported; moechat passes "
                             f"{', '.join(known)}", where)
        out: dict = {}
        switches = [extra[k] for k in THINKING_SWITCHES if k in extra]
        if switches:
            if not all(isinstance(v, bool) for v in switches) or len(set(switches)) > 1:
                raise BadRequest(f"{where}: enable_thinking (or thinking) must be true or false", where)
            out.update(self.worker.engine.thinking_kwargs(switches[0]))
        if extra.get("reasoning_effort") is not None:
            out["reasoning_effort"] = extra["reasoning_effort"]
        return out


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
