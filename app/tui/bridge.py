"""The only module that talks to the engine: an invisible widget whose thread workers own it.

    UI thread (Textual)                       worker threads (one holds the engine lock at a time)
    ChatScreen --load(model)--------------->  load: import torch + engine, Engine.load, describe
               --generate(history, text, ..)->  generate: Conversation.send(...) -> chunks
               <--TokensArrived (doorbell)--    each chunk queued in an outbox; a doorbell when the
               --take_tokens()------------->      UI has taken the last batch
                                                between tokens: apply pending retunes, and every
               <--StatsUpdated (<= 4 Hz)----    STATS_INTERVAL_S a cache snapshot -> StatsTracker
               --stop()--> cancel Event         (checked by the engine between tokens)
               --retune(...)--> pending dict   applied by the generating thread at its next token,
                                               or by a retune worker when nothing is generating

Why this shape: the engine is not thread-safe and `retune_cache` must run between tokens on the
thread that iterates the generator, so one lock serialises load, generate and retune, and a retune
asked for mid-reply waits in a dict for the generating thread's next safe point (one decode step).
The UI never blocks on the engine: every call here returns at once. torch and the engine are
imported inside the load worker (`load_engine`), so `import moechat.app` stays torch-free and the
first frame comes before the model has even started loading.

Tokens go into an outbox (a list under a lock); the first one after the UI last emptied it rings a
`TokensArrived` doorbell, and the UI takes the whole outbox when it draws. A token is never delayed
by more than the UI's own pace, and the UI wakes per batch, not per token: at 300 tok/s per-token
messages kept the UI thread 20% busy, GIL the generating thread needs. Stats go out at most every
STATS_INTERVAL_S as replaceable messages. A chunk's `thinking` (a reasoning model's) travels beside its
text. The engine object is duck-typed (the app's tests pass a fake): `conversation()`, `sampling()`,
`default_max_tokens()`, `cache_snapshot()`, `retune_cache()`, and optionally `template_reads()`.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from textual import work
from textual.widget import Widget

from moechat.engine.plan.hardware import quiet_openmp, set_threads  # no torch; shared with `run`

from .livestats import StatsTracker
from .messages import (
    CacheRetuned,
    CacheState,
    EngineFailed,
    EngineReady,
    GenerationFailed,
    GenerationFinished,
    HitCurveReady,
    LoadProgress,
    ModelInfo,
    PolicyPredicted,
    RetuneFailed,
    StatsUpdated,
    TokensArrived,
)

STATS_INTERVAL_S = 0.25  # cache snapshots for the live panel: 4 a second
BUNDLED_TRACE = "routing_trace.npz"  # a model dir's recorded routing (assets/demo-moe has one)
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass(frozen=True)
class LoadOptions:
    """How to load the model: the flags `moechat chat` shares with `moechat run`."""

    dtype: str | None = None
    device: str | None = None
    context: int | None = None
    expert_slots: int | None = None
    policy: str | None = None
    ram_cache_mb: int | None = None
    resident: bool = False  # every expert on the device, no cache (the heatmap stays empty)
    prefetch: str | None = None  # None: the engine's default when experts are cached
    prefetch_depth: int = 1
    warm_start: bool = True  # fill the slots from the model's saved routing profile
    expert_format: str | None = None  # native, int8, int4 (None: native); int8/int4 convert once into a repacked file
    on_miss: str = "auto"  # where a miss runs: load (into a slot), host (from the RAM tier, in place), auto
    host_layers: int = 0  # the first N MoE layers' experts stay on the host
    dense_format: str = "native"  # int8 / int4 attention, int8 LM head (CPU; quant/dense_quant.py)
    threads: int | None = None  # --threads: compute threads (None: every core but one, `hardware.set_threads`)


@dataclass(frozen=True)
class Tokens:
    """Generated text waiting for the UI: the answer's text and the thinking, of generation `gen_id`."""

    gen_id: int
    text: str
    token_ids: tuple[int, ...]
    thinking: str = ""


