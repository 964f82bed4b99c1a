"""bf16 on an AVX2 CPU: the one-token GEMV (native.c, one row a step against two) and the many-token products
(native_prefill_bf16.c's fp32 tiles against torch's bf16 GEMM), at Qwen3-30B-A3B and GPT-OSS-20B shapes, 1 and 2
threads, interleaved, medians and spread.

    python bench/bf16_cpu.py [--reps 7] [--threads 1,2] [--parts gemv,prefill,engine] [--engine DIR,...]

GEMV: native.c built twice from this tree for AVX2 (-march=x86-64-v3, BF16_PAIRS=0 and =1), each loaded with
ctypes and called straight on the raw pointers; the LM heads [151936, 2048] and [201088, 2880] (one matrix, 0.6 and
1.2 GB: read from RAM), and a read probe (numpy's sum over the same bytes as int64, one thread; two threads each
summing a half) in the same rounds. GB/s = the matrix's bytes / the call's time. Both builds' outputs are checked bit
for bit against each other (the pairs keep each row's sums).

Prefill: the product of T bf16 tokens with a bf16 weight [R, in] as moechat's CPU prefill makes it: an expert's w13
[1536, 2048] and w2 [2048, 768] at 8 tokens (128 prompt tokens x top-8 / 128 experts), the same at 32, and the
attention's qkv [5120, 2048] and o [2048, 4096] at 128 tokens; the tiles through quant/prefill.py `bf16` (this
machine's build: it says which kernel it has; the pool on T threads, torch's own ops on one, as the engine runs
them) against torch's `x @ w.t()` in bf16 on T threads (on an AVX2-only CPU torch 2.13
takes its `bf16_dot_with_fp32_arith` fallback) and against the fp32 GEMM of the widened operands (MKL, the widening
counted). Weights cycle over enough distinct matrices (96 MB) that each call reads them from RAM, as a prefill does.

Engine (`--engine DIR,...`: model folders with bf16 dense weights, such as bench/vs_llamacpp.py's Qwen3-30B-A3B- and
GPT-OSS-20B-shaped checkpoints): each a fresh process per run (load, one warm-up generation, then a `--prompt`-token
prompt and `--tokens` greedy tokens), the tiles on and off (MOECHAT_BF16_TILES=0: torch's bf16 GEMM where they would
run) alternating, `--rounds` rounds: prefill and decode tok/s medians, and whether both gave the same tokens.

No timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from moechat.engine.quant import native, prefill

HEADS = {"qwen3 head": (151936, 2048), "gpt-oss head": (201088, 2880)}
PRODUCTS = {"w13 T=8": (8, 1536, 2048), "w2 T=8": (8, 2048, 768), "w13 T=32": (32, 1536, 2048),
            "qkv T=128": (128, 5120, 2048), "o T=128": (128, 2048, 4096)}


def _build(out: Path, *flags: str) -> ctypes.CDLL:
    cc = shutil.which("cc")
    if cc is None:
        raise SystemExit("no C compiler")
    subprocess.run([cc, "-O3", "-march=x86-64-v3", *flags, "-shared", "-fPIC", "-fno-math-errno", "-o", str(out),
                    str(native.SOURCE), "-lm", "-lpthread"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    lib.moechat_bf16_gemv.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_void_p]
    lib.moechat_bf16_gemv.restype = ctypes.c_int
    lib.moechat_set_threads.argtypes = [ctypes.c_int]
    return lib


def _probe(a: np.ndarray, threads: int) -> float:
    """Seconds to sum the array's bytes as int64 on `threads` threads (numpy releases the GIL)."""
    parts = np.array_split(a, threads)
    t0 = time.perf_counter()
    if threads == 1:
        parts[0].sum()
    else:
        ts = [threading.Thread(target=p.sum) for p in parts]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    return time.perf_counter() - t0


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.1f} ({min(xs):.1f}-{max(xs):.1f})"


