"""`moechat chat --remote URL`: the chat app with any OpenAI-compatible server behind it.

    engine = RemoteEngine.connect("http://gpu-box:8000", model=None, api_key=None)   # GET /v1/models
    make_app(engine.label, engine_factory=lambda *_: engine)                         # the usual app

`RemoteEngine` has the methods the bridge calls on a local engine (conversation, sampling,
default_max_tokens, cache_snapshot, retune_cache, template_reads, close), so the app, the store and
the bridge's threading are the same code for both. A reply is one streamed `POST /v1/chat/completions`
(SSE read with httpx-sse); Stop closes the connection, which a moechat server turns into a cancel before
its next token. Works with moechat serve, vLLM, SGLang, llama-server: only OpenAI's fields are required.

The cache panel: a moechat server says so in `/v1/models` (a `moechat` object: layers, experts,
context, sampling defaults) and exports its cache in `/metrics`; `cache_snapshot` rebuilds a
`CacheSnapshot` from those series (at most every METRICS_INTERVAL_S), so hit rates per layer, bytes
moved, prefetch and slots show as they would locally. Per-expert residency is not exported, so the
heatmap's cells stay empty (its per-layer hit rates are real). Any other server has no such metrics:
the panel shows tok/s only, and `panel_note` says so. Tuning is done where the model runs: the server has no
API to retune, so the app hides its knobs and shows `tuning_note` in their place.

No torch: nothing here loads a model.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field, fields
from types import SimpleNamespace
from urllib.parse import urlsplit

from moechat.engine.errors import MoechatError  # pure Python

METRICS_INTERVAL_S = 0.5
_TIMEOUT_S = 30.0  # connect and each read; a reply's stream has no total limit


@dataclass(frozen=True)
class RemoteChunk:
    """GenerationChunk's fields (engine/runtime/generate.py), without importing torch."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    cache: object = None
    thinking: str = ""


@dataclass(frozen=True)
class RemoteSampling:
    """What the sampling dialog shows (the server's defaults, when it says them) and what is sent: `overrides`
    only, so the server keeps its own defaults for the rest."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    do_sample: bool = True
    overrides: dict = field(default_factory=dict, compare=False, repr=False)


def api_base(url: str) -> str:
    """The /v1 base of a server given as http://host:port, http://host:port/ or http://host:port/v1."""
    url = url.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise MoechatError(f"--remote {url!r}: expected a URL like http://127.0.0.1:8000 (the server's address)")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        path += "/v1"
    return f"{parts.scheme}://{parts.netloc}{path}"


def _error_message(response) -> str:
    try:
        body = response.json()
        message = body["error"]["message"] if isinstance(body.get("error"), dict) else body.get("error")
    except Exception:  # noqa: BLE001 - any body: its first line
        message = (response.text or "").strip().splitlines()[0][:200] if response.text else ""
    return f"HTTP {response.status_code}" + (f": {message}" if message else "")