# (model dir or repo id, options, progress callback) -> engine
EngineFactory = Callable[[str, LoadOptions, Callable[[str], None]], Any]


def policy_names() -> tuple[str, ...]:
    from moechat.engine.cache.policy import POLICIES  # pure Python and numpy: no torch

    return POLICIES


def prefetch_modes() -> tuple[str, ...]:
    from moechat.engine.cache.prefetch import PREFETCH_MODES  # pure Python: no torch

    return PREFETCH_MODES


def default_policy() -> str:
    from moechat.engine.cache.policy import DEFAULT_POLICY

    return DEFAULT_POLICY


def looks_like_repo_id(model: str) -> bool:
    """'org/name', or 'org/name:QUANT' (one quant of a GGUF repo), that is not a local path."""
    repo, _, quant = model.partition(":")
    return bool(_REPO_ID.match(repo)) and (quant == "" or ":" not in quant) and not Path(model).exists()


def is_local_model(model: str | Path) -> bool:
    """A model on this disk: a directory (safetensors, or one holding a GGUF model) or a .gguf file (a split
    set's first part)."""
    path = Path(model).expanduser()
    return path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf")


NO_MODEL_HINT = "pass a directory with config.json and *.safetensors (or a .gguf file), or a Hub repo id"


def resolve_model(model: str, cache_dir: str | Path | None = None) -> Path:
    """A local model dir, or a Hub repo id's complete snapshot in the Hugging Face cache (default: HF_HUB_CACHE);
    a partial download is a NotDownloadedError naming `moechat pull`, never half a model."""
    from moechat.engine.errors import ConfigError

    path = Path(model).expanduser()
    if is_local_model(path):
        return path
    if looks_like_repo_id(model):
        from ..cli.pull import resolve_model_arg

        if ":" in model:  # one quant of a GGUF repo: its cached files
            return Path(resolve_model_arg(model))
        from moechat.engine.plan.hub import Hub

        return Hub(cache_dir=cache_dir).resolve(model)
    raise ConfigError(f"{model}: no such model directory; {NO_MODEL_HINT}")


TRACE_ROWS = 250_000  # routing rows the session keeps for the predicted hit rate (the curve reads 200k)


def load_engine(model: str, options: LoadOptions, progress: Callable[[str], None]):
    """The real engine factory; runs in the load worker, where torch gets imported."""
    progress("importing torch")
    quiet_openmp()  # before torch loads its OpenMP runtime: idle workers sleep, not spin
    import torch

    set_threads(torch, options.threads)  # default_threads(): from 3 cores one is left for the UI thread
    from moechat.engine.cache.provider import CacheConfig
    from moechat.engine.runtime.generate import Engine

    path = resolve_model(model)
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cache = None
    if not options.resident:
        # As `moechat run`: what the user left unset comes from the memory plan when the experts do not all
        # fit on the device; else every expert gets a slot (and the panel shows them filling up).
        progress("planning memory")
        slots, ram_cache_bytes = _cache_defaults(path, device, options, progress)
        from moechat.engine.cache.prefetch import default_prefetch

        # record_trace: the session's routing feeds the tuning panel's predicted hit rate (11 + 2K bytes a
        # layer per token, a copy of [T, K] ids per layer call).
        prefetch = options.prefetch or default_prefetch(device)
        cache = CacheConfig(expert_slots=slots, policy=options.policy or default_policy(),
                            ram_cache_bytes=ram_cache_bytes, prefetch=prefetch,
                            prefetch_depth=options.prefetch_depth, warm_start=options.warm_start, record_trace=True,
                            trace_max_rows=TRACE_ROWS, on_miss=options.on_miss, host_layers=options.host_layers)
    fmt = options.expert_format or "native"
    if fmt == "native":
        progress(f"loading {path.name} on {device} (weights, tokenizer, expert cache)")
    else:
        from ..cli.fit import repacked_formats

        first = fmt not in repacked_formats(path)
        progress(f"loading {path.name} on {device} with {fmt} experts"
                 + (" (the first start converts every expert into a repacked file: minutes for a big model)"
                    if first else " (from the repacked file written at the first start)"))
    engine = Engine.load(path, dtype=options.dtype, device=device, context=options.context, cache=cache,
                         expert_format=None if fmt == "native" else fmt, dense_format=options.dense_format)
    for notice in engine.notices:  # e.g. a tokenizer far smaller than the model's embedding
        progress(f"warning: {notice}")
    return engine


