"""GB/s of the fused MoE kernels on a CUDA GPU: packed bytes read per second, timed by replaying a CUDA graph.

For each format at its model's widths (MXFP4: GPT-OSS-20B, H = I = 2880, 32 experts, top-4; FP8 128 x 128 blocks,
int8, int4: Qwen3-30B-A3B, H 2048, I 768, 128 experts, top-8; `--all-widths`: every format at both) and each T in
`--tokens` (1, 4: decode, one kernel pair; 128: prefill, grouped tl.dot), one MoE layer (both projections, bf16
activations, the residual added) over a pool holding every expert as random packed bytes on the device. The graph
holds `--calls` launches of the layer, each routed to a different set of experts (T = 1: K experts, T = 4: 4 K,
T = 128: all of them), so consecutive calls never find their experts in L2 (an H200 has 60 MB of it; one GPT-OSS
expert is 13.2 MB). Bytes = the packed tensors of the experts a call routes to (codes, scales, biases), counted
once per call; the figure is bytes / (replay time / calls), no host time inside. The copy rate is a
device-to-device copy of 1 GiB (bytes read + written / time), so `of copy` is the fraction of the HBM rate a
kernel reaches; the issue's aim is >= 0.7 at T = 1.

    python bench/kernel_rates.py [--tokens 1,4,128] [--calls 16] [--all-widths] [--json]
    TRITON_INTERPRET=1 python bench/kernel_rates.py --smoke   # tiny widths on the CPU: checks the script only
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

from moechat.engine.layers.moe import ExpertActivation

# H = hidden, I = intermediate, E = experts, K = top-k, C = slots
MODELS = {"gpt-oss-20b": dict(H=2880, I=2880, E=32, K=4), "qwen3-30b-a3b": dict(H=2048, I=768, E=128, K=8)}
HOME = {"mxfp4": "gpt-oss-20b", "fp8": "qwen3-30b-a3b", "int8": "qwen3-30b-a3b", "int4": "qwen3-30b-a3b"}
SMOKE = dict(H=64, I=64, E=8, K=2)


def pool(fmt: str, H: int, I: int, C: int, device) -> dict[str, torch.Tensor]:
    """Every expert of a layer as random packed bytes in C slots (values finite; their size is what counts)."""
    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, device=device)  # noqa: E731
    if fmt == "mxfp4":
        return {"w13_blocks": u8(C, 2 * I, H // 32, 16), "w13_scales": u8(C, 2 * I, H // 32) // 16 + 116,
                "w2_blocks": u8(C, H, I // 32, 16), "w2_scales": u8(C, H, I // 32) // 16 + 116,
                "w13_bias": torch.zeros(C, 2 * I, dtype=torch.bfloat16, device=device),
                "w2_bias": torch.zeros(C, H, dtype=torch.bfloat16, device=device)}
    if fmt == "fp8":  # bytes without the e4m3 NaN (0x7F, 0xFF)
        e4m3 = lambda *s: (u8(*s) % 0x7F | (u8(*s) & 0x80)).view(torch.float8_e4m3fn)  # noqa: E731
        b = 128
        return {"w13": e4m3(C, 2 * I, H), "w2": e4m3(C, H, I),
                "w13_scale": torch.rand(C, 2 * math.ceil(I / b), math.ceil(H / b), device=device) * 1e-3,
                "w2_scale": torch.rand(C, math.ceil(H / b), math.ceil(I / b), device=device) * 1e-3}
    if fmt == "int8":
        return {"w13_q": u8(C, 2 * I, H).view(torch.int8), "w2_q": u8(C, H, I).view(torch.int8),
                "w13_scale": torch.rand(C, 2 * I, device=device) * 1e-3,
                "w2_scale": torch.rand(C, H, device=device) * 1e-3}
    return {"w13_q": u8(C, 2 * I, H // 2), "w2_q": u8(C, H, I // 2),
            "w13_scale": (torch.rand(C, 2 * I, H // 32, device=device) * 1e-3).half(),
            "w2_scale": (torch.rand(C, H, I // 32, device=device) * 1e-3).half()}


def layer(fmt: str, tensors, x, weights, slot_ids, residual):
    act = ExpertActivation("clamped_swiglu" if fmt == "mxfp4" else "swiglu")
    if fmt == "mxfp4":
        from moechat.engine.quant.kernels.mxfp4_moe import mxfp4_moe

        return mxfp4_moe(x, weights, slot_ids, tensors, act, residual=residual)
    from moechat.engine.quant.kernels.quant_moe import quant_moe

    return quant_moe(x, weights, slot_ids, tensors, act, fmt, block=(128, 128) if fmt == "fp8" else None,
                     residual=residual)


def routings(T: int, K: int, E: int, calls: int, device) -> list[torch.Tensor]:
    """`calls` routings [T, K] int32 that walk through the experts: each call's experts distinct from the last's
    where E allows (T K <= E: disjoint sets in turn; else every expert each call)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for c in range(calls):
        if T * K <= E:
            sets = E // (T * K)
            ids = torch.arange(T * K) + (c % sets) * T * K  # [T*K]
        else:
            ids = torch.cat([torch.randperm(E, generator=g) for _ in range(math.ceil(T * K / E))])[: T * K]
            ids = ids.view(T, K)
            # top-k ids of a token are distinct: shift repeats within a row
            for t in range(T):
                row = ids[t].tolist()
                seen: set[int] = set()
                for k, e in enumerate(row):
                    while e in seen:
                        e = (e + 1) % E
                    seen.add(e)
                    row[k] = e
                ids[t] = torch.tensor(row)
        out.append(ids.view(T, K).to(torch.int32).to(device))
    return out


