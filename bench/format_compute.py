"""Expert compute per format on the CPU, against dense bf16: the numbers behind engine/plan.py's
EXPERT_COMPUTE_EFFICIENCY["cpu"] (what the memory plan and `moechat fit`'s format advice assume).

For each expert width (Qwen3-30B-A3B: H 2048, I 768; GPT-OSS: H = I = 2880) and each format, one token through
both projections of one expert (`fmt.linear`, the path experts.py takes for a packed format on the CPU), over
enough copies of the expert that the weights come from RAM, not cache. Formats are timed in interleaved rounds
(dense int8 int4 fp8 mxfp4, dense int8 ...) so load from other processes lands on all alike; the table gives
each format's median GB/s of its packed bytes and that rate over dense bf16's (the efficiency the plan uses).

    python bench/format_compute.py [--threads 1] [--rounds 7] [--copies 24]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moechat.engine.quant import get_format, mxfp4
from moechat.engine.quant.fp8 import fp8_format, quantize_blocks

# H = hidden size, I = expert intermediate size
WIDTHS = {"qwen3-30b-a3b": (2048, 768), "gpt-oss": (2880, 2880)}
FORMATS = ("dense", "int8", "int4", "fp8", "mxfp4")


def expert(name: str, H: int, I: int) -> tuple[object, dict[str, torch.Tensor]]:
    """One expert (w13 [2I, H], w2 [H, I]) in format `name`, from the same gaussian weights."""
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(2 * I, H, generator=g) * 0.02  # [2I, H]
    w2 = torch.randn(H, I, generator=g) * 0.02  # [H, I]
    if name == "dense":
        return get_format("dense"), {"w13": w13.bfloat16(), "w2": w2.bfloat16()}
    if name == "fp8":
        block = (128, 128)
        gate, gate_s = quantize_blocks(w13[:I], block)
        up, up_s = quantize_blocks(w13[I:], block)
        down, down_s = quantize_blocks(w2, block)
        return fp8_format(block), {"w13": torch.cat([gate, up]), "w13_scale": torch.cat([gate_s, up_s]),
                                   "w2": down, "w2_scale": down_s}
    if name == "mxfp4":
        b13, s13 = mxfp4.quantize(w13)
        b2, s2 = mxfp4.quantize(w2)
        return get_format("mxfp4"), {"w13_blocks": b13, "w13_scales": s13, "w2_blocks": b2, "w2_scales": s2}
    fmt = get_format(name)
    tensors = {}
    for which, w in (("w13", w13), ("w2", w2)):
        for part, t in fmt.quantize(w).items():
            tensors[f"{which}_{part}"] = t
    return fmt, tensors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--copies", type=int, default=24, help="copies of each expert cycled through (beyond cache)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} interleaved rounds, "
          f"{args.copies} copies of each expert, one token (bf16 activations)")
    ratios: dict[str, list[float]] = {f: [] for f in FORMATS}
    for model, (H, I) in WIDTHS.items():
        x13 = torch.randn(1, H).bfloat16()  # [1, H]
        x2 = torch.randn(1, I).bfloat16()  # [1, I]
        setups = {}
        for name in FORMATS:
            fmt, tensors = expert(name, H, I)
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            copies = [{k: v.clone() for k, v in tensors.items()} for _ in range(args.copies)]
            fmt.linear(x13, copies[0], "w13")
            fmt.linear(x2, copies[0], "w2")
            setups[name] = (fmt, nbytes, copies)
        times: dict[str, list[float]] = {name: [] for name in FORMATS}
        for _ in range(args.rounds):
            for name, (fmt, _, copies) in setups.items():
                t0 = time.perf_counter()
                for c in copies:
                    fmt.linear(x13, c, "w13")
                    fmt.linear(x2, c, "w2")
                times[name].append((time.perf_counter() - t0) / len(copies))
        dense_rate = setups["dense"][1] / statistics.median(times["dense"])
        print(f"\n{model} (H {H}, I {I})")
        print(f"  {'format':<7} {'packed MB':>9} {'ms/expert':>10} {'spread':>15} {'GB/s packed':>11} {'/ dense':>8}")
        for name, (_, nbytes, _) in setups.items():
            med = statistics.median(times[name])
            rate = nbytes / med
            ratios[name].append(rate / dense_rate)
            spread = f"{min(times[name]) * 1e3:.2f}-{max(times[name]) * 1e3:.2f}"
            print(f"  {name:<7} {nbytes / 1e6:>9.2f} {med * 1e3:>10.3f} {spread:>15} {rate / 1e9:>11.2f} "
                  f"{rate / dense_rate:>8.3f}")
    print("\nEXPERT_COMPUTE_EFFICIENCY['cpu'] from these (the mean over the widths):")
    print("  {" + ", ".join(f'"{n}": {statistics.mean(r):.2g}' for n, r in ratios.items()) + "}")


if __name__ == "__main__":
    main()
