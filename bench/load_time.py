"""Load time: moechat's `load_model` beside llama.cpp loading the same model's GGUF, and both beside a plain read.

Each load is a fresh process (as a start is): moechat's `load_model` (every expert resident, bf16, dense weights
memory-mapped, each float byte checked for NaN/Inf) against `llama-simple -m GGUF -n 1`'s own "load time" (mmap,
no check). Rounds alternate the engines (ABBA); the table gives medians and spread, each load's MB/s over the
model's bytes, and the ratio to llama.cpp; the last line is a plain sequential read of the same safetensors files
into one reused buffer (the page cache's bound: what a load that copies each byte once could reach).

The page cache is warm unless `--cold`: then each file is dropped from it (posix_fadvise DONTNEED, as
bench/prefetch.py does) before each load, so each load is the first read of the file since then (on a VM the
host may still cache the disk: say which was measured).

Variants (`--variants`, moechat only): `native` (the build), `torch` (MOECHAT_NATIVE=0: the torch `aminmax`
check, as before issue 27), `4k` (resident experts in plain 4 KB pages instead of hostmem's huge pages).

    python bench/load_time.py --model DIR [--gguf FILE] [--rounds 3] [--threads 1,2] [--variants native,torch,4k]
                              [--expert-format int4 --dense-format int4]
    python bench/load_time.py --work /tmp/lt --layers 2    # writes a Qwen3-30B-A3B-shaped model (and its GGUF)

llama.cpp as bench/vs_llamacpp.py finds it (`--llama-cpp DIR` or MOECHAT_LLAMA_CPP; its converter makes the GGUF
when `--gguf` is not given); without it the table has moechat alone and says why.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import vs_llamacpp  # bench/vs_llamacpp.py: run as a script, this file's folder is on sys.path


def model_files(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


def drop_from_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read(files: list[Path]) -> float:
    """Seconds to read every file front to back in 8 MB preads into one reused buffer."""
    buf = memoryview(bytearray(8 << 20))
    t0 = time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            off = 0
            while n := os.preadv(fd, [buf], off):
                off += n
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def worker(args) -> None:
    """One moechat load in this process; prints its seconds as JSON."""
    import torch

    torch.set_num_threads(args.threads)
    if args.variant == "4k":
        from moechat.engine.cache import hostmem

        hostmem.advise_huge = lambda t: False  # the resident buffers in plain pages
    from moechat.engine.load.loader import load_model

    t0 = time.perf_counter()
    load_model(args.worker, dtype="bfloat16", max_positions=256, expert_format=args.expert_format,
               repack_dir=args.repack_dir, dense_format=args.dense_format)
    print(json.dumps({"load_s": time.perf_counter() - t0}))


def moechat_load(model: Path, threads: int, variant: str, args) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    fmt = ["--expert-format", args.expert_format, "--repack-dir", str(args.repack_dir)] if args.expert_format else []
    fmt += ["--dense-format", args.dense_format] if args.dense_format else []
    if variant == "torch":
        env["MOECHAT_NATIVE"] = "0"
    out = subprocess.run([sys.executable, __file__, "--worker", str(model), "--threads", str(threads), "--variant",
                          variant, *fmt], env=env, capture_output=True, text=True)
    if out.returncode:
        raise vs_llamacpp.BenchError("moechat load failed: " + (out.stderr.strip().splitlines() or ["?"])[-1])
    return json.loads(out.stdout.strip().splitlines()[-1])["load_s"]


def llama_load(llama, gguf: Path, threads: int) -> float:
    out = subprocess.run([llama.tool("llama-simple"), "-m", str(gguf), "-n", "1", "hi"], capture_output=True,
                         text=True, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    m = re.search(r"load time =\s*([0-9.]+) ms", out.stdout + out.stderr)
    if out.returncode or m is None:
        raise vs_llamacpp.BenchError("llama-simple did not report a load time: "
                                     + ((out.stderr or out.stdout).strip().splitlines() or ["?"])[-1])
    return float(m.group(1)) / 1e3


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a safetensors model folder (else one is written)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/load_time"), help="where a written model and GGUF go")
    ap.add_argument("--layers", type=int, default=2, help="of the written Qwen3-30B-A3B-shaped model's 48")
    ap.add_argument("--gguf", type=Path, default=None, help="the same model as GGUF (else converted)")
    ap.add_argument("--llama-cpp", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="2")
    ap.add_argument("--variants", default="native")
    ap.add_argument("--expert-format", default=None, help="int8 / int4: moechat loads the repacked experts "
                    "(written once by the warm-up); pass --gguf of the matching llama.cpp type (Q8_0, Q4_0)")
    ap.add_argument("--repack-dir", type=Path, default=None, help="where the repacked experts go (default: --work)")
    ap.add_argument("--dense-format", default=None, help="int8 / int4: attention and the LM head quantized at load, "
                    "as bench/vs_llamacpp.py's int8 / int4 rows run them")
    ap.add_argument("--cold", action="store_true", help="drop each file from the page cache before each load")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="native", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.expert_format and args.repack_dir is None:
        args.repack_dir = args.work / f"repacked-{args.expert_format}"
    if args.worker is not None:
        args.threads = int(args.threads)
        return worker(args)
    try:
        run(args)
    except vs_llamacpp.BenchError as e:
        sys.exit(f"load_time: {e}")


def run(args) -> None:
    model = args.model
    if model is None:
        model = args.work / f"qwen3-shaped-{args.layers}"
        if not (model / "tokenizer.json").exists():
            vs_llamacpp.qwen3_shaped(model, args.layers)
    llama, why = vs_llamacpp.find_llama_cpp(args.llama_cpp, None)
    gguf = args.gguf
    if llama is not None and gguf is None:
        why = vs_llamacpp.check_converter(llama)
        if why:
            llama = None
        else:
            gguf = vs_llamacpp.convert(llama, model, args.work / f"{model.name}-bf16.gguf", "bf16")
    if llama is not None and not Path(llama.tool("llama-simple")).exists():
        llama, why = None, f"{llama.bin} has no llama-simple: build that target"
    files = model_files(model)
    nbytes = sum(f.stat().st_size for f in files)  # MB/s over the checkpoint's bytes
    threads = [int(t) for t in args.threads.split(",")]
    variants = args.variants.split(",")
    print(f"{model}: {nbytes / 1e9:.2f} GB in {len(files)} safetensors file(s)"
          + (f"; GGUF {gguf} {gguf.stat().st_size / 1e9:.2f} GB" if llama is not None else f"; llama.cpp: {why}"))
    print(f"page cache: {'dropped before each load (--cold)' if args.cold else 'warm'}; {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    moechat_load(model, threads[0], variants[0], args)  # warm-up: the kernel library built, the files paged in
    if args.expert_format:  # moechat reads the repacked experts (written by the warm-up) and the dense weights
        files = files + [args.repack_dir / "experts.bin"]
    seq_bytes = sum(f.stat().st_size for f in files)
    res: dict[tuple, list[float]] = {}
    seq: list[float] = []
    for r in range(args.rounds):
        jobs = [("moechat", t, v) for t in threads for v in variants]
        if llama is not None:
            jobs += [("llama.cpp", t, "") for t in threads]
        for engine, t, v in jobs if r % 2 == 0 else jobs[::-1]:  # ABBA
            if args.cold:
                drop_from_cache(files if engine == "moechat" else [gguf])
            s = moechat_load(model, t, v, args) if engine == "moechat" else llama_load(llama, gguf, t)
            res.setdefault((engine, t, v), []).append(s)
        if args.cold:
            drop_from_cache(files)
        seq.append(sequential_read(files))
        print(f"round {r + 1}/{args.rounds} done (load average {os.getloadavg()[0]:.1f})", flush=True)
    print("\n| engine | variant | threads | load s, median (min-max) | MB/s | vs llama.cpp |")
    print("|---|---|---:|---:|---:|---:|")
    for (engine, t, v), xs in res.items():
        med = statistics.median(xs)
        peer = res.get(("llama.cpp", t, ""))
        ratio = f"{med / statistics.median(peer):.1f}x" if peer and engine == "moechat" else "-"
        size = nbytes if engine == "moechat" else gguf.stat().st_size
        print(f"| {engine} | {v or '-'} | {t} | {spread(xs)} | {size / med / 1e6:,.0f} | {ratio} |")
    print(f"| sequential read ({seq_bytes / 1e9:.2f} GB) | - | 1 | {spread(seq)} | "
          f"{seq_bytes / statistics.median(seq) / 1e6:,.0f} | - |")


if __name__ == "__main__":
    main()
