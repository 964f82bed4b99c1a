"""MXFP4 experts at GPT-OSS-20B's widths: what each way of computing with them costs, against the bandwidth.

    python bench/quantized_experts.py                 # CPU: ways torch offers, bytes per miss, engine decode
    python bench/quantized_experts.py --device cuda   # the fused Triton kernel vs the device's copy bandwidth

CPU: one expert (w13 [5760, 2880], w2 [2880, 2880], biases, clamped SwiGLU) for one token (decode) and a
small prefill, each method timed in interleaved rounds (A B C .. A B C ..) together with a read-bandwidth
probe (torch.sum over a buffer far bigger than the last-level cache), so contention from other processes
lands on all of them alike; medians with the spread (min-max) of the rounds. Then the bytes a miss moves
(bf16 vs MXFP4) and decode tok/s of a GPT-OSS-shaped model (real widths, few layers) through the Engine with
a quarter of its experts in slots.

CUDA (bench/gpu_check.sh): the fused kernel for decode and prefill batches over 32 slots, GB/s of packed
bytes read against a big device copy, next to the per-expert torch path (MXFP4 dequantized per expert,
and bf16 experts).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from moechat.engine.layers.moe import ExpertActivation
from moechat.engine.quant import get_format, mxfp4

# T = tokens, K = top-k, E = experts, C = slots, H = hidden size, I = expert intermediate size
H = I = 2880  # GPT-OSS-20B (and 120B)
ACT = ExpertActivation("clamped_swiglu")
MB = 1e6


# -- one expert, packed -------------------------------------------------------------------------------------
def make_expert(seed: int = 0) -> dict[str, torch.Tensor]:
    """A GPT-OSS-20B-shaped MXFP4 expert with bf16 biases, quantized from gaussian weights."""
    g = torch.Generator().manual_seed(seed)
    b13, s13 = mxfp4.quantize(torch.randn(2 * I, H, generator=g) * 0.02)  # [2I, H/32, 16], [2I, H/32]
    b2, s2 = mxfp4.quantize(torch.randn(H, I, generator=g) * 0.02)  # [H, I/32, 16], [H, I/32]
    return {"w13_blocks": b13, "w13_scales": s13, "w2_blocks": b2, "w2_scales": s2,
            "w13_bias": (torch.randn(2 * I, generator=g) * 0.02).bfloat16(),
            "w2_bias": (torch.randn(H, generator=g) * 0.02).bfloat16()}


def packed_bytes(ex: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ex.values())


BF16_BYTES = get_format("dense").expert_bytes(H, I, torch.bfloat16, bias=True)  # 49.8 MB


def reference(x: torch.Tensor, ex: dict[str, torch.Tensor]) -> torch.Tensor:
    """The slow obvious expert in fp32: dequantize_reference + F.linear."""
    w13 = mxfp4.dequantize_reference(ex["w13_blocks"], ex["w13_scales"])
    w2 = mxfp4.dequantize_reference(ex["w2_blocks"], ex["w2_scales"])
    return F.linear(ACT(F.linear(x.float(), w13, ex["w13_bias"].float())), w2, ex["w2_bias"].float())


# -- the methods: each builds what it keeps (outside the timing) and returns x [T, H] -> [T, H] ----------------
def m_dense(ex, dtype):
    """Experts already expanded to `dtype` (what a bf16 checkpoint computes with: 4x the bytes of MXFP4)."""
    w13 = mxfp4.dequantize_reference(ex["w13_blocks"], ex["w13_scales"], dtype)
    w2 = mxfp4.dequantize_reference(ex["w2_blocks"], ex["w2_scales"], dtype)
    b13, b2 = ex["w13_bias"].to(dtype), ex["w2_bias"].to(dtype)
    return lambda x: F.linear(ACT(F.linear(x, w13, b13)), w2, b2)


def m_table(ex, dtype):
    """moechat before this bench: the byte -> value-pair table (torch.embedding) into a reused scratch + F.linear."""
    s13 = torch.empty(2 * I, H, dtype=dtype)
    s2 = torch.empty(H, I, dtype=dtype)
    b13, b2 = ex["w13_bias"].to(dtype), ex["w2_bias"].to(dtype)

    def run(x):
        w13 = mxfp4.dequantize_into(ex["w13_blocks"], ex["w13_scales"], s13)
        a = ACT(F.linear(x, w13, b13))
        return F.linear(a, mxfp4.dequantize_into(ex["w2_blocks"], ex["w2_scales"], s2), b2)
    return run


def m_gather_tiles(ex):
    """The table as a 1-D index_select of fp32 value pairs (int64 words) into row tiles, scale multiply, a GEMV
    per tile (one token) or one GEMM on the whole matrix (more): preallocated, in cache."""
    v = torch.tensor(mxfp4.FP4_VALUES)
    b = torch.arange(256)
    pair = torch.stack([v[b & 15], v[b >> 4]], -1).contiguous().view(torch.int64).view(256)  # [256]
    scale_lut = torch.ldexp(torch.ones(256), torch.arange(256) - 127)  # [256]
    bufs = {}

    def linear(x, blocks, scales, bias):
        R, G, _ = blocks.shape
        rows = mxfp4.tile_rows(G * 32)
        if (R, G) not in bufs:
            bufs[R, G] = (torch.empty(rows * G * 16, dtype=torch.int64), torch.empty(R, G * 32), torch.empty(R, G))
        idx, full, factors = bufs[R, G]
        torch.index_select(scale_lut, 0, scales.reshape(-1).long(), out=factors.view(-1))
        y = torch.empty(1, R) if x.shape[0] == 1 else None
        for r0 in range(0, R, rows):
            r1 = min(R, r0 + rows)
            n = r1 - r0
            i = idx[: n * G * 16]
            i.copy_(blocks[r0:r1].reshape(-1))
            w = full[r0:r1]
            torch.index_select(pair, 0, i, out=w.view(torch.int64).view(-1))
            w.view(n, G, 32).mul_(factors[r0:r1, :, None])
            if y is not None:
                torch.addmm(bias[r0:r1], x, w.t(), out=y[:, r0:r1])
        return y if y is not None else F.linear(x, full, bias)

    b13, b2 = ex["w13_bias"].float(), ex["w2_bias"].float()

    def run(x):
        xf = x.float()
        a = ACT(linear(xf, ex["w13_blocks"], ex["w13_scales"], b13))
        return linear(a, ex["w2_blocks"], ex["w2_scales"], b2).to(x.dtype)
    return run


def m_bf16_bits(ex):
    """bf16 bit patterns with int32 ops (two per byte: sign -> bit 15, magnitude -> bits 6-8, i.e. code x 2^-126),
    x 2^(s - 1) in bf16 into a whole-matrix scratch (exact for s <= 128), F.linear in bf16."""
    bufs = {}

    def decode(blocks, scales):
        R, G, _ = blocks.shape
        if (R, G) not in bufs:
            bufs[R, G] = (torch.empty(R, G * 16, dtype=torch.int32), torch.empty(R, G * 16, dtype=torch.int32),
                          torch.empty(R, G * 32, dtype=torch.bfloat16), torch.empty(R, G, dtype=torch.int32))
        w, t, out, f = bufs[R, G]
        w.copy_(blocks.reshape(R, -1))
        w.mul_(0x40040)  # low code to bits 6-9, high code to bits 22-25
        w.bitwise_and_(0x03C003C0)
        torch.bitwise_and(w, 0x02000200, out=t)  # sign bits (9, 25) -> (15, 31)
        w.bitwise_xor_(t)
        t.bitwise_left_shift_(6)
        w.bitwise_or_(t)
        f.copy_(scales)
        f.add_(126).bitwise_left_shift_(23)  # fp32 2^(s - 1)
        torch.mul(w.view(torch.bfloat16).view(R, G, 32), f.view(torch.float32).bfloat16()[..., None],
                  out=out.view(R, G, 32))
        return out

    def run(x):
        a = ACT(F.linear(x, decode(ex["w13_blocks"], ex["w13_scales"]), ex["w13_bias"]))
        return F.linear(a, decode(ex["w2_blocks"], ex["w2_scales"]), ex["w2_bias"])
    return run


def m_moechat(ex):
    """moechat's CPU path (Mxfp4Format.linear): fp16 bit patterns in row tiles, fp32 GEMV per tile."""
    fmt = get_format("mxfp4")
    return lambda x: fmt.linear(ACT(fmt.linear(x, ex, "w13")), ex, "w2")


