"""Every message the bridge's workers post to the UI, as dataclasses, and the values they carry.

Posted from worker threads with `post_message` (thread-safe), handled on the UI thread. Tokens are
never merged away or dropped: `TokensArrived` says "tokens are waiting", and the UI takes every
waiting token from the bridge (`EngineBridge.take_tokens`) when it next draws; while one is
outstanding the worker only queues (so 300 tok/s cost ~10 UI wake-ups a second, not 300). Stats
messages replace a pending one of the same kind (`can_replace`), so a slow frame never builds a
backlog of stale numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from textual.message import Message

from .livestats import DashboardStats
from .sysmon import MemoryReading

if TYPE_CHECKING:  # the engine is imported by the load worker, never at start-up
    from moechat.engine.cache.mrc import HitCurve


@dataclass(frozen=True)
class CacheState:
    """The effective expert-cache configuration, as the engine reports it after (re)tuning."""

    slots: int
    max_slots: int  # every expert of every MoE layer
    policy: str
    ram_budget_bytes: int  # 0: every expert in RAM
    ram_used_bytes: int
    all_experts_bytes: int | None = None  # the size of every expert: the RAM tier's "all in RAM" point
    prefetch: str = "off"  # cross-layer prefetch mode (engine/cache/prefetch.py PREFETCH_MODES)
    prefetch_depth: int = 0
    # "ram": a CPU computing misses in place; the slot count changes nothing there, the RAM tier's size does
    fast_tier: str = "slots"
    expert_bytes: int = 0  # one expert in the format the tiers hold
    ram_tier_experts: int = 0  # experts the RAM tier holds at most now


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: str
    model_type: str
    dtype: str
    device: str
    num_layers: int
    num_experts: int
    top_k: int
    sampling_defaults: dict = field(default_factory=dict)  # from generation_config.json (+ transformers')
    generation_config: dict = field(default_factory=dict)  # the file itself: which defaults it sets
    default_max_tokens: int = 512
    has_chat_template: bool = True
    reads_reasoning_effort: bool = False  # the chat template reads `reasoning_effort` (gpt-oss)
    thinking_switch: bool = False  # the chat template turns thinking on/off (enable_thinking: Qwen, GLM, Gemma 4)
    cache: CacheState | None = None  # None: every expert resident (no cache)
    expert_format: str = "native"  # the --expert-format the experts are held in: native, int8 or int4
    native_format: str = ""  # how the checkpoint ships them, as the engine names it: dense, mxfp4, fp8
    format_bytes: dict = field(default_factory=dict)  # every expert's bytes in each format it can run in
    repacked: frozenset = frozenset()  # converted formats whose repacked file is already written (reused)


# -- loading ---------------------------------------------------------------------------------------------
@dataclass
class LoadProgress(Message):
    stage: str
    elapsed: float


@dataclass
class EngineReady(Message):
    info: ModelInfo
    seconds: float


@dataclass
class EngineFailed(Message):
    error: str


# -- generation ------------------------------------------------------------------------------------------
@dataclass
class TokensArrived(Message):
    """Tokens of generation `gen_id` are queued in the bridge; take them with `take_tokens()`."""

    gen_id: int


@dataclass
class GenerationFinished(Message):
    gen_id: int
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    generated_tokens: int
    prefill_tps: float
    decode_tps: float


@dataclass
class GenerationFailed(Message):
    gen_id: int
    error: str


# -- stats and tuning ------------------------------------------------------------------------------------
@dataclass
class StatsUpdated(Message):
    stats: DashboardStats

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, StatsUpdated)


@dataclass
class MemorySampled(Message):
    reading: MemoryReading

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, MemorySampled)


@dataclass
class HitCurveReady(Message):
    """LRU's predicted hit rate at every slot count, from the routing seen so far (engine/cache/mrc.py)."""

    curve: HitCurve  # frozen, its array read-only

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, HitCurveReady)


@dataclass
class PolicyPredicted(Message):
    """The chosen policy's predicted hit rate at one slot count (engine/cache/replay.py), replayed off the UI thread."""

    result: object  # engine.cache.replay.PolicyReplay
    source: str  # where the routing came from

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, PolicyPredicted)


@dataclass
class CacheRetuned(Message):
    state: CacheState
    at_token: int | None  # tokens generated in the running reply when it applied; None when idle


@dataclass
class RetuneFailed(Message):
    error: str


# -- the setup wizard (screens/setup/) -------------------------------------------------------------------
# The values are the engine's frozen dataclasses (Hardware, CatalogStatus, SearchHit, FitVerdict, DownloadPlan,
# DownloadProgress), typed loosely so that importing this module does not import the engine.
@dataclass
class HardwareProbed(Message):
    hardware: object  # engine.hardware.Hardware


@dataclass
class CatalogRowChecked(Message):
    """One row's live state: commit, size, gating and its verdict on this machine (config.json only)."""

    listing_id: int  # which fill of the table it belongs to (a newer search makes it stale)
    status: object  # engine.hub.CatalogStatus
    offline: str | None = None  # why the Hub was not asked (HF_HUB_OFFLINE, unreachable): the row is an estimate
    quants: tuple = ()  # a GGUF repo without safetensors: its quants (engine.plan.hub.GGUFQuant), smallest first


@dataclass
class SearchFinished(Message):
    listing_id: int
    query: str
    hits: list  # [engine.hub.SearchHit]


@dataclass
class PlanReady(Message):
    """The chosen model's exact verdict (safetensors headers) and what its download would do."""

    repo_id: str
    verdict: object  # engine.hub.FitVerdict
    download: object | None  # engine.hub.DownloadPlan; None when it is downloaded and the Hub is not needed
    local: str | None  # the complete snapshot already in the cache


@dataclass
class QuantsChecked(Message):
    """A GGUF repo's quants for the wizard, each with its verdict once its header is read; `done` after the last."""

    repo_id: str
    quants: tuple  # engine.plan.hub.gguf.QuantFit, smallest first
    done: bool


@dataclass
class DownloadProgressed(Message):
    progress: object  # engine.hub.DownloadProgress

    def can_replace(self, message: Message) -> bool:
        # a byte count replaces an older byte count; the plan and notes (resume, retry) are never dropped
        return (isinstance(message, DownloadProgressed) and message.progress.note is None
                and message.progress.plan is None)


@dataclass
class DownloadFinished(Message):
    repo_id: str
    path: str


@dataclass
class SetupFailed(Message):
    """A wizard step failed: `what` is "hardware", "search", "plan" or "download"; `error` the engine's message."""

    what: str
    repo_id: str | None
    title: str
    error: str
    cancelled: bool = False
