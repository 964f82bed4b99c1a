"""The rate model: predicted decode tok/s from bytes per token over each tier's bandwidth (docs/plan.md derives it).

With C slots out of N experts and hit rate h, a token moves L_moe x K x (1 - h) x expert bytes over the link.
Qwen3-30B-A3B in bf16 on a 12 GiB GPU: 862 slots of 9.4 MB (14% of 6,144 experts), so at the conservative
uniform-routing hit rate a token moves 3.1 GB over PCIe: at 25 GB/s, <= 8 tok/s from the link alone. Hit rates come
from a `MissRatioCurve` (replayed routing traces) or a stated default; `MissPlacement` is decode per `--on-miss` mode.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

from .hardware import GB
from .spec import ModelSpec

GPU_EFFICIENCY = 0.7  # fraction of peak memory bandwidth decode mat-vecs reach
# Eager PyTorch launch/dispatch per decoder layer. The CPU's is measured by `moechat run` where it has run
# (engine/plan/calibration.py: 2.0-2.2 ms on the busy 2-core CI machine, the demo model at 70-78 tok/s; ~1 ms when it
# is quiet); this is the figure before that, within 2x of both.
OVERHEAD_PER_LAYER_S = {"gpu": 0.15e-3, "cpu": 1.5e-3}
OVERHEAD_PER_MISS_S = {"gpu": 0.03e-3, "cpu": 0.05e-3}  # policy + copy call (+ preadv) per expert load
TRACED_MISS_FACTOR = 0.6  # best LRU miss rate / uniform-routing miss rate seen on ../shared/traces
# Expert compute of each format's path today, as a fraction of the rate the device reads dense weights at,
# counted on the format's packed bytes (1: the packed bytes are read once, as a fused kernel does). CPU: measured
# by bench/format_compute.py (one thread, one token, Qwen3-30B-A3B's and GPT-OSS's expert widths, medians of
# interleaved rounds, wall and thread clocks, rounded down) for the native kernels (quant/native.py: the path of a
# machine with a C compiler and AVX2; without them the torch paths run at int8 0.6-0.7, int4 0.06, mxfp4 0.045,
# fp8 0.15);
# GPU: 1 where a fused kernel reads the packed bytes and was measured (MXFP4, kernels/mxfp4_moe.py), else counted
# from the bytes the torch path moves per packed byte (int8: cast to bf16 + GEMM, 5 B; int4: codes to int32, a
# table lookup, the scale product and the GEMM, ~12.5 B per 0.625 B; fp8: blocks expanded in fp32, ~33 B).
# FP8/int8/int4 have a fused kernel too (kernels/quant_moe.py) whose rate no GPU has measured yet: raise their
# GPU rows when bench/gpu_check.sh has. The plan's speeds and the recommended format follow these numbers.
EXPERT_COMPUTE_EFFICIENCY = {
    "cpu": {"dense": 1.0, "int8": 1.0, "int4": 0.85, "mxfp4": 0.85, "fp8": 0.8},
    "gpu": {"dense": 1.0, "int8": 0.2, "int4": 0.05, "mxfp4": 1.0, "fp8": 0.03},
}


# -- hit rates -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MissRatioCurve:
    """Hit rate against the fraction of experts cached, from replaying routing traces.

    `points`: (fraction, hit rate) for the policy the cache runs; `best`: the same for Belady (what any
    policy could reach), optional. Between points the curve is linear; (0, 0) and (1, 1) are implied.
    """

    points: tuple[tuple[float, float], ...]
    best: tuple[tuple[float, float], ...] | None = None
    source: str = "routing trace"

    @staticmethod
    def _at(points, fraction: float) -> float:
        pts = sorted({(0.0, 0.0), (1.0, 1.0), *((float(f), float(h)) for f, h in points)})
        xs = [p[0] for p in pts]
        i = bisect.bisect_left(xs, fraction)
        if i < len(xs) and xs[i] == fraction:
            return pts[i][1]
        (x0, y0), (x1, y1) = pts[max(0, i - 1)], pts[min(len(pts) - 1, i)]
        return y0 if x1 == x0 else y0 + (y1 - y0) * (fraction - x0) / (x1 - x0)

    def hit_at(self, fraction: float) -> float:
        return min(1.0, max(0.0, self._at(self.points, fraction)))

    def best_at(self, fraction: float) -> float:
        return self.hit_at(fraction) if not self.best else max(self.hit_at(fraction), self._at(self.best, fraction))

    @classmethod
    def from_stack_distances(cls, curve, num_keys: int, points: int = 32) -> MissRatioCurve:
        """From a cache/mrc.py `HitCurve` (hit rate at every slot count): hit rate against the fraction of all
        `num_keys` experts, at `points` sizes. Duck-typed, so the planner does not import the cache."""
        step = (max(num_keys, 1) - 1) / max(points - 1, 1)
        sizes = sorted({round(1 + i * step) for i in range(points)})
        pts = tuple((float(c) / num_keys, float(curve.hit_rate(int(c)) or 0.0)) for c in sizes)
        return cls(pts, None, f"{curve.policy.upper()} stack distances, {curve.source or 'routing trace'}")

    @classmethod
    def from_json(cls, data, num_experts: int, *, policy: str | None = None) -> MissRatioCurve:
        """{"points": [[fraction, hit], ...], "best": [...], "source": ...}, or bench/replay.py --json rows."""
        if isinstance(data, dict) and "points" in data:
            return cls(tuple(tuple(p) for p in data["points"]),
                       tuple(tuple(p) for p in data["best"]) if data.get("best") else None,
                       str(data.get("source", "given curve")))
        if isinstance(data, list) and data and isinstance(data[0], dict) and "hit_rate" in data[0]:
            rows = [r for r in data if r.get("pool", "global") == "global"] or data
            names = [r["policy"] for r in rows if r["policy"] != "belady"]
            policy = policy or (max(set(names), key=lambda n: sum(r["hit_rate"] for r in rows if r["policy"] == n))
                                if names else "belady")
            pts = tuple((r["capacity_per_layer"] / num_experts, r["hit_rate"]) for r in rows if r["policy"] == policy)
            best = tuple((r["capacity_per_layer"] / num_experts, r["hit_rate"]) for r in rows
                         if r["policy"] == "belady")
            traces = sorted({str(r.get("trace", "")) for r in rows})
            return cls(pts, best or None, f"bench/replay.py, {policy}, {', '.join(traces)}")
        raise ValueError("a miss-ratio curve is {\"points\": [[fraction, hit_rate], ...]} or bench/replay.py "
                         "--json output")


@dataclass(frozen=True)
class DecodeEstimate:
    """Predicted decode tok/s (a range) and the bandwidth bound; see docs/plan.md for the formula."""

    low: float
    high: float
    bound: float
    bound_by: str
    hit_rate_low: float
    hit_rate_high: float
    hit_source: str
    device_bytes: int  # read from device memory per token (dense + active experts + KV)
    link_bytes_low: int  # over the host->device link per token, at the low hit rate
    link_bytes_high: int
    disk_bytes_low: int
    disk_bytes_high: int
    device_gbps: float
    link_gbps: float | None
    disk_gbps: float
    compute_efficiency: float = 1.0  # the expert format's compute rate / the dense read rate (EXPERT_COMPUTE_...)
    on_miss: str | None = None  # the --on-miss mode low/high/bound are for (None: no miss runs anywhere else)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _hit_rates(spec: ModelSpec, fraction: float, curve: MissRatioCurve | None) -> tuple[float, float, str]:
    if fraction >= 1:
        return 1.0, 1.0, "every expert resident"
    if curve is not None:
        return curve.hit_at(fraction), curve.best_at(fraction), curve.source
    low = fraction  # uniform independent routing: any online policy hits the resident fraction
    high = 1 - TRACED_MISS_FACTOR * (1 - fraction)
    return low, high, (f"conservative default: uniform routing ({low:.1%}) to {TRACED_MISS_FACTOR:g}x its miss "
                       f"rate ({high:.1%}), the best LRU reached on the shared real traces")


def _decode(spec: ModelSpec, kind: str, context: int, slots: int, ram_experts: int, link: float | None,
            devbw: float, diskbw: float, curve: MissRatioCurve | None, layer_s: float | None = None) -> DecodeEstimate:
    N, K, Lm, eb = spec.total_experts, spec.top_k, spec.num_moe_layers, spec.expert_bytes
    c = min(1.0, slots / N) if N else 1.0
    h_lo, h_hi, source = _hit_rates(spec, c, curve)
    # RAM tier (inclusive of the slots): a slot miss goes to disk unless RAM holds the expert.
    r = max(c, min(1.0, ram_experts / N)) if N else 1.0
    if kind == "cpu":
        d_lo, d_hi = 1 - h_lo, 1 - h_hi  # slots are RAM; every slot miss reads the shards
    elif r >= 1:
        d_lo = d_hi = 0.0
    else:
        rd_lo, rd_hi, _ = _hit_rates(spec, r, curve)
        d_lo, d_hi = 1 - rd_lo, 1 - rd_hi
    active = Lm * K * eb
    # Attention reads a window layer's last `window` keys whatever was allocated; averaged over a filling context.
    kv_read = spec.kv_bytes(max(1, context // 2), windowed=True)
    dev_bytes = spec.dense_read_bytes + active + kv_read
    # A format whose compute path runs below the dense read rate costs as if it read active / f bytes.
    f = compute_efficiency(spec, kind)
    dev_work = dev_bytes - active + active / f
    eff = GPU_EFFICIENCY if kind == "gpu" else 1.0

    def seconds(h: float, d: float) -> tuple[float, float, float, float]:
        link_b = active * (1 - h) if kind == "gpu" else 0.0
        disk_b = active * d
        misses = Lm * K * (1 - h)
        t = (dev_work / (devbw * GB * eff) + (link_b / (link * GB) if link_b else 0.0) + disk_b / (diskbw * GB)
             + spec.num_layers * (layer_s or OVERHEAD_PER_LAYER_S[kind]) + misses * OVERHEAD_PER_MISS_S[kind])
        return t, link_b, disk_b, misses

    t_lo, link_lo, disk_lo, _ = seconds(h_lo, d_lo)
    t_hi, link_hi, disk_hi, _ = seconds(h_hi, d_hi)
    device = "device memory" if active / f - active <= dev_bytes - active else f"{spec.format_key} expert compute"
    limits = {device: dev_work / (devbw * GB)}
    if link_hi:
        limits["link"] = link_hi / (link * GB)
    if disk_hi:
        limits["disk"] = disk_hi / (diskbw * GB)
    bound_by = max(limits, key=limits.get)
    return DecodeEstimate(
        low=1 / t_lo, high=1 / t_hi, bound=1 / limits[bound_by], bound_by=bound_by, hit_rate_low=h_lo,
        hit_rate_high=h_hi, hit_source=source, device_bytes=int(dev_bytes), link_bytes_low=int(link_lo),
        link_bytes_high=int(link_hi), disk_bytes_low=int(disk_lo), disk_bytes_high=int(disk_hi),
        device_gbps=devbw * eff, link_gbps=link if kind == "gpu" else None, disk_gbps=diskbw, compute_efficiency=f)


@dataclass(frozen=True)
class MissPlacement:
    """Predicted decode tok/s with every miss served one way (`--on-miss`): load (over the link into a slot),
    host (computed on the CPU from the RAM tier while the GPU computes the slotted experts) or auto (per miss,
    the cheaper of the two: at least the better of them, which is what is predicted)."""

    mode: str  # load | host | auto
    low: float
    high: float
    bound: float
    bound_by: str
    host_experts: float = 0.0  # experts computed on the host per token, at the low hit rate

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _placements(spec: ModelSpec, decode: DecodeEstimate, hostbw: float) -> tuple[MissPlacement, ...]:
    """load / host / auto on a GPU with a RAM tier (docs/plan.md, "Where misses run").

    Host: per MoE layer the GPU computes its slotted experts while the CPU computes the missed ones from RAM
    (reading their packed bytes at `hostbw` x the format's CPU compute efficiency), so the layer costs the
    longer of the two plus two activation copies; nothing crosses the link but activations. Attention and
    the dense weights do not overlap with it. Disk reads (experts beyond the RAM tier) cost the same either
    way."""
    from ..cache.hybrid import ACTIVATION_COPY_S  # pure Python

    Lm, K, eb = spec.num_moe_layers, spec.top_k, spec.expert_bytes
    active = Lm * K * eb
    f_dev = decode.compute_efficiency
    f_host = compute_efficiency(spec, "cpu")
    dev_rate = decode.device_gbps * GB
    out = [MissPlacement("load", decode.low, decode.high, decode.bound, decode.bound_by)]
    rates = []
    for h, disk_b in ((decode.hit_rate_low, decode.disk_bytes_low), (decode.hit_rate_high, decode.disk_bytes_high)):
        dense_t = (decode.device_bytes - active) / dev_rate
        dev_experts_t = active * h / f_dev / dev_rate
        host_t = active * (1 - h) / (hostbw * GB * f_host)
        copies = Lm * (1 - h ** K) * 2 * ACTIVATION_COPY_S  # layers with at least one miss
        t = (dense_t + max(dev_experts_t, host_t) + copies + disk_b / (decode.disk_gbps * GB)
             + spec.num_layers * OVERHEAD_PER_LAYER_S["gpu"])
        limits = {"device memory": dense_t + dev_experts_t, "host RAM": host_t + dense_t}
        if disk_b:
            limits["disk"] = disk_b / (decode.disk_gbps * GB)
        rates.append((1 / t, limits, Lm * K * (1 - h)))
    (lo, lo_limits, n_host), (hi, hi_limits, _) = rates
    limits = hi_limits if hi >= lo else lo_limits  # the bound of the faster end, so that high <= bound
    bound_by = max(limits, key=limits.get)
    # low-high as rates, not as hit rates: with a slow device path (int4 on a GPU today) more hits are slower
    host = MissPlacement("host", min(lo, hi), max(lo, hi), 1 / limits[bound_by], bound_by, host_experts=n_host)
    best = max((out[0], host), key=lambda p: p.low)
    out += [host, replace(best, mode="auto")]
    return tuple(out)


def rate(x: float) -> str:
    """A tok/s figure: one decimal, two significant digits below 1 (a bound of 0.145 is "0.15", not "0.1")."""
    return f"{x:.1f}" if x >= 1 else f"{x:.2g}"


def rate_range(low: float, high: float) -> str:
    """"11.0-14.2", or one number when the two are the same: with as many decimals (up to 3) as it takes for two
    different rates to read differently, so a range never shows as "5.2-5.2"; always low-high, whichever end a
    caller names first (a host placement is faster at the *low* hit rate when its GPU path is slow)."""
    low, high = min(low, high), max(low, high)
    for decimals in (1, 2, 3):
        a, b = f"{low:.{decimals}f}", f"{high:.{decimals}f}"
        if a != b:
            return f"{a}-{b}"
    return f"{low:.1f}" if abs(low) >= 0.05 else f"{low:.3g}"


def compute_efficiency(spec: ModelSpec, kind: str) -> float:
    """How fast the experts' format computes on `kind` ("cpu" | "gpu"), as a fraction of the dense read rate."""
    return EXPERT_COMPUTE_EFFICIENCY[kind].get(spec.format_key, 1.0)

