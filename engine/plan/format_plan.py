"""Which expert format to run a model in: every format the engine loads, planned side by side, and a
recommendation that keeps the quality aims.

The formats are `native` (what the checkpoint ships: bf16, MXFP4 or block-FP8) and what `--expert-format`
converts to (int8, int4). Each is planned with `make_plan` on the same machine: a smaller expert means more
slots, more of the model in RAM and fewer bytes per miss, but a conversion costs quality, and a format whose
compute path is slow costs time (plan.EXPERT_COMPUTE_EFFICIENCY). Qwen3-30B-A3B on an 8 GiB GPU with 32 GiB
of RAM: its 56 GiB of bf16 experts stream from disk (~1 tok/s), int8's 27 GiB all sit in RAM.

Quality is measured, not assumed (bench/expert_formats.py, QUALITY below), and only from full-precision
experts: converting MXFP4 or FP8 experts rounds them a second time, unmeasured, so a compressed checkpoint is
never advised away from its own format (and for MXFP4 both conversions are larger than native anyway).

The rule: among the formats that fit and keep their quality aim, take the most precise one (native, int8,
int4) unless a less precise one is predicted at least SPEEDUP times faster, at the conservative end of its
range. Pure Python over numbers, like plan.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from . import CONVERTIBLE_FORMATS, MemoryPlan, ModelSpec, Preferences, gib, make_plan, rate, rate_range
from .hardware import Hardware

FORMATS = ("native", *CONVERTIBLE_FORMATS)  # most precise first
SPEEDUP = 1.1  # a less precise format must be predicted this much faster to be advised


@dataclass(frozen=True)
class FormatQuality:
    """A converted format against native bf16 on the same tokens (bench/expert_formats.py)."""

    perplexity_change: float  # fraction: +0.0026 = perplexity 0.26% higher than native
    top1_agreement: float  # next-token predictions equal to native's
    kl: float  # mean KL(native || format) per token, nats
    aim: float  # the largest perplexity change the format is allowed

    @property
    def meets_aim(self) -> bool:
        return self.perplexity_change <= self.aim

    def describe(self) -> str:
        return (f"perplexity {self.perplexity_change:+.2%} vs native, top-1 agreement {self.top1_agreement:.1%} "
                f"(aim: within {self.aim:.0%})")


# The bundled demo model's held-out corpus (every domain, 60 sequences x 256 tokens), bf16 experts as native;
# issue 14's aims: int8 within 1% perplexity of native, int4 (groups of 32) within 5%.
QUALITY_SOURCE = "bench/expert_formats.py, the demo model's held-out text"
QUALITY = {
    # the demo model after its second training stage, 40 held-out windows of 256 tokens (int4: fp16 group scales)
    "int8": FormatQuality(perplexity_change=0.0001, top1_agreement=0.996, kl=7e-5, aim=0.01),
    "int4": FormatQuality(perplexity_change=0.0022, top1_agreement=0.961, kl=3.5e-3, aim=0.05),
}


@dataclass(frozen=True)
class FormatOption:
    """One format planned on one machine. `plan` is None when the format cannot hold this model."""

    name: str  # "native" | "int8" | "int4"
    spec: ModelSpec | None
    plan: MemoryPlan | None
    keeps_quality: bool
    quality: str  # "as shipped", the measured numbers, or why they do not apply
    note: str = ""  # "larger than native MXFP4 (...)", or why the format cannot be used

    @property
    def flags(self) -> list[str]:
        return [] if self.name == "native" else ["--expert-format", self.name]

    @property
    def fits(self) -> bool:
        return self.plan is not None and self.plan.ok

    @property
    def speed(self) -> float:
        """The conservative end of the predicted decode range (0 when it does not fit)."""
        d = self.plan.decode if self.plan is not None else None
        return d.low if d is not None and self.plan.ok else 0.0

    @property
    def label(self) -> str:
        if self.spec is None:
            return self.name
        what = f"{self.name} ({self.spec.expert_format_name}" if self.name == "native" else f"{self.name} ("
        return f"{what}{', ' if self.name == 'native' else ''}{gib(self.spec.expert_bytes)} an expert)"

    def headline(self) -> str:
        """"with --expert-format int4: 2,310 slots, RAM holds every expert, 11.0-14.2 tok/s predicted (bound 16.0)"."""
        who = f"with --expert-format {self.name}" if self.name != "native" else "native"
        if self.plan is None:
            return f"{who}: {self.note}"
        if not self.plan.ok:
            r = self.plan.refusal
            return f"{who}: does not fit (short by {r.short_bytes / (1 << 30):.1f} GiB of {r.resource})"
        return f"{who}: {where_experts_live(self.plan)}, {tok_s(self.plan)}"

    def describe(self) -> str:
        """One line for a table of formats: size, tiers, speed, and the quality or what stands in the way."""
        if self.spec is None:
            return self.note
        size = (f"{self.spec.expert_format_name}, " if self.name == "native" else "") + f"{gib(self.spec.expert_bytes)}"
        line = f"{size} an expert: " + self.headline().split(": ", 1)[1]
        extra = [x for x in (self.note, "" if self.name == "native" else f"quality: {self.quality}") if x]
        return line + "".join(f"; {x}" for x in extra)

    def to_json(self) -> dict:
        p = self.plan
        return {"name": self.name, "flags": self.flags, "fits": self.fits, "keeps_quality": self.keeps_quality,
                "quality": self.quality, "note": self.note, "headline": self.headline(),
                "expert_bytes": None if self.spec is None else self.spec.expert_bytes,
                "all_experts_bytes": None if self.spec is None else self.spec.all_experts_bytes,
                "expert_slots": None if p is None else p.expert_slots,
                "host_tier": None if p is None else p.host_tier,
                "decode": None if p is None or p.decode is None else
                {"low": p.decode.low, "high": p.decode.high, "bound": p.decode.bound, "bound_by": p.decode.bound_by}}


def sizes_apart(a: int, b: int) -> tuple[str, str]:
    """Two different byte counts written so that they read differently: "42.0 MiB" while that differs, else with
    more decimals ("42.02 MiB vs 42.00 MiB"), else in bytes."""
    if gib(a) != gib(b):
        return gib(a), gib(b)
    big = max(a, b)
    unit, div = ("GiB", 1 << 30) if big >= 1 << 30 else ("MiB", 1 << 20) if big >= 1 << 20 else ("KiB", 1024)
    for decimals in (2, 3, 4):
        x, y = f"{a / div:.{decimals}f} {unit}", f"{b / div:.{decimals}f} {unit}"
        if x != y:
            return x, y
    return f"{a:,} B", f"{b:,} B"


def tok_s(plan: MemoryPlan) -> str:
    """"11.0-14.2 tok/s predicted (bound 16.0)"."""
    d = plan.decode
    return f"{rate_range(d.low, d.high)} tok/s predicted (bound {rate(d.bound)})"


def where_experts_live(plan: MemoryPlan) -> str:
    """"2,310 slots, RAM holds every expert" and the like: the tiers of a plan in a few words."""
    N = plan.total_experts
    if plan.resident:
        return "every expert in RAM, no cache" if plan.device == "cpu" else f"every expert on {plan.device}, no cache"
    slots = f"{plan.expert_slots:,} slot" + ("" if plan.expert_slots == 1 else "s")
    if plan.device == "cpu":
        return f"{slots} in RAM ({plan.expert_slots / N:.0%} of the experts), the rest stream from disk"
    if plan.ram_cache_bytes is None:
        return f"{slots}, RAM holds every expert"
    held = plan.experts_in_ram
    if not held:
        return f"{slots}, every miss streams from disk"
    return f"{slots}, RAM holds {held:,} of {N:,} experts, the rest stream from disk"


@dataclass(frozen=True)
class FormatAdvice:
    options: tuple[FormatOption, ...]  # FORMATS order
    recommended: str | None  # None: no format fits
    reason: str

    def option(self, name: str) -> FormatOption | None:
        return next((o for o in self.options if o.name == name), None)

    @property
    def best(self) -> FormatOption:
        """The recommended option, else native (whose plan then carries the refusal)."""
        return self.option(self.recommended or "native")

    @property
    def flags(self) -> list[str]:
        return self.best.flags

    def to_json(self) -> dict:
        return {"recommended": self.recommended, "reason": self.reason, "options": [o.to_json() for o in self.options]}


def _option(name: str, native: ModelSpec, hw: Hardware, prefs: Preferences) -> FormatOption:
    if name == "native":
        return FormatOption("native", native, make_plan(native, hw, prefs), True, "as shipped")
    try:
        spec = native.in_format(name)
    except ConfigError as e:
        return FormatOption(name, None, None, False, "", note=f"cannot be used: {e}")
    notes = []
    if spec.expert_bytes == native.expert_bytes:
        notes.append(f"the same size as native {native.expert_format_name} ({spec.expert_bytes:,} B an expert)")
    elif spec.expert_bytes > native.expert_bytes:
        ours, theirs = sizes_apart(spec.expert_bytes, native.expert_bytes)
        notes.append(f"larger than native {native.expert_format_name} ({ours} vs {theirs} an expert)")
    q = QUALITY[name]
    if native.format_key != "dense":
        quality = (f"not measured from {native.expert_format_name} (converting rounds its experts a second time); "
                   "never advised")
        keeps = False
    else:
        quality = q.describe()
        keeps = q.meets_aim
    return FormatOption(name, spec, make_plan(spec, hw, prefs), keeps, quality, "; ".join(notes))


def plan_formats(spec: ModelSpec, hw: Hardware, prefs: Preferences | None = None) -> FormatAdvice:
    """Every loadable expert format of `spec` (its native one) planned on `hw`, and the one to run."""
    prefs = prefs if prefs is not None else Preferences()
    if spec.converted_from is not None:
        raise ConfigError(f"{spec.name}: plan the formats from the native spec, not a converted one")
    options = tuple(_option(name, spec, hw, prefs) for name in FORMATS)
    candidates = [o for o in options if o.fits and o.keeps_quality]
    native = options[0]
    if not candidates:
        why = native.plan.refusal.message if native.plan.refusal else "no format fits"
        return FormatAdvice(options, None, f"no format fits this machine: {why}")
    best = candidates[0]
    for o in candidates[1:]:
        if o.speed >= SPEEDUP * best.speed:
            best = o
    if best.name == "native":
        others = [o for o in options[1:] if o.fits and o.keeps_quality]
        if spec.format_key != "dense":
            reason = (f"the checkpoint's own {spec.expert_format_name} experts: a conversion is not measured to "
                      "keep quality from them" + _larger(options))
            faster = [o for o in options[1:] if o.speed >= SPEEDUP * native.speed]
            if faster:
                o = max(faster, key=lambda o: o.speed)
                reason += (f"; {o.name} is predicted {o.speed / native.speed:.1f}x faster here (its compute path is "
                           f"faster), at a quality not measured")
        elif others:
            fastest = max(others, key=lambda o: o.speed)
            reason = (f"the checkpoint's own format: {fastest.name} would be {fastest.speed / best.speed:.2f}x its "
                      f"predicted speed, under the {SPEEDUP:g}x a conversion must bring")
        else:
            reason = "the checkpoint's own format: no conversion fits"
        return FormatAdvice(options, "native", reason)
    q = QUALITY[best.name]
    if native.fits:
        gain = (f"{best.speed / native.speed:.1f}x native's predicted speed ({native.speed:.1f} -> {best.speed:.1f} "
                "tok/s at the low ends)")
    else:
        gain = f"native does not fit ({native.headline().split(': ', 1)[1]})"
    return FormatAdvice(options, best.name, f"{gain}; {q.describe()}, measured with {QUALITY_SOURCE}")


def _larger(options: tuple[FormatOption, ...]) -> str:
    larger = [o.name for o in options[1:] if o.note.startswith("larger")]
    return f"; {' and '.join(larger)} would be larger than native" if larger else ""
