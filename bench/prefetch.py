"""Prefetch off vs on, same model, prompt and slot budget, experts streamed from a cold disk.

    python bench/prefetch.py [--model assets/demo-moe] [--slots 24] [--new 96] [--runs 3]
    python bench/prefetch.py --traces ../shared/traces      # + replay of real routing traces

Live part: the model is loaded with C expert slots and no RAM tier (every miss reads the safetensors
shards with preadv). Before each run the page cache of the model's files is dropped
(posix_fadvise DONTNEED); with --cold-reads (default) every expert read also drops its pages again, so
each miss costs a device read, as for a model much larger than RAM. Each configuration runs --runs
times, interleaved, each on a freshly loaded engine (no warm start); medians are reported. Decode
figures are the difference between the snapshot after the first token and the one at the end, per
decoded token. Precision: share of predicted experts the layer then used; recall: share of used
experts that were predicted.

Trace part (--traces): the same provider code replayed over recorded routing (no hidden states there,
so only the previous-token predictor can run): demand misses per token with and without it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent

CONFIGS = [  # (label, policy, prefetch, depth, transfer, budget per predicted layer; None = top-k)
    ("lru, no prefetch", "lru", "off", 1, "thread", None),
    ("lrfu-layered, no prefetch", "lrfu-layered", "off", 1, "thread", None),
    ("next-layer, inline", "lrfu-layered", "next-layer", 1, "inline", None),
    ("next-layer", "lrfu-layered", "next-layer", 1, "thread", None),
    ("next-layer, budget 2K", "lrfu-layered", "next-layer", 1, "thread", "2k"),
    ("next-layer, depth 2", "lrfu-layered", "next-layer", 2, "thread", None),
    ("both (+previous token)", "lrfu-layered", "both", 1, "thread", None),
    ("lru + next-layer", "lru", "next-layer", 1, "thread", None),
]


def drop_page_cache(model: Path) -> None:
    for f in model.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_reads_cold(disk) -> None:
    """Every expert read of this DiskStore drops the pages it read: each miss is a device read."""
    from moechat.engine.cache import store as store_mod

    fd_of = disk._fd

    def pread(seg, out):
        store_mod._read_exact(fd_of(seg.file), seg.file, out, seg.offset)
        os.posix_fadvise(fd_of(seg.file), seg.offset, seg.nbytes, os.POSIX_FADV_DONTNEED)

    disk._pread = pread


def prompt_ids(engine) -> list[int]:
    text = ("Write a Python function that reads a JSON file, counts how often each key appears at any depth, "
            "and prints the ten most common keys with their counts.")
    if engine.chat_template is not None:
        return engine.encode_chat([{"role": "user", "content": text}])
    return engine.encode(text)


def run_once(model: Path, slots: int, new: int, cfg, cold_reads: bool, device: str = "cpu", tier: str = "disk") -> dict:
    from moechat.engine.cache.provider import CacheConfig
    from moechat.engine.runtime.generate import Engine

    label, policy, prefetch, depth, transfer, budget = cfg
    if budget == "2k":
        from moechat.engine.load.loader import read_model_config

        budget = 2 * read_model_config(model)[1].top_k
    config = CacheConfig(expert_slots=slots, policy=policy, ram_cache_bytes=0 if tier == "disk" else None,
                         prefetch=prefetch, prefetch_depth=depth, transfer=transfer, warm_start=False,
                         prefetch_budget=budget)
    engine = Engine.load(model, cache=config, device=device)
    if cold_reads and tier == "disk":
        make_reads_cold(engine.provider.store.disk)
    ids = prompt_ids(engine)
    sampling = engine.sampling(temperature=0.0, do_sample=False, repetition_penalty=1.0)
    drop_page_cache(model)
    first = None
    tokens = []
    t_first = None
    for chunk in engine.generate(ids, sampling=sampling, max_tokens=new, stop_on_eos=False):
        tokens.extend(chunk.token_ids)
        if first is None:
            first = engine.cache_snapshot()
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    last = engine.cache_snapshot()
    n = len(tokens) - 1  # decode steps after the first token

    def d(field):
        a, b = getattr(first, field), getattr(last, field)
        return (sum(b) - sum(a)) if isinstance(a, tuple) else b - a

    per_layer = []
    for i in range(len(last.hits)):
        p, c, r = last.predicted[i] - first.predicted[i], last.predicted_correct[i] - first.predicted_correct[i], \
            last.routed[i] - first.routed[i]
        per_layer.append((c / p if p else float("nan"), c / r if r else float("nan")))
    return {
        "label": label, "tokens": tokens, "decode_tok_s": n / (t_end - t_first),
        "misses_per_tok": d("misses") / n, "stall_ms_per_tok": 1e3 * d("stall_seconds") / n,
        "issued_per_tok": d("prefetch_issued") / n, "used_per_tok": d("prefetch_used") / n,
        "wasted_per_tok": d("prefetch_wasted") / n,
        "precision": d("predicted_correct") / d("predicted") if d("predicted") else float("nan"),
        "recall": d("predicted_correct") / d("routed") if d("routed") else float("nan"),
        "per_layer": per_layer,
    }


def fmt(x: float, spec: str = ".2f") -> str:
    return "-" if x != x else format(x, spec)


def live(args) -> None:
    model = Path(args.model)
    torch.set_num_threads(args.threads) if args.threads else None
    results: dict[str, list[dict]] = {cfg[0]: [] for cfg in CONFIGS}
    for r in range(args.runs):
        order = CONFIGS if r % 2 == 0 else CONFIGS[::-1]
        for cfg in order:
            results[cfg[0]].append(run_once(model, args.slots, args.new, cfg, args.cold_reads, args.device,
                                            args.tier))
    ref = results[CONFIGS[0][0]][0]["tokens"]
    for label, runs in results.items():
        for res in runs:
            if res["tokens"] != ref:
                sys.exit(f"{label}: greedy tokens differ from the first configuration's")
    where = ("every expert in (pinned) RAM" if args.tier == "ram" else "no RAM tier, "
             + ("cold reads (pages dropped after each read)" if args.cold_reads else "page cache dropped per run"))
    print(f"\nmodel {model} on {args.device}, {args.slots} slots, {where}, {args.new} new tokens, "
          f"medians of {args.runs} runs, torch threads {torch.get_num_threads()}; greedy output identical in all runs")
    base = statistics.median(r["misses_per_tok"] for r in results[CONFIGS[0][0]])
    base_tps = statistics.median(r["decode_tok_s"] for r in results[CONFIGS[0][0]])
    print("\n| configuration | decode tok/s | vs LRU | demand misses/tok | vs LRU | stall ms/tok | "
          "prefetched/tok | used/tok | wasted/tok | precision | recall |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, runs in results.items():
        m = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k not in ("label", "tokens", "per_layer")}
        print(f"| {label} | {m['decode_tok_s']:.1f} | {m['decode_tok_s'] / base_tps:.2f}x | "
              f"{m['misses_per_tok']:.2f} | {m['misses_per_tok'] / base:.2f} | {m['stall_ms_per_tok']:.2f} | "
              f"{m['issued_per_tok']:.2f} | {m['used_per_tok']:.2f} | {m['wasted_per_tok']:.2f} | "
              f"{fmt(m['precision'])} | {fmt(m['recall'])} |")
    print("\nPrediction accuracy per layer during decode (precision / recall; layer 0 is never predicted):\n")
    labels = ["next-layer", "next-layer, depth 2", "both (+previous token)"]
    print("| layer | " + " | ".join(labels) + " |")
    print("|---:|" + "---:|" * len(labels))
    n_layers = len(results[labels[0]][0]["per_layer"])
    for i in range(n_layers):
        cells = []
        for label in labels:
            p, r = results[label][0]["per_layer"][i]
            cells.append(f"{fmt(p)} / {fmt(r)}")
        print(f"| {i} | " + " | ".join(cells) + " |")


class _ZeroStore:
    """A store for replay: an expert is one float, copying it is free; only the counting matters."""

    expert_bytes = 1

    def read_into(self, layer, expert, dst):
        return "ram", 1


def replay(trace_path: Path, capacity_fraction: float, mode: str) -> dict:
    """The real CachedProvider over a recorded trace: demand misses per token, precision, recall."""
    from moechat.engine.cache.policy import DEFAULT_POLICY, make_policy
    from moechat.engine.cache.prefetch import Predictor
    from moechat.engine.cache.provider import CachedProvider
    from moechat.engine.cache.slots import SlotPool
    from moechat.engine.cache.trace import RoutingTrace

    trace = RoutingTrace.load(trace_path)
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    layers = trace.moe_layers.tolist()
    C = max(K, int(capacity_fraction * len(layers) * E))
    pool = SlotPool(C, L, E, {"w": ((1,), torch.float32)})
    provider = CachedProvider(pool, _ZeroStore(), make_policy(DEFAULT_POLICY, capacity=C))
    provider.set_predictor(Predictor(dict.fromkeys(layers), top_k=K, num_layers=L))
    provider.set_prefetch(mode, 1)
    dummy = torch.zeros(1, 1)
    ids = torch.from_numpy(trace.topk_ids.astype(np.int64))  # [N, K]
    for row, layer in enumerate(trace.layer.tolist()):  # rows are in execution order
        provider.observe(layer, dummy)
        for _ in provider.batches(layer, ids[row : row + 1]):
            pass
    N = len(np.unique(np.stack([trace.sequence, trace.token]), axis=1).T)
    snap = provider.snapshot()
    per_layer = [(c / p if p else float("nan")) for c, p in zip(snap.predicted_correct, snap.predicted, strict=True)]
    return {"misses_per_tok": sum(snap.misses) / N, "precision": snap.prefetch_precision,
            "recall": snap.prefetch_recall, "C": C, "N": N, "per_layer": per_layer, "layers": layers}


def traces(args) -> None:
    root = Path(args.traces)
    files = sorted(root.rglob("*.npz"))
    if not files:
        sys.exit(f"{root}: no moechat .npz traces (convert them with bench/replay.py's loader first)")
    print("\nReplay of recorded routing through the same provider (previous-token prediction; the traces "
          "hold no hidden states, so next-layer prediction cannot run on them):\n")
    print("| trace | tokens | slots (share of all experts) | demand misses/tok, off | previous-token | ratio | "
          "precision | recall |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    per_layer = {}
    for f in files:
        for frac in args.fractions:
            off = replay(f, frac, "off")
            on = replay(f, frac, "previous-token")
            per_layer[f.parent.name] = on
            print(f"| {f.parent.name}/{f.name} | {off['N']} | {off['C']} ({frac:.0%}) | {off['misses_per_tok']:.2f} | "
                  f"{on['misses_per_tok']:.2f} | {on['misses_per_tok'] / off['misses_per_tok']:.2f} | "
                  f"{fmt(on['precision'])} | {fmt(on['recall'])} |")
    print("\nPrevious-token precision per MoE layer (= recall: K predicted, K used):\n")
    for name, on in per_layer.items():
        cells = " ".join(f"{layer}:{fmt(on['per_layer'][layer])}" for layer in on["layers"])
        print(f"- {name}: {cells}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "assets" / "demo-moe"))
    ap.add_argument("--slots", type=int, default=24)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--cold-reads", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tier", choices=["disk", "ram"], default="disk",
                    help="where missed experts come from: the shards on disk (default) or all experts in RAM")
    ap.add_argument("--traces", help="also replay the .npz routing traces under this directory")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--skip-live", action="store_true")
    args = ap.parse_args()
    if not args.skip_live:
        live(args)
    if args.traces:
        traces(args)


if __name__ == "__main__":
    main()
