"""Decode on the CPU with the dense weights in the model's dtype vs int8 vs int4 (`--dense-format`), side by side,
and what each costs in quality.

A Qwen3-30B-A3B-shaped checkpoint (real widths: hidden 2048, 32 query / 4 KV heads of 128, 128 experts of 768, the
full 151,936-token vocabulary; `--layers` of its 48 layers, random bf16 weights; `--model` takes an existing one,
e.g. /work/bench_scratch/qwen3-shaped-2), every expert resident in `--expert-format` (int8 or int4), bf16
activations. int8 holds attention's projections and the LM head in int8; int4 holds attention in int4 and the LM
head in int8 (quant/dense_quant.py). For each dense format: decode tok/s over rounds interleaved (median and
spread), the bytes one token reads (attention, LM head, the K active experts per layer), the fraction of the
read-bandwidth bound those bytes allow at this machine's probe (numpy, the same probe as `moechat fit`'s
calibration, best of its repeats, taken between rounds), and the bound the same formats would give the whole
48-layer model (attention and experts scaled by 48 / layers).

Quality, teacher-forced over `--seqs` sequences of `--seq` tokens the native model sampled itself (temperature 1,
fixed seeds; random weights have no corpus to be measured on, so its own text is the one whose perplexity means
something): perplexity and its ratio to native, top-1 agreement with native, mean KL(native || format) a token,
and the logits' relative error |l - l_native| / |l_native| (median over positions). `--demo` adds the same on the
bundled demo model (trained; fp32), where the weights are real.

    python bench/dense_format.py [--model DIR | --layers 2] [--expert-format int8] [--rounds 5] [--tokens 24]
                                 [--threads 1] [--seqs 4] [--seq 64] [--demo]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch


def qwen3_shaped(path: Path, layers: int) -> Path:
    import transformers

    config = transformers.AutoConfig.for_model(
        "qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096, initializer_range=0.02,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


def token_bytes(engine) -> dict[str, int]:
    """Bytes one decode token reads, by part (KV and norms left out: small at these lengths)."""
    from moechat.engine.models.base import Attention

    model, a = engine.model, engine.args
    attn = lm = 0
    for layer in model.layer_list:
        sa = layer.self_attn
        if isinstance(sa, Attention):
            if sa.qkv_q is not None:
                attn += sa.qkv_q.nbytes + sa.o_q.nbytes
            else:
                attn += sum(t.numel() * t.element_size() for t in (sa.qkv_t, sa.o_weight_t))
    lm = model.lm_q.nbytes if model.lm_q is not None else model.lm_weight_t.numel() * model.lm_weight_t.element_size()
    fmt = engine.loaded.expert_format
    expert = fmt.expert_bytes(a.hidden_size, a.moe_intermediate_size, engine.loaded.dtype, False)
    experts = len(engine.loaded.cls.moe_layers(a)) * a.num_experts_per_tok * expert
    return {"attention": attn, "lm_head": lm, "experts": experts}


DENSE = ("native", "int8", "int4")
FULL_LAYERS = 48  # Qwen3-30B-A3B's


def all_logits(engine, ids: list[int]) -> torch.Tensor:
    """fp32 logits [T, V] for every position of ids, prefilled in one chunk."""
    from moechat.engine.layers.kv_cache import KVCache

    kv = KVCache.for_model(engine.args, len(ids), engine.loaded.dtype, engine.loaded.device)
    with torch.inference_mode():
        return engine.model.logits(engine.model(torch.tensor(ids), kv, engine.provider)).float()  # [T, V]


def sampled_sequences(engine, n: int, length: int) -> list[list[int]]:
    """n sequences of `length` tokens the engine samples itself (temperature 1, seeds 0..n-1)."""
    from moechat.engine.runtime.sampling import SamplingParams

    out = []
    for i in range(n):
        prompt = [3 + 7 * i, 11 + i]
        ids = [t for c in engine.generate(prompt, sampling=SamplingParams(temperature=1.0, seed=i),
                                          max_tokens=length - len(prompt), stop_on_eos=False) for t in c.token_ids]
        out.append(prompt + ids)
    return out


def quality(engines: dict, seqs: list[list[int]]) -> dict[str, dict]:
    """Per dense format, teacher-forced over seqs against the native engine's logits."""
    refs = [all_logits(engines["native"], s[:-1]) for s in seqs]
    out = {}
    for name, engine in engines.items():
        nll = agree = kl = count = 0.0
        rel = []
        for s, ref in zip(seqs, refs, strict=True):
            logits = ref if name == "native" else all_logits(engine, s[:-1])
            target = torch.tensor(s[1:])
            logp, ref_logp = torch.log_softmax(logits, -1), torch.log_softmax(ref, -1)
            nll += -float(logp.gather(1, target[:, None]).sum())
            agree += float((logits.argmax(-1) == ref.argmax(-1)).sum())
            kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
            rel += ((logits - ref).norm(dim=-1) / ref.norm(dim=-1)).tolist()
            count += len(target)
        out[name] = {"ppl": math.exp(nll / count), "top1": agree / count, "kl": kl / count,
                     "rel": statistics.median(rel)}
    return out


