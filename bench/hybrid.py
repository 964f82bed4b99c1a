"""Where misses run: decode tok/s of load-only vs host-only vs auto, side by side in one run.

At 10%, 25% and 50% of the experts in slots (every expert in the RAM tier), on the bundled demo model and on
a Qwen3-30B-A3B-shaped model (real widths: H 2048, I 768, 128 experts, top-8; a few layers, random bf16
weights written to disk). On a CPU "load" is a memcpy from the RAM tier into a RAM slot and "host" computes
in place; on CUDA (`--device cuda`) load crosses the PCIe link and host runs on the CPU while the GPU runs
the resident experts. The three modes are interleaved (ABAB) over --runs rounds; medians and spread.

    python bench/hybrid.py [--device cpu|cuda] [--runs 5] [--tokens 48] [--layers 2] [--skip-qwen] [--threads]
                           [--warm] [--paired 30]

`--paired N` adds host / load on the demo model in process time over N paired rounds (median and quartiles):
the ratio other processes on a shared machine do not bias. `--threads` adds a sweep of torch's intra-op pool
size (the host experts' threads) with misses on the host.
By default the slots start empty, so on a CPU host and auto never slot an expert (every miss in place) while
load fills them; `--warm` starts every mode with the prompt's most used experts in slots, so host and auto
split steps between the slots and the RAM tier (one expert pass on a CPU: engine/layers/experts.py).

Figures (README, "Where misses run on this 2-core CPU"): on a busy 2-core machine the differences between the modes on
the demo model are within the run-to-run spread (host == load's work at 50% warm read 0.88-1.09x); the
host path's per-layer bookkeeping now equals an all-hit load step's, and a split step is one pass.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moechat.engine.cache.provider import CacheConfig
from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(temperature=0.0, do_sample=False)
MODES = ("load", "host", "auto")


def qwen3_shaped(layers: int) -> Path:
    """A Qwen3-30B-A3B-shaped checkpoint (real expert widths, `layers` layers, vocab 4096) in bf16."""
    import transformers

    path = Path(tempfile.mkdtemp(prefix="qwen3_shaped_"))
    config = transformers.AutoConfig.for_model(
        "qwen3_moe", vocab_size=4096, hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    return path


def bench(name: str, path: Path, device: str, runs: int, tokens: int, fractions=(0.10, 0.25, 0.50),
          warm: bool = False) -> None:
    probe = Engine.load(path, device=device)
    a = probe.args
    total = len(probe.loaded.cls.moe_layers(a)) * a.num_experts
    prompt = list(range(3, 19))
    del probe
    counts = None
    if warm:  # how often each expert served this prompt's decode: the slots start with the most used
        counter = Engine.load(path, device=device, cache=CacheConfig(expert_slots=total, warm_start=False))
        for _ in counter.generate(prompt, sampling=GREEDY, max_tokens=tokens, stop_on_eos=False):
            pass
        counts = counter.provider.frequency.copy()
        counter.close()
    rows = []
    for frac in fractions:
        slots = max(1, int(total * frac))
        engines = {m: Engine.load(path, device=device, cache=CacheConfig(expert_slots=slots, on_miss=m,
                                                                          warm_start=False)) for m in MODES}
        if counts is not None:
            for engine in engines.values():
                engine.provider.warm(counts)
        outs = {}
        times = {m: [] for m in MODES}
        for _ in range(runs):
            for m, engine in engines.items():
                t0 = time.perf_counter()
                ids = [t for c in engine.generate(prompt, sampling=GREEDY, max_tokens=tokens, stop_on_eos=False)
                       for t in c.token_ids]
                if device == "cuda":
                    torch.cuda.synchronize()
                times[m].append(len(ids) / (time.perf_counter() - t0))
                outs.setdefault(m, ids)
        same = len({tuple(v) for v in outs.values()}) == 1
        for m, engine in engines.items():
            snap = engine.provider.snapshot()
            host = sum(snap.host_computed)
            loads = snap.expert_loads_decode + snap.expert_loads_prefill
            rows.append((f"{frac:.0%} ({slots})", m, statistics.median(times[m]), min(times[m]), max(times[m]),
                         host, loads, same))
            engine.close()
    print(f"\n{name} on {device}: decode tok/s, {runs} interleaved runs of {tokens} tokens, "
          f"{torch.get_num_threads()} torch threads, slots {'warm (the most used experts)' if warm else 'cold'}")
    print("| slots | on-miss | tok/s median | spread | vs load | misses on host | loads | same output |")
    print("|---|---|---:|---|---:|---:|---:|---|")
    base = {r[0]: r[2] for r in rows if r[1] == "load"}
    for slots, m, med, lo, hi, host, loads, same in rows:
        print(f"| {slots} | {m} | {med:.1f} | {lo:.1f}-{hi:.1f} | {med / base[slots]:.2f}x | {host} | {loads} | "
              f"{'yes' if same else 'NO'} |")


def thread_sweep(path: Path, device: str, runs: int, tokens: int, fraction: float = 0.10) -> None:
    """Host experts run on the forward thread through torch's intra-op pool: its size is the choice. Decode tok/s
    with misses on the host at each pool size from 1 to the usable cores, interleaved, next to the size
    `leave_a_core` picks (every core but one, which the UI, the transfer worker and the CUDA driver use)."""
    from moechat.engine.plan.hardware import leave_a_core, usable_cores

    saved = torch.get_num_threads()
    cores = usable_cores()
    torch.set_num_threads(cores)
    chosen = leave_a_core(torch)
    probe = Engine.load(path, device=device)
    total = len(probe.loaded.cls.moe_layers(probe.args)) * probe.args.num_experts
    del probe
    engine = Engine.load(path, device=device, cache=CacheConfig(expert_slots=max(1, int(total * fraction)),
                                                                on_miss="host", warm_start=False))
    prompt = list(range(3, 19))
    sizes = list(range(1, cores + 1))
    times = {n: [] for n in sizes}
    for _ in range(runs):
        for n in sizes:
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            got = sum(len(c.token_ids) for c in engine.generate(prompt, sampling=GREEDY, max_tokens=tokens,
                                                                stop_on_eos=False))
            if device == "cuda":
                torch.cuda.synchronize()
            times[n].append(got / (time.perf_counter() - t0))
    engine.close()
    torch.set_num_threads(saved)
    print(f"\nhost-expert thread pool on {device} ({path.name}, {fraction:.0%} of experts in slots, misses on the "
          f"host): {cores} usable cores, leave_a_core picks {chosen}")
    print("| torch threads | tok/s median | spread | vs 1 thread | chosen |")
    print("|---:|---:|---|---:|---|")
    one = statistics.median(times[1])
    for n in sizes:
        med = statistics.median(times[n])
        print(f"| {n} | {med:.1f} | {min(times[n]):.1f}-{max(times[n]):.1f} | {med / one:.2f}x | "
              f"{'<-' if n == chosen else ''} |")


def paired(path: Path, device: str, rounds: int, tokens: int, fractions) -> None:
    """host / load decode rate per round in process time (CPU seconds of this process: what other processes on a
    shared machine do not bias), the two engines alternating first; median and quartiles of the per-round ratios."""
    prompt = list(range(3, 19))
    probe = Engine.load(path, device=device)
    total = len(probe.loaded.cls.moe_layers(probe.args)) * probe.args.num_experts
    del probe

    def rate(engine: Engine) -> float:
        t0 = time.process_time()
        n = sum(len(c.token_ids) for c in engine.generate(prompt, sampling=GREEDY, max_tokens=tokens))
        return n / (time.process_time() - t0)

    print(f"\nhost / load in process time, {rounds} paired rounds of {tokens} tokens, slots cold")
    print("| slots | median | quartiles |")
    print("|---|---:|---|")
    for frac in fractions:
        slots = max(1, int(total * frac))
        engines = {m: Engine.load(path, device=device, cache=CacheConfig(expert_slots=slots, on_miss=m,
                                                                          warm_start=False)) for m in ("load", "host")}
        for e in engines.values():
            rate(e)  # the first run fills what a run fills
        ratios = []
        for r in range(rounds):
            order = ("load", "host") if r % 2 == 0 else ("host", "load")
            got = {m: rate(engines[m]) for m in order}
            ratios.append(got["host"] / got["load"])
        q = statistics.quantiles(ratios, n=4)
        print(f"| {frac:.0%} ({slots}) | {statistics.median(ratios):.3f} | {q[0]:.3f}-{q[2]:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--layers", type=int, default=2, help="layers of the Qwen3-shaped model")
    ap.add_argument("--skip-qwen", action="store_true")
    ap.add_argument("--skip-demo", action="store_true")
    ap.add_argument("--fractions", default="0.1,0.25,0.5", help="shares of the experts in slots, comma-separated")
    ap.add_argument("--threads", action="store_true", help="also sweep the host pool's size (Qwen3-shaped)")
    ap.add_argument("--warm", action="store_true",
                    help="start every mode with the slots holding the prompt's most used experts (host and auto then "
                         "split steps between slots and the RAM tier); default: empty slots")
    ap.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                    help="also host / load of the demo model in process time over ROUNDS paired rounds")
    args = ap.parse_args()
    from moechat.engine.plan.hardware import leave_a_core

    leave_a_core(torch)  # the threads moechat run uses (every core but one)
    fractions = tuple(float(f) for f in args.fractions.split(","))
    if not args.skip_demo:
        bench("demo model (6 layers x 16 experts, top-2)", ROOT / "assets" / "demo-moe", args.device, args.runs,
              args.tokens, fractions, args.warm)
        if args.paired:
            paired(ROOT / "assets" / "demo-moe", args.device, args.paired, args.tokens, fractions)
    qwen = None
    if not args.skip_qwen:
        qwen = qwen3_shaped(args.layers)
        bench(f"Qwen3-30B-A3B-shaped ({args.layers} layers x 128 experts, top-8, 9.4 MB experts)",
              qwen, args.device, args.runs, args.tokens, fractions, args.warm)
    if args.threads:
        thread_sweep(qwen or qwen3_shaped(args.layers), args.device, args.runs, args.tokens)


if __name__ == "__main__":
    main()
