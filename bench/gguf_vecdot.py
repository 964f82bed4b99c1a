"""One token through a Qwen3-30B-A3B expert's w13 (1536 x 2048) per GGUF type: the tile path (decode 256 rows to
fp32, one GEMM) against native_gguf.c's integer dots (x to Q8 blocks once, integer sums per row), with bf16
F.linear beside; then (--prefill) T = 4 / 32 / 128 tokens through the same w13: the tile path against the many-token
kernel (`prefill`: 4-row blocks decoded once into an fp32 scratch, fp32 FMA tiles). The paths interleaved in every
round, medians printed.

    python bench/gguf_vecdot.py [--threads 1] [--rounds 9] [--prefill] [--types Q4_K,Q6_K]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from moechat.engine.quant.gguf import TILE_ROWS, TYPES, VECDOT_TYPES, decode_rows, prefill, vecdot

R, C = 1536, 2048  # w13 of one Qwen3-30B-A3B expert: 2 x 768 rows of the 2048-wide hidden state


QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4", "BF16", "F16")
# where each other type keeps its fp16 scale(s): random codes, sane scales
SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q2_K": (80, 2), "Q3_K": (108, 1), "Q6_K": (208, 1), "IQ4_XS": (0, 1),
          "IQ4_NL": (0, 1)}


def blocks(name: str, rng) -> torch.Tensor:
    """[R, row_bytes] valid blocks: the gguf package's quantizer where it has one, random codes for the others."""
    t = TYPES[name]
    if name == "F32":
        return torch.from_numpy(rng.standard_normal((R, C)).astype(np.float32).view(np.uint8))
    if name in QUANTIZABLE:
        from gguf import GGMLQuantizationType, quants

        w = rng.standard_normal((R, C)).astype(np.float32)
        q = np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType[name]))
        return torch.from_numpy(q.view(np.uint8).reshape(R, -1))
    raw = rng.integers(0, 256, size=(R * C // t.block, t.nbytes), dtype=np.uint8)
    at, n = SCALES[name]
    raw[:, at:at + 2 * n] = rng.uniform(0.001, 0.05, size=(raw.shape[0], n)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(R, -1))


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


def one_token(a, names, rng) -> None:
    wb, xb = torch.randn(R, C).bfloat16(), torch.randn(1, C).bfloat16()
    x = torch.randn(1, C)
    print(f"one token, w13 {R} x {C}, {a.threads} thread(s), medians of {a.rounds} interleaved rounds")
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
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--prefill", action="store_true", help="also T = 4 / 32 / 128 tokens: tiles against prefill")
    ap.add_argument("--types", default="", help="comma-separated GGUF types (default: every one)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    names = a.types.split(",") if a.types else sorted(TYPES)
    one_token(a, names, rng)
    if a.prefill:
        many_tokens(a, names, rng)


if __name__ == "__main__":
    main()
