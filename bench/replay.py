"""Replay routing traces through the real eviction policies; print hit rates side by side.

    python bench/replay.py [TRACE.npz ...] [--shared] [--json] [--max-tokens N (default 3000; 0: all)]

With no trace given (or with --shared): every .npz under ../shared/traces (seen from the repository root),
plus those given.
For each trace, capacities of 10%, 25%, 50% and 75% of a layer's experts (at least top-k, so one token's
experts fit), two setups:
  per-layer  each MoE layer has its own cache of C experts and its own policy instance;
  global     one policy over all (layer, expert) keys, capacity C x MoE layers.
A step is one row of the trace (one token at one layer): the pool accesses its K experts, then for each
miss evicts the policy's victim (never one of the step's own experts) and admits the miss, as
engine/cache/provider/core.py does. Caches start cold; decode traces replay each generation cold, prefill
traces one stream across prompts (the setup of ../shared/traces/README.md section 3, whose table is
then recomputed under its own definitions and compared; for the DeepSeek rows that needs the whole
trace, --max-tokens 0). `--json` prints a list of {trace, policy, pool, capacity_per_layer, hit_rate}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from moechat.engine.cache.policy import LAYERED, POLICIES, EvictionPolicy, make_policy
from moechat.engine.cache.trace import DECODE, RoutingTrace

SHARED_TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
FRACTIONS = (0.10, 0.25, 0.50, 0.75)
DEFAULT_MAX_TOKENS = 3000

# ../shared/traces/README.md section 3: (file name, C per layer) -> (LRU, LFU, LFRU, Belady) hit rates.
README_TABLE = {
    ("deepseek_v2_lite_puffin_prefill_part1.npz", 8): (0.308, 0.300, 0.309, 0.414),
    ("deepseek_v2_lite_puffin_prefill_part1.npz", 16): (0.471, 0.436, 0.450, 0.663),
    ("deepseek_v2_lite_puffin_prefill_part1.npz", 32): (0.707, 0.664, 0.678, 0.868),
    ("mixtral_8x7b_instruct_fp8_decode_routing.npz", 4): (0.612, 0.603, 0.622, 0.739),
    ("mixtral_8x7b_instruct_fp8_decode_routing.npz", 6): (0.809, 0.811, 0.824, 0.894),
}
# The README's definitions, as options of the real classes: its LFU counts accesses since admission, and
# its LFRU counts age in tokens (one tick per K accesses of a layer's stream).
README_POLICIES = (("LRU", "lru", {}), ("LFU", "lfu", {"history": False}),
                   ("LFRU", "lfru", {"accesses_per_tick": "K"}), ("Belady", "belady", {}))


def segments(trace: RoutingTrace) -> list[np.ndarray]:
    """Row indices replayed with a cold cache each: per generation for decode traces, else one stream."""
    if len(trace) and (trace.phase == DECODE).all():
        starts = np.flatnonzero(np.diff(trace.sequence, prepend=-1))
        return np.split(np.arange(len(trace)), starts[1:])
    return [np.arange(len(trace))]


def steps_of(trace: RoutingTrace, rows: np.ndarray) -> list[list[tuple[int, int]]]:
    """Each row's distinct keys, in order: what one call of the provider asks for."""
    layers = trace.layer[rows].tolist()
    out = []
    for layer, ids in zip(layers, trace.topk_ids[rows].tolist(), strict=True):
        out.append([(layer, e) for e in dict.fromkeys(ids)])
    return out


def run_steps(policy: EvictionPolicy, steps: list[list[tuple[int, int]]], capacity: int) -> int:
    """Drive `policy` through a pool of `capacity` slots; returns the hits."""
    resident: set = set()
    hits = 0
    access, victim, evict, admit = policy.access, policy.victim, policy.evict, policy.admit
    for keys in steps:
        misses = []
        for key in keys:
            access(key)
            if key in resident:
                hits += 1
            else:
                misses.append(key)
        for key in misses:
            if len(resident) >= capacity:
                v = victim(keys)
                evict(v)
                resident.discard(v)
            admit(key)
            resident.add(key)
    return hits


