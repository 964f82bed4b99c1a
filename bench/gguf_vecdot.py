"""One token through GGUF matrices per type. Default: an LM head out of cache (151936 x 2048, 75-330 MB a type):
native_gguf.c's integer dots (x to Q8 blocks once, integer sums per row) in GB/s of weights read, beside a read
probe (torch's fp32 sum over a 1 GB tensor, one thread) measured in the same rounds, and optionally (--base FILE)
an older native_gguf.c built beside it (a serial pool, one thread) for before/after; every path interleaved in every
round, medians and the spread (min-max) printed. --expert: the old table, one Qwen3-30B-A3B w13 (1536 x 2048) in
cache: bf16 F.linear, the tile path (decode 256 rows to fp32, one GEMM), the integer dots. --prefill: T = 4 / 32 /
128 tokens through that w13: the tile path against the many-token kernel (4-row blocks decoded once into an fp32
scratch, fp32 FMA tiles). Timings only, never asserted.

    python bench/gguf_vecdot.py [--rounds 7] [--types Q6_K,Q8_0] [--base old_native_gguf.c] [--expert] [--prefill]
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from moechat.engine.quant.gguf import TILE_ROWS, TYPES, VECDOT_TYPES, decode_rows, prefill, vecdot

R, C = 1536, 2048  # w13 of one Qwen3-30B-A3B expert: 2 x 768 rows of the 2048-wide hidden state
HEAD = 151936  # Qwen's vocabulary: the LM head's rows


QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4", "BF16", "F16")
# where each other type keeps its fp16 scale(s): random codes, sane scales
SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q2_K": (80, 2), "Q3_K": (108, 1), "Q6_K": (208, 1), "IQ4_XS": (0, 1),
          "IQ4_NL": (0, 1), "Q8_0": (0, 1), "Q4_0": (0, 1), "Q4_1": (0, 2), "Q5_0": (0, 1), "Q5_1": (0, 2)}
_POOL = """#include <stdint.h>
int moechat_parallel_for(int (*fn)(void *, int64_t, int64_t), void *ctx, int64_t units, int64_t align,
                         int64_t bytes) { (void)align; (void)bytes; return fn(ctx, 0, units); }
"""


def blocks(name: str, rng, rows: int = R, quantize: bool = True) -> torch.Tensor:
    """[rows, row_bytes] valid blocks: the gguf package's quantizer where it has one (if `quantize`), random codes
    with sane scales for the others."""
    t = TYPES[name]
    if name == "F32":
        return torch.from_numpy(rng.standard_normal((rows, C)).astype(np.float32).view(np.uint8))
    if quantize and name in QUANTIZABLE:
        from gguf import GGMLQuantizationType, quants

        w = rng.standard_normal((rows, C)).astype(np.float32)
        q = np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType[name]))
        return torch.from_numpy(q.view(np.uint8).reshape(rows, -1))
    raw = rng.integers(0, 256, size=(rows * C // t.block, t.nbytes), dtype=np.uint8)
    if name == "MXFP4":
        raw[:, 0] = rng.integers(118, 124, size=raw.shape[0])  # E8M0 scales 2^-10 .. 2^-4
    else:
        at, n = SCALES[name]
        raw[:, at:at + 2 * n] = rng.uniform(0.001, 0.05, size=(raw.shape[0], n)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def tiles(x: torch.Tensor, raw: torch.Tensor, t) -> torch.Tensor:
    y = torch.empty(x.shape[0], R)  # [T, R]
    for r in range(0, R, TILE_ROWS):
        torch.matmul(x, decode_rows(raw[r:r + TILE_ROWS], t, C).t(), out=y[:, r:r + TILE_ROWS])
    return y


def ms(f, n: int = 20) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e3


def build_base(src: str):
    """`src` (a native_gguf.c) built as this machine's library is (-O3 -march=native) with a serial pool."""
    d = Path(tempfile.mkdtemp(prefix="gguf_base_"))
    (d / "pool.c").write_text(_POOL)
    so = d / "base.so"
    subprocess.run([shutil.which("cc") or "cc", "-O3", "-march=native", "-shared", "-fPIC", "-fno-math-errno", "-o",
                    str(so), src, str(d / "pool.c"), "-lm"], check=True)
    fn = ctypes.CDLL(str(so)).moechat_gguf_vecdot
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def spread(v: list[float]) -> str:
    return f"{statistics.median(v):5.1f} ({min(v):4.1f}-{max(v):4.1f})"


