"""Expert formats on the CPU, side by side: compute rates against the read bandwidth, and decode tok/s at one byte
budget (issue 14). The compute table is what engine/plan/'s EXPERT_COMPUTE_EFFICIENCY["cpu"] assumes.

1. Compute: for each expert width (Qwen3-30B-A3B: H 2048, I 768; GPT-OSS: H = I = 2880) and each format, one token
   through both projections of one expert (`fmt.linear`, the path experts.py takes for a packed format on the CPU),
   over enough copies of the expert that the weights come from RAM, not cache (held as the RAM tier holds experts: a
   slab per tensor, in huge pages where the OS gives them). Formats and a read-bandwidth probe (torch.sum over 512
   MB, in huge pages too) are timed in interleaved rounds (probe dense int8 int4 fp8 mxfp4, probe dense ..) so load
   from other processes lands on all alike; the table gives each format's median GB/s of its packed bytes, that over
   the probe's (the bandwidth aim is 0.6) and over dense bf16's (the plan's efficiency). Each packed format runs
   twice per round: its one-token native kernel (quant/native.py, when it is active) and its torch path
   (MOECHAT_NATIVE=0, "torch" rows). `--clock thread` times CPU seconds of this thread instead of wall seconds (a
   busy machine's other processes then cost the rates less; memory contention remains).
2. Engine (`--engine`): decode tok/s of the bundled demo model and of a Qwen3-30B-A3B-shaped checkpoint (real
   widths: H 2048, I 768, 128 experts, top-8; `--layers` layers, random bf16 weights written to disk, and an FP8
   copy with 128 x 128 block scales) in each format (native bf16, int8, int4 via --expert-format, fp8), every
   engine with the same byte budget: slots = `--slot-share` and the RAM tier = `--ram-share` of the bf16 experts'
   bytes, so a smaller format holds more experts in each. Formats interleaved (ABAB) over `--runs` rounds;
   medians and spread, hit rate, MB moved per token, and whether each format's greedy tokens repeat every round.

    python bench/format_compute.py [--threads 1] [--rounds 7] [--copies 24] [--clock wall|thread] [--engine] [--runs 3]
                                   [--layers 2]
    python bench/format_compute.py --device cuda [--smoke]   # the fused FP8/int8/int4 kernel vs copy bandwidth
3. Prefill (`--prefill`, issue 27): the many-token CPU path of the packed formats over three paths: the torch tile
   decoders + GEMM (MOECHAT_NATIVE_DECODE=0), native.c's decoders + GEMM (MOECHAT_PREFILL_KERNEL=0) and the prefill
   kernels (quant/prefill.py; int8: torch's int8 GEMM vs the kernel), interleaved in one process, medians and
   spread, at each of `--prefill-threads`; `--prefill-chunks 64,128,256,512` sweeps the engine's chunk size. Kernel level: decode GB/s of packed bytes of one projection (Qwen3-30B-A3B's and
   GPT-OSS's w13), and both projections of one expert for T tokens (T = 8: a 128-token prompt's tokens per expert
   at top-8 of 128; 128: every token); engine level (`--layers` > 0): prefill tok/s of a `--prefill-prompt`-token
   prompt on the Qwen3-30B-A3B-shaped checkpoint, experts resident, in bf16, int4 and FP8.

    python bench/format_compute.py --prefill [--prefill-threads 1,2] [--rounds 7] [--runs 3] [--layers 2]
                                   [--prefill-tokens 8,128] [--prefill-chunks 64,128,256,512] [--no-prefill-engines]
4. Integer prefill (`--prefill-int`, issue 27): int4 and MXFP4 experts of both widths, bf16 x, T tokens through w13
   and w2: the integer-dot kernel (x quantized to int8 blocks, quant/prefill.py) vs the decoded tile (fp32 FMAs),
   interleaved per thread count, medians, GMAC/s.

    python bench/format_compute.py --prefill-int [--prefill-tokens 128] [--prefill-threads 1,2] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moechat.engine.cache import hostmem
from moechat.engine.quant import get_format, mxfp4, native
from moechat.engine.quant.fp8 import fp8_format, quantize_blocks

ROOT = Path(__file__).resolve().parents[1]

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


def compute_table(args) -> None:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    print(f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {args.threads} thread(s), "
          f"{args.rounds} interleaved rounds, {args.copies} copies of each expert, one token (bf16 activations), "
          f"{args.clock} clock, load average {load:.1f} at start")
    print(f"one-token CPU path: {native.status()}")
    probe = hostmem.empty((128 << 20,), torch.float32).fill_(1.0)  # 512 MB, past the last-level cache, huge pages
    probe.sum()
    paths = [(name, "1") for name in FORMATS]
    if native.library() is not None:  # each packed format's torch path too, interleaved with its kernel
        paths += [(name, "0") for name in FORMATS if name != "dense"]
    label = {p: p[0] if p[1] == "1" or native.library() is None else f"{p[0]} (torch)" for p in paths}
    ratios: dict[str, list[float]] = {label[p]: [] for p in paths}
    for model, (H, I) in WIDTHS.items():
        x13 = torch.randn(1, H).bfloat16()  # [1, H]
        x2 = torch.randn(1, I).bfloat16()  # [1, I]
        setups = {}
        for name in FORMATS:
            fmt, tensors = expert(name, H, I)
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            # the copies as the RAM tier holds experts: one slab per tensor, [copies, ...], in huge pages
            slabs = {k: hostmem.empty((args.copies, *v.shape), v.dtype) for k, v in tensors.items()}
            for k, v in tensors.items():
                slabs[k][:] = v
            copies = [{k: slabs[k][c] for k in tensors} for c in range(args.copies)]
            for path in paths:
                if path[0] == name:
                    os.environ[native.ENV] = path[1]
                    fmt.linear(x13, copies[0], "w13")
                    fmt.linear(x2, copies[0], "w2")
                    setups[path] = (fmt, nbytes, copies)
        times: dict[tuple, list[float]] = {path: [] for path in paths}
        bw: list[float] = []
        for _ in range(args.rounds):
            t0 = clock()
            probe.sum()
            bw.append(probe.numel() * 4 / (clock() - t0))
            for path, (fmt, _, copies) in setups.items():
                os.environ[native.ENV] = path[1]
                t0 = clock()
                for c in copies:
                    fmt.linear(x13, c, "w13")
                    fmt.linear(x2, c, "w2")
                times[path].append((clock() - t0) / len(copies))
        os.environ.pop(native.ENV, None)
        read_bw = statistics.median(bw)
        dense_rate = setups[("dense", "1")][1] / statistics.median(times[("dense", "1")])
        print(f"\n{model} (H {H}, I {I}); read bandwidth {read_bw / 1e9:.2f} GB/s median "
              f"[{min(bw) / 1e9:.2f}-{max(bw) / 1e9:.2f}]")
        print("| format | packed MB | ms/expert | spread | GB/s packed | / read bw | / dense bf16 |")
        print("|---|---:|---:|---|---:|---:|---:|")
        for path, (_, nbytes, _) in setups.items():
            med = statistics.median(times[path])
            rate = nbytes / med
            ratios[label[path]].append(rate / dense_rate)
            spread = f"{min(times[path]) * 1e3:.2f}-{max(times[path]) * 1e3:.2f}"
            print(f"| {label[path]} | {nbytes / 1e6:.2f} | {med * 1e3:.3f} | {spread} | {rate / 1e9:.2f} | "
                  f"{rate / read_bw:.2f} | {rate / dense_rate:.3f} |")
    print("\nEXPERT_COMPUTE_EFFICIENCY['cpu'] from these (the mean over the widths):")
    print("  {" + ", ".join(f'"{n}": {statistics.mean(r):.2g}' for n, r in ratios.items()) + "}")


# -- decode tok/s per format at one byte budget ----------------------------------------------------------------
ENGINE_FORMATS = ("bf16", "int8", "int4", "fp8")


def fp8_copy(src: Path, dst: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """The checkpoint at `src` with its routed experts' projections written FP8 the Hub's way (e4m3 + block
    `weight_scale_inv`); everything else as it is (an FP8 checkpoint's dense layers are dequantized at load)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    out = {}
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as fh:
            for name in fh.keys():
                t = fh.get_tensor(name)
                if ".experts." in name and name.endswith("proj.weight"):
                    out[name], out[name + "_scale_inv"] = quantize_blocks(t.float(), block)
                else:
                    out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    raw = json.loads((dst / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def engine_table(name: str, path: Path, fp8_path: Path, args, work: Path) -> None:
    """Decode tok/s per format, every engine with the same slot and RAM byte budget, interleaved over rounds."""
    from moechat.engine.cache.provider import CacheConfig
    from moechat.engine.runtime.generate import Engine
    from moechat.engine.runtime.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, do_sample=False)
    probe = Engine.load(path)
    a = probe.args
    layers = len(probe.loaded.cls.moe_layers(a))
    H, I, E = a.hidden_size, a.moe_intermediate_size, a.num_experts
    dtype = next(probe.model.parameters()).dtype
    del probe
    bf16_bytes = get_format("dense").expert_bytes(H, I, dtype, False)
    slot_budget = args.slot_share * layers * E * bf16_bytes
    ram_budget = args.ram_share * layers * E * bf16_bytes
    prompt = list(range(3, 3 + args.prompt))
    engines, rows = {}, {}
    for fmt_name in ENGINE_FORMATS:
        fmt = fp8_format((128, 128)) if fmt_name == "fp8" else get_format("dense" if fmt_name == "bf16" else fmt_name)
        nbytes = fmt.expert_bytes(H, I, dtype, False)
        slots = min(layers * E, max(a.num_experts_per_tok, int(slot_budget // nbytes)))
        ram = int(ram_budget) if ram_budget < layers * E * nbytes else None  # None: every expert fits in RAM
        cache = CacheConfig(expert_slots=slots, ram_cache_bytes=ram, repack_dir=str(work / "repack"))
        t0 = time.perf_counter()
        engines[fmt_name] = Engine.load(fp8_path if fmt_name == "fp8" else path, cache=cache,
                                        expert_format=fmt_name if fmt_name in ("int8", "int4") else None)
        rows[fmt_name] = dict(nbytes=nbytes, slots=slots, ram=ram, load_s=time.perf_counter() - t0, tok=[],
                              outs=set(), hit=[], moved=[])
    for _ in range(args.runs):
        for fmt_name, engine in engines.items():
            r = rows[fmt_name]
            ids, last = [], None
            for chunk in engine.generate(prompt, sampling=greedy, max_tokens=args.tokens, stop_on_eos=False):
                ids.extend(chunk.token_ids)
                last = chunk
            r["tok"].append(last.decode_tokens_per_s)
            r["outs"].add(tuple(ids))
            snap = last.cache
            if snap is not None:
                r["hit"].append(snap.hit_rate)
                r["moved"].append((snap.bytes_from_ram + snap.bytes_from_disk) / max(1, len(ids)))
    for engine in engines.values():
        engine.close()
    base = statistics.median(rows["bf16"]["tok"])
    print(f"\n{name}: {layers} MoE layers x {E} experts (top-{a.num_experts_per_tok}), bf16 expert "
          f"{bf16_bytes / 1e6:.2f} MB; budget per engine: slots {slot_budget / 1e6:.0f} MB ({args.slot_share:.1%} of "
          f"the bf16 experts), RAM tier {ram_budget / 1e6:.0f} MB ({args.ram_share:.1%}); {args.runs} interleaved "
          f"runs of {args.tokens} tokens after a {args.prompt}-token prompt, {torch.get_num_threads()} torch threads")
    print("| format | expert MB | slots | RAM tier | decode tok/s median | spread | vs bf16 | hit rate | "
          "MB moved/token | same tokens every run |")
    print("|---|---:|---:|---|---:|---|---:|---:|---:|---|")
    for fmt_name, r in rows.items():
        med = statistics.median(r["tok"])
        ram = "every expert" if r["ram"] is None else f"{r['ram'] / 1e6:.0f} MB"
        hit = statistics.median(r["hit"]) if r["hit"] else float("nan")
        moved = statistics.median(r["moved"]) if r["moved"] else 0.0
        print(f"| {fmt_name} | {r['nbytes'] / 1e6:.2f} | {r['slots']} | {ram} | {med:.2f} | "
              f"{min(r['tok']):.2f}-{max(r['tok']):.2f} | {med / base:.2f}x | {hit:.0%} | {moved / 1e6:.1f} | "
              f"{'yes' if len(r['outs']) == 1 else 'NO'} |")


# -- CUDA: the fused FP8 / int8 / int4 kernel vs the device's copy bandwidth ------------------------------------
def cuda_table(args) -> None:
    """kernels/quant_moe.py at Qwen3-30B-A3B widths over 32 slots, top-8, bf16 (--smoke: tiny widths on the CPU
    under TRITON_INTERPRET=1, which checks this script, not the speed), next to the per-expert torch paths."""
    from quantized_experts import copy_bandwidth, device_time

    from moechat.engine.layers.experts import _general_compute
    from moechat.engine.layers.moe import ExpertActivation, ExpertBatch
    from moechat.engine.quant.kernels.quant_moe import quant_moe

    act = ExpertActivation()
    dev = torch.device("cpu" if args.smoke else "cuda")
    H, I = (64, 32) if args.smoke else WIDTHS["qwen3-30b-a3b"]
    C, K = 32, 8
    name = "CPU (Triton interpreter, smoke test)" if args.smoke else torch.cuda.get_device_name(0)
    copy_bw = copy_bandwidth(dev, 1 << (20 if args.smoke else 31))
    reps = 2 if args.smoke else 20
    bf16_expert = get_format("dense").expert_bytes(H, I, torch.bfloat16, False)
    print(f"device: {name}, torch {torch.__version__}; device copy bandwidth (read + write) {copy_bw / 1e9:.0f} GB/s")
    print(f"Qwen3-30B-A3B experts (H {H}, I {I}) over {C} slots, top-{K}, bf16 activations; bytes = the experts a "
          "batch uses, read once")
    print("| path | T | experts | us | GB/s | of copy | check |")
    print("|---|---:|---:|---:|---:|---:|---|")
    g = torch.Generator().manual_seed(0)

    def show(label, T, fn, nbytes, used, check=""):
        try:
            sec = device_time(fn, reps, dev)
            rate = nbytes / sec
            print(f"| {label} | {T} | {used} | {sec * 1e6:.1f} | {rate / 1e9:.0f} | {rate / copy_bw:.0%} | {check} |",
                  flush=True)
        except Exception as e:  # keep the table: say what failed
            print(f"| {label} | {T} | {used} | - | - | - | failed: {type(e).__name__}: {str(e)[:120]} |", flush=True)

    for fmt_name in ("fp8", "int8", "int4"):
        fmt, one = expert(fmt_name, H, I)
        # C slots: the one expert's tensors with rows rolled per slot, so slots differ
        tensors = {k: torch.stack([v.roll(7 * c, dims=0) for c in range(C)]).to(dev) for k, v in one.items()}
        per_expert = sum(t[0].numel() * t.element_size() for t in tensors.values())
        block = fmt.block if fmt_name == "fp8" else None
        for T in (1, 4) if args.smoke else (1, 8, 64, 512):
            x = torch.randn(T, H, generator=g).bfloat16().to(dev)
            ids = torch.stack([torch.randperm(C, generator=g)[:K] for _ in range(T)]).to(dev)  # [T, K]
            tw = torch.softmax(torch.randn(T, K, generator=g), -1).to(dev)
            used = int(ids.unique().numel())
            batch = ExpertBatch(tensors, ids, ids.cpu(), format=fmt)
            try:
                want = _general_compute(x, tw, batch, x, act).float()
                got = quant_moe(x, tw, ids, tensors, act, fmt_name, block=block, residual=x).float()
                diff, top = float((got - want).abs().max()), float(want.abs().max())
                check = f"max diff vs torch {diff:.1e} (out <= {top:.1f})"
            except Exception as e:
                check = f"failed: {type(e).__name__}: {str(e)[:80]}"
            show(f"fused Triton ({fmt_name})", T, lambda x=x, ids=ids, tw=tw, t=tensors, f=fmt_name, b=block: quant_moe(
                x, tw, ids, t, act, f, block=b, residual=x), used * per_expert, used, check)
            if T == 1:
                show(f"torch per expert ({fmt_name})", T, lambda x=x, tw=tw, batch=batch: _general_compute(
                    x, tw, batch, x, act), used * per_expert, used)
    dense = {"w13": torch.randn(C, 2 * I, H, generator=g).bfloat16().to(dev) * 0.02,
             "w2": torch.randn(C, H, I, generator=g).bfloat16().to(dev) * 0.02}
    x = torch.randn(1, H, generator=g).bfloat16().to(dev)
    ids = torch.arange(K, device=dev)[None]
    tw = torch.full((1, K), 1 / K, device=dev)
    from moechat.engine.layers.experts import expert_compute

    batch = ExpertBatch(dense, ids, ids.cpu(), format=get_format("dense"))
    show("torch per expert (bf16)", 1, lambda: expert_compute(x, tw, batch, x, act), K * bf16_expert, K)


# -- prefill: the many-token path: torch tile decoders + GEMM, native decoders + GEMM (old), prefill kernels (new) --
# (label, MOECHAT_NATIVE_DECODE, MOECHAT_PREFILL_KERNEL)
# (+ MOECHAT_PREFILL_INT: "0" unless a path names it, so "prefill kernel" is the decoded tile for a bf16 x too)
DECODE_PATHS = (("torch decoders", "0", "0"), ("native decoders", "1", "0"), ("prefill kernel", "1", "1"))
INTEGER_PATH = ("integer dot", "1", "1", "1")  # int4 / MXFP4 with a bf16 x: the integer kernels (the default)


def _path_env(path) -> None:
    from moechat.engine.quant import prefill

    os.environ[native.DECODE_ENV], os.environ[prefill.ENV] = path[1], path[2]
    os.environ[prefill.INT_ENV] = path[3] if len(path) > 3 else "0"


def _path_env_clear() -> None:
    from moechat.engine.quant import prefill

    os.environ.pop(native.DECODE_ENV, None)
    os.environ.pop(prefill.ENV, None)
    os.environ.pop(prefill.INT_ENV, None)


def _median_spread(ts: list[float], scale: float = 1.0, fmt: str = ".2f") -> str:
    v = sorted(t * scale for t in ts)
    return f"{statistics.median(v):{fmt}} | {v[0]:{fmt}}-{v[-1]:{fmt}}"


def prefill_kernels(args) -> None:
    """Decode GB/s of packed bytes (one w13) and ms per expert (w13 + w2) for T tokens, old vs new, ABAB."""
    from moechat.engine.quant import cpu

    lib = native.library()
    print(f"\nprefill kernels, {torch.get_num_threads()} thread(s), {args.rounds} interleaved rounds (ABAB); "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| format | width | what | torch decoders | spread | native decoders | spread | prefill kernel | spread | "
          "native / torch decoders | kernel / native decoders |")
    print("|---|---|---|---:|---|---:|---|---:|---|---:|---:|")
    for name in ("int4", "fp8", "mxfp4", "int8"):
        for model, (H, I) in WIDTHS.items():
            fmt, t = expert(name, H, I)
            if name == "int8":  # no decoder: the kernel against torch's int8 GEMM (Int8Format.linear) at each T
                _int8_rows(args, model, fmt, t, H, I)
                continue
            out = torch.empty(2 * I, H)  # [2I, H] fp32
            if name == "int4":
                q, sc = t["w13_q"], t["w13_scale"]
                packed = q.numel() + sc.numel() * 4
                decoders = (lambda: cpu.int4_decode(q, sc, out), lambda: native.int4_decode(lib, q, sc, out))
            elif name == "fp8":
                w8, sc = t["w13"], t["w13_scale"]
                srow, fac = cpu.fp8_scale_rows(2 * I, 128, I), sc * 256.0
                lanes = torch.empty(2 * I, H, dtype=torch.int16)
                packed = w8.numel() + sc.numel() * 4
                decoders = (lambda: cpu.fp8_decode(w8.view(torch.int8), fac[srow], 128, lanes, out),
                            lambda: (native.fp8_decode(lib, w8[:I], sc[: sc.shape[0] // 2], (128, 128), out[:I]),
                                     native.fp8_decode(lib, w8[I:], sc[sc.shape[0] // 2:], (128, 128), out[I:])))
            else:
                b, sc = t["w13_blocks"], t["w13_scales"]
                codes, signs, _ = mxfp4._tile_buffers(2 * I, H)
                fac = mxfp4.scale_factors(sc)
                packed = b.numel() + sc.numel()
                decoders = (lambda: mxfp4.decode_tile(b, fac, codes, signs, out),
                            lambda: native.mxfp4_decode(lib, b, sc, out))
            times = [[], []]
            for _ in range(args.rounds):
                for k, fn in enumerate(decoders):
                    fn()
                    t0 = time.perf_counter()
                    fn()
                    times[k].append(time.perf_counter() - t0)
            rate = [[packed / x / 1e9 for x in ts] for ts in times]
            print(f"| {name} | {model} | decode w13, GB/s packed | {_median_spread(rate[0])} | "
                  f"{_median_spread(rate[1])} | - | - | {statistics.median(rate[1]) / statistics.median(rate[0]):.1f}x "
                  f"| - |")
            for T in args.prefill_tokens:
                x13, x2 = torch.randn(T, H).bfloat16(), torch.randn(T, I).bfloat16()
                times = [[] for _ in DECODE_PATHS]
                for _ in range(args.rounds):
                    for k, path in enumerate(DECODE_PATHS):
                        _path_env(path)
                        t0 = time.perf_counter()
                        fmt.linear(x13, t, "w13")
                        fmt.linear(x2, t, "w2")
                        times[k].append(time.perf_counter() - t0)
                _path_env_clear()
                med = [statistics.median(ts) for ts in times]
                print(f"| {name} | {model} | expert, T={T}, ms | {_median_spread(times[0], 1e3)} | "
                      f"{_median_spread(times[1], 1e3)} | {_median_spread(times[2], 1e3)} | "
                      f"{med[0] / med[1]:.2f}x | {med[1] / med[2]:.2f}x |", flush=True)


def prefill_integer(args) -> None:
    """int4 and MXFP4 experts, bf16 x, T tokens through w13 and w2 (fmt.linear, the engine's path): the integer-dot
    kernel (x as int8 blocks) vs the decoded tile (fp32 FMAs), interleaved (ABAB) at each of `--prefill-threads`,
    medians over `--rounds`; GMAC/s = 3 H I T / time (MOECHAT_PREFILL_INT switches the two)."""
    from moechat.engine.quant import prefill

    lib = native.library()
    paths = (("decoded tile", "0"), ("integer dot", "1"))
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    print(f"\nprefill, integer dot vs decoded tile (bf16 x), {args.rounds} interleaved rounds, {args.clock} clock "
          f"(thread: the calling thread's CPU seconds, meaningful at 1 thread only); integer kernels built for "
          f"{prefill.integer_isa(lib)}; load average {os.getloadavg()[0]:.1f}. err: |y - ref| / |ref| (L2, w13's "
          f"output, bf16) against F.linear(x, weight()) in fp64")
    print("| format | width | T | threads | decoded tile ms | spread | GMAC/s | integer dot ms | spread | GMAC/s | "
          "integer / tile | err tile | err integer |")
    print("|---|---|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---:|")
    for name in ("int4", "mxfp4"):
        for model, (H, I) in WIDTHS.items():
            fmt, t = expert(name, H, I)
            for T in args.prefill_tokens:
                x13, x2 = torch.randn(T, H).bfloat16(), torch.randn(T, I).bfloat16()
                ref = torch.nn.functional.linear(x13.double(), fmt.weight(t, "w13", torch.float64))
                err = []
                for _, flag in paths:
                    os.environ[prefill.INT_ENV] = flag
                    err.append(float((fmt.linear(x13, t, "w13").double() - ref).norm() / ref.norm()))
                for threads in args.prefill_threads:
                    torch.set_num_threads(threads)
                    times = [[] for _ in paths]
                    for _ in range(args.rounds):
                        for k, (_, flag) in enumerate(paths):
                            os.environ[prefill.INT_ENV] = flag
                            t0 = clock()
                            fmt.linear(x13, t, "w13")
                            fmt.linear(x2, t, "w2")
                            times[k].append(clock() - t0)
                    os.environ.pop(prefill.INT_ENV, None)
                    med = [statistics.median(ts) for ts in times]
                    gmac = 3 * H * I * T / 1e9
                    print(f"| {name} | {model} | {T} | {threads} | {_median_spread(times[0], 1e3)} | "
                          f"{gmac / med[0]:.1f} | {_median_spread(times[1], 1e3)} | {gmac / med[1]:.1f} | "
                          f"{med[0] / med[1]:.2f}x | {err[0]:.2e} | {err[1]:.2e} |", flush=True)


def _int8_rows(args, model: str, fmt, t, H: int, I: int) -> None:
    """int8 experts: Int8Format.linear's many-token path (torch's int8 GEMM, bf16) vs the prefill kernel (fp32)."""
    from moechat.engine.quant import prefill

    lib = native.library()
    for T in args.prefill_tokens:
        x13, x2 = torch.randn(T, H).bfloat16(), torch.randn(T, I).bfloat16()
        fns = (lambda: (fmt.linear(x13, t, "w13"), fmt.linear(x2, t, "w2")),
               lambda: (prefill.int8(lib, x13, t["w13_q"], t["w13_scale"]),
                        prefill.int8(lib, x2, t["w2_q"], t["w2_scale"])))
        times = [[], []]
        for _ in range(args.rounds):
            for k, fn in enumerate(fns):
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        med = [statistics.median(ts) for ts in times]
        print(f"| int8 | {model} | expert, T={T}, ms (torch int8 GEMM, kernel) | - | - | "
              f"{_median_spread(times[0], 1e3)} | {_median_spread(times[1], 1e3)} | - | {med[0] / med[1]:.2f}x |",
              flush=True)


def prefill_engines(path: Path, fp8_path: Path, args, work: Path) -> None:
    """Prefill tok/s of one prompt per engine (experts resident), int4/FP8 over the three paths interleaved."""
    from moechat.engine.runtime.generate import Engine
    from moechat.engine.runtime.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, do_sample=False)
    prompt = list(range(3, 3 + args.prefill_prompt))
    engines = {name: Engine.load(fp8_path if name == "fp8" else path,
                                 expert_format=name if name == "int4" else None) for name in ("bf16", "int4", "fp8")}
    runs = ([("bf16", DECODE_PATHS[2])] + [(name, p) for name in ("int4", "fp8") for p in DECODE_PATHS[1:]]
            + [("int4", INTEGER_PATH)])
    label = {r: r[0] if r[0] == "bf16" else f"{r[0]} ({r[1][0]})" for r in runs}
    for threads in args.prefill_threads:
        torch.set_num_threads(threads)
        tok: dict[tuple, list[float]] = {r: [] for r in runs}
        firsts: dict[tuple, set] = {r: set() for r in runs}
        for i in range(args.runs + 1):  # the first round warms every engine up (scratch buffers, pages), not counted
            for r in runs:
                _path_env(r[1])
                chunk = next(iter(engines[r[0]].generate(prompt, sampling=greedy, max_tokens=1, stop_on_eos=False)))
                firsts[r].add(tuple(chunk.token_ids))
                if i:
                    tok[r].append(chunk.prefill_tokens_per_s)
        _path_env_clear()
        print(f"\nQwen3-30B-A3B-shaped prefill, {args.prefill_prompt}-token prompt, experts resident, {threads} "
              f"thread(s), {args.runs} interleaved rounds; load average {os.getloadavg()[0]:.1f}")
        print("| format (path) | prefill tok/s median | spread | vs native decoders + GEMM | vs bf16 | "
              "same first token |")
        print("|---|---:|---|---:|---:|---|")
        base = statistics.median(tok[runs[0]])
        for r in runs:
            med = statistics.median(tok[r])
            old = statistics.median(tok[(r[0], DECODE_PATHS[1])]) if r[0] != "bf16" else med
            same = "yes" if len(firsts[r] | firsts[(r[0], DECODE_PATHS[1] if r[0] != "bf16" else r[1])]) == 1 else "NO"
            print(f"| {label[r]} | {med:.1f} | {min(tok[r]):.1f}-{max(tok[r]):.1f} | {med / old:.2f}x | "
                  f"{med / base:.2f}x | {same} |", flush=True)
    for engine in engines.values():
        engine.close()


def prefill_chunks(path: Path, args) -> None:
    """Prefill tok/s of one `--prefill-prompt`-token prompt (int4 experts resident, the prefill kernels) at each of
    `--prefill-chunks` chunk sizes, interleaved, per thread count: what quant/prefill.chunk_size is based on."""
    from moechat.engine.runtime.generate import Engine
    from moechat.engine.runtime.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, do_sample=False)
    prompt = list(range(3, 3 + args.prefill_prompt))
    engine = Engine.load(path, expert_format="int4")
    for threads in args.prefill_threads:
        torch.set_num_threads(threads)
        tok: dict[int, list[float]] = {c: [] for c in args.prefill_chunks}
        for i in range(args.runs + 1):
            for c in args.prefill_chunks:
                engine.prefill_chunk = c
                chunk = next(iter(engine.generate(prompt, sampling=greedy, max_tokens=1, stop_on_eos=False)))
                if i:
                    tok[c].append(chunk.prefill_tokens_per_s)
        print(f"\nprefill chunk size, int4, {args.prefill_prompt}-token prompt, {threads} thread(s), {args.runs} "
              f"interleaved rounds; load average {os.getloadavg()[0]:.1f}")
        print("| chunk | prefill tok/s median | spread |")
        print("|---:|---:|---|")
        for c in args.prefill_chunks:
            print(f"| {c} | {statistics.median(tok[c]):.1f} | {min(tok[c]):.1f}-{max(tok[c]):.1f} |", flush=True)
    engine.close()


def qwen3_shaped(path: Path, layers: int) -> Path:
    """A Qwen3-30B-A3B-shaped checkpoint (real expert widths, `layers` layers, vocab 4096), random bf16 weights."""
    import transformers

    config = transformers.AutoConfig.for_model(
        "qwen3_moe", vocab_size=4096, hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096, initializer_range=0.02)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--copies", type=int, default=24, help="copies of each expert cycled through (beyond cache)")
    ap.add_argument("--clock", default="wall", choices=["wall", "thread"],
                    help="thread: CPU seconds of this thread (what other processes take of the core not counted)")
    ap.add_argument("--no-compute", dest="compute", action="store_false", help="skip the compute table")
    ap.add_argument("--engine", action="store_true", help="decode tok/s per format at one byte budget")
    ap.add_argument("--runs", type=int, default=3, help="interleaved engine rounds")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2, help="layers of the Qwen3-30B-A3B-shaped model (0: skip it)")
    ap.add_argument("--slot-share", type=float, default=0.125, help="slot budget, as a share of the bf16 experts")
    ap.add_argument("--ram-share", type=float, default=0.25, help="RAM tier budget, as a share of the bf16 experts")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: the fused FP8/int8/int4 kernel's GB/s vs the device's copy bandwidth (only that)")
    ap.add_argument("--smoke", action="store_true",
                    help="with --device cuda: tiny widths on the CPU under TRITON_INTERPRET=1 (checks the script)")
    ap.add_argument("--prefill", action="store_true", help="the many-token path: torch vs native tile decoders")
    ap.add_argument("--prefill-threads", type=lambda v: [int(t) for t in v.split(",")], default=[1, 2])
    ap.add_argument("--prefill-prompt", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=lambda v: [int(t) for t in v.split(",")], default=[8, 128],
                    help="tokens per expert in the kernel table")
    ap.add_argument("--prefill-chunks", type=lambda v: [int(t) for t in v.split(",")], default=[],
                    help="chunk sizes to sweep on the int4 engine (e.g. 64,128,256,512)")
    ap.add_argument("--no-prefill-engines", dest="prefill_engines", action="store_false")
    ap.add_argument("--prefill-int", action="store_true",
                    help="int4 and MXFP4 prefill: the integer-dot kernel vs the decoded tile (bf16 x), then exit")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.prefill_int:
        if native.library() is None:
            raise SystemExit(f"--prefill-int times the native prefill kernels: {native.status()}")
        prefill_integer(args)
        return
    if args.prefill:
        if native.library() is None:
            raise SystemExit(f"--prefill compares the native decoders with the torch ones: {native.status()}")
        for threads in args.prefill_threads if args.compute else ():
            torch.set_num_threads(threads)
            prefill_kernels(args)
        if args.layers:
            work = Path(tempfile.mkdtemp(prefix="moechat-prefill-"))
            try:
                qwen = qwen3_shaped(work / "qwen3-shaped", args.layers)
                if args.prefill_engines:
                    prefill_engines(qwen, fp8_copy(qwen, work / "qwen3-shaped-fp8"), args, work)
                if args.prefill_chunks:
                    prefill_chunks(qwen, args)
            finally:
                shutil.rmtree(work, ignore_errors=True)
        return
    if args.device == "cuda":
        with torch.inference_mode():
            cuda_table(args)
        return
    if args.compute:
        compute_table(args)
    if not args.engine:
        return
    work = Path(tempfile.mkdtemp(prefix="moechat-formats-"))
    try:
        demo = ROOT / "assets" / "demo-moe"
        engine_table("demo model", demo, fp8_copy(demo, work / "demo-fp8"), args, work)
        if args.layers:
            t0 = time.perf_counter()
            qwen = qwen3_shaped(work / "qwen3-shaped", args.layers)
            qwen_fp8 = fp8_copy(qwen, work / "qwen3-shaped-fp8")
            print(f"\n(wrote the Qwen3-30B-A3B-shaped bf16 and FP8 checkpoints in {time.perf_counter() - t0:.0f} s)")
            engine_table("Qwen3-30B-A3B-shaped", qwen, qwen_fp8, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