def build(name: str, kwargs: dict, steps, capacity: int, top_k: int) -> EvictionPolicy:
    kw = {k: (top_k if v == "K" else v) for k, v in kwargs.items()}
    if name == "belady":
        kw["future"] = [key for keys in steps for key in keys]
    return make_policy(name, capacity=capacity, **kw)


def hit_rate(trace: RoutingTrace, name: str, c_layer: int, pool: str, kwargs: dict | None = None) -> float:
    hits = requests = 0
    for seg in segments(trace):
        if pool == "per-layer":
            groups = [seg[trace.layer[seg] == layer] for layer in np.unique(trace.layer[seg])]
            capacity = c_layer
        else:
            groups = [seg]
            capacity = c_layer * len(np.unique(trace.layer[seg]))
        for rows in groups:
            steps = steps_of(trace, rows)
            policy = build(name, kwargs or {}, steps, capacity, trace.top_k)
            hits += run_steps(policy, steps, capacity)
            requests += sum(len(k) for k in steps)
    return hits / requests if requests else float("nan")


def limit_tokens(trace: RoutingTrace, max_tokens: int | None) -> RoutingTrace:
    """The rows of the first `max_tokens` (sequence, token) pairs in execution order."""
    if not max_tokens:
        return trace
    pair = trace.sequence.astype(np.int64) * (int(trace.token.max()) + 1) + trace.token
    _, first = np.unique(pair, return_index=True)
    keep = np.sort(first)[:max_tokens]
    return trace.take(np.isin(pair, pair[keep]))


def describe(path: Path, trace: RoutingTrace, n_tokens_full: int) -> str:
    L = len(trace.moe_layers)
    tokens = len(np.unique(trace.sequence.astype(np.int64) * (int(trace.token.max()) + 1) + trace.token))
    phase = "decode" if (trace.phase == DECODE).all() else "prefill" if not trace.phase.any() else "mixed"
    sub = "" if tokens == n_tokens_full else f" (first {tokens:,} of {n_tokens_full:,} tokens: --max-tokens)"
    setup = "each generation cold" if len(segments(trace)) > 1 else "one stream, cache kept across prompts"
    return (f"{path.name}: {trace.model or 'unknown model'}\n  {phase}, {tokens:,} tokens{sub}, {L} MoE layers x "
            f"{trace.num_experts} experts, top-{trace.top_k}; {setup}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="*", type=Path)
    ap.add_argument("--shared", action="store_true", help="replay ../shared/traces too (the default with no TRACE)")
    ap.add_argument("--json", action="store_true", help="print a JSON list of rows instead of tables")
    ap.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                    help=f"replay only the first N tokens of each trace; 0: all (default {DEFAULT_MAX_TOKENS}: "
                         "both shared traces in under 2 minutes on one core; the DeepSeek one in full, 22,287 "
                         "tokens, takes 15-20 minutes)")
    ap.add_argument("--policies", default=",".join(POLICIES), help="online policies to run (Belady always runs)")
    ap.add_argument("--no-readme-check", action="store_true", help="skip recomputing README section 3")
    args = ap.parse_args(argv)

    paths = list(args.traces)
    if not paths or args.shared:
        shared = sorted(SHARED_TRACES.glob("**/*.npz"))
        paths = shared + [p for p in paths if p.resolve() not in {s.resolve() for s in shared}]
    if not paths:
        print(f"no traces given and none found in {SHARED_TRACES}", file=sys.stderr)
        return 2
    names = [p for p in args.policies.split(",") if p]
    rows = []
    for path in paths:
        full = RoutingTrace.load(path)
        trace = limit_tokens(full, args.max_tokens)
        n_full = len(np.unique(full.sequence.astype(np.int64) * (int(full.token.max()) + 1) + full.token))
        if not args.json:
            print(describe(path, trace, n_full))
        t0 = time.perf_counter()
        E, K = trace.num_experts, trace.top_k
        caps = sorted({max(K, round(f * E)) for f in FRACTIONS})
        if not args.json:
            print("  capacity per layer: " + ", ".join(
                f"{f:.0%} of {E} -> {max(K, round(f * E))}" + (f" (at least top-{K})" if round(f * E) < K else "")
                for f in FRACTIONS))
        results: dict[tuple[str, str, int], float] = {}
        for pool in ("per-layer", "global"):
            for c in caps:
                for name in [*names, "belady"]:
                    base = name.removesuffix(LAYERED)
                    if pool == "per-layer" and base != name and base in names:
                        rate = results[(pool, base, c)]  # one layer per pool: per-layer sizing changes nothing
                    else:
                        rate = hit_rate(trace, name, c, pool)
                    results[(pool, name, c)] = rate
                    rows.append(dict(trace=path.name, policy=name, pool=pool, capacity_per_layer=c, hit_rate=rate))
            if not args.json:
                print_table(pool, caps, E, names, results)
        readme = None
        if not args.no_readme_check and any(k[0] == path.name for k in README_TABLE):
            if len(trace) == len(full):
                readme = readme_check(path.name, trace, results)
            elif not args.json:
                print("  README section 3 check skipped: the trace was cut by --max-tokens (0 replays it all)")
        if not args.json:
            if readme:
                print(readme)
            print(f"  ({time.perf_counter() - t0:.0f} s)\n")
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


