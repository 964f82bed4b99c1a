"""The requests of `moechat serve`, parsed: OpenAI's JSON bodies in, checked values out (pure Python, no HTTP).

Every field moechat honours is checked for type and range here, before a request is queued; every field it
cannot honour is refused with a `BadRequest` naming the field and what to send instead (a 400 for the client),
never silently ignored when ignoring it would change the reply. Fields that do not change the reply (`user`,
`parallel_tool_calls`, `service_tier`, ...) are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
import math

_ROLES = ("system", "developer", "user", "assistant", "tool")


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.code, self.type = param, status, code, type_


def _number(body: dict, name: str, lo: float, hi: float, *, integer: bool = False):
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
        raise BadRequest(f"{name} must be {'an integer' if integer else 'a number'}, got {json.dumps(value)}", name)
    if not lo <= value <= hi:
        raise BadRequest(f"{name} must be between {_shown(lo, integer)} and {_shown(hi, integer)}, got "
                         f"{f'{value:,}' if isinstance(value, int) else value}", name)
    return value


def _shown(bound: float, integer: bool) -> str:
    """A range's bound as a person reads it: an integer's whole, with thousands separators (1,073,741,824, not
    1.07374e+09), a number's shortest form (0.5, 2)."""
    return f"{int(bound):,}" if integer or float(bound).is_integer() else f"{bound:g}"


def _text_content(content, where: str) -> str | None:
    """A message's content as text: a string, or a list of text parts (images refused)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}: content part of type {kind!r} is not supported: this model reads text",
                                 where)
            if not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}: a text part needs a 'text' string", where)
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where}: content must be a string or a list of text parts", where)


def parse_messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object with role and content", where)
        role = m.get("role")
        if role not in _ROLES:
            raise BadRequest(f"{where}.role must be one of {', '.join(_ROLES)}, got {json.dumps(role)}",
                             f"{where}.role")
        content = _text_content(m.get("content"), f"{where}.content")
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            raise BadRequest(f"{where}.content is missing", f"{where}.content")
        message = {"role": "system" if role == "developer" else role, "content": content or ""}
        for key in ("name", "tool_call_id"):
            if key in m:
                message[key] = m[key]
        if m.get("tool_calls"):
            message["tool_calls"] = _template_tool_calls(m["tool_calls"], f"{where}.tool_calls")
        thinking = m.get("reasoning_content") or m.get("reasoning")
        if role == "assistant" and isinstance(thinking, str) and thinking:
            message["thinking"] = thinking  # where moechat's templates (and gpt-oss's) read it back
        out.append(message)
    return out


def _template_tool_calls(calls, where: str) -> list[dict]:
    """OpenAI sends a call's arguments as a JSON string; chat templates (gpt-oss's, transformers' convention) want
    the object, and Qwen3's takes either: a string that is a JSON object becomes one, as vLLM does."""
    if not isinstance(calls, list):
        raise BadRequest(f"{where} must be a list", where)
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRequest(f"{where}[{i}] must be {{type: 'function', function: {{name, arguments}}}}", where)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                parsed = None
            arguments = parsed if isinstance(parsed, dict) else arguments
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def parse_stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
        raise BadRequest("stop must be a non-empty string or a list of up to 16 of them", "stop")
    return tuple(stops)


def parse_common(body: dict, served: str) -> dict:
    """Fields both endpoints share: model, max_tokens, sampling, stop, stream; refusals for what moechat does not
    do, each naming the field and what to send instead."""
    model = body.get("model")
    if model is not None and model != served:
        raise BadRequest(f"the model {model!r} does not exist: this server serves {served!r}", "model", 404,
                         "model_not_found")
    n = body.get("n")
    if n not in (None, 1):
        raise BadRequest("n must be 1: the server generates one sequence at a time", "n")
    for name in ("frequency_penalty", "presence_penalty"):
        value = _number(body, name, -2, 2)
        if value:
            raise BadRequest(f"{name} is not supported (moechat samples with a multiplicative repetition penalty): "
                             "send repetition_penalty, e.g. 1.1, instead", name)
    if body.get("best_of") not in (None, 1):
        raise BadRequest("best_of must be 1", "best_of")
    if body.get("logit_bias"):
        raise BadRequest("logit_bias is not supported by moechat serve", "logit_bias")
    max_tokens = _number(body, "max_completion_tokens", 1, 1 << 30, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", 1, 1 << 30, integer=True)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("ignore_eos must be true or false", "ignore_eos")
    sampling = {
        "temperature": _number(body, "temperature", 0, 2),
        "top_p": _number(body, "top_p", 0, 1),
        "top_k": _number(body, "top_k", 0, 1 << 20, integer=True),  # extensions, as vLLM and llama-server take
        "min_p": _number(body, "min_p", 0, 1),
        "repetition_penalty": _number(body, "repetition_penalty", 0, 10),
        "seed": _number(body, "seed", -(1 << 63), (1 << 64) - 1, integer=True),
    }
    if sampling["top_p"] == 0:
        raise BadRequest("top_p must be greater than 0", "top_p")
    return {"max_tokens": max_tokens, "stream": stream, "include_usage": bool(options.get("include_usage")),
            "stop": parse_stop(body.get("stop")), "sampling": sampling, "ignore_eos": ignore_eos}


def parse_logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives to report per token (None: no logprobs). Chat: `logprobs` true + `top_logprobs`
    0..20; completions: `logprobs` 0..5 (OpenAI's ranges)."""
    value = body.get("logprobs")
    if kind == "chat":
        if value not in (None, True, False):
            raise BadRequest("logprobs must be true or false", "logprobs")
        top = _number(body, "top_logprobs", 0, 20, integer=True)
        if top is not None and not value:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        return (top or 0) if value else None
    if value is None or value is False:
        return None
    return _number(body, "logprobs", 0, 5, integer=True)


def parse_prompt(value) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise BadRequest("prompt is empty", "prompt")
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if isinstance(value, list) and value and all(isinstance(t, (str, list)) for t in value):
        raise BadRequest("batched prompts are not supported: send one prompt per request", "prompt")
    raise BadRequest("prompt must be a string or a list of token ids", "prompt")