def int8_expand(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """MXFP4 -> int8 [R, in] + a per-row scale: q = 2 x code value x 2^(s - s_min(row)), row scale 2^(s_min - 128).
    Lossless where a row's scales span at most 3 binades (12 x 2^3 = 96 <= 127); wider rows are clamped.
    Returns (q, scale [R] fp32, fraction of rows that are lossless)."""
    R, G, _ = blocks.shape
    v2 = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int16)
    b = torch.arange(256)
    pair = torch.stack([v2[b & 15], v2[b >> 4]], -1)  # [256, 2] int16
    smin = scales.amin(dim=1, keepdim=True).to(torch.int16)  # [R, 1]
    shift = (scales.to(torch.int16) - smin)  # [R, G]
    lossless = float((shift.amax(dim=1) <= 3).float().mean())
    vals = pair[blocks.reshape(R, -1).long()].view(R, G, 32)  # [R, G, 32] int16
    q = (vals << shift.clamp(max=3)[..., None]).clamp(-127, 127).to(torch.int8).view(R, G * 32)
    return q, torch.ldexp(torch.ones(R), smin[:, 0].to(torch.int32) - 128), lossless


def m_int8(ex, expand_each_call: bool):
    """torch's _weight_int8pack_mm (bf16 x, int8 weights, a bf16 scale per row) on the MXFP4 -> int8 expansion."""
    b13, b2 = ex["w13_bias"], ex["w2_bias"]

    def expand():
        q13, sc13, _ = int8_expand(ex["w13_blocks"], ex["w13_scales"])
        q2, sc2, _ = int8_expand(ex["w2_blocks"], ex["w2_scales"])
        return q13, sc13.bfloat16(), q2, sc2.bfloat16()
    kept = None if expand_each_call else expand()

    def run(x):
        q13, sc13, q2, sc2 = kept or expand()
        a = ACT(torch.ops.aten._weight_int8pack_mm(x, q13, sc13) + b13)
        return torch.ops.aten._weight_int8pack_mm(a, q2, sc2) + b2
    return run


