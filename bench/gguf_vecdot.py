"""One token through a Qwen3-30B-A3B expert's w13 (1536 x 2048) per GGUF type: the tile path (decode 256 rows to
fp32, one GEMM) against native_gguf.c's integer dots (x to Q8 blocks once, integer sums per row), with bf16
F.linear beside; the three interleaved in every round, medians printed.

    python bench/gguf_vecdot.py [--threads 1] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from moechat.engine.quant.gguf import TILE_ROWS, TYPES, VECDOT_TYPES, decode_rows, vecdot

R, C = 1536, 2048  # w13 of one Qwen3-30B-A3B expert: 2 x 768 rows of the 2048-wide hidden state


def blocks(name: str, rng) -> torch.Tensor:
    """[R, row_bytes] valid blocks: the gguf package's quantizer for the 32-blocks, random codes for the k-quants."""
    t = TYPES[name]
    if name in ("Q8_0", "Q4_0"):
        from gguf import GGMLQuantizationType, quants

        w = rng.standard_normal((R, C)).astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType[name])).view(np.uint8))
    raw = rng.integers(0, 256, size=(R * C // t.block, t.nbytes), dtype=np.uint8)
    half = rng.uniform(0.001, 0.05, size=(raw.shape[0], 2)).astype(np.float16).view(np.uint8)
    if name == "Q6_K":
        raw[:, -2:] = half[:, :2]
    else:
        raw[:, 0:4] = half
    return torch.from_numpy(raw.reshape(R, -1))


def tiles(x: torch.Tensor, raw: torch.Tensor, t) -> torch.Tensor:
    y = torch.empty(1, R)
    for r in range(0, R, TILE_ROWS):
        torch.matmul(x, decode_rows(raw[r:r + TILE_ROWS], t, C).t(), out=y[:, r:r + TILE_ROWS])
    return y


def ms(f, n: int = 20) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    wb, xb = torch.randn(R, C).bfloat16(), torch.randn(1, C).bfloat16()
    x = torch.randn(1, C)
    print(f"one token, w13 {R} x {C}, {a.threads} thread(s), medians of {a.rounds} interleaved rounds")
    print(f"{'type':6} {'MB':>5} {'bf16 ms':>8} {'tiles ms':>9} {'int-dot ms':>11} {'speed-up':>9} {'GB/s':>6}")
    for name in sorted(VECDOT_TYPES):
        t, raw = TYPES[name], blocks(name, rng)
        b, o, n = [], [], []
        for _ in range(a.rounds):
            b.append(ms(lambda: F.linear(xb, wb)))
            o.append(ms(lambda: tiles(x, raw, t)))  # noqa: B023
            n.append(ms(lambda: vecdot(x, raw, t, C)))  # noqa: B023
        mb, mo, mn = (statistics.median(v) for v in (b, o, n))
        print(f"{name:6} {raw.numel() / 1e6:5.2f} {mb:8.3f} {mo:9.3f} {mn:11.3f} {mo / mn:8.1f}x "
              f"{raw.numel() / mn / 1e6:6.1f}")


if __name__ == "__main__":
    main()