def _cache_defaults(path: Path, device: str, options: LoadOptions, progress) -> tuple[int | None, int | None]:
    """`cache_defaults` of `moechat run`; planning is advice, never a failure: on error the sizes stay unset."""
    from moechat.app.cli.fit import cache_defaults

    try:
        return cache_defaults(path, device=device, dtype=options.dtype, context=options.context,
                              expert_slots=options.expert_slots, ram_cache_mb=options.ram_cache_mb,
                              warn=lambda message: progress(f"warning: {message}"),
                              expert_format=options.expert_format)
    except Exception:  # noqa: BLE001 - a model the planner cannot read still loads (the loader explains)
        return options.expert_slots, None if options.ram_cache_mb is None else options.ram_cache_mb << 20


def describe_error(e: BaseException) -> str:
    """One readable line for an exception the engine did not type (a MoechatError's str() already is)."""
    from moechat.engine.errors import MoechatError

    if isinstance(e, MoechatError):
        return str(e)
    first = (str(e).strip().splitlines() or [""])[0]
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return (f"out of memory ({first or type(e).__name__}); lower --context, use fewer --expert-slots or a "
                "smaller --dtype")
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _moe_layer_count(engine) -> int | None:
    loaded = getattr(engine, "loaded", None)
    cls = getattr(loaded, "cls", None)
    try:
        return len(cls.moe_layers(engine.args)) if cls is not None else None
    except Exception:
        return None


def cache_state(engine, snap) -> CacheState | None:
    if snap is None:
        return None
    moe_layers = _moe_layer_count(engine)
    max_slots = moe_layers * snap.resident.shape[1] if moe_layers else int(snap.resident.size)
    store = getattr(getattr(engine, "provider", None), "store", None)
    expert_bytes = getattr(store, "expert_bytes", None)
    return CacheState(snap.num_slots, max_slots, snap.policy, snap.ram_cache_bytes, snap.ram_cache_used_bytes,
                      expert_bytes * max_slots if expert_bytes else None, getattr(snap, "prefetch", "off"),
                      getattr(snap, "prefetch_depth", 0), getattr(snap, "fast_tier", "slots"), int(expert_bytes or 0),
                      int(getattr(snap, "ram_tier_experts", 0)))


def format_info(engine, moe_layers: int | None) -> tuple[str, str, dict[str, int], frozenset[str]]:
    """(format held, native format, every expert's bytes per format it can run in, formats already repacked).

    The converted sizes come from the planner's byte formulas (engine/plan.py, equal to engine/quant's layouts);
    native's from the checkpoint's own format. Best effort: what cannot be read is left out, never an error."""
    loaded = getattr(engine, "loaded", None)
    held = getattr(getattr(loaded, "expert_format", None), "name", None)
    native = getattr(loaded, "native_format", None) or getattr(loaded, "expert_format", None)
    native_name = getattr(native, "name", "")
    fmt = "native" if held in (None, native_name) else held
    args = engine.args
    n = (moe_layers or int(args.num_hidden_layers)) * int(args.num_experts)
    sizes: dict[str, int] = {}
    try:
        sizes["native"] = n * native.expert_bytes(args.hidden_size, args.moe_intermediate, loaded.dtype,
                                                  args.expert_bias)
    except Exception:  # noqa: BLE001 - a fake or partial engine: the store's size when it holds native experts
        store_bytes = getattr(getattr(getattr(engine, "provider", None), "store", None), "expert_bytes", None)
        if fmt == "native" and store_bytes:
            sizes["native"] = n * store_bytes
    try:
        from moechat.engine.plan import FLOAT_SIZES, packed_expert_tensors

        elem = FLOAT_SIZES[str(loaded.dtype).removeprefix("torch.")]
        bias = bool(getattr(args, "expert_bias", False))
        for name in ("int8", "int4"):
            tensors = packed_expert_tensors(name, int(args.hidden_size), int(args.moe_intermediate), elem, bias,
                                            gated=bool(getattr(args, "gated_experts", True)))
            sizes[name] = n * sum(t.nbytes for t in tensors)
    except Exception:  # noqa: BLE001 - no sizes for a model whose widths the format cannot take (or a fake)
        pass
    try:
        from ..cli.fit import repacked_formats

        repacked = repacked_formats(getattr(loaded, "model_dir", None))
    except Exception:  # noqa: BLE001 - an unreadable cache dir: nothing is known to be written
        repacked = frozenset()
    return fmt, native_name, sizes, repacked


