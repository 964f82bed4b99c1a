"""A fake engine for the app's tests: scripted replies, deterministic routing, gated tokens.

`FakeEngine` has the methods the bridge uses (conversation, sampling, default_max_tokens,
cache_snapshot, retune_cache, template_reads, and the args/loaded attributes `describe` reads) and
returns the engine's real `CacheSnapshot`. A `Reply` may script thinking, streamed before its tokens.
With `gated=True` each token (and each piece of thinking) waits for `release()`, so a test can stop a
reply, or change the cache, between two known tokens.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from moechat.app.tui.app import make_app
from moechat.app.tui.bridge import LoadOptions
from moechat.app.tui.settings import Settings
from moechat.app.tui.store import ChatStore
from moechat.app.tui.sysmon import MemoryReading
from moechat.engine.cache.stats import CacheSnapshot
from moechat.engine.errors import ConfigError, MoechatError

GiB = 1 << 30


@dataclass(frozen=True)
class FakeChunk:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    cache: CacheSnapshot | None = None
    thinking: str = ""


@dataclass(frozen=True)
class FakeSampling:
    temperature: float = 0.7
    top_k: int = 20
    top_p: float = 0.8
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    do_sample: bool = True


@dataclass
class Reply:
    tokens: list[str]
    finish: str = "stop"
    fail_at: int | None = None  # raise MoechatError before this token
    error: str = "the KV cache is full: 4096 tokens; start a new chat or raise --context"
    thinking: list[str] = field(default_factory=list)  # pieces of thinking, each a chunk before the tokens


@dataclass
class SendCall:
    history: list[dict]
    text: str
    sampling: FakeSampling
    max_tokens: int | None
    cancel: threading.Event | None
    thread: int = 0
    template_kwargs: dict = field(default_factory=dict)


class FakeConversation:
    def __init__(self, engine: FakeEngine):
        self.engine = engine
        self.messages: list[dict] = []

    def send(self, text, *, sampling=None, max_tokens=None, cancel=None, **template_kwargs):
        e = self.engine
        e.sends.append(SendCall([dict(m) for m in self.messages], text, sampling, max_tokens, cancel,
                                threading.get_ident(), template_kwargs))
        reply = e.replies.pop(0) if e.replies else Reply(["Hello", " there", "!"])
        e.yielded = 0
        prompt = 5 + len(text.split())
        pieces = [("", t) for t in reply.thinking] + [(t, "") for t in reply.tokens]
        for i, (piece, thinking) in enumerate(pieces):
            if e.gate is not None and not e.gate.acquire(timeout=20):
                raise RuntimeError("test gate never released")
            if reply.fail_at == i:
                raise MoechatError(reply.error)
            e.route(i)
            last = i == len(pieces) - 1
            finish = reply.finish if last else ("cancelled" if cancel is not None and cancel.is_set() else None)
            e.yielded = i + 1
            yield FakeChunk(piece, (100 + i,), finish, prompt, i + 1, 500.0, 40.0 + i,
                            e.cache_snapshot() if finish else None, thinking)
            if finish:
                return


@dataclass
class FakeEngine:
    num_layers: int = 4
    num_experts: int = 16
    top_k: int = 2
    slots: int = 24
    policy: str = "lru"
    replies: list[Reply] = field(default_factory=list)
    gated: bool = False
    expert_bytes: int = 1 << 20
    template_variables: frozenset = frozenset()  # what template_reads() answers yes to

    def __post_init__(self):
        L, E = self.num_layers, self.num_experts
        # hidden 256 x expert width 128: the sizes the panel shows for each expert format (1 MiB a native expert)
        self.args = SimpleNamespace(num_hidden_layers=L, num_experts=E, top_k=self.top_k, model_type="fake_moe",
                                    hidden_size=256, moe_intermediate=128, expert_bias=False)
        self.loaded = SimpleNamespace(model_dir=Path("/models/fake-moe"), dtype="torch.float32", device="cpu",
                                      cls=None)
        self.provider = SimpleNamespace(store=SimpleNamespace(expert_bytes=self.expert_bytes))
        self.generation_config = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "do_sample": True}
        self.chat_template = object()
        self.gate = threading.Semaphore(0) if self.gated else None
        self.sends: list[SendCall] = []
        self.retunes: list[tuple[int, int, dict]] = []  # (tokens yielded, thread, changes)
        self.yielded = 0
        self.ram_budget = 0
        self.slot_map = np.full((L, E), -1, dtype=np.int32)
        self.frequency = np.zeros((L, E), dtype=np.int64)
        self.hits = [0] * L
        self.misses = [0] * L
        self.order: list[tuple[int, int]] = []  # LRU order of resident keys
        self.bytes_from_ram = 0

    # -- the engine's interface ---------------------------------------------------------------------
    def conversation(self, system=None):
        return FakeConversation(self)

    def sampling(self, **overrides):
        values = {**vars(FakeSampling()), **{k: v for k, v in overrides.items() if v is not None}}
        if values["temperature"] < 0:
            raise ConfigError("sampling override: temperature = -1.0 is invalid; temperature must be >= 0")
        return FakeSampling(**values)

    def default_max_tokens(self):
        return 64

    def template_reads(self, variable):
        return variable in self.template_variables

    def thinking_kwargs(self, on):  # as Engine.thinking_kwargs
        from moechat.engine.text.reasoning import thinking_switch

        name = thinking_switch(self.template_variables)
        return {} if on is None or name is None else {name: bool(on)}

    def cache_snapshot(self) -> CacheSnapshot:
        return CacheSnapshot(num_slots=self.slots, slots_used=len(self.order), policy=self.policy,
                             resident=self.slot_map >= 0, frequency=self.frequency.copy(),
                             slot_map=self.slot_map.copy(), hits=tuple(self.hits), misses=tuple(self.misses),
                             bytes_from_ram=self.bytes_from_ram, bytes_from_disk=0, load_seconds=0.0,
                             expert_loads_prefill=0, expert_loads_decode=sum(self.misses),
                             ram_cache_bytes=self.ram_budget, ram_cache_used_bytes=self.ram_budget // 2)

    def retune_cache(self, *, expert_slots=None, policy=None, ram_cache_bytes=None):
        self.retunes.append((self.yielded, threading.get_ident(),
                             {k: v for k, v in dict(expert_slots=expert_slots, policy=policy,
                                                    ram_cache_bytes=ram_cache_bytes).items() if v is not None}))
        if policy is not None:
            if policy not in ("lru", "lfu", "lfru", "lrfu", "lru2", "arc"):
                raise ValueError(f"unknown eviction policy {policy!r}")
            self.policy = policy
        if expert_slots is not None:
            self.slots = max(1, min(expert_slots, self.num_layers * self.num_experts))
            while len(self.order) > self.slots:
                self._evict()
        if ram_cache_bytes is not None:
            all_bytes = self.expert_bytes * self.num_layers * self.num_experts
            self.ram_budget = 0 if ram_cache_bytes >= all_bytes else ram_cache_bytes
        return self.cache_snapshot()

    # -- deterministic routing: a few hot experts per layer and a rotating tail ------------------------
    def _evict(self):
        layer, expert = self.order.pop(0)
        self.slot_map[layer, expert] = -1

    def route(self, step: int):
        for layer in range(self.num_layers):
            for expert in ((layer * 3) % self.num_experts, (step * 5 + layer) % self.num_experts):
                key = (layer, expert)
                self.frequency[layer, expert] += 1
                if self.slot_map[layer, expert] >= 0:
                    self.hits[layer] += 1
                    self.order.remove(key)
                else:
                    self.misses[layer] += 1
                    self.bytes_from_ram += self.expert_bytes
                    while len(self.order) >= self.slots:
                        self._evict()
                    self.slot_map[layer, expert] = len(self.order)
                self.order.append(key)

    def release(self, n: int = 1):
        for _ in range(n):
            self.gate.release()


class FixedMemory:
    """A memory probe with constant numbers, so screenshots do not change from run to run."""

    def read(self) -> MemoryReading:
        return MemoryReading(32 * GiB, 12 * GiB, 20 * GiB, 3 * GiB // 2, (), "no NVIDIA driver")


def fake_factory(engine: FakeEngine | Exception) -> Callable:
    def factory(model, options, progress):
        progress("loading the fake model")
        if isinstance(engine, Exception):
            raise engine
        return engine

    return factory


@pytest.fixture
def anyio_backend():
    return "asyncio"  # Textual runs on asyncio


@pytest.fixture
def app_env(tmp_path, monkeypatch):
    """XDG dirs in tmp_path, so no test reads or writes the user's settings and chats."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    return tmp_path


@pytest.fixture
def build_app(app_env):
    """build_app(engine, **make_app kwargs) -> (app, store) with settings and chats under tmp_path."""

    def build(engine, model="/models/fake-moe", **kwargs):
        store = kwargs.pop("store", None) or ChatStore(app_env / "chats.sqlite3")
        settings = kwargs.pop("settings", None) or Settings(path=app_env / "settings.toml")
        app = make_app(model, engine_factory=fake_factory(engine), options=LoadOptions(), settings=settings,
                       store=store, memory_probe=FixedMemory(), export_dir=app_env / "exports", **kwargs)
        return app, store

    return build


async def wait_for(pilot, predicate, timeout: float = 10.0, what: str = "condition"):
    """Let the app run until predicate() is true."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


@pytest.fixture
def fakes():
    """The fakes for a test module to use (conftest is not importable by name under --import-mode=importlib)."""
    return SimpleNamespace(Engine=FakeEngine, Reply=Reply, wait_for=wait_for, Memory=FixedMemory, Chunk=FakeChunk)
