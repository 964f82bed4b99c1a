"""The engine side of `moechat serve`: one thread owns the engine and runs requests one at a time, in order.

    HTTP handlers (asyncio)                     engine thread
    submit(job) -> FIFO (<= max_queue waiting)  take the oldest job; skip it if its client left
      QueueFull -> 429 + Retry-After            render the chat template, tokenize, check the context
    await job.next() <- Start | Delta | Calls   Engine.generate: each chunk -> stop strings -> a Delta
                       | Done | Failed          between two tokens: the client gone? cancel (one token)
    client disconnects -> job.cancel.set()      every SNAPSHOT_INTERVAL_S: a cache snapshot for /metrics

Why one thread: the engine runs one sequence at a time and is not thread-safe (the CLI and the app
use it from one thread too), so the server's concurrency is a queue in front of it, not a pool. The
queue is bounded so a flood of clients gets a prompt 429 with an honest Retry-After (the running
request's expected time plus the queue's, from the recent mean request time) instead of a pile of
sockets waiting minutes. Events cross to the event loop through an outbox and a doorbell (one
`call_soon_threadsafe` per batch): when the loop keeps up a batch is one token; when the machine is busy, the
tokens that came meanwhile go out as one SSE chunk instead of each costing a wake of the loop thread and a
GIL hand-over the engine thread waits for (bench/serve.py measures the whole path).

Requests are stateless, as OpenAI's API is: each one prefills its whole prompt into the one KV
cache (truncated, never reallocated), exactly as `moechat run` prefills it, so a greedy reply through
the server equals `moechat run`'s token for token.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from moechat.engine.errors import MoechatError

SNAPSHOT_INTERVAL_S = 0.5  # cache snapshots for /metrics while a request generates
_PROMPT_TAIL_TOKENS = 8  # as Engine.reasoning_parser: enough of the prompt to know where the reply starts


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the server is busy: {retry_after} s")
        self.retry_after = retry_after


class RequestError(Exception):
    """A request the engine refused before generating (too long, a template error...): a 4xx for the client."""

    def __init__(self, message: str, status: int = 400, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.type, self.code, self.param = status, type_, code, param


# -- events, engine thread -> handler ----------------------------------------------------------------------
@dataclass(frozen=True)
class Start:
    prompt_tokens: int


@dataclass(frozen=True)
class Delta:
    text: str = ""
    thinking: str = ""
    logprobs: tuple = ()  # with logprobs asked: one OpenAI entry per token, {token, logprob, bytes, top_logprobs}

    def merge(self, other: Delta) -> Delta:
        return Delta(self.text + other.text, self.thinking + other.thinking, self.logprobs + other.logprobs)


@dataclass(frozen=True)
class Calls:
    calls: tuple  # ToolCall, ...


@dataclass(frozen=True)
class Done:
    finish_reason: str  # stop | length | tool_calls | cancelled
    prompt_tokens: int
    completion_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    first_token_s: float  # from submit to the first generated token (queue wait included)
    cached_tokens: int = 0  # prompt tokens whose KV came from the previous request (--prefix-cache)


@dataclass(frozen=True)
class Failed:
    error: RequestError
    started: bool  # tokens were already sent


@dataclass
class Job:
    """One request: what to generate and where its events go."""

    kind: str  # "chat" | "completion"
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    sampling: Any = None  # SamplingParams
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    template_kwargs: dict = field(default_factory=dict)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: not asked; k: each token's logprob and the k best
    endpoint: str = "chat"
    cancel: threading.Event = field(default_factory=threading.Event)
    number: int = 0  # arrival order
    submitted: float = 0.0
    loop: asyncio.AbstractEventLoop | None = None
    # Events cross threads through an outbox and a doorbell, as app/tui/bridge.py's tokens do: the engine thread
    # wakes the event loop once per batch, not per token, so on a busy machine the loop thread (which must take
    # the GIL the engine thread also needs) runs once for however many tokens came meanwhile, and their text
    # goes out as one SSE chunk. While the loop keeps up, a batch is one token.
    _outbox: list = field(default_factory=list)
    _outbox_lock: threading.Lock = field(default_factory=threading.Lock)
    _rung: bool = False
    _items: collections.deque = field(default_factory=collections.deque)  # loop thread only
    _ready: asyncio.Event | None = None

    def bind(self) -> None:
        """Attach to the running event loop (call from a handler)."""
        self.loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()

    def send(self, event) -> None:
        """From the engine thread."""
        if self.loop is None:
            return
        with self._outbox_lock:
            self._outbox.append(event)
            ring, self._rung = not self._rung, True
        if ring:
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop is closed: the server is shutting down
                pass

    def _deliver(self) -> None:
        with self._outbox_lock:
            items, self._outbox, self._rung = self._outbox, [], False
        self._items.extend(items)
        self._ready.set()

    async def next(self):
        """The next event; Deltas that are already waiting come merged into one."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        event = self._items.popleft()
        if isinstance(event, Delta):
            while self._items and isinstance(self._items[0], Delta):
                event = event.merge(self._items.popleft())
        return event


