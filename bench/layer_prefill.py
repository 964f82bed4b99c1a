"""A prompt's MoE layers in one native call each vs one expert at a time from Python (MOECHAT_LAYER_PREFILL=1 / 0),
whole engines, side by side.

    python bench/layer_prefill.py --row /work/vs/qwen3-shaped-2:int8 --row /work/vs/qwen3-shaped-2:int4 \\
        --row /work/vs/gpt-oss-shaped-2:native [--threads 1,2] [--rounds 3] [--prompt 128] [--tokens 16]

A row is MODEL_DIR:FORMAT: int8 and int4 run the experts and the dense projections in that format (`--expert-format`
and `--dense-format`, as bench/vs_llamacpp.py's rows), native keeps the checkpoint's (GPT-OSS's MXFP4). Each
measurement is a fresh process: load, a warm-up generation, then a `--prompt`-token prompt and `--tokens` greedy
tokens whose prefill and decode tok/s (GenerationChunk's figures) are reported; the two settings alternate (ABBA)
round by round, and the table gives medians with the spread (min-max) and whether both produced the same greedy
tokens (they compute the same bits: tests/engine/test_moe_prefill.py).

`--base DIR` compares builds instead: the kernels compiled from DIR (an older engine/quant folder: its native*.c
files, e.g. `git archive REV engine/quant | tar -x -C /tmp/base`) against this tree's, both with the layer call, the
rest of the engine this tree's; the columns then read base / this build.

The layer call (native_prefill_int.c `moechat_moe_prefill_q8`) takes int4, int8 and MXFP4 experts with bf16 tokens:
x and the activations quantized once a pair, both projections cut into (expert, row group, token block) units the
pool's threads claim, the activation and the weighted scatter in C. The per-expert path makes ~10 Python-driven
kernel calls and torch ops an expert, each a pool wake and a wait, and its torch ops run on one core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

FORMATS = {"int8": ("int8", "int8"), "int4": ("int4", "int4"), "native": (None, "native")}


def _run(model: str, fmt: str, threads: int, prompt: int, tokens: int, source: str | None = None) -> dict:
    """One generation in this process (the --worker side), as bench/bf16_cpu.py's engine part runs one; `source`: the
    native kernels built from that folder's native*.c instead of this tree's."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bf16_cpu import _engine_run

    if source:
        from moechat.engine.quant import native

        native.SOURCE = Path(source) / "native.c"

    experts, dense = FORMATS[fmt]
    return _engine_run(model, threads, prompt, tokens, experts, dense)


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--row", action="append", default=[], metavar="MODEL_DIR:FORMAT",
                    help=f"a model folder and a format ({', '.join(FORMATS)}); repeatable")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--base", default=None, metavar="DIR",
                    help="an older engine/quant folder: its kernels against this tree's (both with the layer call)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--source", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    if a.worker:
        model, _, fmt = a.worker.rpartition(":")
        print(json.dumps(_run(model, fmt, threads[0], a.prompt, a.tokens, a.source)))
        return
    if a.base and not Path(a.base, "native.c").is_file():
        ap.error(f"--base {a.base}: no native.c there (give an engine/quant folder)")
    if not a.row:
        ap.error("give at least one --row MODEL_DIR:FORMAT (bench/vs_llamacpp.py writes such models)")
    for row in a.row:
        model, _, fmt = row.rpartition(":")
        if fmt not in FORMATS or not Path(model, "config.json").is_file():
            ap.error(f"--row {row}: want MODEL_DIR:FORMAT, a folder with a config.json and one of {', '.join(FORMATS)}")
    load = os.getloadavg()[0]
    print(f"{a.prompt}-token prompt, {a.tokens} greedy tokens; tok/s, median (min-max) of {a.rounds} rounds, the "
          f"settings alternating; load average {load:.1f} before")
    what = ("base", "this build", "this / base") if a.base else ("per expert", "layer call", "layer / per expert")
    print(f"| model | format | threads | prefill: {what[0]} | prefill: {what[1]} | {what[2]} | "
          f"decode: {what[0]} | decode: {what[1]} | same tokens |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for row in a.row:
        model, _, fmt = row.rpartition(":")
        for T in threads:
            res: dict[str, list[dict]] = {"0": [], "1": []}
            for r in range(a.rounds):
                for flag in ("0", "1") if r % 2 == 0 else ("1", "0"):
                    env = dict(os.environ, MOECHAT_LAYER_PREFILL="1" if a.base else flag)
                    cmd = [sys.executable, __file__, "--worker", row, "--threads", str(T), "--prompt", str(a.prompt),
                           "--tokens", str(a.tokens)] + (["--source", a.base] if a.base and flag == "0" else [])
                    out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                         check=True).stdout.splitlines()[-1]
                    res[flag].append(json.loads(out))
            pre = {k: [x["prefill"] for x in v] for k, v in res.items()}
            dec = {k: [x["decode"] for x in v] for k, v in res.items()}
            same = all(x["tokens"] == res["0"][0]["tokens"] for v in res.values() for x in v)
            ratio = statistics.median(pre["1"]) / statistics.median(pre["0"])
            print(f"| {Path(model).name} | {fmt} | {T} | {_med(pre['0'])} | {_med(pre['1'])} | {ratio:.2f}x | "
                  f"{_med(dec['0'])} | {_med(dec['1'])} | {'yes' if same else 'NO'} |", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
