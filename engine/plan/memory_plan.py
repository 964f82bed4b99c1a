"""What `make_plan` takes and returns: `Preferences` in; a frozen `MemoryPlan` out, each `Decision` with its
one-line reason in numbers, and a `Refusal` (raised as `PlanRefusedError` by `check()`) naming the shortfall and the
cheapest fix when nothing fits. Also the plan's stated assumptions (docs/plan.md explains each).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MoechatError
from ..units import GiB, MiB
from .rates import DecodeEstimate, MissPlacement, MissRatioCurve

ON_MISS_MODES = ("load", "host", "auto")  # engine/cache/hybrid.py ON_MISS (a test keeps them equal)
REPACK_DIR_HINT = "$XDG_CACHE_HOME/moechat/repacked"  # engine/cache/repacked.py default_repack_dir
MIN_CONTEXT = 512  # below this a chat is not worth planning for
CONTEXT_STEP = 256  # a lowered context is a multiple of this
PREFILL_CHUNK = 512
# engine/layers/kv_cache.py allocates a sliding-window layer a ring of `window` positions (the others the whole
# context), so the plan counts that by default.
KV_WINDOWED_ALLOCATION = True

# Stated assumptions of the plan (docs/plan.md explains each).
CUDA_CONTEXT_BYTES = 512 * MiB  # CUDA context + cuBLAS workspace + allocator slack on the GPU
PROCESS_RAM_GPU = int(1.5 * GiB)  # Python + torch + CUDA runtime host memory, when computing on a GPU
PROCESS_RAM_CPU = 1 * GiB  # Python + torch, CPU only


class PlanRefusedError(MoechatError):
    """The model does not fit this machine; `refusal` has the numbers and the fixes."""

    def __init__(self, refusal: Refusal):
        super().__init__(refusal.message)
        self.refusal = refusal


# -- preferences, decisions, plan ------------------------------------------------------------------------

@dataclass(frozen=True)
class Preferences:
    context: int | None = None  # tokens; None: DEFAULT_CONTEXT capped at the model's, lowered if needed
    prefer: str = "speed"  # "speed": spare device memory -> expert slots; "context": -> KV cache
    margin: float = 0.05  # fraction of each memory total left free
    device: str | None = None  # "cpu", "cuda", "cuda:N"; None: the GPU with most free memory, else the CPU
    hit_curve: MissRatioCurve | None = None
    disk_read_gbps: float | None = None
    host_read_gbps: float | None = None  # the CPU's read rate over packed experts (None: ASSUMED_RAM_GBPS)
    host_read_source: str = ""  # where host_read_gbps comes from, for the plan's lines ("measured on this machine")
    # measured seconds per layer on the CPU beyond the reads (engine/plan/calibration.py)
    cpu_layer_s: float | None = None
    override: bool = False  # load anyway: a refused plan is still made, best effort, and check() passes
    # True: sliding-window layers are allocated `window` tokens, the ring engine/layers/kv_cache.py allocates;
    # False: every layer the whole context (the plan then names the saving the ring brings)
    windowed_kv: bool = KV_WINDOWED_ALLOCATION
    prefill_chunk: int | None = None  # None: what the engine picks (planner.prefill_chunk_for)
    repacked: frozenset[str] = frozenset()  # converted formats whose repacked file is already written (reused)
    # where misses run (`moechat run --on-miss`, default auto): the mode `decode` predicts; the others are in
    # `MemoryPlan.placements`
    on_miss: str = "auto"
    # where the input embedding table lives on a GPU (`--embeddings`): "host" gathers each token's row in RAM and
    # copies it in (a few KB a token) so its VRAM becomes slots; "auto": host when that buys slots (`moechat fit`)
    embeddings: str = "device"


@dataclass(frozen=True)
class Decision:
    item: str
    bytes: int | None
    where: str
    reason: str


@dataclass(frozen=True)
class Refusal:
    resource: str  # "VRAM" | "RAM" | "disk"
    need_bytes: int
    have_bytes: int
    fixes: tuple[str, ...]  # cheapest first
    detail: str = ""
    also: tuple[str, ...] = ()  # further shortfalls

    @property
    def short_bytes(self) -> int:
        return max(0, self.need_bytes - self.have_bytes)

    @property
    def message(self) -> str:
        text = (f"short by {self.short_bytes / GiB:.1f} GiB of {self.resource}"
                + (f" ({self.detail})" if self.detail else "") + ": " + self.fixes[0])
        if len(self.fixes) > 1:
            text += "; or " + "; or ".join(self.fixes[1:])
        if self.also:
            text += "; also " + "; ".join(self.also)
        return text


@dataclass(frozen=True)
class MemoryPlan:
    model: str
    device: str  # "cuda:0" | "cpu"
    device_name: str
    context: int
    expert_slots: int  # C
    total_experts: int
    expert_bytes: int
    host_tier: str  # "none" | "all experts in RAM" | "RAM cache" | "disk only"
    ram_cache_bytes: int | None  # what `moechat run --ram-cache-mb` gets: None = every expert in RAM
    dense_bytes: int
    kv_bytes: int
    workspace_bytes: int
    device_budget_bytes: int
    device_used_bytes: int
    ram_budget_bytes: int
    ram_used_bytes: int
    disk_free_bytes: int | None
    disk_needed_bytes: int
    decisions: tuple[Decision, ...]
    decode: DecodeEstimate | None
    refusal: Refusal | None = None
    overridden: bool = False
    estimated: bool = False
    notes: tuple[str, ...] = ()
    placements: tuple[MissPlacement, ...] = ()  # decode per --on-miss mode (a GPU with misses from RAM)
    embeddings: str = "device"  # where the input embedding table lives ("host": RAM, one row copied in a token)

    @property
    def best_placement(self) -> MissPlacement | None:
        """The --on-miss mode predicted fastest (auto when it ties the better of load and host)."""
        if not self.placements:
            return None
        return max(self.placements, key=lambda p: (round(p.low, 6), p.mode == "auto"))

    @property
    def ok(self) -> bool:
        return self.refusal is None

    @property
    def resident(self) -> bool:
        """Every expert on the compute device: no cache needed (moechat run's resident path)."""
        return self.expert_slots >= self.total_experts

    @property
    def needs_cache(self) -> bool:
        return not self.resident

    @property
    def experts_in_ram(self) -> int:
        if self.device == "cpu":
            return self.expert_slots
        if self.ram_cache_bytes is None:
            return self.total_experts
        return self.ram_cache_bytes // self.expert_bytes if self.expert_bytes else 0

    def check(self) -> MemoryPlan:
        """This plan, or PlanRefusedError when it was refused and not overridden."""
        if self.refusal is not None and not self.overridden:
            raise PlanRefusedError(self.refusal)
        return self

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("decisions", "decode", "refusal")}
        out["fits"] = self.ok
        out["resident"] = self.resident
        out["decisions"] = [{"item": d.item, "bytes": d.bytes, "where": d.where, "reason": d.reason}
                            for d in self.decisions]
        out["decode"] = None if self.decode is None else self.decode.to_json()
        out["placements"] = [p.to_json() for p in self.placements]
        out["best_on_miss"] = None if self.best_placement is None else self.best_placement.mode
        out["refusal"] = None if self.refusal is None else {
            "resource": self.refusal.resource, "short_bytes": self.refusal.short_bytes,
            "need_bytes": self.refusal.need_bytes, "have_bytes": self.refusal.have_bytes,
            "fixes": list(self.refusal.fixes), "also": list(self.refusal.also), "message": self.refusal.message}
        out["notes"] = list(self.notes)
        return out

