"""Decode tok/s at 1 and 2 (or --threads) torch threads, with OpenMP's default wait policy vs OMP_WAIT_POLICY=passive,
on the bundled demo model and a Qwen3-30B-A3B-shaped checkpoint (bench/format_compute.py's `qwen3_shaped`), per
expert format (bf16 as shipped, int8, int4), optionally for two source trees side by side (A/B of two commits).

    python bench/threads.py [--rounds 5] [--tokens 64] [--layers 1] [--threads 1,2] [--skip-qwen3]
                            [--model DIR] [--formats native,int8,int4] [--policies default,passive]
                            [--tree before=/path/holding/a/moechat/package ...]

A --tree is a folder holding a `moechat` package (moechat/engine, moechat/app: e.g. links into `git archive` of
another commit) imported instead of the installed one (PYTHONPATH); the table then has a column per tree.

Each measurement is a fresh process (OMP_WAIT_POLICY is read once, when torch loads its OpenMP runtime): load, 8
greedy tokens of warm-up, then `--tokens` greedy tokens whose decode tok/s is the figure; the configurations are
interleaved round by round (a busy neighbour hits all of them alike) and the table gives medians with the spread
(min-max), the load average before and after, and whether every configuration produced the same greedy tokens
(the engine's thread-count invariance: one line per model).

Why: torch's OpenMP workers spin after each op (libgomp's default, OMP_WAIT_POLICY unset: ~200 ms on a
machine with fewer threads than cores) and take the core that native.c's pool wants next (issue 27); passive puts
them to sleep at once. `moechat run`/`serve`/`chat` set passive before torch loads unless the user set a policy
(engine/plan/hardware/cores.py quiet_openmp), and size the pool with `--threads` (default `leave_a_core`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "assets" / "demo-moe"

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams
fmt = sys.argv[4] if len(sys.argv) > 4 else "native"
if len(sys.argv) > 5 and int(sys.argv[5]):  # the native pool's own count; torch's set by argv[2]
    from moechat.engine.quant import native
    native.pin_threads(native.library(), int(sys.argv[5]))
engine = Engine.load(sys.argv[1], dtype="bfloat16", expert_format=None if fmt == "native" else fmt)
engine.eos_token_ids = frozenset()  # fixed-length replies
greedy = SamplingParams(temperature=0.0, do_sample=False)
prompt = list(range(3, 19))
list(engine.generate(prompt, sampling=greedy, max_tokens=8))
chunks = list(engine.generate(prompt, sampling=greedy, max_tokens=int(sys.argv[3])))
print(json.dumps({"tok_s": chunks[-1].decode_tokens_per_s, "tokens": [t for c in chunks for t in c.token_ids],
                  "threads": torch.get_num_threads()}))
"""