def head(a, names, rng) -> None:
    base = build_base(a.base) if a.base else None
    probe = torch.ones(256 << 20)  # 1 GB of fp32: far beyond the L3
    x = torch.randn(1, C)
    print(f"one token, {HEAD} x {C} (out of cache), 1 thread, GB/s of weights read: medians (min-max) of {a.rounds} "
          f"interleaved rounds; probe: torch's fp32 sum over 1 GB, read in the same rounds")
    print(f"{'type':6} {'MB':>5} {'probe GB/s':>17} {'now GB/s':>17} {'ratio':>5}"
          + (f" {'base GB/s':>17} {'ratio':>5} {'now/base':>8} {'bits':>5}" if base else ""))
    for name in names:
        if name not in VECDOT_TYPES:
            continue
        t, raw = TYPES[name], blocks(name, rng, HEAD, quantize=False)
        gb = raw.numel() / 1e9
        y = torch.empty(1, HEAD)
        vecdot(x, raw, t, C)  # the library built and loaded, the pages touched
        p, n, o = [], [], []
        for _ in range(a.rounds):
            p.append(probe.numel() * 4 / 1e9 / (ms(lambda: probe.sum(), 1) / 1e3))
            n.append(gb / (ms(lambda: vecdot(x, raw, t, C), 2) / 1e3))  # noqa: B023
            if base:
                old = lambda: base(t.id, x.data_ptr(), raw.data_ptr(), HEAD, C, y.data_ptr())  # noqa: B023, E731
                o.append(gb / (ms(old, 2) / 1e3))
        mp = statistics.median(p)
        line = f"{name:6} {raw.numel() / 1e6:5.0f} {spread(p):>17} {spread(n):>17} {statistics.median(n) / mp:5.2f}"
        if base:
            same = torch.equal(vecdot(x, raw, t, C), y)
            line += (f" {spread(o):>17} {statistics.median(o) / mp:5.2f} "
                     f"{statistics.median(n) / statistics.median(o):7.2f}x {'same' if same else 'DIFF':>5}")
        print(line)


def one_token(a, names, rng) -> None:
    wb, xb = torch.randn(R, C).bfloat16(), torch.randn(1, C).bfloat16()
    x = torch.randn(1, C)
    print(f"\none token, w13 {R} x {C}, {a.threads} thread(s), medians of {a.rounds} interleaved rounds")
    print(f"{'type':6} {'MB':>5} {'bf16 ms':>8} {'tiles ms':>9} {'int-dot ms':>11} {'speed-up':>9} {'GB/s':>6}")
    for name in names:
        if name not in VECDOT_TYPES:
            continue
        t, raw = TYPES[name], blocks(name, rng)
        b, o, n = [], [], []
        for _ in range(a.rounds):
            b.append(ms(lambda: F.linear(xb, wb)))
            o.append(ms(lambda: tiles(x, raw, t)))  # noqa: B023
            n.append(ms(lambda: vecdot(x, raw, t, C)))  # noqa: B023
        mb, mo, mn = (statistics.median(v) for v in (b, o, n))
        print(f"{name:6} {raw.numel() / 1e6:5.2f} {mb:8.3f} {mo:9.3f} {mn:11.3f} {mo / mn:8.1f}x "
              f"{raw.numel() / mn / 1e6:6.1f}")


def many_tokens(a, names, rng) -> None:
    print(f"\nT tokens, w13 {R} x {C}, {a.threads} thread(s), medians of {a.rounds} interleaved rounds: the tile path "
          f"(256 rows decoded, torch's GEMM) against prefill (4-row blocks decoded once, fp32 FMA tiles)")
    Ts = (4, 32, 128)
    print(f"{'type':6} " + " ".join(f"{f'T={T} tiles':>12} {'prefill':>8} {'x':>5}" for T in Ts))
    xs = {T: torch.randn(T, C) for T in Ts}
    for name in names:
        t, raw = TYPES[name], blocks(name, rng)
        cells = []
        for T in Ts:
            o, p = [], []
            n = max(1, 16 // T)
            for _ in range(a.rounds):
                o.append(ms(lambda: tiles(xs[T], raw, t), n))  # noqa: B023
                p.append(ms(lambda: prefill(xs[T], raw, t, C), n))  # noqa: B023
            mo, mp = statistics.median(o), statistics.median(p)
            cells.append(f"{mo:12.2f} {mp:8.2f} {mo / mp:4.1f}x")
        print(f"{name:6} " + " ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="threads of --expert / --prefill (the head: one)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--types", default="", help="comma-separated GGUF types (default: every one)")
    ap.add_argument("--base", default="", help="an older native_gguf.c to time beside this one (the LM head)")
    ap.add_argument("--expert", action="store_true", help="also one token through a w13 in cache, against tiles")
    ap.add_argument("--prefill", action="store_true", help="also T = 4 / 32 / 128 tokens: tiles against prefill")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    names = a.types.split(",") if a.types else sorted(TYPES)
    torch.set_num_threads(1)
    head(a, names, rng)
    torch.set_num_threads(a.threads)
    if a.expert:
        one_token(a, names, rng)
    if a.prefill:
        many_tokens(a, names, rng)


if __name__ == "__main__":
    main()
