"""Warm start of the expert cache: none, moechat's saved routing profile, or a llama.cpp imatrix.

    python bench/imatrix_warm.py [--model assets/demo-moe] [--corpus /work/demo_build/corpus] [--slots 16 32]
                                 [--prompts 6] [--tokens 160] [--prompt-tokens 8]

Live part (the demo model, CPU, C expert slots, misses loaded into a slot, prefetch off): each held-out prompt
runs on a freshly loaded engine per configuration (interleaved), its first --prompt-tokens tokens (default 8) as
the prompt and greedy
decoding to --tokens tokens in all; the hit rate is the slot hit rate over every expert request of the first 16,
40 and --tokens tokens (the prefill is one step per layer: with 8 tokens it routes to up to 16 experts a layer,
which can flush a small warm cache before decode starts), median over prompts.
- cold: empty slots (--no-warm-start).
- profile: the routing profile moechat saved after an earlier session of other held-out prompts (what
  `--warm-start` reads by default).
- imatrix: an imatrix in llama.cpp's GGUF format (written by engine/cache/imatrix.py) made as llama-imatrix makes
  one: the model's routing counted over calibration text (--calib-texts documents of the training corpus, up to
  256 tokens each, prefill only), read back and ranked per layer (`--warm-start imatrix:FILE`).

Trace part: the recorded trace shipped with the demo model (assets/demo-moe/routing_trace.npz, 4 sequences)
replayed through an LRU of C slots started empty, from the other sequences' counts (a profile, leave one out),
and from the imatrix above: hit rate over each sequence's first --tokens tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WINDOWS = (16, 40, 160)  # hit rate over the first N tokens (prompt included)


def _texts(path: Path, n: int, skip: int = 0) -> list[str]:
    """n documents of a corpus file, spread over its domains (every k-th line)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    step = max(1, len(lines) // (n + skip))
    picked = [json.loads(line)["text"] for line in lines[::step]]
    return picked[skip:skip + n]


def _engine(model: Path, slots: int, warm_start, profile_dir: Path):
    from moechat.engine.cache.provider import CacheConfig
    from moechat.engine.runtime.generate import Engine

    config = CacheConfig(expert_slots=slots, prefetch="off", warm_start=warm_start, profile_dir=str(profile_dir))
    return Engine.load(model, dtype="float32", cache=config)


def _rate(snap) -> float:
    return sum(snap.hits) / max(1, sum(snap.hits) + sum(snap.misses))


def _run(engine, ids: list[int], total: int, prompt_tokens: int = 8) -> dict[int, float]:
    """Greedy decode to `total` tokens; the hit rate so far at each window's end."""
    from moechat.engine.runtime.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, do_sample=False)
    rates, done = {}, prompt_tokens
    for chunk in engine.generate(ids[:prompt_tokens], sampling=greedy, max_tokens=total - prompt_tokens,
                                 stop_on_eos=False):
        done += len(chunk.token_ids)
        if done in WINDOWS or done == total:
            rates[done] = _rate(engine.cache_snapshot())
    return rates


def record_imatrix(model: Path, texts: list[str], out: Path) -> np.ndarray:
    """Routing counts [L, E] over calibration text (prefill), written as llama.cpp's GGUF imatrix."""
    from moechat.engine.cache.imatrix import write_gguf_imatrix
    from moechat.engine.cache.provider import CacheConfig
    from moechat.engine.runtime.generate import Engine

    engine = Engine.load(model, dtype="float32", cache=CacheConfig(expert_slots=None, warm_start=False))
    from moechat.engine.runtime.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, do_sample=False)
    for text in texts:
        ids = engine.tokenizer.encode(text)[:256]
        for _ in engine.generate(ids, sampling=greedy, max_tokens=1):
            pass
    counts = engine.provider.frequency.astype(np.float64)
    write_gguf_imatrix(out, counts, datasets=[f"demo corpus: {len(texts)} documents"])
    return counts


def save_profile_from_session(model: Path, slots: int, prompts: list[list[int]], total: int, profile_dir: Path):
    engine = _engine(model, slots, False, profile_dir)
    for ids in prompts:
        _run(engine, ids, total, 8)
    engine.close()  # writes the routing profile
    return engine.profile_path