def measure(model: Path, threads: int, policy: str | None, tokens: int, fmt: str = "native",
            tree: str | None = None, pool: int = 0) -> dict:
    """One fresh process: `threads` torch threads (and the native pool's, unless `pool` gives its own count)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    if tree is not None:
        env["PYTHONPATH"] = tree
    out = subprocess.run([sys.executable, "-c", CHILD, str(model), str(threads), str(tokens), fmt, str(pool)], env=env,
                         check=True, capture_output=True, text=True, timeout=600, cwd=tree or None)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=1, help="layers of the Qwen3-30B-A3B-shaped model")
    ap.add_argument("--threads", type=lambda v: [int(t) for t in v.split(",")], default=[1, 2])
    ap.add_argument("--skip-qwen3", action="store_true")
    ap.add_argument("--work", type=Path, help="where the Qwen3-shaped checkpoint is kept (default: a temp dir)")
    ap.add_argument("--model", type=Path, help="measure this checkpoint (instead of the demo and the Qwen3 shape)")
    ap.add_argument("--formats", type=lambda v: v.split(","), default=["native"],
                    help="expert formats: native (as shipped), int8, int4")
    ap.add_argument("--policies", type=lambda v: [None if p == "default" else p for p in v.split(",")],
                    default=[None, "passive"], help="OpenMP wait policies: default, passive")
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR",
                    help="a folder holding a moechat package to measure instead of the installed one (repeatable)")
    args = ap.parse_args()
    if args.tree:
        trees = [tuple(t.split("=", 1)) for t in args.tree]
        trees = [(label, str(Path(d).resolve())) for label, d in trees]
        return compare_trees(args, trees)

    models = {"demo": DEMO}
    tmp = None
    if args.model is not None:
        models = {args.model.name: args.model}
    elif not args.skip_qwen3:
        sys.path.insert(0, str(ROOT / "bench"))
        from format_compute import qwen3_shaped

        work = args.work or Path(tmp := tempfile.mkdtemp(prefix="moechat-threads-"))
        path = work / f"qwen3-shaped-{args.layers}"
        if not (path / "config.json").exists():
            qwen3_shaped(path, args.layers)
        models[f"qwen3-shaped ({args.layers} layer{'s' if args.layers > 1 else ''})"] = path

    configs = [(t, p) for t in args.threads for p in (None, "passive")]
    load0 = os.getloadavg()[0]
    rates: dict[tuple[str, int, str | None], list[float]] = {}
    tokens: dict[str, set[tuple[int, ...]]] = {}
    for r in range(args.rounds):
        for name, path in models.items():
            for t, p in (configs if r % 2 == 0 else configs[::-1]):  # ABBA: drift hits both orders
                got = measure(path, t, p, args.tokens)
                rates.setdefault((name, t, p), []).append(got["tok_s"])
                tokens.setdefault(name, set()).add(tuple(got["tokens"]))
    load1 = os.getloadavg()[0]

    print(f"cores {os.cpu_count()}, load average {load0:.1f} before, {load1:.1f} after; {args.rounds} interleaved "
          f"rounds of {args.tokens} greedy bf16 tokens; decode tok/s median (min-max)")
    print(f"{'model':<28}{'threads':>8}{'OMP default':>24}{'passive':>24}{'passive/default':>17}")
    for name in models:
        for t in args.threads:
            cells, med = [], []
            for p in (None, "passive"):
                v = rates[(name, t, p)]
                med.append(statistics.median(v))
                cells.append(f"{med[-1]:.1f} ({min(v):.1f}-{max(v):.1f})")
            print(f"{name:<28}{t:>8}{cells[0]:>24}{cells[1]:>24}{med[1] / med[0]:>16.2f}x")
        base = {p: statistics.median(rates[(name, args.threads[0], p)]) for p in (None, "passive")}
        for t in args.threads[1:]:
            print(f"{'':<28}{f'{t} / {args.threads[0]} threads':>20}"
                  + "".join(f"{statistics.median(rates[(name, t, p)]) / base[p]:>23.2f}x" for p in (None, "passive")))
        print(f"{'':<28}greedy tokens {'identical' if len(tokens[name]) == 1 else 'DIFFER'} across every "
              f"configuration")
    if tmp:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def compare_trees(args, trees: list[tuple[str, str]]) -> None:
    """Decode tok/s per format and thread count for each source tree, interleaved round by round (ABBA), the first
    policy of --policies only; medians (min-max) and each tree's ratio to the first."""
    model = args.model or DEMO
    policy = args.policies[0]
    configs = [(f, t, tree) for f in args.formats for t in args.threads for tree in trees]
    load0 = os.getloadavg()[0]
    rates: dict[tuple, list[float]] = {}
    tokens: dict[tuple, set] = {}
    for r in range(args.rounds):
        for f, t, (label, d) in (configs if r % 2 == 0 else configs[::-1]):
            got = measure(model, t, policy, args.tokens, f, d)
            rates.setdefault((f, t, label), []).append(got["tok_s"])
            tokens.setdefault((f, label), set()).add(tuple(got["tokens"]))
    load1 = os.getloadavg()[0]
    print(f"{model.name}: cores {os.cpu_count()}, load average {load0:.1f} before, {load1:.1f} after; {args.rounds} "
          f"interleaved rounds of {args.tokens} greedy tokens, OMP_WAIT_POLICY={policy or 'default'}; decode tok/s "
          "median (min-max)")
    labels = [label for label, _ in trees]
    print(f"{'format':<8}{'threads':>8}" + "".join(f"{label:>22}" for label in labels)
          + "".join(f"{label + '/' + labels[0]:>18}" for label in labels[1:]))
    for f in args.formats:
        for t in args.threads:
            med = [statistics.median(rates[(f, t, label)]) for label in labels]
            cells = [f"{m:.2f} ({min(rates[(f, t, label)]):.2f}-{max(rates[(f, t, label)]):.2f})"
                     for m, label in zip(med, labels, strict=True)]
            print(f"{f:<8}{t:>8}" + "".join(f"{c:>22}" for c in cells)
                  + "".join(f"{m / med[0]:>17.2f}x" for m in med[1:]))
        for label in labels:
            one = statistics.median(rates[(f, args.threads[0], label)])
            ratios = ", ".join(f"{t}/{args.threads[0]} threads {statistics.median(rates[(f, t, label)]) / one:.2f}x"
                               for t in args.threads[1:])
            same = len(tokens[(f, label)]) == 1
            print(f"{'':<8}{label}: {ratios}; greedy tokens {'identical' if same else 'DIFFER'} across thread counts")


if __name__ == "__main__":
    main()
