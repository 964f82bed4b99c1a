"""torch's packed CPU kernels that moechat does not own: guarded by what is known, checked once per machine.

moechat calls one private torch kernel on the CPU, `aten._weight_int8pack_mm` (int8 experts, several tokens, and
every int8 call where the native kernels are not built). Its correctness depends on the CPU: torch 2.13's
AVX-512 build, given a bf16 input whose width is not a multiple of 16, returns garbage for one row (an error of
7.6e19 against values under 1e3) and crashes the process (SIGSEGV) for more than one; fp32 and fp16 inputs are
exact there. So a path is used only where

1. the known guard holds (`KNOWN_GUARDS`: widths a multiple of 16, every CPU), and
2. this machine's check passed: the kernel run on tiny shapes (1, 2, 3 and 17 rows; widths 16 to 2048) against
   its slow reference (fp32 `x @ q.T * scale`), per input dtype, in a child process, since a wrong path may
   crash rather than answer. A dtype whose check crashes or disagrees is marked unusable, the rest go on in a
   fresh child.

The verdict is cached beside the native kernels' build (`native.cache_dir()`), keyed by the torch version, its
CPU capability, the CPU's flags and this check's version, so the ~2 s check runs once per machine and torch.
Where a path is not usable, the caller takes the slow obvious path (int8: the codes cast to the input's dtype
and one GEMM, exact since |q| <= 127 fits bf16). `status()` lists what is active and why (`moechat --version`,
`moechat fit --json`). MOECHAT_TORCH_PATHS=0 turns every such path off without a check.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import threading
from dataclasses import dataclass

import torch

ENV = "MOECHAT_TORCH_PATHS"  # "0": never the private kernels
CHECK_VERSION = 1
DTYPES = ("bfloat16", "float16", "float32")
# Known faults, checked before any per-machine verdict (a width the check cannot cover is never trusted).
KNOWN_GUARDS = {"int8pack_mm": "input width a multiple of 16 (torch 2.13 AVX-512: garbage or SIGSEGV otherwise)"}
# rows, cols, out: 1 row is the decode case, 2-3 the crash seen, 17 past a 16-row micro-tile; widths from the
# smallest allowed to a real hidden size.
CASES = ((1, 16, 8), (2, 32, 24), (3, 48, 40), (17, 64, 33), (1, 80, 96), (5, 128, 64), (2, 512, 16), (3, 2048, 32))
_TIMEOUT_S = 120

_LOCK = threading.Lock()
_VERDICT: dict[str, dict[str, str]] = {}  # path -> dtype -> "ok" or why not


@dataclass(frozen=True)
class CaseResult:
    dtype: str
    ok: bool
    why: str


def int8pack_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The kernel under check: x [n, in] (bf16/fp16/fp32), q int8 [out, in], scale [out] in x's dtype -> [n, out]."""
    return torch.ops.aten._weight_int8pack_mm(x, q, scale)


def int8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The slow obvious product in fp32: x @ q.T * scale."""
    return (x.float() @ q.float().T) * scale.float()


def check_dtype(op, dtype_name: str) -> CaseResult:
    """Run `op` over CASES in `dtype_name` against int8_reference. Bound per output: the output's own rounding
    (2^-8 |y| in bf16, 2^-10 in fp16) plus 2^-12 (bf16) / 2^-14 (fp16) / 1e-5 (fp32) of sum |x q s| for the
    order of the sum; the scale is given in x's dtype to both, so its rounding is not an error."""
    dtype = getattr(torch, dtype_name)
    rel, acc = {torch.bfloat16: (2.0**-8, 2.0**-12), torch.float16: (2.0**-10, 2.0**-14)}.get(dtype, (0.0, 1e-5))
    g = torch.Generator().manual_seed(1234)
    for rows, cols, out in CASES:
        x = torch.randn(rows, cols, generator=g).to(dtype)  # [n, in]
        q = torch.randint(-127, 128, (out, cols), generator=g, dtype=torch.int8)  # [out, in]
        scale = (torch.rand(out, generator=g) * 0.02 + 1e-3).to(dtype)  # [out]
        got = op(x, q, scale)
        want = int8_reference(x, q, scale)  # [n, out]
        if tuple(got.shape) != (rows, out):
            return CaseResult(dtype_name, False, f"shape {tuple(got.shape)} for {rows}x{cols} -> {out}")
        bound = rel * want.abs() + acc * (x.float().abs() @ q.float().abs().T) * scale.float() + 1e-6
        err = (got.float() - want).abs()
        if not bool(torch.isfinite(got.float()).all()) or bool((err > bound).any()):
            worst = float(err.nan_to_num(float("inf")).max())
            return CaseResult(dtype_name, False, f"wrong results at {rows}x{cols} -> {out} (error {worst:.3g} "
                                                 f"against values up to {float(want.abs().max()):.3g})")
    return CaseResult(dtype_name, True, "ok")