def live(args, imatrix: Path, work: Path) -> dict[int, dict[tuple[str, int], list[float]]]:
    from moechat.engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(args.model)
    held = _texts(args.corpus / "heldout.jsonl", args.prompts * 2)
    earlier = [tok.encode(t) for t in held[args.prompts:]]  # the "earlier session" the profile comes from
    prompts = [tok.encode(t) for t in held[:args.prompts]]
    results: dict[int, dict[tuple[str, int], list[float]]] = {}
    for slots in args.slots:
        profile_dir = work / f"profiles-{slots}"
        save_profile_from_session(args.model, slots, earlier, args.tokens, profile_dir)
        rates: dict[tuple[str, int], list[float]] = {}
        for ids in prompts:
            for label, warm in (("cold", False), ("profile", True), ("imatrix", f"imatrix:{imatrix}")):
                engine = _engine(args.model, slots, warm, profile_dir)
                for window, rate in _run(engine, ids, args.tokens, args.prompt_tokens).items():
                    rates.setdefault((label, window), []).append(rate)
                engine.provider.quiesce()  # no close(): the saved profile stays the earlier session's
        results[slots] = rates
    return results


def _lru_rate(keys: list[tuple[int, int]], slots: int, start: list[tuple[int, int]]) -> float:
    cache: OrderedDict = OrderedDict((k, None) for k in reversed(start[:slots]))  # most used last = most recent
    hits = 0
    for key in keys:
        if key in cache:
            hits += 1
            cache.move_to_end(key)
        else:
            cache[key] = None
            if len(cache) > slots:
                cache.popitem(last=False)
    return hits / max(1, len(keys))


def _top(scores: np.ndarray) -> list[tuple[int, int]]:
    E = scores.shape[1]
    return [divmod(int(i), E) for i in np.argsort(-scores, axis=None, kind="stable") if scores.reshape(-1)[i] > 0]


def trace_part(args, imatrix_scores: np.ndarray) -> dict[int, dict[tuple[str, int], list[float]]]:
    from moechat.engine.cache.trace import RoutingTrace

    trace = RoutingTrace.load(args.model / "routing_trace.npz")
    seqs = sorted(set(trace.sequence.tolist()))
    out: dict[int, dict[tuple[str, int], list[float]]] = {}
    for slots in args.slots:
        rates: dict[tuple[str, int], list[float]] = {}
        for s in seqs:
            rows = np.flatnonzero(trace.sequence == s)
            others = trace.take(np.flatnonzero(trace.sequence != s))
            profile = np.zeros((trace.num_layers, trace.num_experts))
            np.add.at(profile, (np.repeat(others.layer, trace.top_k), others.topk_ids.reshape(-1)), 1)
            for window in sorted({*WINDOWS, args.tokens}):
                if window > args.tokens:
                    continue
                keys = trace.take(rows[trace.token[rows] - trace.token[rows].min() < window]).requests()
                for label, start in (("cold", []), ("profile", _top(profile)), ("imatrix", _top(imatrix_scores))):
                    rates.setdefault((label, window), []).append(_lru_rate(keys, slots, start))
        out[slots] = rates
    return out


def _table(title: str, results: dict[int, dict[tuple[str, int], list[float]]]) -> None:
    print(f"\n{title}: median hit rate over the first N tokens")
    print(f"{'slots':>6} {'tokens':>6} {'cold':>8} {'profile':>8} {'imatrix':>8}   n")
    for slots, rates in results.items():
        for window in sorted({w for _, w in rates}):
            cells = "".join(f" {statistics.median(rates[(label, window)]):>8.1%}"
                            for label in ("cold", "profile", "imatrix"))
            print(f"{slots:>6} {window:>6}{cells}   {len(rates[('cold', window)])}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "assets" / "demo-moe")
    p.add_argument("--corpus", type=Path, default=Path("/work/demo_build/corpus"))
    p.add_argument("--slots", type=int, nargs="+", default=[16, 32])
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--tokens", type=int, default=160)
    p.add_argument("--calib-texts", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=8)
    args = p.parse_args(argv)
    if not (args.corpus / "train.jsonl").is_file():
        print(f"no corpus at {args.corpus} (train.jsonl, heldout.jsonl): pass --corpus", file=sys.stderr)
        return 2
    from moechat.engine.cache.imatrix import read_imatrix

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        imatrix = work / "demo-moe.imatrix.gguf"
        record_imatrix(args.model, _texts(args.corpus / "train.jsonl", args.calib_texts), imatrix)
        config = json.loads((args.model / "config.json").read_text())
        scores = read_imatrix(imatrix).expert_scores(config["num_hidden_layers"], config["num_experts"])
        experts = config["num_hidden_layers"] * config["num_experts"]
        print(f"demo model: {experts} experts ({config['num_hidden_layers']} layers x {config['num_experts']}, "
              f"top-{config['num_experts_per_tok']}); first {args.tokens} tokens per prompt")
        _table(f"live (CPU, misses loaded into slots, prefetch off, {args.prompt_tokens}-token prompts)",
               live(args, imatrix, work))
        _table("recorded trace (assets/demo-moe/routing_trace.npz, LRU)", trace_part(args, scores))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
