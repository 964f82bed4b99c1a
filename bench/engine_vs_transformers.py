"""moechat vs transformers `generate`, same weights, same prompt, fp32, greedy, in one run.

    python bench/engine_vs_transformers.py [--runs 5] [--prompt 512] [--new 128] [--only a|b]

Random-weight models are built with transformers and saved as safetensors:
  (a) small qwen3_moe, like the bundled demo model: per-token overhead dominates decode;
  (b) larger qwen3_moe: decode is bound by memory bandwidth;
  (c) deepseek_v3-shaped: tiny widths with V3's ratios (MLA with a q LoRA, 8 groups choosing 4, top-8 of 64
      routed experts with a correction bias, one shared expert, the first layer dense); the table also gives
      the KV cache bytes per token of both engines (moechat keeps MLA's latent, transformers the expanded K/V).
For (b) the table also gives the bandwidth bound: bytes of weights one decoded token reads, divided by
this machine's matrix-vector read bandwidth, measured here in the same run. Medians of --runs runs.
Random weights route near-uniformly, which is the worst case for neither engine (both run all experts
resident); transformers is given `eos_token_id=None` so both generate exactly --new tokens.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

MODELS = {
    "a": dict(vocab_size=8192, hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=1024,
              norm_topk_prob=True),
    "b": dict(vocab_size=32768, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
              intermediate_size=2048, norm_topk_prob=True),
    "c": dict(model_type="deepseek_v3", vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
              v_head_dim=32, n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4,
              moe_intermediate_size=64, intermediate_size=512, n_shared_experts=1, first_k_dense_replace=1,
              routed_scaling_factor=2.5, norm_topk_prob=True),
}


def build(path: Path, spec: dict):
    import transformers

    spec = dict(spec)
    config = transformers.AutoConfig.for_model(spec.pop("model_type", "qwen3_moe"), **spec,
                                               max_position_embeddings=2048, initializer_range=0.05,
                                               eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    return model


def kv_bytes_per_token(engine, model, n: int = 16) -> tuple[float, float]:
    """KV cache bytes one token costs: moechat's preallocated cache over its length, transformers' cache after
    a forward of n tokens."""
    kv = engine.new_sequence().kv
    ours = kv.nbytes() / kv.max_tokens
    with torch.inference_mode():
        out = model(torch.arange(n, device=model.device)[None], use_cache=True)
    theirs = 0
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                theirs += t.numel() * t.element_size()
    return ours, theirs / n


def decode_bytes_per_token(spec: dict) -> int | None:
    """fp32 bytes of weights a decode step reads: attention, norms, routers, K experts per layer, lm_head
    (qwen3_moe rows only)."""
    if "model_type" in spec:
        return None
    H, L, D = spec["hidden_size"], spec["num_hidden_layers"], spec["head_dim"]
    nH, nKV, E, K, I = (spec["num_attention_heads"], spec["num_key_value_heads"], spec["num_experts"],
                        spec["num_experts_per_tok"], spec["moe_intermediate_size"])
    attn = H * (nH + 2 * nKV) * D + nH * D * H + 2 * D + 2 * H
    per_layer = attn + E * H + K * 3 * H * I
    return 4 * (L * per_layer + spec["vocab_size"] * H + H)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matvec_bandwidth(device: str, nbytes: int = 256 << 20, reps: int = 20) -> float:
    """Bytes/s this machine reads a large fp32 matrix at in a matrix-vector product (the decode pattern)."""
    rows = 8192
    w = torch.randn(rows, nbytes // 4 // rows, device=device)
    x = torch.randn(w.shape[1], device=device)
    torch.mv(w, x)
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        torch.mv(w, x)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return w.numel() * 4 / statistics.median(times)


def load_moechat(path: Path, context: int, device: str):
    from moechat.engine.runtime.generate import Engine

    return Engine.load(path, dtype="float32", context=context, device=device)


def run_moechat(engine, prompt: list[int], new: int) -> tuple[float, float, list[int]]:
    from moechat.engine.runtime.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, do_sample=False)
    chunks = list(engine.generate(prompt, sampling=greedy, max_tokens=new))
    return chunks[-1].prefill_tokens_per_s, chunks[-1].decode_tokens_per_s, [c.token_ids[0] for c in chunks]


def run_transformers(model, prompt: list[int], new: int) -> tuple[float, float, list[int]]:
    ids = torch.tensor([prompt], device=model.device)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, use_cache=True)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        t1 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
        t2 = time.perf_counter()
    prefill = t1 - t0
    decode = (t2 - t1) - prefill  # the second call prefills again, then decodes new-1 tokens
    return len(prompt) / prefill, (new - 1) / decode, out[0, len(prompt):].tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--only", choices=sorted(MODELS))
    parser.add_argument("--device", default="cpu")
    opts = parser.parse_args()
    print(f"torch {torch.__version__}, {opts.device}, {torch.get_num_threads()} threads, fp32, prompt {opts.prompt}, "
          f"{opts.new} greedy new tokens, median of {opts.runs} runs")
    bandwidth = matvec_bandwidth(opts.device)
    rows, kv_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in MODELS.items():
            if opts.only and name != opts.only:
                continue
            path = Path(tmp) / name
            ref = build(path, spec).to(opts.device)
            generator = torch.Generator().manual_seed(1)
            prompt = torch.randint(0, spec["vocab_size"], (opts.prompt,), generator=generator).tolist()
            engine = load_moechat(path, len(prompt) + opts.new + 8, opts.device)
            run_moechat(engine, prompt[:64], 4)  # warm-up, both engines: first calls allocate and fault pages
            run_transformers(ref, prompt[:64], 4)
            ours, theirs = [], []
            for _ in range(opts.runs):
                ours.append(run_moechat(engine, prompt, opts.new))
                theirs.append(run_transformers(ref, prompt, opts.new))
            same = ours[0][2] == theirs[0][2]
            med = lambda runs, i: statistics.median(r[i] for r in runs)
            weight_bytes = decode_bytes_per_token(spec)
            bound = bandwidth / weight_bytes if weight_bytes else float("nan")
            rows.append((name, med(ours, 0), med(theirs, 0), med(ours, 1), med(theirs, 1), bound, same))
            kv_rows.append((name, *kv_bytes_per_token(engine, ref)))
            print(f"({name}: moechat decode {rows[-1][3]:.1f} tok/s, transformers {rows[-1][4]:.1f} tok/s)",
                  flush=True)
            del ref, engine
    print(f"matrix-vector read bandwidth: {bandwidth / 1e9:.1f} GB/s")
    header = (f"{'model':<6}{'prefill moechat':>16}{'prefill hf':>12}{'ratio':>7}{'decode moechat':>16}"
              f"{'decode hf':>11}{'ratio':>7}{'bw bound':>10}{'moechat/bound':>15}{'same tokens':>13}")
    print(header)
    print("-" * len(header))
    for name, pm, ph, dm, dh, bound, same in rows:
        print(f"{name:<6}{pm:>16.1f}{ph:>12.1f}{pm / ph:>7.2f}{dm:>16.1f}{dh:>11.1f}{dm / dh:>7.2f}"
              f"{bound:>10.1f}{dm / bound:>15.2f}{same!s:>13}")
    print("(tok/s; bw bound = measured matvec bandwidth / fp32 weight bytes read per decoded token)")
    print(f"\n{'model':<6}{'KV bytes/token moechat':>24}{'transformers':>14}{'ratio':>8}")
    for name, ours, theirs in kv_rows:
        print(f"{name:<6}{ours:>24.0f}{theirs:>14.0f}{ours / theirs:>8.3f}")


if __name__ == "__main__":
    main()