def _child() -> None:
    """The checking process: argv = op ("module:function") and dtypes; one JSON line per dtype as it finishes."""
    import importlib

    module, _, attr = sys.argv[1].partition(":")
    op = getattr(importlib.import_module(module), attr)
    for name in sys.argv[2:]:
        print(json.dumps({"start": name}), flush=True)
        r = check_dtype(op, name)
        print(json.dumps({"dtype": r.dtype, "ok": r.ok, "why": r.why}), flush=True)


def run_check(op: str = f"{__name__}:int8pack_mm", dtypes: tuple[str, ...] = DTYPES,
              env: dict[str, str] | None = None) -> dict[str, str]:
    """Check `op` (a "module:function" the child imports) per dtype in child processes -> dtype -> "ok" or why
    not. A child that dies (a crash, a timeout) marks the dtype it was on and the rest go on in a new child."""
    left, verdict = list(dtypes), {}
    code = f"import {__name__} as m; m._child()"
    while left:
        try:
            proc = subprocess.run([sys.executable, "-c", code, op, *left], capture_output=True, text=True,
                                  timeout=_TIMEOUT_S, env=env)
            out, err, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out = (e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout) or ""
            err, rc = "timeout", None
        current = None
        for line in out.splitlines():
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "start" in msg:
                current = msg["start"]
            elif msg.get("dtype") in left:
                verdict[msg["dtype"]] = "ok" if msg["ok"] else msg["why"]
                left.remove(msg["dtype"])
                current = None
        if not left:
            break
        if current is None:  # died before a dtype began (an import error): nothing of this op can be trusted
            tail = " ".join(err.split())[-200:]
            why = f"the check could not run (exit {rc}: {tail})"
            verdict.update({d: why for d in left})
            break
        how = f"timed out after {_TIMEOUT_S} s" if rc is None else (
            f"crashed (signal {-rc})" if rc < 0 else f"exited with {rc}")
        verdict[current] = f"the check {how}"
        left.remove(current)
    return verdict


def _key() -> str:
    from .native import _cpu_flags

    parts = [torch.__version__, torch.backends.cpu.get_cpu_capability(), _cpu_flags(), platform.machine(),
             str(CHECK_VERSION)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def _cache_path():
    from .native import cache_dir

    return cache_dir() / f"torch-paths-{_key()}.json"


def _load_cached() -> dict[str, str] | None:
    try:
        data = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return None
    got = data.get("int8pack_mm") if isinstance(data, dict) else None
    if not isinstance(got, dict) or set(got) != set(DTYPES) or not all(isinstance(v, str) for v in got.values()):
        return None  # damaged or from another layout: check again
    return got


def _save(verdict: dict[str, str]) -> None:
    from ..io.files import atomic_write

    try:
        atomic_write(_cache_path(), json.dumps({"int8pack_mm": verdict}, indent=1), fsync=False)
    except OSError:
        pass  # a read-only cache: the check runs again next time, never a failure


def verdict() -> dict[str, str]:
    """int8pack_mm's per-dtype verdict on this machine (cached on disk; checked on the first call ever)."""
    if os.environ.get(ENV, "1") == "0":
        return {d: f"{ENV}=0" for d in DTYPES}
    if "int8pack_mm" not in _VERDICT:
        with _LOCK:
            if "int8pack_mm" not in _VERDICT:
                got = _load_cached()
                if got is None:
                    got = run_check()
                    _save(got)
                _VERDICT["int8pack_mm"] = got
    return _VERDICT["int8pack_mm"]


def int8pack_usable(dtype: torch.dtype, cols: int) -> bool:
    """Whether `_weight_int8pack_mm` may take an x of `dtype` with `cols` columns on this machine."""
    if cols % 16 != 0:
        return False
    name = str(dtype).removeprefix("torch.")
    return verdict().get(name) == "ok"


def status() -> list[str]:
    """One line per guarded path: what is used, and why not where it is not."""
    v = verdict()
    ok = [d for d in DTYPES if v.get(d) == "ok"]
    bad = [f"{d}: {v.get(d)}" for d in DTYPES if v.get(d) != "ok"]
    line = f"torch _weight_int8pack_mm: {'used for ' + ', '.join(ok) if ok else 'not used'} " \
           f"({KNOWN_GUARDS['int8pack_mm']})"
    return [line + (f"; not used for {'; '.join(bad)}" if bad else "")]


def reset() -> None:
    """Forget the verdict (tests): the next call loads or checks again."""
    with _LOCK:
        _VERDICT.clear()