class StopMatcher:
    """Stop strings over streamed text: text is released only once no stop string can start in it, so a stop
    split across tokens is still found and never shown."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string was reached: nothing after it is ever sent)."""
        if not self.stops:
            return text, False
        self.buf += text
        first = min((at for at in (self.buf.find(s) for s in self.stops) if at != -1), default=-1)
        if first != -1:
            out, self.buf = self.buf[:first], ""
            return out, True
        cut = max(0, len(self.buf) - self.hold)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


class EngineWorker:
    """Owns the engine on one thread; `submit` jobs from the event loop. `metrics` (ServerMetrics) is told of
    every request; `snapshot` is the latest CacheSnapshot (None while every expert is resident)."""

    def __init__(self, engine, *, max_queue: int = 16, metrics=None, prefix_cache: bool = False):
        self.engine = engine
        self.max_queue = max_queue
        self.prefix_cache = prefix_cache
        self.metrics = metrics
        self.snapshot = None
        self._jobs: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._numbers = itertools.count(1)
        self._running: Job | None = None
        self._stopping = False
        self._mean_s = 2.0  # recent mean request time, for Retry-After (an EWMA)
        self._sequence = None
        self._thread = threading.Thread(target=self._loop, name="moechat-engine", daemon=True)

    # -- event loop side --------------------------------------------------------------------------------
    def start(self) -> None:
        self.snapshot = self._snapshot()
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Shutting down: waiting requests get a 503 now, the running one is cancelled before its next token and
        ends with a 503 error event, so every response completes. `timeout` 0 returns at once (a signal handler)."""
        shutting = RequestError("the server is shutting down; retry on another server or after its restart", 503,
                                "server_error", "shutting_down")
        with self._cond:
            self._stopping = True
            for job in self._jobs:
                job.cancel.set()
                job.send(Failed(shutting, started=False))
            self._jobs.clear()
            if self._running is not None:
                self._running.cancel.set()
            self._cond.notify_all()
        if timeout and self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return len(self._jobs)

    @property
    def busy(self) -> bool:
        return self._running is not None

    def submit(self, job: Job) -> None:
        """Queue `job` (FIFO); QueueFull when max_queue requests already wait."""
        with self._cond:
            waiting = sum(1 for j in self._jobs if not j.cancel.is_set())
            if waiting >= self.max_queue or self._stopping:
                raise QueueFull(max(1, min(600, math.ceil(self._mean_s * (waiting + 1)))))
            job.number = next(self._numbers)
            job.submitted = time.perf_counter()
            self._jobs.append(job)
            self._cond.notify()
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._jobs))

    # -- engine thread ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._jobs.popleft()
                self._running = job
            if self.metrics is not None:
                self.metrics.queue_depth.set(len(self._jobs))
                self.metrics.running.set(1)
            t0 = time.perf_counter()
            try:
                if job.cancel.is_set():  # its client left while it waited
                    job.send(Done("cancelled", 0, 0, 0.0, 0.0, 0.0))
                    status = "cancelled"
                else:
                    status = self._run(job)
            except BaseException as e:  # noqa: BLE001 - nothing a request does may stop the server
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                job.send(Failed(RequestError(_describe(e), 500, "server_error"), started=True))
                status = "error"
            finally:
                with self._cond:
                    self._running = None
                elapsed = time.perf_counter() - t0
            if status in ("ok", "error"):
                self._mean_s = 0.7 * self._mean_s + 0.3 * elapsed
            self.snapshot = self._snapshot()
            if self.metrics is not None:
                self.metrics.running.set(0)
                self.metrics.requests.labels(job.endpoint, status).inc()
                self.metrics.latency.labels(job.endpoint).observe(time.perf_counter() - job.submitted)

    def _snapshot(self):
        try:
            return self.engine.cache_snapshot()
        except Exception:  # noqa: BLE001 - metrics are best effort
            return self.snapshot

    def _encode(self, job: Job) -> tuple[list[int], Any]:
        """(prompt ids, parser for thinking/answer/tool calls); RequestError for what the client must change."""
        from moechat.engine.errors import GenerationCancelled
        from moechat.engine.text.tool_calls import make_tool_parser

        engine = self.engine
        try:
            if job.kind == "chat":
                ids = engine.encode_chat(job.messages, cancel=job.cancel, **job.template_kwargs)
                source = engine.chat_template.source if engine.chat_template is not None else None
                tail = engine.tokenizer.decode(ids[-_PROMPT_TAIL_TOKENS:]) if engine.tokenizer is not None else ""
                parser = make_tool_parser(source, tail, job.template_kwargs.get("tools"))  # schemas type XML calls
            else:
                ids = list(job.prompt) if isinstance(job.prompt, list) else engine.encode(job.prompt)
                parser = None
        except GenerationCancelled:
            raise
        except MoechatError as e:
            raise RequestError(str(e)) from None
        if not ids:
            raise RequestError("the prompt is empty: give at least one token", param="prompt")
        vocab = engine.args.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        if len(ids) >= engine.context:
            raise RequestError(f"the prompt is {len(ids):,} tokens; this server's context is {engine.context:,} "
                               "tokens, and a reply needs at least one more: shorten the prompt, or restart the "
                               "server with a larger --context", code="context_length_exceeded",
                               param="messages" if job.kind == "chat" else "prompt")
        return ids, parser

    def _run(self, job: Job) -> str:
        from moechat.engine.errors import GenerationCancelled

        engine = self.engine
        try:
            ids, parser = self._encode(job)
        except GenerationCancelled:
            job.send(Done("cancelled", 0, 0, 0.0, 0.0, 0.0))
            return "cancelled"
        except RequestError as e:
            job.send(Failed(e, started=False))
            return "rejected"
        job.send(Start(len(ids)))
        if self._sequence is None:
            self._sequence = engine.new_sequence()
        seq = self._sequence
        # Stateless by default: the whole prompt is prefilled, as `moechat run` does. With --prefix-cache the KV
        # of the longest prefix shared with what the cache holds (the previous request and its reply) is kept.
        keep = 0
        if self.prefix_cache:
            keep = min(_common_prefix(seq.tokens, ids), len(ids) - 1)  # at least one token prefilled for logits
        keep = seq.truncate(keep)  # fewer where a recurrent state has no snapshot at keep (engine/layers/kv_cache.py)
        stops = StopMatcher(job.stop)
        finish, last, first_token_s = None, None, 0.0
        last_snapshot = time.perf_counter()
        generated = after_cancel = 0
        stream = engine.generate(ids[keep:], sampling=job.sampling, max_tokens=job.max_tokens, cancel=job.cancel,
                                 sequence=seq, stop_on_eos=not job.ignore_eos, reasoning=parser,
                                 logprobs=job.logprobs)
        try:
            for chunk in stream:
                last = chunk
                generated = chunk.generated_tokens
                if job.cancel.is_set() and chunk.token_ids:
                    after_cancel += 1  # the token being computed when the client left; the engine stops next
                if generated == 1 and chunk.token_ids:
                    first_token_s = time.perf_counter() - job.submitted
                    if self.metrics is not None:
                        self.metrics.ttft.labels(job.endpoint).observe(first_token_s)
                text, hit = stops.feed(chunk.text)
                if chunk.finish_reason is not None and not hit:
                    text += stops.flush()
                entries = self._logprob_entries(chunk) if job.logprobs is not None else ()
                if text or chunk.thinking or entries:
                    job.send(Delta(text, chunk.thinking, entries))
                calls = parser.take_calls() if hasattr(parser, "take_calls") else []
                if calls:
                    job.send(Calls(tuple(calls)))
                    finish = "tool_calls"
                if hit:
                    finish = "stop"
                    break
                if chunk.finish_reason is not None:
                    finish = finish or chunk.finish_reason
                    break
                now = time.perf_counter()
                if now - last_snapshot >= SNAPSHOT_INTERVAL_S:  # between two tokens: a safe point
                    self.snapshot = self._snapshot()
                    last_snapshot = now
        except MoechatError as e:
            seq.truncate(0)  # a failure mid-forward may leave the KV and its token list apart
            job.send(Failed(RequestError(str(e), 500, "server_error"), started=True))
            self._count(len(ids), generated, last)
            return "error"
        finally:
            stream.close()  # a stop string ends it early: the engine quiesces its loads
            if after_cancel and self.metrics is not None:
                self.metrics.after_cancel.inc(after_cancel)
        if job.cancel.is_set() and finish in (None, "cancelled", "length", "stop") and last is not None \
                and last.finish_reason == "cancelled":
            finish = "cancelled"
        self._count(len(ids), generated, last)
        self.snapshot = self._snapshot()  # before Done: a client that scrapes /metrics next sees this request
        if finish == "cancelled" and self._stopping:
            job.send(Failed(RequestError("the server is shutting down: the reply was cut here", 503, "server_error",
                                         "shutting_down"), started=True))
            return "cancelled"
        job.send(Done(finish or "stop", len(ids), generated, last.prefill_tokens_per_s if last else 0.0,
                      last.decode_tokens_per_s if last else 0.0, first_token_s, keep))
        return "cancelled" if finish == "cancelled" else "ok"

    def _logprob_entries(self, chunk) -> tuple:
        """OpenAI's per-token logprob entries for a chunk (none for the closing chunk of a cancel)."""
        if chunk.logprob is None or not chunk.token_ids:
            return ()

        def entry(token_id: int, logprob: float) -> dict:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}

        return ({**entry(chunk.token_ids[0], chunk.logprob),
                 "top_logprobs": [entry(i, v) for i, v in chunk.top_logprobs]},)

    def _token_text(self, token_id: int) -> str:
        tokenizer = self.engine.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else f"<{token_id}>"

    def _count(self, prompt_tokens: int, generated: int, last) -> None:
        m = self.metrics
        if m is None:
            return
        m.prompt_tokens.inc(prompt_tokens)
        m.generated_tokens.inc(generated)
        if last is not None:
            m.prefill_tps.set(last.prefill_tokens_per_s)
            if last.decode_tokens_per_s:
                m.decode_tps.set(last.decode_tokens_per_s)


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _describe(e: BaseException) -> str:
    from ..tui.bridge import describe_error

    return describe_error(e)
