"""Decode and prefill tok/s per GGUF quant type on a Qwen3-30B-A3B-shaped GGUF, next to the same shape from
safetensors with int8 / int4 experts, and each type's native one-token kernel in GB/s against the read bandwidth.

The GGUF files (one per type, `--types`, written once into `--work` with the gguf package's writer, streamed tensor by
tensor): Qwen3-30B-A3B's real widths (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of 768, top-8, the full
151,936-token vocabulary), `--layers` of its 48 layers, every tensor of that type (attention and experts; the output
and embedding matrices too, as a pure Q8_0 file has them) as random valid blocks (random codes, fp16 scales that keep
the weights near N(0, 0.02)); norms and routers F32. moechat keeps the experts, the output matrix and the embedding
table packed (the table and head: quant/gguf_dense.py) and dequantizes attention to bf16 at load. `Q4_K+bf16 head`
is the Q4_K file with MOECHAT_GGUF_PACKED=0: its head and table dequantized to bf16 at load, as before issue 30.

The safetensors model (`--model`, default /work/bench_scratch/qwen3-shaped-2 when it exists, else one is built as
bench/dense_format.py builds it): the same shape in bf16, run with `--expert-format int8` / `int4` (converted once
into a repacked file under `--work`), the dense weights in bf16 (the LM head through native.c's bf16 GEMV).
Every expert is resident in every row (the byte budget holds all of them): the rows differ by the bytes a token reads.

Each round loads every format in turn (order reversed every other round; each in a process of its own), generates
`--tokens` greedy tokens after a `--prompt`-token prompt, and keeps the prefill and decode tok/s the engine reports;
medians over `--rounds`. Kernel rates: one bf16 token through the full-vocabulary output matrix (151,936 x 2048) by
`vecdot` per type, and through int8 / int4 QuantLinear (quant/dense_quant.py) and bf16 native GEMV for reference;
packed bytes / time (median of `--reps`), against the one-thread RAM read probe `moechat fit` calibrates with
(plan/calibration.py, best of the probes taken between rounds). bf16 activations, `--threads` threads.

    python bench/gguf_types.py [--types Q8_0,Q4_0,Q4_K,Q5_K,Q6_K] [--layers 2] [--rounds 3] [--tokens 12]
                               [--prompt 64] [--threads 1] [--work DIR] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from moechat.engine.quant.gguf import TYPES

sys.path.insert(0, str(Path(__file__).parent))
from dense_format import FULL_LAYERS, qwen3_shaped  # noqa: E402

H, NH, NKV, D, E, K, I, V = 2048, 32, 4, 128, 128, 8, 768, 151936  # Qwen3-30B-A3B
SCRATCH = Path("/work/bench_scratch/qwen3-shaped-2")

# where each type keeps its fp16 scale(s) and the value that gives weights of about N(0, 0.02) over random codes
SCALES = {"Q8_0": ((0, 2.7e-4),), "Q4_0": ((0, 4.3e-3),), "Q4_1": ((0, 4.3e-3), (2, -0.03)),
          "Q5_0": ((0, 2.2e-3),), "Q5_1": ((0, 2.2e-3), (2, -0.035)), "Q4_K": ((0, 1.3e-4), (2, 1e-4)),
          "Q5_K": ((0, 6.5e-5), (2, 1e-4)), "Q6_K": ((208, 4e-5),), "Q2_K": ((80, 6e-4), (82, 1e-4)),
          "Q3_K": ((108, 2.5e-4),), "IQ4_NL": ((0, 3e-4),), "IQ4_XS": ((0, 3e-4),)}


def blocks(name: str, rows: int, cols: int, rng) -> np.ndarray:
    """[rows, row_bytes] uint8: random codes, the type's fp16 scales set (see SCALES)."""
    t = TYPES[name]
    raw = rng.integers(0, 256, size=(rows * (cols // t.block), t.nbytes), dtype=np.uint8)
    for at, value in SCALES[name]:
        raw[:, at:at + 2] = np.full((raw.shape[0], 1), value, np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write_shaped(path: Path, name: str, layers: int, seed: int = 0) -> Path:
    """A Qwen3-30B-A3B-shaped qwen3moe GGUF with every matrix in `name`, written tensor by tensor."""
    import gguf

    rng = np.random.default_rng(seed)
    q = gguf.GGMLQuantizationType[name]
    t = TYPES[name]
    tensors = [("token_embd.weight", (V, H)), ("output_norm.weight", (H,)), ("output.weight", (V, H))]
    for i in range(layers):
        b = f"blk.{i}."
        tensors += [(b + "attn_q.weight", (NH * D, H)), (b + "attn_k.weight", (NKV * D, H)),
                    (b + "attn_v.weight", (NKV * D, H)), (b + "attn_output.weight", (H, NH * D)),
                    (b + "attn_q_norm.weight", (D,)), (b + "attn_k_norm.weight", (D,)),
                    (b + "attn_norm.weight", (H,)), (b + "ffn_norm.weight", (H,)),
                    (b + "ffn_gate_inp.weight", (E, H)), (b + "ffn_gate_exps.weight", (E, I, H)),
                    (b + "ffn_up_exps.weight", (E, I, H)), (b + "ffn_down_exps.weight", (E, H, I))]
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_context_length(4096)
    w.add_embedding_length(H)
    w.add_block_count(layers)
    w.add_feed_forward_length(6144)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    w.add_expert_feed_forward_length(I)

    def float_kind(tname: str, shape) -> bool:
        return len(shape) == 1 or "ffn_gate_inp" in tname

    for tname, shape in tensors:
        if float_kind(tname, shape):
            w.add_tensor_info(tname, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            byte_shape = (*shape[:-1], t.row_bytes(shape[-1]))
            w.add_tensor_info(tname, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=q)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for tname, shape in tensors:
        if len(shape) == 1:
            w.write_tensor_data(np.ones(shape, np.float32))
        elif float_kind(tname, shape):
            w.write_tensor_data((rng.standard_normal(shape) * 0.02).astype(np.float32))
        else:
            rows = int(np.prod(shape[:-1]))
            w.write_tensor_data(blocks(name, rows, shape[-1], rng).reshape(*shape[:-1], -1))
    w.close()
    return path


def token_bytes(engine) -> dict[str, int]:
    """Bytes one decode token reads, by part (KV and norms left out: small at these lengths), as
    bench/dense_format.py counts them; the K experts a layer in their format's packed layout."""
    model, a, fmt = engine.model, engine.args, engine.loaded.expert_format
    attn = sum(t.numel() * t.element_size() for layer in model.layer_list
               for t in (layer.self_attn.qkv_t, layer.self_attn.o_weight_t))
    lm = model.lm_q.nbytes if model.lm_q is not None else model.lm_weight_t.numel() * model.lm_weight_t.element_size()
    layout = fmt.layout(a.hidden_size, a.moe_intermediate_size, engine.loaded.dtype, False)
    expert = sum(torch.Size(shape).numel() * dt.itemsize for shape, dt in layout.values())
    return {"attention": attn, "lm_head": lm, "experts": len(engine.loaded.cls.moe_layers(a)) * K * expert}


def median_s(f, reps: int) -> float:
    f()  # warm: pages in, scratch allocated
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_rates(names: list[str], reps: int) -> dict[str, float]:
    """GB/s of one bf16 token through a [V, H] output matrix per type (vecdot), int8 / int4 QuantLinear, bf16."""
    from moechat.engine.models.base import _bf16_gemv_lib
    from moechat.engine.quant import native
    from moechat.engine.quant.dense_quant import QuantLinear
    from moechat.engine.quant.gguf import vecdot

    rng = np.random.default_rng(1)
    x = torch.randn(1, H).bfloat16()
    out = {}
    for name in names:
        raw = torch.from_numpy(blocks(name, V, H, rng))
        t = TYPES[name]
        assert vecdot(x, raw, t, H) is not None
        out[name] = raw.numel() / median_s(lambda raw=raw, t=t: vecdot(x, raw, t, H), reps) / 1e9
    w = torch.randn(V, H).mul_(0.02).bfloat16()
    lib = _bf16_gemv_lib(x, w.t())
    if lib is not None:
        out["bf16 (native GEMV)"] = w.numel() * 2 / median_s(lambda: native.bf16_gemv(lib, x, w), reps) / 1e9
    for fmt in ("int8", "int4"):
        ql = QuantLinear(w, None, fmt)
        out[f"{fmt} (QuantLinear)"] = ql.nbytes / median_s(lambda ql=ql: ql(x, out_dtype=torch.float32), reps) / 1e9
        del ql
    return out


def child(spec: dict) -> None:
    """One measurement: load, generate, print {prefill, decode, bytes} as the last line."""
    from moechat.engine.runtime.generate import Engine
    from moechat.engine.runtime.sampling import SamplingParams

    torch.set_num_threads(spec["threads"])
    engine = Engine.load(spec["path"], dtype="bfloat16", context=spec["prompt"] + spec["tokens"] + 8, **spec["kw"])
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(spec["prompt"])]
    last = None
    for chunk in engine.generate(prompt, sampling=SamplingParams(temperature=0.0, do_sample=False),
                                 max_tokens=spec["tokens"], stop_on_eos=False):
        last = chunk
    print(json.dumps({"prefill": last.prefill_tokens_per_s, "decode": last.decode_tokens_per_s,
                      "bytes": token_bytes(engine)}))
    engine.close()


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return child(json.loads(sys.argv[2]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_K,Q5_K,Q6_K")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5, help="kernel rates: timed calls per kernel")
    ap.add_argument("--work", type=Path, default=Path("/work/bench_scratch/gguf_types"))
    ap.add_argument("--model", type=Path, default=None, help="the safetensors model (bf16, Qwen3-shaped)")
    ap.add_argument("--no-safetensors", action="store_true", help="GGUF rows only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XDG_CACHE_HOME", str(args.work / "xdg"))  # the int8/int4 repacked files go here

    from moechat.engine.plan.calibration import measure_ram_read_gbps

    names = args.types.split(",")
    files = {}
    for name in names:
        path = args.work / f"qwen3-shaped-{args.layers}-{name}.gguf"
        if not path.exists():
            t0 = time.perf_counter()
            write_shaped(path.with_suffix(".part"), name, args.layers).rename(path)
            print(f"(wrote {path.name}, {path.stat().st_size / 1e9:.2f} GB, in {time.perf_counter() - t0:.0f} s)")
        files[name] = path
    rows: dict[str, dict] = {}  # label -> (path, load kwargs, env)
    for name in names:
        rows[name] = {"path": files[name], "kw": {}, "env": None}
    if "Q4_K" in files:
        rows["Q4_K+bf16 head"] = {"path": files["Q4_K"], "kw": {}, "env": "0"}
    if not args.no_safetensors:
        model = args.model or (SCRATCH if (SCRATCH / "config.json").exists() else None)
        if model is None:
            model = args.work / f"qwen3-shaped-{args.layers}"
            if not (model / "config.json").exists():
                qwen3_shaped(model, args.layers)
        for fmt in ("int8", "int4"):
            rows[f"safetensors {fmt}"] = {"path": model, "kw": {"expert_format": fmt}, "env": None}
    probes, result = [], {label: {"prefill": [], "decode": [], "bytes": None} for label in rows}
    labels = list(rows)
    for r in range(args.rounds):
        probes.append(measure_ram_read_gbps())
        for label in labels if r % 2 == 0 else labels[::-1]:
            spec = rows[label]
            env = dict(os.environ, **({"MOECHAT_GGUF_PACKED": spec["env"]} if spec["env"] is not None else {}))
            # each measurement in a process of its own: every engine's memory returned before the next loads
            cmd = [sys.executable, __file__, "--child", json.dumps({"path": str(spec["path"]), "kw": spec["kw"],
                                                                   "prompt": args.prompt, "tokens": args.tokens,
                                                                   "threads": args.threads})]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise SystemExit(f"{label}: the measurement failed:\n{out.stderr[-3000:]}")
            got = json.loads(out.stdout.strip().splitlines()[-1])
            result[label]["prefill"].append(got["prefill"])
            result[label]["decode"].append(got["decode"])
            result[label]["bytes"] = got["bytes"]
            print(f"(round {r + 1}: {label}: prefill {got['prefill']:.1f}, decode {got['decode']:.2f} tok/s)",
                  flush=True)
    rates = kernel_rates(names, args.reps)
    probes.append(measure_ram_read_gbps())
    gbps = max(probes)
    print(f"\nQwen3-30B-A3B-shaped, {args.layers} of {FULL_LAYERS} layers, full vocabulary, every expert resident, "
          f"bf16 activations, {args.threads} thread(s); {args.rounds} interleaved rounds, {args.prompt}-token prompt, "
          f"{args.tokens} tokens; read probe {gbps:.1f} GB/s (best of {len(probes)}, "
          f"{min(probes):.1f}-{max(probes):.1f})")
    print("| format | MB/token: attention + LM head + experts = all | prefill tok/s | decode tok/s median | spread | "
          "bound tok/s | of bound |")
    print("|---|---|---:|---:|---|---:|---:|")
    for label, res in result.items():
        b = res["bytes"]
        total = sum(b.values())
        med = statistics.median(res["decode"])
        bound = gbps * 1e9 / total
        print(f"| {label} | {b['attention'] / 1e6:.0f} + {b['lm_head'] / 1e6:.0f} + {b['experts'] / 1e6:.0f} = "
              f"{total / 1e6:.0f} | {statistics.median(res['prefill']):.1f} | {med:.2f} | "
              f"{min(res['decode']):.2f}-{max(res['decode']):.2f} | {bound:.1f} | {med / bound:.2f} |")
    print(f"\none bf16 token through the {V:,} x {H} output matrix ({args.threads} thread(s), median of {args.reps}): "
          f"packed GB/s and the fraction of the {gbps:.1f} GB/s read probe")
    print("| kernel | GB/s | of read |")
    print("|---|---:|---:|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} | {rate / gbps:.2f} |")


if __name__ == "__main__":
    main()
