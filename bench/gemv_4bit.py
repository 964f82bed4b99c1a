"""GB/s of the one-token int4 (groups of 32) and MXFP4 GEMVs over a bf16 x (native.c's integer path), the default
build (-march=native: the AVX-512 loop on a CPU with AVX-512 BW) against the AVX2-only build (-march=x86-64-v3), at
one and two threads.

    python bench/gemv_4bit.py [--reps 9] [--threads 1,2] [--formats int4,mxfp4] [--shapes head,w13,w2,hot]
                              [--build NAME=-DFLAG,...] [--lib NAME=path/to/kernels.so] [--mb 96]

Shapes (Qwen3-30B-A3B): the LM head 151936 x 2048 (one matrix, 175 MB in int4), an expert's w13 1536 x 2048 and w2
2048 x 768. An expert matrix (0.9-1.7 MB) fits in L2/L3, so a sample cycles over enough distinct random matrices
(--mb, default 96 MB: 3x a 32 MB L3) that each call reads its bytes from RAM, as a decode step does; `hot` is one
512 x 2048 matrix (0.5 MB) called again and again from L2: the kernel's own rate, no RAM in the way. GB/s = packed
bytes (codes + scales) of a sample / its time; the calls go straight to ctypes with y allocated once. Builds run in
turn within each round (ABAB..., a busy neighbour hits all alike); the table gives the median and the spread
(min-max) over --reps rounds, and each build's ratio to the first. --build adds a build with extra compiler flags
(e.g. avx512-8k=-DI16_AHEAD=8192); --lib loads a prebuilt library (another commit's). Every build's outputs are
checked bit for bit against the first's ("bits": same, or the builds that differ). No timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from moechat.engine.quant import native

AVX2_FLAGS = ("-O3", "-march=x86-64-v3", "-shared", "-fPIC", "-fno-math-errno")  # AVX2 + FMA + F16C, no AVX-512
SHAPES = {"head": (151936, 2048), "w13": (1536, 2048), "w2": (2048, 768), "hot": (512, 2048)}  # rows, cols


def cpu_has(flag: str) -> bool:
    try:
        return f" {flag} " in f" {Path('/proc/cpuinfo').read_text()} ".replace("\n", " ")
    except OSError:
        return False


def isa(lib) -> str:
    """What the 4-bit integer GEMV of `lib` was built for (moechat_i16_isa; a library without it: AVX2)."""
    try:
        return {0: "scalar", 1: "AVX2", 2: "AVX-512BW", 3: "AVX-512VNNI"}[lib.moechat_i16_isa()]
    except AttributeError:
        return "AVX2 (no moechat_i16_isa)"


def matrices(fmt: str, rows: int, cols: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n random packed matrices (codes, scales): any byte is a valid code; scales finite and moderate."""
    g = torch.Generator().manual_seed(rows + cols)
    out = []
    for _ in range(n):
        codes = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
        if fmt == "int4":
            scales = (torch.rand(rows, cols // 32, generator=g) * 1e-2 + 1e-3).half()
        else:
            scales = torch.randint(118, 130, (rows, cols // 32), dtype=torch.uint8, generator=g)
        out.append((codes, scales))
    return out


def caller(lib, fmt: str, rows: int, cols: int, x: torch.Tensor, y: torch.Tensor):
    """A function that runs one GEMV of a (codes, scales) pair into y: the bare ctypes call."""
    fn = lib.moechat_int4_gemv if fmt == "int4" else lib.moechat_mxfp4_gemv
    xp, yp = x.data_ptr(), y.data_ptr()
    if fmt == "int4":
        return lambda c, s: fn(xp, 1, c.data_ptr(), s.data_ptr(), rows, cols, 32, yp)
    return lambda c, s: fn(xp, 1, c.data_ptr(), s.data_ptr(), rows, cols, yp)


def sample(call, mats, calls: int) -> float:
    """Seconds for `calls` GEMVs cycling over mats."""
    t0 = time.perf_counter()
    for i in range(calls):
        rc = call(*mats[i % len(mats)])
        if rc:
            raise RuntimeError(f"kernel returned {rc}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--formats", default="int4,mxfp4")
    ap.add_argument("--shapes", default="head,w13,w2,hot")
    ap.add_argument("--mb", type=float, default=96.0, help="bytes an expert shape cycles over")
    ap.add_argument("--build", action="append", default=[], help="NAME=-DFLAG,... (extra flags on the default build)")
    ap.add_argument("--lib", action="append", default=[], help="NAME=path to a prebuilt kernel library")
    ap.add_argument("--no-avx2", action="store_true", help="leave the AVX2-only build out")
    args = ap.parse_args()

    libs = {"native": native.build_and_load()}
    if not args.no_avx2:
        libs["avx2"] = native.build_and_load(AVX2_FLAGS)
    for spec in args.build:
        name, flags = spec.split("=", 1)
        libs[name] = native.build_and_load(native.FLAGS + tuple(f for f in flags.split(",") if f))
    for spec in args.lib:
        name, path = spec.split("=", 1)
        libs[name] = native.load(Path(path))
    print(f"CPU: avx512bw {'yes' if cpu_has('avx512bw') else 'no'}, avx512_vnni "
          f"{'yes' if cpu_has('avx512_vnni') else 'no'}; builds: "
          + ", ".join(f"{k} ({isa(v)})" for k, v in libs.items()))
    names = list(libs)
    head = f"{'format':6} {'shape':5} {'rows x cols':>13} {'thr':>3}  " + "  ".join(f"{n:>22}" for n in names)
    print(head + "  bits")
    x = torch.randn(1, 2048 * 2, generator=torch.Generator().manual_seed(1)).bfloat16()
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            rows, cols = SHAPES[shape]
            per = rows * cols // 2 + rows * cols // 32 * (2 if fmt == "int4" else 1)  # bytes a matrix
            n = 1 if shape in ("head", "hot") else max(2, int(args.mb * 2**20 / per) + 1)
            mats = matrices(fmt, rows, cols, n)
            calls = {"head": 3, "hot": 200}.get(shape, n)
            xs = x[:, :cols].contiguous()
            ys = {k: torch.empty(rows) for k in names}
            fns = {k: caller(libs[k], fmt, rows, cols, xs, ys[k]) for k in names}
            bits = {}
            for k in names:  # the outputs of the first matrix, before timing (as int32: NaN == NaN)
                fns[k](*mats[0])
                bits[k] = ys[k].clone().view(torch.int32)
            differ = [k for k in names if not torch.equal(bits[k], bits[names[0]])]
            for t in (int(s) for s in args.threads.split(",")):
                for k in names:
                    native.set_threads(libs[k], t)
                    sample(fns[k], mats, calls)  # warm: pool started, pages touched
                gbs = {k: [] for k in names}
                for _ in range(args.reps):
                    for k in names:
                        gbs[k].append(per * calls / sample(fns[k], mats, calls) / 1e9)
                base = statistics.median(gbs[names[0]])
                cells = []
                for k in names:
                    m = statistics.median(gbs[k])
                    cells.append(f"{m:5.1f} ({min(gbs[k]):4.1f}-{max(gbs[k]):4.1f}) {m / base:4.2f}x")
                print(f"{fmt:6} {shape:5} {f'{rows} x {cols}':>13} {t:>3}  " + "  ".join(f"{c:>22}" for c in cells)
                      + f"  {'same' if not differ else 'differ: ' + ','.join(differ)}", flush=True)
            del mats
    for lib in libs.values():
        native.set_threads(lib, 1)


if __name__ == "__main__":
    main()