def print_quality(title: str, q: dict[str, dict]) -> None:
    print(f"\n{title}")
    print("| dense weights | perplexity | vs native | top-1 agreement | KL a token | logit error (median) |")
    print("|---|---:|---:|---:|---:|---:|")
    base = q["native"]["ppl"]
    for name, r in q.items():
        print(f"| {name} | {r['ppl']:.3f} | {r['ppl'] / base - 1:+.2%} | {r['top1']:.3f} | {r['kl']:.2e} | "
              f"{r['rel']:.4f} |")


def demo_quality(seqs: int, seq: int) -> None:
    from moechat.engine.runtime.generate import Engine

    demo = Path(__file__).resolve().parents[1] / "assets" / "demo-moe"
    engines = {dense: Engine.load(demo, dtype="float32", dense_format=dense) for dense in DENSE}
    q = quality(engines, sampled_sequences(engines["native"], seqs, seq))
    print_quality(f"demo model (assets/demo-moe, fp32, native experts): {seqs} sequences of {seq} tokens it sampled",
                  q)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="an existing Qwen3-shaped checkpoint (else one is built)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--expert-format", choices=["int8", "int4"], default="int8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seqs", type=int, default=4, help="quality: sequences (0: skip the quality part)")
    ap.add_argument("--seq", type=int, default=64, help="quality: tokens a sequence")
    ap.add_argument("--demo", action="store_true", help="quality on the bundled demo model too")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from moechat.engine.plan.calibration import measure_ram_read_gbps
    from moechat.engine.runtime.generate import Engine
    from moechat.engine.runtime.sampling import SamplingParams

    path = args.model
    if path is None:
        work = args.work or Path(tempfile.mkdtemp(prefix="dense_format_"))
        path = work / f"qwen3-shaped-{args.layers}"
        if not (path / "config.json").exists():
            t0 = time.perf_counter()
            qwen3_shaped(path, args.layers)
            print(f"(wrote the checkpoint in {time.perf_counter() - t0:.0f} s)")
    engines, rows = {}, {}
    for dense in DENSE:
        t0 = time.perf_counter()
        engines[dense] = Engine.load(path, dtype="bfloat16", expert_format=args.expert_format, dense_format=dense,
                                     context=max(256, args.seq + 8))
        rows[dense] = {"load_s": time.perf_counter() - t0, "tok": [], "bytes": token_bytes(engines[dense])}
    layers = engines["native"].args.num_hidden_layers
    greedy = SamplingParams(temperature=0.0, do_sample=False)
    prompt = list(range(3, 35))
    probes = []
    for i in range(args.rounds):
        probes.append(measure_ram_read_gbps())
        order = DENSE if i % 2 == 0 else DENSE[::-1]  # interleaved, each format first and last in turn
        for dense in order:
            last = None
            for chunk in engines[dense].generate(prompt, sampling=greedy, max_tokens=args.tokens, stop_on_eos=False):
                last = chunk
            rows[dense]["tok"].append(last.decode_tokens_per_s)
    gbps = max(probes)
    print(f"\nQwen3-30B-A3B-shaped, {layers} of {FULL_LAYERS} layers, full vocabulary, {args.expert_format} experts, "
          f"bf16 activations, {args.threads} thread(s); {args.rounds} interleaved rounds of {args.tokens} tokens; "
          f"read probe {gbps:.1f} GB/s (best of {len(probes)}, spread {min(probes):.1f}-{max(probes):.1f})")
    print(f"| dense weights | MB/token: attention + LM head + experts = all | decode tok/s median | spread | "
          f"vs native | bound tok/s | of bound | {FULL_LAYERS} layers: GB/token | bound tok/s |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    base = statistics.median(rows["native"]["tok"])
    for dense, r in rows.items():
        b = r["bytes"]
        total = sum(b.values())
        full = (b["attention"] + b["experts"]) * FULL_LAYERS / layers + b["lm_head"]
        med = statistics.median(r["tok"])
        bound = gbps * 1e9 / total
        print(f"| {dense} | {b['attention'] / 1e6:.0f} + {b['lm_head'] / 1e6:.0f} + {b['experts'] / 1e6:.0f} = "
              f"{total / 1e6:.0f} | {med:.2f} | {min(r['tok']):.2f}-{max(r['tok']):.2f} | {med / base:.2f}x | "
              f"{bound:.1f} | {med / bound:.2f} | {full / 1e9:.2f} | {gbps * 1e9 / full:.1f} |")
    if args.seqs:
        q = quality(engines, sampled_sequences(engines["native"], args.seqs, args.seq))
        print_quality(f"quality, the same engines (bf16): {args.seqs} sequences of {args.seq} tokens the native model "
                      "sampled", q)
    if args.demo:
        demo_quality(max(args.seqs, 4), args.seq)


if __name__ == "__main__":
    main()