class RemoteEngine:
    def __init__(self, base_url: str, model: str, info: dict | None, api_key: str | None = None, client=None):
        import httpx

        self.base_url = base_url
        self.server = base_url.removesuffix("/v1")
        self.model = model
        self.info = info or {}
        self.is_moechat = info is not None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = client or httpx.Client(headers=headers, timeout=httpx.Timeout(_TIMEOUT_S))
        i = self.info
        self.args = SimpleNamespace(num_hidden_layers=int(i.get("num_layers", 0)),
                                    num_experts=int(i.get("num_experts", 0)), top_k=int(i.get("top_k", 0)),
                                    model_type=i.get("model_type") or "remote")
        # shown as the model's name and path (a URL is neither a directory nor a Hub repo id)
        self.loaded = SimpleNamespace(model_dir=f"{base_url}/{model}", dtype=i.get("dtype", "remote"),
                                      device=f"{urlsplit(base_url).netloc}" + (f" {i['device']}" if "device" in i
                                                                               else ""), cls=None)
        self.provider = None
        self.generation_config = dict(i.get("generation_config") or {})
        self.chat_template = object() if i.get("has_chat_template", True) else None
        self._snapshot = None
        self._snapshot_at = 0.0
        self._snapshot_lock = threading.Lock()

    @classmethod
    def connect(cls, url: str, model: str | None = None, api_key: str | None = None) -> RemoteEngine:
        """Ask the server which models it serves; one line naming what to fix when it cannot be used."""
        import httpx

        base = api_base(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        client = httpx.Client(headers=headers, timeout=httpx.Timeout(_TIMEOUT_S))
        try:
            r = client.get(base + "/models")
        except httpx.HTTPError as e:
            client.close()
            raise MoechatError(f"cannot reach {base}: {e}; is the server running (moechat serve)?") from None
        if r.status_code != 200:
            client.close()
            hint = " (pass --api-key)" if r.status_code == 401 else ""
            raise MoechatError(f"{base}/models: {_error_message(r)}{hint}")
        try:
            served = [m for m in r.json()["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except (ValueError, KeyError, TypeError):
            client.close()
            raise MoechatError(f"{base}/models: not an OpenAI-compatible model list") from None
        names = [m["id"] for m in served]
        if model is None:
            if not served:
                client.close()
                raise MoechatError(f"{base} serves no model")
            entry = served[0]
        elif model in names:
            entry = served[names.index(model)]
        else:
            client.close()
            raise MoechatError(f"{base} does not serve {model!r}; it serves: {', '.join(names) or 'nothing'}")
        info = entry.get("moechat") if isinstance(entry.get("moechat"), dict) else None
        return cls(base, entry["id"], info, api_key, client)

    @property
    def label(self) -> str:
        return f"{self.base_url}/{self.model}"

    @property
    def panel_note(self) -> str:
        if self.is_moechat:
            return (f"Remote moechat server {self.server}: the panel shows its /metrics (hit rates per layer, bytes "
                    "moved, prefetch, slots); per-expert residency is not exported, and the cache is tuned where it "
                    "runs (moechat serve flags).")
        return (f"Remote server {self.server} is not a moechat server: no expert-cache metrics, so the panel shows "
                "tok/s only.")

    @property
    def tuning_note(self) -> str:
        """In place of the panel's knobs: why they cannot act from here (one line)."""
        if self.is_moechat:
            return "Tuned on the server: restart moechat serve with --expert-slots, --policy or --ram-cache-mb."
        return "No knobs: this server is not moechat serve, so moechat cannot see or tune its expert cache."

    # -- the engine's interface -----------------------------------------------------------------------------
    def conversation(self, system: str | None = None) -> RemoteConversation:
        return RemoteConversation(self, system)

    def sampling(self, **overrides) -> RemoteSampling:
        defaults = self.info.get("sampling_defaults") or {}
        names = [f.name for f in fields(RemoteSampling) if f.name != "overrides"]
        given = {k: v for k, v in overrides.items() if v is not None and k in names}
        for name, value in given.items():
            if name in ("temperature", "top_p", "min_p", "repetition_penalty") and (
                    not isinstance(value, (int, float)) or value < 0):
                raise MoechatError(f"sampling override: {name} = {value} is invalid; it must be >= 0")
        values = {k: defaults.get(k) for k in names if k in defaults}
        return RemoteSampling(**{**values, **given}, overrides=given)

    def default_max_tokens(self) -> int:
        return int(self.info.get("default_max_tokens") or 512)

    def template_reads(self, variable: str) -> bool:
        return bool(self.info.get(f"reads_{variable}", False))

    def thinking_kwargs(self, on: bool | None) -> dict:
        """As Engine.thinking_kwargs; the server maps enable_thinking to its template's own switch."""
        return {} if on is None or not self.info.get("thinking_switch") else {"enable_thinking": bool(on)}

    def retune_cache(self, **changes):
        raise MoechatError("the expert cache of a remote server is tuned where it runs: restart moechat serve with "
                           "other --expert-slots / --policy / --ram-cache-mb")

    def close(self) -> None:
        self.client.close()

    def cache_snapshot(self, fresh: bool = False):
        """The server's cache from its /metrics (None: not a moechat server, or every expert resident), scraped at
        most every METRICS_INTERVAL_S unless `fresh`. Never raises: a failed scrape keeps the last snapshot."""
        if not self.is_moechat:
            return None
        with self._snapshot_lock:
            now = time.monotonic()
            if not fresh and now - self._snapshot_at < METRICS_INTERVAL_S:
                return self._snapshot
            self._snapshot_at = now
            try:
                r = self.client.get(self.server + "/metrics")
                if r.status_code == 200:
                    self._snapshot = snapshot_from_metrics(r.text)
            except Exception:  # noqa: BLE001 - the panel keeps its last numbers
                pass
            return self._snapshot


def snapshot_from_metrics(text: str):
    """A CacheSnapshot from moechat serve's /metrics (app/serve/metrics.py names); None without a cache."""
    import numpy as np
    from prometheus_client.parser import text_string_to_metric_families

    from moechat.engine.cache.stats import CacheSnapshot

    layered: dict[str, dict[int, float]] = {}
    single: dict[str, float] = {}
    labelled: dict[str, dict[str, float]] = {}
    config: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "layer" in s.labels:
                layered.setdefault(s.name, {})[int(s.labels["layer"])] = s.value
            elif s.name == "moechat_expert_cache_config":
                config = dict(s.labels)
            elif s.labels:
                labelled.setdefault(s.name, {}).update({v: s.value for v in s.labels.values()})
            else:
                single[s.name] = s.value
    if not single.get("moechat_expert_cache_enabled"):
        return None
    hits = layered.get("moechat_expert_cache_hits_total", {})
    L = max(hits, default=-1) + 1
    E = int(single.get("moechat_experts_per_layer", 0))

    def per_layer(name: str) -> tuple[int, ...]:
        values = layered.get(name, {})
        return tuple(int(values.get(i, 0)) for i in range(L)) if values else ()

    moved = labelled.get("moechat_expert_bytes_moved_total", {})
    loads = labelled.get("moechat_expert_loads_total", {})
    empty = np.zeros((L, E), dtype=bool)
    return CacheSnapshot(
        num_slots=int(single.get("moechat_expert_slots", 0)),
        slots_used=int(single.get("moechat_expert_slots_used", 0)),
        policy=config.get("policy", "?"), resident=empty, frequency=np.zeros((L, E), dtype=np.int64),
        slot_map=np.full((L, E), -1, dtype=np.int32), hits=per_layer("moechat_expert_cache_hits_total"),
        misses=per_layer("moechat_expert_cache_misses_total"), bytes_from_ram=int(moved.get("ram", 0)),
        bytes_from_disk=int(moved.get("disk", 0)), load_seconds=0.0,
        expert_loads_prefill=int(loads.get("prefill", 0)), expert_loads_decode=int(loads.get("decode", 0)),
        ram_cache_bytes=int(single.get("moechat_ram_tier_budget_bytes", 0)),
        ram_cache_used_bytes=int(single.get("moechat_ram_tier_used_bytes", 0)),
        prefetch=config.get("prefetch", "off"), prefetch_depth=int(config.get("prefetch_depth") or 0),
        stall_seconds=float(single.get("moechat_expert_stall_seconds_total", 0.0)),
        prefetch_issued=per_layer("moechat_prefetch_issued_total"),
        prefetch_used=per_layer("moechat_prefetch_used_total"),
        prefetch_late=per_layer("moechat_prefetch_late_total"),
        prefetch_wasted=per_layer("moechat_prefetch_wasted_total"),
        on_miss=config.get("on_miss", "load"), host_computed=per_layer("moechat_expert_host_computed_total"))


class RemoteConversation:
    def __init__(self, engine: RemoteEngine, system: str | None = None):
        self.engine = engine
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []

    def _body(self, sampling: RemoteSampling | None, max_tokens: int | None, template_kwargs: dict) -> dict:
        messages = []
        for m in self.messages:
            out = {"role": m["role"], "content": m["content"]}
            if m.get("thinking"):
                out["reasoning_content"] = m["thinking"]
            messages.append(out)
        body = {"model": self.engine.model, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}}
        over = dict(sampling.overrides) if sampling is not None else {}
        for name in ("temperature", "top_p", "seed"):
            if name in over:
                body[name] = over.pop(name)
        if not over.pop("do_sample", True):
            body["temperature"] = 0
        if self.engine.is_moechat:  # extensions moechat serve (and vLLM) take; plain OpenAI servers refuse them
            body.update(over)
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if template_kwargs.get("reasoning_effort"):
            body["reasoning_effort"] = template_kwargs["reasoning_effort"]
        if "enable_thinking" in template_kwargs:  # as vLLM, SGLang and llama-server take it
            body["chat_template_kwargs"] = {"enable_thinking": template_kwargs["enable_thinking"]}
        return body

    def send(self, content: str, *, sampling=None, max_tokens: int | None = None,
             cancel: threading.Event | None = None, **template_kwargs):
        """Stream a reply to `content` after `messages`; records it in `messages` (stopped replies too)."""
        import httpx
        from httpx_sse import EventSource

        self.messages.append({"role": "user", "content": content})
        body = self._body(sampling, max_tokens, template_kwargs)
        reply, thinking = [], []
        prompt_tokens = generated = 0
        t0 = time.perf_counter()
        t_first = t_last = None
        finish = None
        url = self.engine.base_url + "/chat/completions"
        try:
            with self.engine.client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise MoechatError(f"{self.engine.server}: {_error_message(r)}")
                for event in EventSource(r).iter_sse():
                    if cancel is not None and cancel.is_set():
                        finish = "cancelled"  # leaving the block closes the connection: the server stops
                        break
                    if event.data == "[DONE]":
                        break
                    try:
                        data = json.loads(event.data)
                    except ValueError:
                        continue  # not a chunk (a comment or a keep-alive)
                    if isinstance(data.get("error"), dict):
                        raise MoechatError(f"{self.engine.server}: {data['error'].get('message')}")
                    usage = data.get("usage")
                    if isinstance(usage, dict):
                        prompt_tokens = int(usage.get("prompt_tokens") or prompt_tokens)
                        generated = int(usage.get("completion_tokens") or generated)
                    for choice in data.get("choices") or ():
                        delta = choice.get("delta") or {}
                        text = delta.get("content") or ""
                        think = delta.get("reasoning_content") or delta.get("reasoning") or ""
                        finish = choice.get("finish_reason") or finish
                        if not (text or think):
                            continue
                        now = time.perf_counter()
                        t_first = t_first or now
                        t_last = now
                        generated += 1
                        reply.append(text)
                        thinking.append(think)
                        yield RemoteChunk(text, (), None, prompt_tokens, generated,
                                          *self._rates(prompt_tokens, generated, t0, t_first, t_last), thinking=think)
        except httpx.HTTPError as e:
            self._record(reply, thinking, started=bool(reply or thinking))
            raise MoechatError(f"{self.engine.server}: connection lost ({e})") from None
        except MoechatError:
            self._record(reply, thinking, started=bool(reply or thinking))
            raise
        except GeneratorExit:
            self._record(reply, thinking, started=True)
            raise
        self._record(reply, thinking, started=True)
        yield RemoteChunk("", (), finish or "stop", prompt_tokens, generated,
                          *self._rates(prompt_tokens, generated, t0, t_first, t_last),
                          cache=self.engine.cache_snapshot(fresh=True))  # the reply's own routing included

    @staticmethod
    def _rates(prompt_tokens: int, generated: int, t0: float, t_first, t_last) -> tuple[float, float]:
        prefill = prompt_tokens / (t_first - t0) if prompt_tokens and t_first else 0.0
        decode = (generated - 1) / (t_last - t_first) if generated > 1 and t_last and t_last > t_first else 0.0
        return prefill, decode

    def _record(self, reply: list[str], thinking: list[str], started: bool) -> None:
        if not started:
            self.messages.pop()
            return
        message = {"role": "assistant", "content": "".join(reply)}
        if any(thinking):
            message["thinking"] = "".join(thinking)
        self.messages.append(message)


def add_remote_args(chat) -> None:
    """`moechat chat --remote URL [--model NAME] [--api-key KEY]` on the chat parser (app/tui/launch.py's)."""
    remote = chat.add_argument_group("remote server", "chat with a model served elsewhere: moechat serve, vLLM, "
                                     "SGLang, llama-server or any OpenAI-compatible server")
    remote.add_argument("--remote", metavar="URL", help="the server's address, e.g. http://gpu-box:8000 (no local "
                        "model is loaded)")
    remote.add_argument("--model", dest="remote_model", metavar="NAME", help="with --remote: the served model to "
                        "chat with (default: the first the server lists)")
    remote.add_argument("--api-key", metavar="KEY", help="with --remote: sent as 'Authorization: Bearer KEY' "
                        "(default: $MOECHAT_API_KEY)")
    local = chat.get_default("handler")

    def handler(args) -> int:
        if args.remote is not None:
            return run_remote_chat(args)
        if args.remote_model is not None or args.api_key is not None:
            raise MoechatError("--model and --api-key name a served model: use them with --remote URL")
        return local(args)

    chat.set_defaults(handler=handler)


def run_remote_chat(args) -> int:
    """`moechat chat --remote URL [--model NAME] [--api-key KEY]`."""
    import os

    from .app import make_app
    from .bridge import LoadOptions
    from .launch import thinking_arg

    if args.model is not None:
        raise MoechatError(f"MODEL ({args.model}) and --remote exclude each other: the model runs on the server "
                           "(pick one of its models with --model NAME)")
    key = args.api_key if args.api_key is not None else os.environ.get("MOECHAT_API_KEY") or None
    engine = RemoteEngine.connect(args.remote, args.remote_model, key)
    app = make_app(engine.label, engine_factory=lambda model, options, progress: engine,
                   options=LoadOptions(resident=True), reasoning_effort=args.reasoning_effort,
                   thinking=thinking_arg(args))
    app.startup_notices.append(engine.panel_note)
    app.tuning_note = engine.tuning_note  # the knobs hidden: the server has no API to retune its cache
    app.run()
    return app.return_code or 0