def print_table(pool: str, caps: list[int], E: int, names: list[str], results) -> None:
    header = "".join(f"{n:>15}" for n in [*names, "belady"])
    print(f"\n  {pool} pool: hit rate (fraction of Belady)" + (", capacity C x layers" if pool == "global" else ""))
    print(f"  {'C per layer':<13}{header}")
    for c in caps:
        opt = results[(pool, "belady", c)]
        best = max(results[(pool, n, c)] for n in names)
        cells = []
        for n in names:
            r = results[(pool, n, c)]
            mark = "*" if r == best else " "
            cells.append(f"{r:7.3f} ({r / opt:.3f}){mark}".rjust(15))
        cells.append(f"{opt:7.3f}".rjust(15))
        print(f"  {f'{c}/{E} ({c / E:.0%})':<13}" + "".join(cells))
    if pool == "per-layer" and any(n.endswith(LAYERED) for n in names):
        print(f"  (* best online policy; X{LAYERED} is X here, each pool holding one layer)")
    else:
        print("  (* best online policy)")


def readme_check(file: str, trace: RoutingTrace, results) -> str:
    lines = ["\n  README section 3 (per-layer; its LFU counts since admission, its LFRU ages in tokens):",
             "  C per layer          LRU      LFU     LFRU   Belady   README (LRU LFU LFRU Belady)    match"]
    all_match = True
    for (name, c), expected in sorted(README_TABLE.items()):
        if name != file:
            continue
        got = []
        for _, pol, kw in README_POLICIES:
            if not kw and ("per-layer", pol, c) in results:
                got.append(results[("per-layer", pol, c)])
            else:
                got.append(hit_rate(trace, pol, c, "per-layer", kw))
        ok = all(abs(round(g, 3) - e) < 1e-9 for g, e in zip(got, expected, strict=True))
        all_match &= ok
        E = trace.num_experts
        lines.append(f"  {f'{c}/{E}':<16}" + "".join(f"{g:9.4f}" for g in got) + "   "
                     + " ".join(f"{e:.3f}" for e in expected) + f"   {'yes' if ok else 'NO'}")
    lines.append(f"  numbers {'match' if all_match else 'do NOT all match'} README section 3 (to 3 decimals)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
