"""One decode step of a Gated DeltaNet layer beside one of the full-attention layers it replaces, at Qwen3.6-35B-A3B's
real widths (config.json from ../shared/model-configs or --config), in bf16 on this CPU, and a prefill chunk of each.

    python bench/recurrent_layers.py [--context 4096] [--threads 1] [--rounds 5]

Prints the median ms per step (interleaved rounds, min-max beside it) for: the delta-rule layer (projections, conv,
recurrence, gated norm, out_proj) with the native one-token steps (native_recurrent.c) and with the torch steps
(MOECHAT_RECURRENT_NATIVE=0), the recurrence and the conv alone each way, Mamba-2's SSM step at Nemotron-3-Nano's
widths (64 heads x 64 x 128) each way, and the gated attention layer with `context` cached positions; then a
prefill of `context` tokens in chunks of --prefill (1024, the engine's) through each layer (attention at its real
positions, 0 to `context`), and the delta rule's and Mamba-2's chunked scans alone.
The issue's aim: a recurrent layer costs no more per token than a full-attention layer at 4k context.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from moechat.engine.layers.kv_cache import KVCache
from moechat.engine.models import gated_deltanet as gd
from moechat.engine.models import mamba2
from moechat.engine.models.qwen3_5_moe import Qwen3_5MoeArgs
from moechat.engine.models.qwen3_next import GatedAttention, GatedDeltaNet

CONFIG = Path(__file__).resolve().parents[2] / "shared" / "model-configs" / "Qwen--Qwen3.6-35B-A3B" / "config.json"


def _random(module: torch.nn.Module, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    for p in module.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.02).to(dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill", type=int, default=1024, help="the prefill chunk (the engine's default size)")
    ap.add_argument("--prefill-rounds", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    args = Qwen3_5MoeArgs.from_dict(json.loads(Path(a.config).read_text()))
    dt = torch.bfloat16
    linear = args.layer_types.index("linear_attention")
    full = args.layer_types.index("full_attention")
    delta, attn = GatedDeltaNet(args, linear, "split"), GatedAttention(args, full)
    for m in (delta, attn):
        _random(m, dt)
        m.finalize()
    S = a.context + a.prefill + a.steps * a.rounds * 16 + 8
    kv = KVCache.for_model(args, S, dt)
    kv.k[full].normal_()
    kv.v[full].normal_()
    H = args.hidden_size
    R = args.rotary_dim
    cos, sin = torch.ones(1, 1, R, dtype=dt), torch.zeros(1, 1, R, dtype=dt)
    x = torch.randn(1, H, dtype=dt)
    st = kv.state[linear]
    q = torch.randn(1, args.linear_num_key_heads, args.linear_key_head_dim)
    v = torch.randn(1, args.linear_num_value_heads, args.linear_value_head_dim)
    g1, b1 = -torch.rand(1, args.linear_num_value_heads), torch.rand(1, args.linear_num_value_heads)

    qkv = torch.randn(1, delta.conv_dim, dtype=dt)
    # Mamba-2 at Nemotron-3-Nano-30B-A3B's widths: 64 heads x 64, 8 groups x 128, conv over 4096 + 2 x 8 x 128
    mH, mP, mG, mN = 64, 64, 8, 128
    m_state = torch.zeros(mH, mP, mN)
    mx, mB = torch.randn(1, mH, mP, dtype=dt), torch.randn(1, mG, mN, dtype=dt)
    mdt, mA, mD = torch.rand(1, mH) * 0.1, -torch.rand(mH), torch.randn(mH)
    mC = mH * mP + 2 * mG * mN
    m_conv, m_w, m_xc = torch.zeros(mC, 3, dtype=dt), torch.randn(mC, 4, dtype=dt) * 0.1, torch.randn(1, mC, dtype=dt)

    cases = {}  # name -> (fn, MOECHAT_RECURRENT_NATIVE)
    for way, env in (("native", "1"), ("torch", "0")):
        cases[f"Gated DeltaNet layer, {way} steps"] = (lambda: delta.forward(x, kv, x), env)
        cases[f"  delta rule alone, {way}"] = (lambda: gd.delta_rule(q, q, v, g1, b1, st["ssm"]), env)
        cases[f"  conv alone, {way}"] = (lambda: gd.causal_conv1d(qkv, delta.conv_w, st["conv"]), env)
        cases[f"Mamba-2 SSM step, {way}"] = (lambda: mamba2.ssd(mx, mdt, mA, mB, mB, mD, m_state), env)
        cases[f"  Mamba-2 conv, {way}"] = (lambda: gd.causal_conv1d(m_xc, m_w, m_conv, m_w[:, 0]), env)
    cases[f"gated attention, {a.context} cached"] = (lambda: attn.forward(x, cos, sin, kv, a.context, x), "1")
    times = {k: [] for k in cases}
    with torch.inference_mode():
        for _ in range(a.rounds):
            for name, (fn, env) in cases.items():  # interleaved: each round runs every case
                os.environ[gd.ENV] = env
                fn()
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    fn()
                times[name].append((time.perf_counter() - t0) / a.steps * 1e3)
        os.environ[gd.ENV] = "1"
        # prefill: the whole context in the engine's chunks, each layer from position 0 to `context`
        C = a.prefill
        xp = torch.randn(C, H, dtype=dt)
        cp, sp = torch.ones(C, 1, R, dtype=dt), torch.zeros(C, 1, R, dtype=dt)
        starts = range(0, a.context, C)
        mxp, mBp = torch.randn(C, mH, mP, dtype=dt), torch.randn(C, mG, mN, dtype=dt)
        mdtp = torch.rand(C, mH) * 0.1
        qp, kp = torch.randn(C, args.linear_num_key_heads, args.linear_key_head_dim), \
            torch.randn(C, args.linear_num_key_heads, args.linear_key_head_dim)
        vp = torch.randn(C, args.linear_num_value_heads, args.linear_value_head_dim)
        gp, bp = -torch.rand(C, args.linear_num_value_heads), torch.rand(C, args.linear_num_value_heads)
        pre = {
            "Gated DeltaNet layer": lambda: [delta.forward(xp, kv, xp) for _ in starts],
            "  delta rule alone (chunked)": lambda: [gd.delta_rule_chunked(qp, kp, vp, gp, bp, st["ssm"])
                                                     for _ in starts],
            f"gated attention, 0 to {a.context}": lambda: [attn.forward(xp, cp, sp, kv, s0, xp) for s0 in starts],
            "Mamba-2 SSD scan alone (Nemotron)": lambda: [mamba2.ssd_chunked(mxp, mdtp, mA, mBp, mBp, mD, m_state)
                                                          for _ in starts],
        }
        wall, cpu = {k: [] for k in pre}, {k: [] for k in pre}
        for _ in range(a.prefill_rounds):
            for name, fn in pre.items():  # interleaved
                kv.truncate(0)
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                wall[name].append((time.perf_counter() - t0) * 1e3)
                cpu[name].append((time.process_time() - c0) * 1e3)
    print(f"decode, one token, bf16, {a.threads} thread(s), median of {a.rounds} rounds x {a.steps} steps")
    for name, ts in times.items():
        print(f"  {name:36s} {statistics.median(ts):7.3f} ms  ({min(ts):.3f}-{max(ts):.3f})")
    print(f"prefill of {a.context} tokens in chunks of {C}, median of {a.prefill_rounds} interleaved rounds: wall ms "
          "(min-max), CPU ms, wall ms per 1k tokens")
    for name in pre:
        w, c = wall[name], cpu[name]
        print(f"  {name:36s} {statistics.median(w):8.1f} ({min(w):.1f}-{max(w):.1f})  cpu {statistics.median(c):8.1f}"
              f"  {statistics.median(w) * 1024 / a.context:7.1f} /1k")

if __name__ == "__main__":
    main()
