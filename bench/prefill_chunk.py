"""Prefill tok/s by chunk size on one checkpoint, bf16 and int4 experts resident: the engine's own choice
(quant/prefill.machine_chunk_size, from the last-level cache) beside fixed sizes, interleaved rounds, medians.

    python bench/prefill_chunk.py /work/bench_scratch/qwen3-shaped-2 --prompt 1024 --chunks 256,512,1024 --runs 3

Prints one table per format; the first token must be the same at every chunk size (prefill in chunks is exact).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--chunks", type=lambda v: [int(c) for c in v.split(",")], default=[256, 512, 1024])
    ap.add_argument("--formats", type=lambda v: v.split(","), default=["native", "int4"])
    ap.add_argument("--runs", type=int, default=3, help="interleaved rounds (after one warm-up round)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from moechat.engine.runtime.generate import Engine
    from moechat.engine.runtime.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, do_sample=False)
    prompt = list(range(3, 3 + args.prompt))
    engines = {f: Engine.load(args.model, expert_format=f) for f in args.formats}
    chosen = next(iter(engines.values())).prefill_chunk
    sizes = sorted(set(args.chunks) | {chosen})
    tok = {(f, c): [] for f in args.formats for c in sizes}
    firsts = {f: set() for f in args.formats}
    for i in range(args.runs + 1):
        for f, engine in engines.items():
            for c in sizes:
                engine.prefill_chunk = c
                chunk = next(iter(engine.generate(prompt, sampling=greedy, max_tokens=1, stop_on_eos=False)))
                firsts[f].add(tuple(chunk.token_ids))
                if i:
                    tok[(f, c)].append(chunk.prefill_tokens_per_s)
    print(f"{args.prompt}-token prompt, {args.threads} thread(s), {args.runs} interleaved rounds, engine's choice "
          f"{chosen}; load average {os.getloadavg()[0]:.1f}")
    print("| experts | chunk | prefill tok/s median | spread | vs 512 |")
    print("|---|---:|---:|---|---:|")
    for f in args.formats:
        base = statistics.median(tok[(f, 512)]) if (f, 512) in tok else None
        for c in sizes:
            med = statistics.median(tok[(f, c)])
            mark = " (chosen)" if c == chosen else ""
            ratio = f"{med / base:.2f}x" if base else "-"
            print(f"| {f} | {c}{mark} | {med:.1f} | {min(tok[(f, c)]):.1f}-{max(tok[(f, c)]):.1f} | {ratio} |")
        print(f"| {f} | same first token at every chunk | {'yes' if len(firsts[f]) == 1 else 'NO'} | | |")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
