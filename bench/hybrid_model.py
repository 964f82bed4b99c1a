"""A whole Qwen3.6-35B-A3B-shaped model on this CPU: prefill and decode tok/s in bf16 and with int4 experts, and the
Gated DeltaNet layers' share of a decode step beside the full-attention layers'.

    python bench/hybrid_model.py [--layers 2] [--rounds 3] [--threads 1] [--work DIR]

The checkpoint is written once (to --work, default a temporary folder) by transformers from the real config.json
(../shared/model-configs/Qwen--Qwen3.6-35B-A3B, or --config) with its real widths and full vocabulary, `--layers`
of its 40 layers (three Gated DeltaNet layers to one gated full-attention layer as the real pattern has them, at
least one of each) and random weights. Both engines load from it (bf16 experts as stored; int4 converted once)
and run the same prompt, interleaved, `--rounds` times; medians with min-max beside them.

The share is timed inside the decode steps: each token mixer's forward (the DeltaNet layer: projections, conv,
recurrence, gated norm, out_proj; the attention layer: projections, RoPE, attention over the cache, gate, o_proj)
accumulated per call with one token, per layer, against the step's wall time. The aim of issue 31: a recurrent
layer costs no more per token than a full-attention layer (bench/recurrent_layers.py measures it at 4k context).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

CONFIG = Path(__file__).resolve().parents[2] / "shared" / "model-configs" / "Qwen--Qwen3.6-35B-A3B" / "config.json"


def layer_types(n: int) -> list[str]:
    """The real pattern (a full-attention layer every 4th), cut to n layers with at least one of each kind."""
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    if "full_attention" not in kinds:
        kinds[-1] = "full_attention"
    return kinds


def write_checkpoint(path: Path, config_path: Path, layers: int) -> None:
    import transformers

    text = json.loads(config_path.read_text())
    text = dict(text.get("text_config", text))
    text.update(num_hidden_layers=layers, layer_types=layer_types(layers), mtp_num_hidden_layers=0,
                model_type="qwen3_5_moe_text", max_position_embeddings=8192)
    text.pop("architectures", None)
    config = transformers.AutoConfig.for_model(**text)
    torch.manual_seed(0)
    with torch.no_grad():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        for n, p in model.named_parameters():
            if n.endswith("A_log"):
                p.copy_(torch.rand_like(p) * 2 - 1)  # decays in a realistic range
    model.save_pretrained(path)


class MixerClock:
    """Seconds per one-token forward of each token mixer, by kind, patched in for the timed runs."""

    def __init__(self):
        from moechat.engine.models.qwen3_next import GatedAttention, GatedDeltaNet

        self.kinds = {GatedDeltaNet: "deltanet", GatedAttention: "attention"}
        self.seconds = defaultdict(float)
        self.calls = defaultdict(int)
        self._saved = {}

    def __enter__(self):
        for cls, kind in self.kinds.items():
            original = self._saved[cls] = cls.forward

            def timed(module, x, *args, _original=original, _kind=kind, **kwargs):
                if x.shape[0] != 1:
                    return _original(module, x, *args, **kwargs)
                t0 = time.perf_counter()
                out = _original(module, x, *args, **kwargs)
                self.seconds[_kind] += time.perf_counter() - t0
                self.calls[_kind] += 1
                return out

            cls.forward = timed
        return self

    def __exit__(self, *exc):
        for cls, original in self._saved.items():
            cls.forward = original

    def reset(self):
        self.seconds.clear()
        self.calls.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens (the prefill)")
    ap.add_argument("--tokens", type=int, default=16, help="decode tokens per round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--formats", default="native,int4", help="expert formats to compare (native = bf16 as stored)")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    a = ap.parse_args()
    if not a.config.exists():
        raise SystemExit(f"no config at {a.config} (../shared/model-configs is absent here): pass --config")
    torch.set_num_threads(a.threads)

    from moechat.engine.runtime.generate import Engine
    from moechat.engine.runtime.sampling import SamplingParams

    work = a.work or Path(tempfile.mkdtemp(prefix="hybrid_model_"))
    path = work / f"qwen3.6-shaped-{a.layers}"
    if not (path / "config.json").exists():
        t0 = time.perf_counter()
        write_checkpoint(path, a.config, a.layers)
        print(f"(wrote {path} in {time.perf_counter() - t0:.0f} s)")
    formats = a.formats.split(",")
    engines = {}
    for fmt in formats:
        t0 = time.perf_counter()
        engines[fmt] = Engine.load(path, dtype="bfloat16", expert_format=None if fmt == "native" else fmt,
                                   context=a.prompt + a.tokens + 8)
        print(f"(loaded {fmt} in {time.perf_counter() - t0:.1f} s)")
    kinds = layer_types(a.layers)
    n_delta, n_attn = kinds.count("linear_attention"), kinds.count("full_attention")
    greedy = SamplingParams(temperature=0.0, do_sample=False)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, engines[formats[0]].args.vocab_size, (a.prompt,), generator=g).tolist()
    rows = {fmt: defaultdict(list) for fmt in formats}
    with MixerClock() as clock:
        for _ in range(a.rounds):
            for fmt, engine in engines.items():
                clock.reset()
                last = None
                t0 = time.perf_counter()
                for chunk in engine.generate(prompt, sampling=greedy, max_tokens=a.tokens, stop_on_eos=False):
                    last = chunk
                wall = time.perf_counter() - t0
                steps = max(clock.calls["deltanet"] // max(n_delta, 1), 1)
                r = rows[fmt]
                r["prefill"].append(last.prefill_tokens_per_s)
                r["decode"].append(last.decode_tokens_per_s)
                r["delta_ms"].append(1e3 * clock.seconds["deltanet"] / steps / max(n_delta, 1))
                r["attn_ms"].append(1e3 * clock.seconds["attention"] / steps / max(n_attn, 1))
                r["share"].append(clock.seconds["deltanet"] / steps * last.decode_tokens_per_s)
                r["wall"].append(wall)

    def cell(values, fmt="{:.1f}"):
        return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"

    print(f"\nQwen3.6-35B-A3B-shaped ({a.layers} of 40 layers: {n_delta} Gated DeltaNet + {n_attn} full attention, real "
          f"widths, full vocabulary), bf16 activations, {a.threads} thread(s), {a.prompt}-token prompt then "
          f"{a.tokens} greedy tokens, {a.rounds} interleaved rounds; medians (min-max)")
    print("| experts | prefill tok/s | decode tok/s | DeltaNet layer ms/token | attention layer ms/token | "
          "DeltaNet layers' share of a decode step |")
    print("|---|---:|---:|---:|---:|---:|")
    for fmt in formats:
        r = rows[fmt]
        print(f"| {'bf16' if fmt == 'native' else fmt} | {cell(r['prefill'])} | {cell(r['decode'], '{:.2f}')} | "
              f"{cell(r['delta_ms'], '{:.2f}')} | {cell(r['attn_ms'], '{:.2f}')} | {cell(r['share'], '{:.2f}')} |")


if __name__ == "__main__":
    main()
