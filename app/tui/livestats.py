"""What the live panel shows, computed from the engine's snapshots off the UI thread.

`StatsTracker` is fed by the bridge's worker, between tokens: the tok/s of each chunk, and every
~0.25 s a `CacheSnapshot` (a copy of [L, E] arrays: 60 x 256 is 15k numbers, tens of microseconds). It
turns two consecutive snapshots into rates the snapshot itself cannot give: bytes moved per token by
tier, and *recent use* per expert, the requests of the last tokens with a half-life of
RECENT_HALF_LIFE_TOKENS (time counted in tokens, so the heatmap holds still while the model is idle).
Its output, `DashboardStats`, is frozen: the UI only draws it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where used: 0.1-0.15 s the first frame does not need
    import numpy as np

RECENT_HALF_LIFE_TOKENS = 8.0
SPARK_POINTS = 60  # decode tok/s samples kept for the sparkline


@dataclass(frozen=True)
class DashboardStats:
    prefill_tps: float | None = None
    decode_tps: float | None = None
    decode_history: tuple[float, ...] = ()
    prompt_tokens: int = 0
    generated_tokens: int = 0
    # cache (None / empty when every expert is resident and there is no cache)
    hit_rate: float | None = None  # since load (the session)
    # this reply's decode (or the last reply's), read beside the session's: after a retune the session's hides what
    # the cache does now; counted from the first token, so the prompt's prefill (a burst of first uses) is left out
    turn_hit_rate: float | None = None
    turn_hits: int = 0
    turn_misses: int = 0
    layer_hit_rates: tuple[float, ...] = ()  # NaN: no request yet (or a dense layer)
    hits: int = 0
    misses: int = 0
    bytes_per_token_ram: float | None = None  # RAM -> slots, last window
    bytes_per_token_disk: float | None = None  # disk -> RAM/slots, last window
    bytes_from_ram: int = 0  # since load
    bytes_from_disk: int = 0
    num_slots: int = 0
    slots_used: int = 0
    policy: str = ""
    ram_cache_bytes: int = 0  # 0: every expert in RAM
    ram_cache_used_bytes: int = 0
    prefetch: str = "off"  # the engine's cross-layer prefetch mode
    prefetch_issued: int = 0  # since load
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    stall_ms_per_token: float | None = None  # the forward pass waiting for expert bytes, last window
    on_miss: str = "load"  # where a miss runs: load | host | auto (hybrid execution)
    host_computed: int = 0  # misses computed on the host from the RAM tier, since load
    resident: np.ndarray | None = field(default=None, compare=False)  # [L, E] bool
    recent: np.ndarray | None = field(default=None, compare=False)  # [L, E] float in [0, 1]
    hosted: np.ndarray | None = field(default=None, compare=False)  # [L, E] bool: ran on the host (session)
    # "ram": a CPU computing misses in place, where the cache is the RAM tier over the disk: hits, misses, the
    # rates and `resident` above then count that tier (a hit: no disk read) and the slots are not shown
    fast_tier: str = "slots"
    ram_tier_experts: int = 0  # how many experts the RAM tier holds at most
    expert_bytes: int = 0

    @property
    def has_cache(self) -> bool:
        return self.resident is not None


def _nan_to_none(x: float) -> float | None:
    return None if x is None or math.isnan(x) else x


def _hosted(snap) -> np.ndarray | None:
    """[L, E] bool: experts the host computed this session (the snapshot's `where_ran` bit 2), or None."""
    import numpy as np
    where = getattr(snap, "where_ran", None)
    if where is None or not getattr(snap, "host_computed", ()) or not sum(snap.host_computed):
        return None
    return (np.asarray(where) & 2).astype(bool)


class StatsTracker:
    """Accumulates chunks and snapshots into `DashboardStats`. Not thread-safe: one worker at a time."""

    def __init__(self, half_life_tokens: float = RECENT_HALF_LIFE_TOKENS):
        self.half_life = half_life_tokens
        self.tokens = 0  # tokens forwarded through the model since load (prefill + decode)
        self.prefill_tps: float | None = None
        self.decode_tps: float | None = None
        self.history: list[float] = []
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self._gen_base = 0  # self.tokens when the current generation started
        self._prev = None  # the previous snapshot
        self._prev_tokens = 0
        self._recent: np.ndarray | None = None  # [L, E] decayed request counts
        self._per_token: tuple[float | None, float | None] = (None, None)
        self._stall_per_token: float | None = None
        self._cache_stats: dict = {}
        self._turn_base: tuple[int, int] | None = None  # (hits, misses) since load when this reply's decode began
        self._turn_waiting = False  # a reply started; its base is the first snapshot after its first token

    # -- inputs ---------------------------------------------------------------------------------------
    def start_generation(self) -> None:
        self._gen_base = self.tokens
        self.prompt_tokens = self.generated_tokens = 0
        self._turn_waiting = True

    def observe_chunk(self, prompt_tokens: int, generated_tokens: int, prefill_tps: float,
                      decode_tps: float) -> None:
        """One GenerationChunk's counters (the bridge passes numbers, not the engine's object)."""
        self.prompt_tokens, self.generated_tokens = prompt_tokens, generated_tokens
        # After chunk n the model has run the prompt and n - 1 decode steps.
        self.tokens = self._gen_base + prompt_tokens + max(generated_tokens - 1, 0)
        if prefill_tps > 0:
            self.prefill_tps = prefill_tps
        if decode_tps > 0:
            self.decode_tps = decode_tps

    def sample_rate(self) -> None:
        """Take a sparkline point (called at the panel's refresh rate, not per token)."""
        if self.decode_tps is not None:
            self.history.append(self.decode_tps)
            del self.history[:-SPARK_POINTS]

    def observe_snapshot(self, snap) -> None:
        """A `CacheSnapshot` (or anything with its fields) taken now."""
        import numpy as np
        freq = np.asarray(snap.frequency, dtype=np.float64)  # [L, E]
        dt = self.tokens - self._prev_tokens
        prev = self._prev
        if self._recent is None or self._recent.shape != freq.shape or prev is None:
            self._recent = np.zeros_like(freq)
            delta = freq  # everything requested so far counts as recent
            prev = None
        else:
            delta = np.maximum(freq - np.asarray(prev.frequency, dtype=np.float64), 0.0)  # [L, E]
        if dt > 0 or delta.any():
            self._recent = self._recent * 0.5 ** (max(dt, 0) / self.half_life) + delta
        if prev is not None and dt > 0:
            self._per_token = (max(snap.bytes_from_ram - prev.bytes_from_ram, 0) / dt,
                               max(snap.bytes_from_disk - prev.bytes_from_disk, 0) / dt)
            stall, prev_stall = getattr(snap, "stall_seconds", 0.0), getattr(prev, "stall_seconds", 0.0)
            self._stall_per_token = max(stall - prev_stall, 0.0) * 1000 / dt
        self._prev, self._prev_tokens = snap, self.tokens
        tier = getattr(snap, "fast_tier", "slots")
        layer_hits, layer_misses = snap.hits, snap.misses
        resident = snap.resident
        if tier == "ram":  # the slots hold nothing a miss put there: count and draw the RAM tier over the disk
            layer_hits, layer_misses, resident = snap.ram_hits, snap.disk_reads, snap.ram_resident
        hits, misses = sum(layer_hits), sum(layer_misses)
        turn_hits = turn_misses = 0
        if self._turn_waiting and self.generated_tokens >= 1:  # the prefill is done: this reply's decode starts
            self._turn_waiting = False
            self._turn_base = (hits, misses)
        if self._turn_base is not None and not self._turn_waiting:
            turn_hits, turn_misses = max(hits - self._turn_base[0], 0), max(misses - self._turn_base[1], 0)
        self._cache_stats = dict(
            hit_rate=_nan_to_none(hits / (hits + misses)) if hits + misses else None,
            turn_hit_rate=turn_hits / (turn_hits + turn_misses) if turn_hits + turn_misses else None,
            turn_hits=turn_hits, turn_misses=turn_misses,
            layer_hit_rates=tuple(h / (h + m) if h + m else math.nan
                                  for h, m in zip(layer_hits, layer_misses, strict=True)),
            hits=hits, misses=misses, bytes_from_ram=snap.bytes_from_ram, bytes_from_disk=snap.bytes_from_disk,
            num_slots=snap.num_slots, slots_used=snap.slots_used, policy=snap.policy,
            ram_cache_bytes=snap.ram_cache_bytes, ram_cache_used_bytes=snap.ram_cache_used_bytes,
            prefetch=getattr(snap, "prefetch", "off"), prefetch_issued=sum(getattr(snap, "prefetch_issued", ())),
            prefetch_used=sum(getattr(snap, "prefetch_used", ())),
            prefetch_wasted=sum(getattr(snap, "prefetch_wasted", ())),
            on_miss=getattr(snap, "on_miss", "load"), host_computed=sum(getattr(snap, "host_computed", ())),
            hosted=None if tier == "ram" else _hosted(snap), resident=np.asarray(resident, dtype=bool).copy(),
            fast_tier=tier, ram_tier_experts=int(getattr(snap, "ram_tier_experts", 0)),
            expert_bytes=int(getattr(snap, "expert_bytes", 0)))

    # -- output ---------------------------------------------------------------------------------------
    def stats(self) -> DashboardStats:
        recent = None
        if self._recent is not None:
            top = float(self._recent.max()) if self._recent.size else 0.0
            recent = self._recent / max(top, 1.0)  # [L, E] in [0, 1]
        ram, disk = self._per_token
        return DashboardStats(
            prefill_tps=self.prefill_tps, decode_tps=self.decode_tps, decode_history=tuple(self.history),
            prompt_tokens=self.prompt_tokens, generated_tokens=self.generated_tokens,
            bytes_per_token_ram=ram, bytes_per_token_disk=disk, stall_ms_per_token=self._stall_per_token,
            recent=recent, **self._cache_stats)


class RefreshGovernor:
    """Spaces out the UI's optional redraws so the UI thread stays under `budget` of a core.

    The generating thread needs the GIL between its torch calls, and every redraw the UI does (a
    Markdown append re-lays out the screen: ~10 ms on a slow CPU) holds it. So the streamed text is
    redrawn every `interval` seconds, which grows x1.5 while the UI thread's CPU time
    (time.thread_time) exceeds `budget` of the wall time since the last call and shrinks back when it
    is under half of it, between `fastest` and `slowest`. Call `interval()` from the UI thread only.
    (The live panel keeps its own 4 Hz: it repaints only what changed, with no layout pass.)
    """

    def __init__(self, budget: float = 0.05, fastest: float = 0.1, slowest: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, cpu: Callable[[], float] = time.thread_time):
        self.budget, self.fastest, self.slowest = budget, fastest, slowest
        self.clock, self.cpu = clock, cpu
        self.current = fastest
        self.busy = 0.0  # the UI thread's share of a core over the last measured span
        self._last: tuple[float, float] | None = None

    def interval(self) -> float:
        now, cpu = self.clock(), self.cpu()
        if self._last is not None and now - self._last[0] >= 0.05:
            self.busy = (cpu - self._last[1]) / (now - self._last[0])
            if self.busy > self.budget:
                self.current = min(self.current * 1.5, self.slowest)
            elif self.busy < self.budget / 2:
                self.current = max(self.current / 1.5, self.fastest)
        if self._last is None or now - self._last[0] >= 0.05:
            self._last = (now, cpu)
        return self.current


# -- formatting (shared by the panel and its tests) ----------------------------------------------------
def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            x = n / size
            return f"{x:.0f} {unit}" if abs(x) >= 100 else f"{x:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_rate(tps: float | None) -> str:
    if tps is None:
        return "–"
    return f"{tps:.0f}" if tps >= 100 else f"{tps:.1f}"


def fmt_pct(x: float | None) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:.1%}"
