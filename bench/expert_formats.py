"""Quality and speed of the expert formats, side by side: native vs --expert-format int8 / int4.

Quality, per model and format, teacher-forced over the same token sequences:
  perplexity (and its ratio to native), top-1 agreement of next-token predictions with native,
  mean KL(native || format) per token, and greedy agreement (the fraction of 32 greedy tokens that
  equal native's, from the same prompts, up to the first divergence counted as all-different after it).
Models: the bundled demo model on held-out text of its own corpus (packaging/demo_model/build_corpus.py
writes it; --corpus DIR points at its output, else the script builds it into a scratch folder when the
Debian packages it reads are installed), and tiny random transformers models (qwen3_moe, mixtral) on
random token sequences (no perplexity meaning there; agreement and KL are what count).

Speed, per format: decode tok/s of the demo model with every expert resident and with a slot pool
holding a quarter of the experts over a RAM tier of the same byte budget for every format (so a smaller
format holds more experts in the same bytes), runs interleaved (ABAB), median and spread.

`--dense`: each format also with the dense weights (attention projections, LM head) in int8 (`--dense-format int8`,
quant/dense_int8.py), quality against the all-native model. `--no-speed` skips the decode speed part.

    python bench/expert_formats.py [--corpus DIR] [--seqs 24] [--seq 256] [--runs 5] [--dense] [--no-speed]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from moechat.engine.cache.provider import CacheConfig
from moechat.engine.layers.kv_cache import KVCache
from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "assets" / "demo-moe"
FORMATS = ("native", "int8", "int4")
GREEDY = SamplingParams(temperature=0.0, do_sample=False)


def variants(dense: bool) -> dict[str, tuple[str, str]]:
    """name -> (expert format, dense format): every expert format, and with --dense each also over int8 dense."""
    out = {fmt: (fmt, "native") for fmt in FORMATS}
    if dense:
        out.update({f"{fmt} + int8 dense": (fmt, "int8") for fmt in FORMATS})
    return out


def load_variants(path, names: dict[str, tuple[str, str]]) -> dict[str, Engine]:
    return {name: Engine.load(path, dtype="float32", expert_format=fmt, dense_format=dense)
            for name, (fmt, dense) in names.items()}


def all_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """fp32 logits [T, V] for every position of ids, prefilled in one chunk."""
    kv = KVCache.for_model(engine.args, len(ids), engine.loaded.dtype, engine.loaded.device)
    with torch.inference_mode():
        hidden = engine.model(torch.tensor(ids, dtype=torch.long), kv, engine.provider)  # [T, H]
        return engine.model.logits(hidden).float()  # [T, V]


def heldout_sequences(corpus: Path | None, seq: int, n: int) -> dict[str, list[list[int]]]:
    """Held-out text of the demo model's corpus, tokenized with its tokenizer, n windows of seq+1 per domain."""
    from tokenizers import Tokenizer

    if corpus is None:
        corpus = Path(tempfile.mkdtemp(prefix="demo_corpus_"))
        r = subprocess.run([sys.executable, str(ROOT / "packaging/demo_model/build_corpus.py"), "--out", str(corpus)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            print(f"(held-out corpus not built: {r.stderr.strip().splitlines()[-1]}; install the Debian packages "
                  "listed in packaging/demo_model/README.md or pass --corpus)")
            return {}
    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    streams: dict[str, list[int]] = {}
    for line in (corpus / "heldout.jsonl").read_text().splitlines():
        d = json.loads(line)
        streams.setdefault(d["domain"], []).extend(tok.encode(d["text"]).ids + [0])
    return {dom: [ids[i * seq:(i + 1) * seq + 1] for i in range(min(n, (len(ids) - 1) // seq))]
            for dom, ids in sorted(streams.items())}


def quality(engines: dict[str, Engine], seqs: list[list[int]], prompts: list[list[int]]) -> dict[str, dict]:
    out = {}
    ref_logits = [all_logits(engines["native"], s[:-1]) for s in seqs]
    ref_greedy = [[t for c in engines["native"].generate(p, sampling=GREEDY, max_tokens=32, stop_on_eos=False)
                   for t in c.token_ids] for p in prompts]
    for name, engine in engines.items():
        nll = agree = kl = count = 0.0
        for s, ref in zip(seqs, ref_logits, strict=True):
            logits = ref if name == "native" else all_logits(engine, s[:-1])
            target = torch.tensor(s[1:])
            logp = torch.log_softmax(logits, -1)
            nll += -logp.gather(1, target[:, None]).sum().item()
            agree += (logits.argmax(-1) == ref.argmax(-1)).sum().item()
            ref_logp = torch.log_softmax(ref, -1)
            kl += (ref_logp.exp() * (ref_logp - logp)).sum().item()
            count += len(target)
        same = total = 0
        for p, want in zip(prompts, ref_greedy, strict=True):
            got = [t for c in engine.generate(p, sampling=GREEDY, max_tokens=32, stop_on_eos=False)
                   for t in c.token_ids]
            for a, b in zip(got, want, strict=False):
                if a != b:
                    break
                same += 1
            total += len(want)
        out[name] = {"ppl": float(torch.exp(torch.tensor(nll / count))), "top1": agree / count, "kl": kl / count,
                     "greedy": same / max(total, 1)}
    return out


def print_quality(title: str, q: dict[str, dict], perplexity: bool = True) -> None:
    print(f"\n{title}")
    print("| format | perplexity | vs native | top-1 agreement | mean KL (nats) | greedy agreement |")
    print("|---|---:|---:|---:|---:|---:|")
    base = q["native"]["ppl"]
    for name, r in q.items():
        ppl = f"{r['ppl']:.3f}" if perplexity else "-"
        ratio = f"{r['ppl'] / base - 1:+.2%}" if perplexity else "-"
        print(f"| {name} | {ppl} | {ratio} | {r['top1']:.4f} | {r['kl']:.5f} | {r['greedy']:.3f} |")


def decode_speed(runs: int, tokens: int) -> None:
    """Decode tok/s of the demo model per format: all resident, and a quarter of the experts' bytes in slots."""
    native = Engine.load(DEMO, dtype="float32")
    a = native.args
    layers = len(native.loaded.cls.moe_layers(a))
    expert_bytes = native.loaded.provider.nbytes() // (layers * a.num_experts)
    budget = layers * a.num_experts * expert_bytes // 4  # a quarter of the native experts' bytes
    prompt = native.encode_chat([{"role": "user", "content": "What does json.dumps do?"}])
    configs = {}
    for fmt in FORMATS:
        configs[(fmt, "resident")] = Engine.load(DEMO, dtype="float32", expert_format=fmt)
        probe = Engine.load(DEMO, dtype="float32", expert_format=fmt, cache=CacheConfig(expert_slots=1))
        per = probe.provider.store.expert_bytes
        probe.close()
        slots = max(1, budget // per)
        configs[(fmt, f"slots={slots}")] = Engine.load(
            DEMO, dtype="float32", expert_format=fmt,
            cache=CacheConfig(expert_slots=slots, ram_cache_bytes=budget, warm_start=False))
    times: dict[tuple, list[float]] = {k: [] for k in configs}
    for _ in range(runs):  # ABAB: every configuration once per round
        for key, engine in configs.items():
            t0 = time.perf_counter()
            n = sum(len(c.token_ids) for c in engine.generate(prompt, sampling=GREEDY, max_tokens=tokens,
                                                                stop_on_eos=False))
            times[key].append(n / (time.perf_counter() - t0))
    print(f"\ndemo model decode tok/s ({runs} interleaved runs of {tokens} tokens, {torch.get_num_threads()} "
          f"threads; slot runs hold a quarter of the native experts' bytes, {budget / 2**20:.2f} MiB, in slots "
          "and the same in RAM)")
    print("| format | experts held | expert MiB | tok/s median | spread (min-max) | vs native, same holding |")
    print("|---|---|---:|---:|---|---:|")
    for (fmt, where), xs in times.items():
        med = statistics.median(xs)
        same = [v for k, v in times.items() if k[0] == "native" and (k[1] == "resident") == (where == "resident")]
        engine = configs[(fmt, where)]
        per = (engine.provider.store.expert_bytes if where != "resident"
               else engine.loaded.provider.nbytes() / (layers * a.num_experts))
        print(f"| {fmt} | {where} | {per / 2**20:.3f} | {med:.1f} | {min(xs):.1f}-{max(xs):.1f} | "
              f"{med / statistics.median(same[0]):.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, help="build_corpus.py's output folder (heldout.jsonl)")
    ap.add_argument("--seqs", type=int, default=24, help="held-out windows per domain")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dense", action="store_true", help="also each format over int8 dense weights")
    ap.add_argument("--no-speed", action="store_true", help="skip the decode speed part")
    args = ap.parse_args()
    os.environ.setdefault("XDG_CACHE_HOME", tempfile.mkdtemp(prefix="moechat_bench_"))  # repacked files: scratch
    torch.manual_seed(0)

    names = variants(args.dense)
    engines = load_variants(DEMO, names)
    prompts = [engines["native"].encode_chat([{"role": "user", "content": q}])
               for q in ("What does json.dumps do?", "What does str.split do?", "What is 12 + 7?",
                         "What does os.path.join do?", "What does collections.Counter do?")]
    held = heldout_sequences(args.corpus, args.seq, args.seqs)
    if held:
        for dom, seqs in held.items():
            print_quality(f"demo model, held-out {dom} ({len(seqs)} x {args.seq} tokens)", quality(engines, seqs,
                                                                                              prompts[:2]))
        every = [s for seqs in held.values() for s in seqs]
        print_quality(f"demo model, all held-out domains ({len(every)} x {args.seq} tokens)",
                      quality(engines, every, prompts))

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import TINY_MODELS, build_tiny_model  # the test suite's tiny transformers models

    for name in ("qwen3_moe", "mixtral"):
        path = Path(tempfile.mkdtemp(prefix=f"tiny_{name}_"))
        model_type, overrides = TINY_MODELS[name]
        build_tiny_model(path, model_type, overrides, seed=1)
        tiny = load_variants(path, names)
        g = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, 256, (65,), generator=g).tolist() for _ in range(16)]
        prompts_t = [torch.randint(0, 256, (8,), generator=g).tolist() for _ in range(8)]
        print_quality(f"tiny random {name} (16 x 64 random tokens)", quality(tiny, seqs, prompts_t), perplexity=False)

    if not args.no_speed:
        decode_speed(args.runs, args.tokens)


if __name__ == "__main__":
    main()
