"""What a completion request gets back once its job runs: one JSON body (`collect`) or server-sent events
(`stream`), in OpenAI's chat and legacy completion shapes, plus the wait for a job's first event.

A client that goes away cancels its job: the non-streamed paths poll `request.is_disconnected()` every
_DISCONNECT_POLL_S while they wait, and a stream's generator sets the job's cancel event when sse-starlette ends it.
"""

from __future__ import annotations

import json
import time

from .gate import _error
from .request import error_body

_DISCONNECT_POLL_S = 0.25  # how often a request still waiting (queued, or not streamed) checks its client


async def first_event(job, request):
    """The job's first event (Start or Failed), or None if the client disconnected while it waited."""
    import asyncio
    while True:
        try:
            return await asyncio.wait_for(job.next(), _DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                job.cancel.set()
                return None


async def collect(job, rid: str, kind: str, request, model_name: str):
    """The whole reply as one JSON body (chat.completion or text_completion); 499 if the client left first."""
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
                             "model": model_name, "choices": [choice], "usage": usage, "timings": timings})
    message = {"role": "assistant", "content": content if content.strip() or not calls else None}
    if any(thinking):
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = [_tool_call(c) for c in calls]
    logprobs = {"content": entries} if job.logprobs is not None else None
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": event.finish_reason}
    return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()),
                         "model": model_name, "choices": [choice], "usage": usage, "timings": timings})


def stream(job, rid: str, kind: str, include_usage: bool, model_name: str):
    """The reply as server-sent events (OpenAI's chunks, then usage if asked, then [DONE]), pinged every 15 s."""
    from sse_starlette.sse import EventSourceResponse

    from .worker import Calls, Delta, Done, Failed

    created = int(time.time())
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(choice: dict | None, **extra) -> dict:
        body = {"id": rid, "object": obj, "created": created, "model": model_name,
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
