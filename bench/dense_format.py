"""Decode on the CPU with the dense weights in the model's dtype vs in int8 (`--dense-format int8`), side by side.

A Qwen3-30B-A3B-shaped checkpoint (real widths: hidden 2048, 32 query / 4 KV heads of 128, 128 experts of 768, the
full 151,936-token vocabulary; `--layers` of its 48 layers, random bf16 weights), every expert resident in
`--expert-format` (int8 or int4), bf16 activations. For each dense format: decode tok/s over rounds interleaved
ABAB (median and spread), the bytes one token reads (attention, LM head, the K active experts per layer), and the
fraction of the read-bandwidth bound those bytes allow at this machine's probe (numpy, the same probe as
`moechat fit`'s calibration, best of its repeats, taken between rounds).

    python bench/dense_format.py [--layers 2] [--expert-format int8] [--rounds 5] [--tokens 24] [--threads 1]
"""

from __future__ import annotations

import argparse
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
                attn += sa.qkv_t.numel() * sa.qkv_t.element_size() + sa.o_weight_t.numel() * sa.o_weight_t.element_size()
    lm = model.lm_q.nbytes if model.lm_q is not None else model.lm_weight_t.numel() * model.lm_weight_t.element_size()
    fmt = engine.loaded.expert_format
    expert = fmt.expert_bytes(a.hidden_size, a.moe_intermediate_size, engine.loaded.dtype, False)
    experts = len(engine.loaded.cls.moe_layers(a)) * a.num_experts_per_tok * expert
    return {"attention": attn, "lm_head": lm, "experts": experts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--expert-format", choices=["int8", "int4"], default="int8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from moechat.engine.plan.calibration import measure_ram_read_gbps
    from moechat.engine.runtime.generate import Engine
    from moechat.engine.runtime.sampling import SamplingParams

    work = args.work or Path(tempfile.mkdtemp(prefix="dense_format_"))
    path = work / f"qwen3-shaped-{args.layers}"
    if not (path / "config.json").exists():
        t0 = time.perf_counter()
        qwen3_shaped(path, args.layers)
        print(f"(wrote the checkpoint in {time.perf_counter() - t0:.0f} s)")
    engines, rows = {}, {}
    for dense in ("native", "int8"):
        t0 = time.perf_counter()
        engines[dense] = Engine.load(path, dtype="bfloat16", expert_format=args.expert_format, dense_format=dense,
                                     context=256)
        rows[dense] = {"load_s": time.perf_counter() - t0, "tok": [], "bytes": token_bytes(engines[dense])}
    greedy = SamplingParams(temperature=0.0, do_sample=False)
    prompt = list(range(3, 35))
    probes = []
    for _ in range(args.rounds):
        probes.append(measure_ram_read_gbps())
        for dense, engine in engines.items():
            last = None
            for chunk in engine.generate(prompt, sampling=greedy, max_tokens=args.tokens, stop_on_eos=False):
                last = chunk
            rows[dense]["tok"].append(last.decode_tokens_per_s)
    gbps = max(probes)
    print(f"\nQwen3-30B-A3B-shaped, {args.layers} of 48 layers, full vocabulary, {args.expert_format} experts, bf16 "
          f"activations, {args.threads} thread(s); {args.rounds} interleaved rounds of {args.tokens} tokens; "
          f"read probe {gbps:.1f} GB/s (best of {len(probes)}, spread {min(probes):.1f}-{max(probes):.1f})")
    print("| dense weights | MB/token: attention + LM head + experts = all | decode tok/s median | spread | "
          "vs native | bound tok/s | of bound |")
    print("|---|---|---:|---|---:|---:|---:|")
    base = statistics.median(rows["native"]["tok"])
    for dense, r in rows.items():
        b = r["bytes"]
        total = sum(b.values())
        med = statistics.median(r["tok"])
        bound = gbps * 1e9 / total
        print(f"| {dense} | {b['attention'] / 1e6:.0f} + {b['lm_head'] / 1e6:.0f} + {b['experts'] / 1e6:.0f} = "
              f"{total / 1e6:.0f} | {med:.2f} | {min(r['tok']):.2f}-{max(r['tok']):.2f} | {med / base:.2f}x | "
              f"{bound:.1f} | {med / bound:.2f} |")


if __name__ == "__main__":
    main()