def m_compiled(ex):
    """torch.compile (inductor's C++) of the fp16-bit decode of each projection, then F.linear in fp32."""
    def decode(blocks, scales):
        n = torch.stack([blocks & 15, blocks >> 4], -1).to(torch.int16)  # [R, G, 16, 2]
        bits = ((n & 8) << 12) | ((n & 7) << 9)
        v = bits.view(torch.float16).to(torch.float32).reshape(*scales.shape, 32)
        return (v * torch.exp2(scales.to(torch.float32) - 113)[..., None]).reshape(scales.shape[0], -1)
    dec = torch.compile(decode, dynamic=False)
    b13, b2 = ex["w13_bias"].float(), ex["w2_bias"].float()

    def run(x):
        a = ACT(F.linear(x.float(), dec(ex["w13_blocks"], ex["w13_scales"]), b13))
        return F.linear(a, dec(ex["w2_blocks"], ex["w2_scales"]), b2).to(x.dtype)
    return run


def read_probe(nbytes: int = 1 << 30):
    """torch.sum over a buffer far bigger than the last-level cache: the bytes/s a read-bound kernel can get."""
    buf = torch.ones(nbytes // 4)
    return lambda: buf.sum(), nbytes


def has_compiler() -> bool:
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


# -- CPU -----------------------------------------------------------------------------------------------------
def bench_cpu(args) -> None:
    threads = torch.get_num_threads()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"CPU: {threads} threads, load average {load:.1f}, torch {torch.__version__}, "
          f"capability {torch.backends.cpu.get_cpu_capability()}")
    ex = make_expert()
    nbytes = packed_bytes(ex)
    print(f"one GPT-OSS-20B expert: MXFP4 {nbytes / MB:.2f} MB (codes, scales, bf16 biases), "
          f"bf16 {BF16_BYTES / MB:.1f} MB")
    _, _, lossless13 = int8_expand(ex["w13_blocks"], ex["w13_scales"])
    _, _, lossless2 = int8_expand(ex["w2_blocks"], ex["w2_scales"])

    methods = [
        ("dense bf16 (pre-expanded, 4x bytes)", torch.bfloat16, lambda: m_dense(ex, torch.bfloat16)),
        ("dense fp32 (pre-expanded, 8x bytes)", torch.float32, lambda: m_dense(ex, torch.float32)),
        ("table: embedding + scratch, bf16", torch.bfloat16, lambda: m_table(ex, torch.bfloat16)),
        ("table: embedding + scratch, fp32", torch.float32, lambda: m_table(ex, torch.float32)),
        ("table: index_select row tiles, fp32", torch.float32, lambda: m_gather_tiles(ex)),
        ("bf16 bits, int32 ops, bf16 GEMM", torch.bfloat16, lambda: m_bf16_bits(ex)),
        ("int8 expanded per call + int8pack_mm", torch.bfloat16, lambda: m_int8(ex, True)),
        ("int8 kept (2x bytes) + int8pack_mm", torch.bfloat16, lambda: m_int8(ex, False)),
        ("moechat: fp16 bits, row tiles, fp32", torch.float32, lambda: m_moechat(ex)),
        ("moechat: same, bf16 in/out", torch.bfloat16, lambda: m_moechat(ex)),
    ]
    if args.compile and has_compiler():
        methods.append(("torch.compile fp16-bit decode, fp32", torch.float32, lambda: m_compiled(ex)))
    g = torch.Generator().manual_seed(1)
    xs = {T: torch.randn(T, H, generator=g) for T in (1, args.prefill)}
    want = {T: reference(x, ex) for T, x in xs.items()}

    built, notes = [], {}
    for name, dtype, make in methods:
        t0 = time.perf_counter()
        try:
            fn = make()
            got = {T: fn(x.to(dtype)) for T, x in xs.items()}  # warm up (and compile)
        except Exception as e:  # a method torch does not offer on this machine
            print(f"  {name}: skipped ({type(e).__name__}: {str(e)[:120]})")
            continue
        setup = time.perf_counter() - t0
        exact = all(torch.equal(got[T].float(), want[T]) for T in xs) if dtype == torch.float32 else False
        err = max(float((got[T].float() - want[T]).abs().max() / want[T].abs().max()) for T in xs)
        notes[name] = ("bit-exact" if exact else f"max err {err:.1e}") + (f", setup {setup:.0f}s" if setup > 5 else "")
        built.append((name, dtype, fn))

    probe, probe_bytes = read_probe()
    probe()
    times = {name: {T: [] for T in xs} for name, _, _ in built}
    bw = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        probe()
        bw.append(probe_bytes / (time.perf_counter() - t0))
        for name, dtype, fn in built:
            for T, x in xs.items():
                xd = x.to(dtype)
                t0 = time.perf_counter()
                fn(xd)
                times[name][T].append(time.perf_counter() - t0)
    read_bw = statistics.median(bw)
    print(f"read bandwidth (torch.sum over 1 GiB): {read_bw / 1e9:.1f} GB/s median "
          f"[{min(bw) / 1e9:.1f}-{max(bw) / 1e9:.1f}] over {args.rounds} interleaved rounds")
    print(f"int8 expansion lossless for {lossless13:.0%} of w13 rows and {lossless2:.0%} of w2 rows here (a row's "
          "block scales must span <= 3 binades); _weight_int4pack_mm_for_cpu is affine int4 (16 even steps per "
          "group), not E2M1's uneven 0, 0.5 .. 6: not lossless, not run")
    print()
    hdr = (f"{'method':<38}{'T=1 ms/expert':>22}{'packed GB/s':>12}{'bf16-eq GB/s':>13}{'% read BW':>10}"
           f"{f'T={args.prefill} ms':>20}  check")
    print(hdr)
    print("-" * len(hdr))
    for name, _, _ in built:
        t1 = times[name][1]
        med = statistics.median(t1)
        tp = times[name][args.prefill]
        medp = statistics.median(tp)
        print(f"{name:<38}{med * 1e3:>9.1f} [{min(t1) * 1e3:5.1f}-{max(t1) * 1e3:5.1f}]"
              f"{nbytes / med / 1e9:>12.2f}{BF16_BYTES / med / 1e9:>13.2f}{nbytes / med / read_bw:>10.0%}"
              f"{medp * 1e3:>8.1f} [{min(tp) * 1e3:5.0f}-{max(tp) * 1e3:5.0f}]  {notes[name]}")
    print("(packed GB/s: MXFP4 bytes / time; bf16-eq: the bf16 expert's bytes / time; % read BW: packed GB/s over "
          "the probe's)")
    print()
    packed = get_format("mxfp4").expert_bytes(H, I, torch.bfloat16, True)
    print(f"bytes per miss, one GPT-OSS-20B expert: bf16 {BF16_BYTES / MB:.1f} MB, MXFP4 {packed / MB:.2f} MB "
          f"({BF16_BYTES / packed:.1f}x fewer)")
    if args.engine_layers:
        print()
        bench_engine(args, times, nbytes)