def expert_bytes(tensors) -> int:
    return sum(t[0].numel() * t.element_size() for t in tensors.values())


def copy_rate(device, reps: int = 10) -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy (median of `reps`)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * (1 << 30) / statistics.median(times[2:])


def measure(fmt: str, model: str, T: int, calls: int, smoke: bool, device) -> dict:
    shape = SMOKE if smoke else MODELS[model]
    H, I, E, K = shape["H"], shape["I"], shape["E"], shape["K"]
    tensors = pool(fmt, H, I, E, device)
    per_expert = expert_bytes(tensors)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(T, H, generator=g, device=device).to(torch.bfloat16)
    residual = torch.randn(T, H, generator=g, device=device).to(torch.bfloat16)
    weights = torch.softmax(torch.randn(T, K, generator=g, device=device), dim=-1)
    routes = routings(T, K, E, calls, device)
    used = sum(len(set(r.flatten().tolist())) for r in routes) * per_expert  # bytes the calls read
    for r in routes:  # compile, autotune and warm up outside the graph
        layer(fmt, tensors, x, weights, r, residual)
    if smoke:
        t0 = time.perf_counter()
        for r in routes:
            layer(fmt, tensors, x, weights, r, residual)
        seconds = time.perf_counter() - t0
    else:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # on its own side stream; the launches only, no host work replayed
            for r in routes:
                layer(fmt, tensors, x, weights, r, residual)
        graph.replay()  # once untimed
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        seconds = statistics.median(times)
    del tensors
    return {"format": fmt, "model": model, "T": T, "experts_per_call": used / per_expert / calls,
            "MB_per_call": used / calls / 1e6, "us_per_call": seconds / calls * 1e6, "GBps": used / seconds / 1e9}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,4,128")
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--formats", default="mxfp4,fp8,int8,int4")
    p.add_argument("--all-widths", action="store_true", help="every format at both models' widths")
    p.add_argument("--smoke", action="store_true", help="tiny widths on the CPU (under TRITON_INTERPRET=1)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if not a.smoke and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine (or --smoke under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if a.smoke else "cuda")
    copy = None if a.smoke else copy_rate(device)
    rows = []
    for fmt in a.formats.split(","):
        for model in (MODELS if a.all_widths else [HOME[fmt]]):
            for T in (int(t) for t in a.tokens.split(",")):
                row = measure(fmt, model, T, 2 if a.smoke else a.calls, a.smoke, device)
                row["of_copy"] = row["GBps"] * 1e9 / copy if copy else None
                rows.append(row)
    if a.json:
        print(json.dumps({"copy_GBps": copy / 1e9 if copy else None, "rows": rows}, indent=1))
        return 0
    name = "CPU (Triton interpreter, smoke)" if a.smoke else torch.cuda.get_device_name(0)
    print(f"fused MoE kernels on {name}; device copy rate {copy / 1e9:.0f} GB/s" if copy else f"on {name}")
    print(f"{'format':<7} {'widths':<14} {'T':>4} {'experts':>7} {'MB/call':>8} {'us/call':>8} {'GB/s':>7} "
          f"{'of copy':>7}")
    for r in rows:
        frac = f"{r['of_copy']:.2f}" if r["of_copy"] is not None else "-"
        print(f"{r['format']:<7} {r['model']:<14} {r['T']:>4} {r['experts_per_call']:>7.1f} {r['MB_per_call']:>8.1f} "
              f"{r['us_per_call']:>8.1f} {r['GBps']:>7.1f} {frac:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