def describe(engine, model: str) -> ModelInfo:
    args = engine.args
    loaded = getattr(engine, "loaded", None)
    fmt, native, sizes, repacked = format_info(engine, _moe_layer_count(engine))
    try:
        defaults = dataclasses.asdict(engine.sampling())
    except Exception:
        defaults = {}
    return ModelInfo(
        name=Path(str(getattr(loaded, "model_dir", model))).name or model,
        path=str(getattr(loaded, "model_dir", model)),
        model_type=getattr(args, "model_type", ""),
        dtype=str(getattr(loaded, "dtype", "")).removeprefix("torch."),
        device=str(getattr(loaded, "device", "")),
        num_layers=int(args.num_hidden_layers),
        num_experts=int(args.num_experts),
        top_k=int(args.top_k),
        sampling_defaults=defaults,
        generation_config=dict(getattr(engine, "generation_config", None) or {}),
        default_max_tokens=int(engine.default_max_tokens()),
        has_chat_template=getattr(engine, "chat_template", True) is not None,
        reads_reasoning_effort=_template_reads(engine, "reasoning_effort"),
        thinking_switch=_template_reads(engine, "thinking_switch"),
        cache=cache_state(engine, engine.cache_snapshot()),
        expert_format=fmt, native_format=native, format_bytes=sizes, repacked=repacked,
    )


def _template_reads(engine, variable: str) -> bool:
    """Whether the template reads `variable`; "thinking_switch": whether it has a thinking switch."""
    reads = getattr(engine, "template_reads", None)
    if variable == "thinking_switch":
        switch = getattr(engine, "thinking_kwargs", None)
        reads = None if switch is None else (lambda _: bool(switch(True)))
    try:
        return bool(reads(variable)) if reads is not None else False
    except Exception:  # noqa: BLE001 - a template the analysis cannot parse still chats; the option is hidden
        return False