# -- the engine on a GPT-OSS-shaped checkpoint ---------------------------------------------------------------------
def gpt_oss_config(layers: int, vocab: int) -> dict:
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": vocab, "hidden_size": H,
            "intermediate_size": I, "num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": 8,
            "head_dim": 64, "num_local_experts": 32, "experts_per_token": 4, "num_experts_per_tok": 4,
            "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * (layers // 2)
            + ["sliding_attention"] * (layers % 2), "rms_norm_eps": 1e-5, "rope_theta": 150000,
            "max_position_embeddings": 4096, "swiglu_limit": 7.0, "attention_bias": True,
            "tie_word_embeddings": False, "eos_token_id": None, "pad_token_id": None, "dtype": "bfloat16",
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "original_max_position_embeddings": 4096, "truncate": False},
            "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}


def write_gpt_oss(path: Path, layers: int, vocab: int, seed: int = 0) -> None:
    """Random dense weights (names and shapes from moechat's own gpt_oss model) and MXFP4 experts from
    mxfp4.quantize: one quantized w13 / w2 per layer, rolled by rows per expert so the 32 experts differ
    (quantizing 32 experts a layer at 147 ns a weight would take minutes here)."""
    from moechat.engine.models import ARCHITECTURES
    from moechat.engine.quant.writer import save_checkpoint

    config = gpt_oss_config(layers, vocab)
    cls = ARCHITECTURES["gpt_oss"]
    margs = cls.args_class.from_dict(config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in cls.dense_weight_names(margs).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith("sinks"):
            t = torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) * (0.02 if name.endswith("weight") else 0.01)
        tensors[name] = t.bfloat16()
    E = config["num_local_experts"]
    for layer in cls.moe_layers(margs):
        b13, s13 = mxfp4.quantize(torch.randn(2 * I, H, generator=g) * 0.02)
        b2, s2 = mxfp4.quantize(torch.randn(H, I, generator=g) * 0.02)
        roll = lambda t: torch.stack([t.roll(37 * e, dims=0) for e in range(E)])  # [E, ...]
        p = f"model.layers.{layer}.mlp.experts."
        tensors.update({p + "gate_up_proj_blocks": roll(b13), p + "gate_up_proj_scales": roll(s13),
                        p + "down_proj_blocks": roll(b2), p + "down_proj_scales": roll(s2),
                        p + "gate_up_proj_bias": (torch.randn(E, 2 * I, generator=g) * 0.02).bfloat16(),
                        p + "down_proj_bias": (torch.randn(E, H, generator=g) * 0.02).bfloat16()})
    save_checkpoint(path, tensors, config, shards=max(1, layers // 2))


class ExpertClock:
    """Seconds spent in expert compute during decode steps (the model's expert_compute, wrapped)."""

    def __init__(self):
        from moechat.engine.models import base

        self.base, self.real = base, base.expert_compute
        self.decode_seconds = 0.0

        def timed(hidden_states, *a, **kw):
            t0 = time.perf_counter()
            out = self.real(hidden_states, *a, **kw)
            if hidden_states.shape[0] == 1:
                self.decode_seconds += time.perf_counter() - t0
            return out
        base.expert_compute = timed

    def reset(self) -> None:
        self.decode_seconds = 0.0

    def remove(self) -> None:
        self.base.expert_compute = self.real


def bench_engine(args, times, nbytes) -> None:
    from moechat.engine.models import ARCHITECTURES

    L, E, K = args.engine_layers, 32, 4
    print(f"engine, GPT-OSS-shaped ({L} layers x {E} experts, top-{K}, H = I = {H}, 64 x 64 heads, 8 KV heads, "
          f"vocab {args.vocab}), CPU, {args.prompt}-token prompt, {args.new} new tokens, greedy:")
    if "gpt_oss" not in ARCHITECTURES:
        print("  skipped: moechat has no gpt_oss model yet (engine/models/gpt_oss.py)")
        return
    from moechat.engine.cache.provider import CacheConfig
    from moechat.engine.runtime.generate import Engine
    from moechat.engine.runtime.sampling import SamplingParams

    tmp = None
    if args.model_dir:
        path = Path(args.model_dir)
        if not (path / "config.json").exists():
            write_gpt_oss(path, L, args.vocab)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="moechat-gpt-oss-")
        path = Path(tmp.name)
        t0 = time.perf_counter()
        write_gpt_oss(path, L, args.vocab)
        size = sum(f.stat().st_size for f in path.iterdir())
        print(f"  wrote {size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s")
    try:
        greedy = SamplingParams(temperature=0.0, do_sample=False)
        prompt = torch.randint(0, args.vocab, (args.prompt,), generator=torch.Generator().manual_seed(2)).tolist()
        clock = ExpertClock()
        rows = []
        for dtype in ("bfloat16", "float32"):
            for label, cache in [("all experts resident", None),
                                 (f"{L * E // 4} slots (25%)", CacheConfig(expert_slots=L * E // 4))]:
                engine = Engine.load(path, dtype=dtype, device="cpu", cache=cache)
                clock.reset()
                stamps, chunks = [], []
                for chunk in engine.generate(prompt, sampling=greedy, max_tokens=args.new):
                    stamps.append(time.perf_counter())
                    chunks.append(chunk)
                last = chunks[-1]
                snap = last.cache
                moved = (snap.bytes_from_ram + snap.bytes_from_disk) if snap else 0
                share = clock.decode_seconds / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
                rows.append((f"{dtype}, {label}", last.prefill_tokens_per_s, last.decode_tokens_per_s, share,
                             snap.hit_rate if snap else float("nan"), moved / max(1, args.prompt + args.new)))
                del engine
        clock.remove()
        print(f"  {'MXFP4 experts, dense part in':<36}{'prefill tok/s':>14}{'decode tok/s':>14}{'experts %':>11}"
              f"{'hit rate':>10}{'MB moved/token':>16}")
        for label, pre, dec, share, hit, moved in rows:
            print(f"  {label:<36}{pre:>14.1f}{dec:>14.2f}{share:>11.0%}{hit:>10.0%}{moved / MB:>16.1f}")
        print("  (experts %: the share of decode time in expert compute; the rest is attention, router, lm_head)")
        # bf16 experts: a dense bf16 gpt_oss checkpoint is not loadable, so per expert from the table above
        ms = {n: statistics.median(t[1]) for n, t in times.items()}
        ours = ms.get("moechat: same, bf16 in/out")
        dense = ms.get("dense bf16 (pre-expanded, 4x bytes)")
        if ours and dense:
            print(f"  experts per decode token: {L * K} x {ours * 1e3:.1f} ms MXFP4 (moechat) vs {L * K} x "
                  f"{dense * 1e3:.1f} ms bf16 = {L * K * ours * 1e3:.0f} vs {L * K * dense * 1e3:.0f} ms; a miss moves "
                  f"{nbytes / MB:.1f} MB vs {BF16_BYTES / MB:.1f} MB")
    finally:
        if tmp is not None:
            tmp.cleanup()


# -- CUDA ----------------------------------------------------------------------------------------------------------
def device_time(fn, reps: int, dev: torch.device) -> float:
    """Median seconds of fn() over `reps` calls after one warm-up (CUDA events on CUDA)."""
    fn()
    out = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def copy_bandwidth(dev: torch.device, nbytes: int) -> float:
    """Bytes/s a device-to-device copy moves (read + write): the ceiling for a read-bound kernel."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * nbytes / device_time(lambda: dst.copy_(src), 10, dev)


def bench_cuda(args) -> None:
    """The fused kernel at GPT-OSS-20B widths on CUDA (--smoke: tiny widths on the CPU under TRITON_INTERPRET=1,
    which checks this script, not the speed)."""
    from moechat.engine.layers.experts import _general_compute, expert_compute
    from moechat.engine.layers.moe import ExpertBatch
    from moechat.engine.quant.kernels.mxfp4_moe import mxfp4_moe

    dev = torch.device("cpu" if args.smoke else "cuda")
    h = i = 64 if args.smoke else H
    name = "CPU (Triton interpreter, smoke test)" if args.smoke else torch.cuda.get_device_name(0)
    print(f"device: {name}, torch {torch.__version__}")
    copy_bw = copy_bandwidth(dev, 1 << (20 if args.smoke else 31))
    C, K = 32, 4
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w13_blocks": torch.randint(0, 256, (C, 2 * i, h // 32, 16), generator=g, dtype=torch.uint8),
        "w13_scales": torch.randint(119, 122, (C, 2 * i, h // 32), generator=g, dtype=torch.uint8),
        "w2_blocks": torch.randint(0, 256, (C, h, i // 32, 16), generator=g, dtype=torch.uint8),
        "w2_scales": torch.randint(119, 122, (C, h, i // 32), generator=g, dtype=torch.uint8),
        "w13_bias": (torch.randn(C, 2 * i, generator=g) * 0.02).bfloat16(),
        "w2_bias": (torch.randn(C, h, generator=g) * 0.02).bfloat16()}
    tensors = {k: v.to(dev) for k, v in tensors.items()}
    per_expert = sum(t[0].numel() * t.element_size() for t in tensors.values())
    bf16_expert = get_format("dense").expert_bytes(h, i, torch.bfloat16, bias=True)
    fmt = get_format("mxfp4")
    reps = 2 if args.smoke else args.cuda_reps
    rows = []

    def row(label, T, fn, nbytes, check=""):
        try:
            rows.append((label, T, device_time(fn, reps, dev), nbytes, check))
        except Exception as e:  # keep the table: say what failed
            rows.append((label, T, float("nan"), nbytes, f"failed: {type(e).__name__}"))
            print(f"{label} T={T}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)

    for T in (1, 4, 32) if args.smoke else (1, 4, 32, 128, 512):
        x = torch.randn(T, h, generator=g).bfloat16().to(dev)
        ids = torch.stack([torch.randperm(C, generator=g)[:K] for _ in range(T)]).to(dev)  # [T, K]
        tw = torch.softmax(torch.randn(T, K, generator=g), -1).to(dev)
        used = int(ids.unique().numel())
        batch = ExpertBatch(tensors, ids, ids.cpu(), format=fmt)
        try:  # against the per-expert torch path on the same bytes
            want = _general_compute(x, tw, batch, x, ACT).float()
            got = mxfp4_moe(x, tw, ids, tensors, ACT, residual=x).float()
            diff, top = float((got - want).abs().max()), float(want.abs().max())
            check = f"max |diff| vs torch {diff:.1e} (|out| <= {top:.1f})"
        except Exception as e:
            check = f"failed: {type(e).__name__}: {str(e)[:80]}"
        row("fused Triton (MXFP4)", T, lambda x=x, ids=ids, tw=tw: mxfp4_moe(x, tw, ids, tensors, ACT, residual=x),
            used * per_expert, check)
        if T <= 4:
            row("torch per expert (MXFP4 dequant)", T,
                lambda x=x, tw=tw, batch=batch: _general_compute(x, tw, batch, x, ACT), used * per_expert)
    # bf16 experts for the same decode step (4 experts), the per-expert torch path
    dense = {"w13": torch.randn(K, 2 * i, h, device=dev, dtype=torch.bfloat16) * 0.02,
             "w2": torch.randn(K, h, i, device=dev, dtype=torch.bfloat16) * 0.02,
             "w13_bias": tensors["w13_bias"][:K].clone(), "w2_bias": tensors["w2_bias"][:K].clone()}
    x = torch.randn(1, h, device=dev, dtype=torch.bfloat16)
    ids = torch.arange(K, device=dev)[None]
    dense_batch = ExpertBatch(dense, ids, ids.cpu(), format=get_format("dense"))
    tw = torch.full((1, K), 1 / K, device=dev)
    row("torch per expert (bf16 experts)", 1, lambda: expert_compute(x, tw, dense_batch, x, ACT), K * bf16_expert)

    print(f"device copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s")
    print(f"GPT-OSS-20B experts (H = I = {h}) over {C} slots, top-{K}, bf16, clamped SwiGLU with biases; bytes = "
          f"the experts the batch uses, read once ({per_expert / MB:.2f} MB MXFP4, {bf16_expert / MB:.1f} MB bf16)")
    hdr = f"{'path':<34}{'T':>5}{'experts':>8}{'us':>10}{'GB/s':>9}{'% of copy':>10}  check"
    print(hdr)
    print("-" * (len(hdr) + 40))
    for label, T, sec, nbytes, check in rows:
        ne = nbytes / (bf16_expert if "bf16" in label else per_expert)
        print(f"{label:<34}{T:>5}{ne:>8.0f}{sec * 1e6:>10.1f}{nbytes / sec / 1e9:>9.0f}{nbytes / sec / copy_bw:>10.0%}"
              f"  {check}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (CPU)")
    parser.add_argument("--prefill", type=int, default=32, help="tokens of the small prefill (CPU)")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="skip torch.compile (tried when a C++ compiler is found)")
    parser.add_argument("--engine-layers", type=int, default=2, help="layers of the GPT-OSS-shaped model (0: skip)")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=24, help="tokens to decode")
    parser.add_argument("--model-dir", help="write (once) and reuse the GPT-OSS-shaped checkpoint here")
    parser.add_argument("--cuda-reps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true",
                        help="with --device cuda: tiny widths on the CPU under TRITON_INTERPRET=1 (checks the script)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with torch.inference_mode():
        if args.device == "cuda":
            bench_cuda(args)
        else:
            bench_cpu(args)


if __name__ == "__main__":
    main()
