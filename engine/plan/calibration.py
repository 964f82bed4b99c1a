"""Measured machine constants for the decode prediction, kept in $XDG_CACHE_HOME/moechat/calibration.json.

`moechat fit` predicts decode tok/s as (bytes read per token / read bandwidth) + (fixed seconds per layer)
(docs/plan.md). Both constants are properties of the machine, and assumptions get them wrong by 10x on a
small model: the demo model reads 1.6 MB a token (0.08 ms at the assumed 20 GB/s), but eager PyTorch
spends ~1.5 ms a layer launching ops on a 2-core CPU, so the assumed 0.1 ms a layer predicted 920 tok/s
where 110 were measured. So both are measured here and kept:

- `ram_read_gbps`: one thread summing a 256 MiB numpy array, the best of 5 (~0.3 s, no torch), the rate a
  decode's mat-vecs read weights at; `moechat fit` measures it when the file has none (or it is over 30 days
  old). A probe taken while the machine is busy reads low (1.9 GB/s was saved on a loaded machine that reads
  12, and fit predicted 0.7 tok/s for a model that then ran at 4-6), so the best probe is kept, not the last:
  every `fit` takes a quick probe (64 MiB, ~30 ms) and when it reads more than DISAGREE x the quick probe taken
  beside the saved one, probes again in full and keeps the higher; a `moechat run` decode faster than the saved
  rate allows (its reads alone would take longer than the decode did) probes again too;
- `cpu_layer_s`: every `moechat run` decode on the CPU of >= 32 tokens records (1/tok/s - bytes per token /
  ram_read_gbps) / layers, and the median of the last 8 is used.

Torch-free. A damaged, foreign or unwritable file is ignored (the assumptions stay) and rewritten whole
(atomic_write), never a failure.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

FILE = "calibration.json"
MAX_AGE_S = 30 * 24 * 3600
KEEP = 8  # decode measurements kept per device kind
MIN_TOKENS = 32  # shorter decodes are mostly warm-up
PROBE_BYTES = 256 << 20
PROBE_REPS = 5  # the best of these: a busy moment slows some probes, never speeds one up
QUICK_BYTES = 64 << 20  # the quick probe beside a saved one (above a desktop's L3)
QUICK_REPS = 3
DISAGREE = 1.5  # a quick probe this much faster than the one beside the saved rate: the saved one was slowed


def calibration_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moechat" / FILE


@dataclass(frozen=True)
class Calibration:
    ram_read_gbps: float | None = None
    ram_measured_at: float | None = None
    cpu_layer_s: float | None = None  # median of the recorded decodes
    cpu_decodes: tuple[dict, ...] = ()
    ram_quick_gbps: float | None = None  # the quick probe taken with the saved one (what a later quick one is held to)

    @property
    def ram_fresh(self) -> bool:
        return self.ram_read_gbps is not None and time.time() - (self.ram_measured_at or 0) < MAX_AGE_S

    def describe(self) -> str:
        parts = []
        if self.ram_read_gbps is not None:
            parts.append(f"RAM read {self.ram_read_gbps:.1f} GB/s measured on this machine (one thread, the best "
                         "probe kept)")
        if self.cpu_layer_s is not None:
            last = self.cpu_decodes[-1]
            parts.append(f"{self.cpu_layer_s * 1e3:.2f} ms per layer on the CPU (median of {len(self.cpu_decodes)} "
                         f"decodes by moechat run; last {last.get('model', '?')} at {last.get('tok_s', 0):.0f} tok/s)")
        return "; ".join(parts)


def load(path: Path | None = None) -> Calibration:
    from ..io.files import read_json_object

    path = path or calibration_path()
    try:
        data = read_json_object(path, "calibration")
    except Exception:  # noqa: BLE001 - missing or damaged: the assumptions stay
        return Calibration()
    gbps, at = data.get("ram_read_gbps"), data.get("ram_measured_at")
    decodes = data.get("cpu_decodes")
    decodes = tuple(d for d in decodes if _valid_decode(d))[-KEEP:] if isinstance(decodes, list) else ()
    ok = isinstance(gbps, int | float) and 0.01 < gbps < 10_000 and isinstance(at, int | float)
    quick = data.get("ram_quick_gbps")
    quick = float(quick) if ok and isinstance(quick, int | float) and 0.01 < quick < 10_000 else None
    layer_s = statistics.median(d["layer_s"] for d in decodes) if decodes else None
    return Calibration(float(gbps) if ok else None, float(at) if ok else None, layer_s, decodes, quick)


def _valid_decode(d) -> bool:
    return isinstance(d, dict) and isinstance(d.get("layer_s"), int | float) and 0 < d["layer_s"] < 1.0


def _save(cal: Calibration, path: Path) -> None:
    import json

    from ..io.files import atomic_write

    data = {"ram_read_gbps": cal.ram_read_gbps, "ram_measured_at": cal.ram_measured_at,
            "ram_quick_gbps": cal.ram_quick_gbps, "cpu_decodes": list(cal.cpu_decodes)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(data, indent=1).encode(), fsync=False)  # a measurement: losing it is fine
    except OSError:
        pass  # a read-only cache: the next run measures again


def measure_ram_read_gbps(nbytes: int = PROBE_BYTES, reps: int = PROBE_REPS) -> float:
    """One thread reading `nbytes` of float32 (numpy's sum: the read rate a decode's mat-vec reaches), the best of
    `reps` probes (the fastest is the one least disturbed by whatever else runs)."""
    import numpy as np

    a = np.ones(nbytes // 4, dtype=np.float32)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def _probe(cal: Calibration, path: Path) -> Calibration:
    """Probe in full (and the quick probe beside it); keep the better of this and a fresh saved rate."""
    gbps = round(measure_ram_read_gbps(), 2)
    quick = round(measure_ram_read_gbps(QUICK_BYTES, QUICK_REPS), 2)
    if cal.ram_fresh and cal.ram_read_gbps >= gbps:
        new = Calibration(cal.ram_read_gbps, cal.ram_measured_at, cal.cpu_layer_s, cal.cpu_decodes,
                          max(quick, cal.ram_quick_gbps or 0.0))
    else:
        new = Calibration(gbps, time.time(), cal.cpu_layer_s, cal.cpu_decodes, quick)
    _save(new, path)
    return new


def ensure_ram_read_gbps(path: Path | None = None, *, quick_check: bool = True) -> Calibration:
    """The calibration, with the RAM read rate measured now when it has none (or an old one), and kept.

    With `quick_check`, a saved rate is held to a quick probe taken now: one more than DISAGREE x the quick probe
    taken beside the saved rate means the saved probe ran on a busy machine, so it probes again and keeps the
    better."""
    path = path or calibration_path()
    cal = load(path)
    if not cal.ram_fresh:
        return _probe(cal, path)
    if quick_check:
        quick = measure_ram_read_gbps(QUICK_BYTES, QUICK_REPS)
        if quick > DISAGREE * (cal.ram_quick_gbps or cal.ram_read_gbps):
            return _probe(cal, path)
    return cal


def record_cpu_decode(model: str, layers: int, bytes_per_token: int, tok_s: float, tokens: int,
                      path: Path | None = None) -> float | None:
    """Keep what a CPU decode measured: the seconds per layer beyond reading the weights; returns it (None: too
    short a decode to say, or nothing beyond the reads)."""
    if tokens < MIN_TOKENS or tok_s <= 0 or layers <= 0:
        return None
    path = path or calibration_path()
    cal = ensure_ram_read_gbps(path, quick_check=False)
    reads = bytes_per_token / (cal.ram_read_gbps * 1e9)
    if reads >= 1 / tok_s:  # the run read faster than the saved rate allows: that probe was slowed, probe again
        cal = _probe(cal, path)
        reads = bytes_per_token / (cal.ram_read_gbps * 1e9)
    layer_s = (1 / tok_s - reads) / layers
    if layer_s <= 0:
        return None
    entry = {"model": model, "layers": layers, "bytes_per_token": bytes_per_token, "tok_s": round(tok_s, 2),
             "tokens": tokens, "layer_s": layer_s, "at": time.time()}
    decodes = (*cal.cpu_decodes, entry)[-KEEP:]
    _save(Calibration(cal.ram_read_gbps, cal.ram_measured_at, None, decodes, cal.ram_quick_gbps), path)
    return layer_s


def record_run(model_dir, tok_s: float, tokens: int, path: Path | None = None) -> float | None:
    """`record_cpu_decode` for a resident decode of the model in `model_dir` (bytes per token from its safetensors
    headers: the dense weights and top-k experts of every MoE layer). Any problem: nothing recorded."""
    if tokens < MIN_TOKENS:
        return None
    try:
        from . import read_model_spec

        spec = read_model_spec(model_dir)
        per_token = spec.dense_read_bytes + spec.num_moe_layers * spec.top_k * spec.expert_bytes
        return record_cpu_decode(spec.name, spec.num_layers, per_token, tok_s, tokens, path)
    except Exception:  # noqa: BLE001 - a measurement, never a reason for `run` to fail
        return None