def gemv(reps: int, threads: list[int]) -> None:
    with tempfile.TemporaryDirectory() as d:
        builds = {"one row": _build(Path(d) / "rows.so", "-DBF16_PAIRS=0"),
                  "two rows": _build(Path(d) / "pairs.so", "-DBF16_PAIRS=1")}
        print(f"\nbf16 GEMV, one token (native.c for AVX2), GB/s median (min-max) over {reps} interleaved rounds")
        print("| matrix | threads | read probe | one row | two rows | two / one |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, (rows, cols) in HEADS.items():
            g = torch.Generator().manual_seed(rows)
            w = (torch.randn(rows, cols, generator=g) * 0.02).bfloat16()
            x = torch.randn(1, cols, generator=g).bfloat16()
            nbytes = w.numel() * 2
            flat = w.view(torch.int16).numpy().reshape(-1).view(np.int64)
            outs = {}
            for T in threads:
                res = {k: [] for k in ("probe", *builds)}
                for _ in range(reps):
                    res["probe"].append(nbytes / _probe(flat, T) / 1e9)
                    for k, lib in builds.items():
                        lib.moechat_set_threads(T)
                        y = torch.empty(1, rows)
                        t0 = time.perf_counter()
                        rc = lib.moechat_bf16_gemv(x.data_ptr(), 1, w.data_ptr(), rows, cols, y.data_ptr())
                        res[k].append(nbytes / (time.perf_counter() - t0) / 1e9)
                        assert rc == 0
                        outs[k] = y
                assert torch.equal(outs["one row"], outs["two rows"]), "the builds' bits differ"
                ratio = statistics.median(res["two rows"]) / statistics.median(res["one row"])
                print(f"| {name} [{rows}, {cols}] | {T} | {_med(res['probe'])} | {_med(res['one row'])} | "
                      f"{_med(res['two rows'])} | {ratio:.2f}x |", flush=True)


def products(reps: int, threads: list[int]) -> None:
    lib = native.decode_library()
    if lib is None or not prefill.has_bf16(lib):
        print(f"\nprefill: this machine takes no bf16 kernel ({native.status()}); skipped")
        return
    kind = {1: "AVX-512 BF16", 2: "fp32 FMA tiles"}[lib.moechat_prefill_bf16_isa()]
    print(f"\nbf16 products of a prefill, ms median (min-max) over {reps} interleaved rounds; the kernel: {kind}")
    print("| product | threads | kernel | GMAC/s | torch bf16 | torch fp32 (widened) | torch bf16 / kernel |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for T in threads:
        native.pin_threads(lib, T)  # the pool on T threads; torch's own ops on one, as the engine runs them (an
        # OpenMP team left spinning on the other core would take it from the pool's worker)
        for name, (tokens, rows, cols) in PRODUCTS.items():
            g = torch.Generator().manual_seed(rows + cols)
            ws = [(torch.randn(rows, cols, generator=g) * 0.02).bfloat16()
                  for _ in range(max(2, 96_000_000 // (rows * cols * 2)))]
            x = torch.randn(tokens, cols, generator=g).bfloat16()
            res = {"kernel": [], "bf16": [], "fp32": []}
            for i in range(reps):
                torch.set_num_threads(1)
                w = ws[i % len(ws)]
                t0 = time.perf_counter()
                prefill.bf16(lib, x, w)
                res["kernel"].append((time.perf_counter() - t0) * 1e3)
                torch.set_num_threads(T)  # torch's GEMMs on all T threads: their best
                w = ws[(i + 1) % len(ws)]
                t0 = time.perf_counter()
                x @ w.t()
                res["bf16"].append((time.perf_counter() - t0) * 1e3)
                w = ws[(i + 2) % len(ws)]
                t0 = time.perf_counter()
                x.float() @ w.float().t()
                res["fp32"].append((time.perf_counter() - t0) * 1e3)
            torch.set_num_threads(1)
            k = statistics.median(res["kernel"])
            print(f"| {name} [{rows}, {cols}] | {T} | {_med(res['kernel'])} | {tokens * rows * cols / k / 1e6:.1f} | "
                  f"{_med(res['bf16'])} | {_med(res['fp32'])} | {statistics.median(res['bf16']) / k:.1f}x |",
                  flush=True)
    native.pin_threads(lib, None)


def _engine_run(model: str, threads: int, prompt: int, tokens: int, expert_format: str | None = None,
                dense_format: str | None = None) -> dict:
    """One generation in this process (the --worker side; bench/layer_prefill.py's too): load, a warm-up, the
    measured one; prefill and decode tok/s and the greedy tokens."""
    from moechat.engine.plan.hardware.cores import set_threads

    set_threads(torch, threads)
    from moechat.engine.runtime.generate import Engine
    from moechat.engine.runtime.sampling import SamplingParams

    engine = Engine.load(model, dtype="bfloat16", context=prompt + tokens + 8, expert_format=expert_format,
                         dense_format=dense_format)
    vocab = engine.args.vocab_size
    greedy = SamplingParams(temperature=0.0, do_sample=False)
    for _ in engine.generate([(i * 104729 + 7) % vocab for i in range(prompt)], sampling=greedy, max_tokens=2,
                             stop_on_eos=False):
        pass
    last, ids = None, []
    for chunk in engine.generate([(i * 7919 + 13) % vocab for i in range(prompt)], sampling=greedy,
                                 max_tokens=tokens, stop_on_eos=False):
        last = chunk
        ids += chunk.token_ids
    return {"prefill": last.prefill_tokens_per_s, "decode": last.decode_tokens_per_s, "tokens": ids}


def engine(models: list[str], threads: list[int], rounds: int, prompt: int, tokens: int) -> None:
    print(f"\nwhole engine, bf16 dense weights: {prompt}-token prompt, {tokens} greedy tokens, tok/s median (min-max) "
          f"over {rounds} rounds, the tiles on and off alternating")
    print("| model | threads | prefill: torch bf16 GEMM | prefill: tiles | tiles / torch | decode: torch | decode: "
          "tiles | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for model in models:
        for T in threads:
            res = {"0": [], "1": []}
            toks = {}
            for r in range(rounds):
                for tiles in (("0", "1") if r % 2 == 0 else ("1", "0")):
                    env = dict(os.environ, MOECHAT_BF16_TILES=tiles)
                    out = subprocess.run([sys.executable, __file__, "--worker", model, "--threads", str(T),
                                          "--prompt", str(prompt), "--tokens", str(tokens)], env=env,
                                         capture_output=True, text=True, check=True).stdout.splitlines()[-1]
                    one = json.loads(out)
                    res[tiles].append(one)
                    toks.setdefault(tiles, one["tokens"])
            pre = {k: [r["prefill"] for r in v] for k, v in res.items()}
            dec = {k: [r["decode"] for r in v] for k, v in res.items()}
            ratio = statistics.median(pre["1"]) / statistics.median(pre["0"])
            print(f"| {Path(model).name} | {T} | {_med(pre['0'])} | {_med(pre['1'])} | {ratio:.2f}x | "
                  f"{_med(dec['0'])} | {_med(dec['1'])} | {'yes' if toks['0'] == toks['1'] else 'NO'} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--parts", default="gemv,prefill")
    ap.add_argument("--engine", default="", help="model folders for the engine part (comma-separated)")
    ap.add_argument("--rounds", type=int, default=2, help="engine rounds")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    if a.worker:
        print(json.dumps(_engine_run(a.worker, threads[0], a.prompt, a.tokens)))
        return
    print(f"{native.status()}; torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    if "gemv" in a.parts:
        gemv(a.reps, threads)
    if "prefill" in a.parts:
        products(a.reps, threads)
    if a.engine:
        engine(a.engine.split(","), threads, a.rounds, a.prompt, a.tokens)


if __name__ == "__main__":
    main()
