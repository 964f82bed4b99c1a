"""Experts several times the RAM budget: moechat (slots + RAM cache + disk) vs transformers + accelerate
disk offload under the same budget. One run, each engine in its own process (so peak RSS is its own),
the page cache of the model's files dropped before each run (posix_fadvise DONTNEED).

    pip install accelerate    # transformers' offloading needs it (not a moechat dependency)
    python bench/offload.py [--budget-mb 256] [--new 64] [--hf-new 8]

transformers with `device_map` offloading re-reads every offloaded weight on every forward pass, so it
gets fewer tokens (--hf-new) and is reported per token like moechat.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPEC = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
            head_dim=64, num_experts=64, num_experts_per_tok=4, moe_intermediate_size=512, intermediate_size=1024,
            norm_topk_prob=True)


def build(path: Path) -> None:
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(**SPEC, max_position_embeddings=1024, initializer_range=0.05,
                                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(
        path, max_shard_size="512MB")


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM: per address space, so not inherited from the parent like ru_maxrss)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def read_paths(path: Path, layer: int = 0) -> dict[str, float]:
    """Seconds to read every expert of one layer cold: preadv from the shards (moechat's DiskStore), mmap
    (safetensors), and one preadv per expert from a repacked per-expert file."""
    import torch

    from moechat.engine.cache.store import DiskStore
    from moechat.engine.io.checkpoint import Checkpoint
    from moechat.engine.load.loader import read_expert, read_model_config

    cls, args, _ = read_model_config(path)
    ckpt = Checkpoint.open(path)
    disk = DiskStore(cls, args, ckpt, torch.float32)
    E = args.num_experts
    dst = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in disk.shapes.items()}
    repacked = path.parent / "repacked.bin"
    with open(repacked, "wb") as f:
        for e in range(E):
            disk.read_into(layer, e, dst)
            for name in ("w13", "w2"):
                f.write(dst[name].numpy().tobytes())
    out = {}
    drop_page_cache(path)
    t0 = time.perf_counter()
    for e in range(E):
        disk.read_into(layer, e, dst)
    out["preadv from shards"] = time.perf_counter() - t0
    drop_page_cache(path)
    t0 = time.perf_counter()
    for e in range(E):
        for name, t in read_expert(cls, args, ckpt, layer, e).items():
            dst[name].copy_(t)
    out["mmap (safetensors)"] = time.perf_counter() - t0
    drop_page_cache(path.parent)
    fd = os.open(repacked, os.O_RDONLY)
    bufs = [memoryview(dst[name].numpy()).cast("B") for name in ("w13", "w2")]
    per = sum(len(b) for b in bufs)
    t0 = time.perf_counter()
    for e in range(E):
        os.preadv(fd, bufs, e * per)
    out["preadv from a repacked file"] = time.perf_counter() - t0
    os.close(fd)
    repacked.unlink()
    out["MiB"] = E * per / 2**20
    return out


def drop_page_cache(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages (a file just written) are not dropped until written back
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def child_moechat(path: str, budget: int, prompt: list[int], new: int, slots: int, repack: str | None = None) -> dict:
    from moechat.engine.cache.provider import CacheConfig
    from moechat.engine.runtime.generate import Engine
    from moechat.engine.runtime.sampling import SamplingParams

    t0 = time.perf_counter()
    engine = Engine.load(path, dtype="float32", context=len(prompt) + new + 8,
                         cache=CacheConfig(expert_slots=slots, ram_cache_bytes=budget, repack_dir=repack))
    load_s = time.perf_counter() - t0
    chunks = list(engine.generate(prompt, sampling=SamplingParams(temperature=0.0, do_sample=False),
                                  max_tokens=new))
    snap = chunks[-1].cache
    return {"load_s": load_s, "decode_tok_s": chunks[-1].decode_tokens_per_s,
            "prefill_tok_s": chunks[-1].prefill_tokens_per_s, "tokens": [c.token_ids[0] for c in chunks],
            "bytes_read": snap.bytes_from_disk, "hit_rate": snap.hit_rate}


def child_transformers(path: str, budget: int, prompt: list[int], new: int) -> dict:
    import torch
    import transformers

    offload = tempfile.mkdtemp(prefix="hf-offload-")
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, device_map="auto", max_memory={"cpu": budget}, offload_folder=offload)
    load_s = time.perf_counter() - t0
    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        t2 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
        t3 = time.perf_counter()
    prefill = t2 - t1
    return {"load_s": load_s, "decode_tok_s": (new - 1) / max((t3 - t2) - prefill, 1e-9),
            "prefill_tok_s": len(prompt) / prefill, "tokens": out[0, len(prompt):].tolist()}


def run_child(kind: str, path: Path, budget: int, prompt: list[int], new: int, slots: int,
              repack: str | None = None) -> dict:
    if path.exists():
        drop_page_cache(path)
    if repack and Path(repack).exists():
        drop_page_cache(Path(repack))
    args = json.dumps({"kind": kind, "path": str(path), "budget": budget, "prompt": prompt, "new": new,
                       "slots": slots, "repack": repack})
    out = subprocess.run([sys.executable, __file__, "--child", args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{kind} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-mb", type=int, default=256, help="RAM budget for the experts")
    parser.add_argument("--slots", type=int, default=64, help="moechat expert slots (RAM on a CPU)")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--hf-new", type=int, default=8)
    parser.add_argument("--child")
    opts = parser.parse_args()
    if opts.child:
        a = json.loads(opts.child)
        if a["kind"] == "build":
            build(Path(a["path"]))
            result = read_paths(Path(a["path"]))
        elif a["kind"] == "moechat":
            result = child_moechat(a["path"], a["budget"], a["prompt"], a["new"], a["slots"], a["repack"])
        else:
            result = child_transformers(a["path"], a["budget"], a["prompt"], a["new"])
        result["peak_rss_mb"] = peak_rss_mib()
        print(json.dumps(result))
        return
    budget = opts.budget_mb << 20
    prompt = [(13 * i + 5) % SPEC["vocab_size"] for i in range(32)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        reads = run_child("build", path, budget, prompt, 0, 0)  # in a child: this process stays small
        L, E, I, H = SPEC["num_hidden_layers"], SPEC["num_experts"], SPEC["moe_intermediate_size"], SPEC["hidden_size"]
        expert_bytes = 3 * I * H * 4
        print(f"model: {L} layers x {E} experts of {expert_bytes / 2**20:.1f} MiB = {L * E * expert_bytes / 2**30:.2f} "
              f"GiB of experts (fp32), top-{SPEC['num_experts_per_tok']}; RAM budget {opts.budget_mb} MiB "
              f"({L * E * expert_bytes / budget:.1f}x smaller); moechat slots: {opts.slots} "
              f"({opts.slots * expert_bytes / 2**20:.0f} MiB)")
        ours = run_child("moechat", path, budget, prompt, opts.new, opts.slots)
        repack = str(Path(tmp) / "repacked")
        run_child("moechat", path, budget, prompt, 1, opts.slots, repack)  # writes the repacked file once
        ours_rp = run_child("moechat", path, budget, prompt, opts.new, opts.slots, repack)
        theirs = run_child("transformers", path, budget, prompt, opts.hf_new, opts.slots)
    same = ours["tokens"][: opts.hf_new] == theirs["tokens"]
    per_token = ours["bytes_read"] / max(opts.new, 1)
    rows = [("moechat", ours, f"{per_token / 2**20:.1f}"),
            ("moechat --repack-dir", ours_rp, f"{ours_rp['bytes_read'] / max(opts.new, 1) / 2**20:.1f}"),
            ("transformers+accelerate", theirs, "all offloaded")]
    header = (f"{'engine':<26}{'decode tok/s':>14}{'prefill tok/s':>15}{'load s':>9}{'peak RSS MiB':>14}"
              f"{'read/token MiB':>16}")
    print(header)
    print("-" * len(header))
    for name, r, read in rows:
        print(f"{name:<26}{r['decode_tok_s']:>14.2f}{r['prefill_tok_s']:>15.1f}{r['load_s']:>9.1f}"
              f"{r['peak_rss_mb']:>14.0f}{read:>16}")
    mib = reads.pop("MiB")
    print(f"cold read of one layer's {SPEC['num_experts']} experts ({mib:.0f} MiB): " + ", ".join(
        f"{k} {mib / v:.0f} MiB/s" for k, v in reads.items() if k != "peak_rss_mb"))
    print("(the page cache is dropped before each run; within a run both engines may re-read from it)")
    print(f"decode ratio moechat / transformers: {ours['decode_tok_s'] / theirs['decode_tok_s']:.0f}x; "
          f"moechat hit rate {ours['hit_rate']:.1%}; first {opts.hf_new} greedy tokens identical: {same}")


if __name__ == "__main__":
    main()