def _close_engine(engine) -> None:
    close = getattr(engine, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # noqa: BLE001 - saving a profile is best effort; never fail an exit or a switch
            pass


class EngineBridge(Widget):
    """Owns the engine; every method returns at once and answers with messages (see messages.py)."""

    DEFAULT_CSS = "EngineBridge { display: none; }"

    def __init__(self, factory: EngineFactory = load_engine, options: LoadOptions | None = None):
        super().__init__()
        self.factory = factory
        self.options = options or LoadOptions()
        self._engine = None
        self._conversation = None
        self._dropped_told = 0  # turns left out of the prompt when the user was last told
        self._lock = threading.Lock()  # held by whichever worker uses the engine
        self._tracker = StatsTracker()
        self._cancel: threading.Event | None = None
        self._gen_id = 0
        self._pending: dict[str, Any] = {}  # retune changes not yet applied
        self._pending_lock = threading.Lock()
        self._outbox: list[Tokens] = []  # not yet taken by the UI
        self._rung = False  # a TokensArrived is on its way and the UI has not taken the outbox since
        self._outbox_lock = threading.Lock()
        self._curve_rows = -1  # trace rows the last posted hit curve was computed from
        self._curve_trace = None  # the routing that curve came from (and its source), for `predict`
        self._app_exiting = False  # the app is exiting: a load that ends now closes its engine at once
        self._loads = 0  # load threads started and not yet ended
        self._loads_lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return self._engine is not None

    def on_unmount(self) -> None:
        """App exit: stop the reply, then let the engine stop its loads and save its routing profile.

        A stopped reply frees the engine within a token; a model still loading is not waited for (it held the
        exit for seconds): the load worker closes what it loaded when it ends."""
        self._app_exiting = True
        self.stop()
        if self._loads:  # a load holds the lock until it ends; it closes its engine itself
            return
        if self._lock.acquire(timeout=1.0):
            try:
                _close_engine(self._engine)
                self._engine = None
            finally:
                self._lock.release()

    # -- loading --------------------------------------------------------------------------------------
    def load(self, model: str, expert_format: str | None = None) -> None:
        """Load `model` (the one loaded before is closed); `expert_format` replaces the options' for this load
        and the next ones (the panel's format choice reloads through here)."""
        if expert_format is not None:
            self.options = dataclasses.replace(self.options, expert_format=expert_format)
        # A daemon thread, not a Textual thread worker: those run in asyncio's default executor, which
        # `asyncio.run` joins at exit, so quitting while a model loaded waited for the whole load (2-6 s,
        # most of it `import torch`). Loads still run one at a time (self._lock).
        with self._loads_lock:
            self._loads += 1
        threading.Thread(target=self._load, args=(model,), name="moechat-load", daemon=True).start()

    def _load(self, model: str) -> None:
        try:
            self._load_locked(model)
        finally:
            with self._loads_lock:
                self._loads -= 1

    def _load_locked(self, model: str) -> None:
        t0 = time.monotonic()

        def progress(stage: str) -> None:
            self.post_message(LoadProgress(stage, time.monotonic() - t0))

        with self._lock:
            _close_engine(self._engine)  # the routing profile of the model being replaced is saved
            self._engine = self._conversation = None
            try:
                engine = self.factory(model, self.options, progress)
                info = describe(engine, model)
            except BaseException as e:  # noqa: BLE001 - any failure is a notice; the app stays up
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                self.post_message(EngineFailed(describe_error(e)))
                return
            if self._app_exiting:  # the app quit while this loaded
                _close_engine(engine)
                return
            self._engine = engine
            self._tracker = StatsTracker()
            self._curve_rows = -1
            self._curve_trace = None
            self.post_message(EngineReady(info, time.monotonic() - t0))
            self._post_stats(engine)
        if info.cache is not None:  # workers start from the UI thread; call_later posts a message (thread-safe)
            self.call_later(self.update_hit_curve, Path(info.path) / BUNDLED_TRACE)

    # -- generation -----------------------------------------------------------------------------------
    def generate(self, history: list[dict], text: str, sampling: dict | None = None,
                 max_tokens: int | None = None, template_kwargs: dict | None = None) -> int:
        """Start a reply to `text` after `history` (system + earlier turns); returns its generation id.

        `template_kwargs` become chat template variables (``reasoning_effort="high"``).
        """
        self.stop()
        self._gen_id += 1
        self._cancel = threading.Event()
        self._generate(self._gen_id, [dict(m) for m in history], text, dict(sampling or {}), max_tokens,
                       dict(template_kwargs or {}), self._cancel)
        return self._gen_id

    def take_tokens(self) -> list[Tokens]:
        """Every queued chunk, oldest first, merged per generation. UI thread."""
        with self._outbox_lock:
            items, self._outbox, self._rung = self._outbox, [], False
        merged: list[Tokens] = []
        for item in items:
            if merged and merged[-1].gen_id == item.gen_id:
                last = merged[-1]
                merged[-1] = Tokens(item.gen_id, last.text + item.text, last.token_ids + item.token_ids,
                                    last.thinking + item.thinking)
            else:
                merged.append(item)
        return merged

    def _queue_tokens(self, gen_id: int, text: str, ids: tuple[int, ...], thinking: str = "") -> None:
        with self._outbox_lock:
            self._outbox.append(Tokens(gen_id, text, ids, thinking))
            ring, self._rung = not self._rung, True
        if ring:
            self.post_message(TokensArrived(gen_id))

    def stop(self) -> None:
        """Ask the running reply to stop; the engine sees it before its next token."""
        if self._cancel is not None:
            self._cancel.set()

    @work(thread=True, exclusive=True, group="engine-generate", exit_on_error=False)
    def _generate(self, gen_id: int, history: list[dict], text: str, sampling: dict, max_tokens: int | None,
                  template_kwargs: dict, cancel: threading.Event) -> None:
        with self._lock:
            engine = self._engine
            if engine is None:
                self.post_message(GenerationFailed(gen_id, "no model is loaded yet"))
                return
            if cancel.is_set():
                self.post_message(GenerationFinished(gen_id, "cancelled", 0, 0, 0.0, 0.0))
                return
            tracker = self._tracker
            last = None
            try:
                params = engine.sampling(**sampling)
                if self._conversation is None:
                    self._conversation = engine.conversation()
                conversation = self._conversation
                conversation.messages = history  # the UI's transcript is the truth; the KV prefix is reused
                tracker.start_generation()
                last_stats = 0.0
                for chunk in conversation.send(text, sampling=params, max_tokens=max_tokens, cancel=cancel,
                                               **template_kwargs):
                    last = chunk
                    if chunk.text or chunk.token_ids or chunk.thinking:
                        self._queue_tokens(gen_id, chunk.text, tuple(chunk.token_ids), chunk.thinking)
                    tracker.observe_chunk(chunk.prompt_tokens, chunk.generated_tokens, chunk.prefill_tokens_per_s,
                                          chunk.decode_tokens_per_s)
                    if chunk.finish_reason is None:
                        # The safe point: the generator is suspended between two tokens, on this thread.
                        self._apply_retune(engine, at_token=chunk.generated_tokens)
                        now = time.monotonic()
                        # and right after the prefill (the first token): this reply's decode hit rate counts from it
                        if now - last_stats >= STATS_INTERVAL_S or chunk.generated_tokens == 1:
                            tracker.sample_rate()
                            self._post_stats(engine)
                            last_stats = now
            except BaseException as e:  # noqa: BLE001 - shown as a notice; the partial reply is kept
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                self.post_message(GenerationFailed(gen_id, describe_error(e)))
                self._post_stats(engine)
                return
            tracker.sample_rate()
            self._post_stats(engine, last.cache if last is not None else None)
            self._tell_dropped(conversation, len(history))
            if last is not None:
                self.post_message(GenerationFinished(gen_id, last.finish_reason or "stop", last.prompt_tokens,
                                                     last.generated_tokens, last.prefill_tokens_per_s,
                                                     last.decode_tokens_per_s))
            else:
                self.post_message(GenerationFinished(gen_id, "stop", 0, 0, 0.0, 0.0))
        self.call_later(self.update_hit_curve)

    def _tell_dropped(self, conversation, history_len: int) -> None:
        """Once per change: the chat outgrew the context, so its oldest turns were left out of the prompt."""
        dropped = getattr(conversation, "dropped_turns", 0)
        if history_len == 0 or not dropped:
            self._dropped_told = 0
        if not dropped or dropped == self._dropped_told:
            return
        self._dropped_told = dropped
        turns = "turn was" if dropped == 1 else f"{dropped} turns were"
        self.app.call_from_thread(
            self.app.notify, f"This chat is longer than the model's context: its oldest {turns} left out of what "
            "the model sees (they stay in the chat). Start a new chat for a fresh context.",
            title="context full", severity="warning", timeout=8)

    # -- predicted hit rate ---------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="engine-curve", exit_on_error=False)
    def update_hit_curve(self, bundled: Path | None = None) -> None:
        """Post a `HitCurveReady`: LRU's curve on this session's routing, else on the model's bundled trace.

        The recorder is copied under the engine lock (between replies, or it waits for the reply to end);
        the stack-distance pass runs outside it, mostly in numpy sorts that release the GIL.
        """
        from moechat.engine.cache.mrc import lru_hit_curve
        from moechat.engine.cache.trace import RoutingTrace

        trace = None
        with self._lock:
            recorder = getattr(getattr(self._engine, "provider", None), "recorder", None)
            rows = len(recorder) if recorder is not None else 0
            if rows and rows != self._curve_rows:
                trace, source, self._curve_rows = recorder.to_trace(), "this session's routing", rows
        if trace is None and bundled is not None and bundled.is_file():
            try:
                trace, source = RoutingTrace.load(bundled), "the model's bundled routing trace"
            except (OSError, ValueError):
                return  # a damaged bundled trace only means no prediction until this session has routing
        if trace is None:
            return
        curve = lru_hit_curve(trace, source=source)
        self._curve_trace = (trace, source)
        if curve.requests:
            self.post_message(HitCurveReady(curve))

    @work(thread=True, exclusive=True, group="engine-predict", exit_on_error=False)
    def predict(self, policy: str, slots: int) -> None:
        """Post a `PolicyPredicted`: `policy` at `slots` slots replayed over the routing of the last hit curve."""
        from moechat.engine.cache.replay import replay_policy

        if self._curve_trace is None or slots < 1:
            return
        trace, source = self._curve_trace
        try:
            result = replay_policy(trace, policy, slots)
        except ValueError:  # a policy the engine does not know: the panel keeps LRU's curve
            return
        if result.requests:
            self.post_message(PolicyPredicted(result, source))

    # -- tuning ---------------------------------------------------------------------------------------
    def retune(self, *, expert_slots: int | None = None, policy: str | None = None,
               ram_cache_bytes: int | None = None, prefetch: str | None = None) -> None:
        """Queue a cache change (ram_cache_bytes=0: every expert in RAM); applied at the next safe point."""
        changes = {k: v for k, v in (("expert_slots", expert_slots), ("policy", policy),
                                     ("ram_cache_bytes", ram_cache_bytes), ("prefetch", prefetch)) if v is not None}
        if not changes:
            return
        with self._pending_lock:
            self._pending.update(changes)
        self._retune_when_idle()

    @work(thread=True, exclusive=True, group="engine-retune", exit_on_error=False)
    def _retune_when_idle(self) -> None:
        # Blocks while a reply is generating; by then that thread has applied the change and this is a no-op.
        with self._lock:
            if self._engine is not None:
                self._apply_retune(self._engine, at_token=None)

    def _apply_retune(self, engine, at_token: int | None) -> None:
        with self._pending_lock:
            changes, self._pending = self._pending, {}
        if not changes:
            return
        try:
            if changes.get("ram_cache_bytes") == 0:  # 0 = every expert in RAM
                state = cache_state(engine, engine.cache_snapshot())
                changes["ram_cache_bytes"] = (state.all_experts_bytes if state and state.all_experts_bytes
                                              else 1 << 62)
            snap = engine.retune_cache(**changes)
        except Exception as e:  # noqa: BLE001 - a bad value is a notice, generation goes on
            self.post_message(RetuneFailed(describe_error(e)))
            return
        self._tracker.observe_snapshot(snap)
        self.post_message(CacheRetuned(cache_state(engine, snap), at_token))
        self.post_message(StatsUpdated(self._tracker.stats()))

    def _post_stats(self, engine, snap=None) -> None:
        snap = snap if snap is not None else engine.cache_snapshot()
        if snap is not None:
            self._tracker.observe_snapshot(snap)
        self.post_message(StatsUpdated(self._tracker.stats()))
