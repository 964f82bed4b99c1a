"""moechat beside llama.cpp on the CPU: the same random-weight models in both engines, interleaved, in one run.

Two models at real widths with fewer layers (flags give the issue's or the full counts):
  - Qwen3-30B-A3B-shaped (hidden 2048, 128 experts of 768, top-8, vocabulary 151,936), bf16 weights, run as
    bf16 / int8 / int4 experts in moechat (int8 with `dense_format="int8"`, int4 with `dense_format="int4"`:
    attention in 4 bits and the LM head in int8, as llama.cpp's Q4_0 keeps attention in Q4_0 and its output matrix
    in Q6_K; bf16 with native dense) against llama.cpp's BF16 / Q8_0 / Q4_0 (or `--q4 Q4_K_M`) of the same
    checkpoint; and with `--formats ...,gguf-q8,gguf-q4` moechat on llama.cpp's own Q8_0 / Q4_0 file (experts in the
    file's types, attention dequantized to bf16 at load, the output matrix kept packed);
  - GPT-OSS-20B-shaped (hidden 2880, 32 experts of 2880, top-4, vocabulary 201,088, sliding window, sinks,
    biases), experts in MXFP4 as shipped (random codes and scales: speed does not depend on the values), dense in
    bf16: moechat's native MXFP4 against the GGUF llama.cpp's converter makes from it (MXFP4 experts, bf16 rest).
For each row and each thread count: prefill tok/s of a `--prompt`-token prompt and decode tok/s of `--tokens`
greedy tokens (llama-bench's pp and tg tests; moechat's GenerationChunk figures; each engine runs one warm-up
generation before the measured one, llama-bench's default), medians over `--rounds` rounds in
which the engines alternate, each engine's fraction of its bandwidth bound (bytes one decode token reads in that
engine's own weights: attention, LM head, K of E experts per layer / the read probe of `moechat fit`'s calibration,
one thread, best of the probes taken between rounds; numpy's sum reads slower than a tuned kernel does, so a
fraction can pass 1), and peak RSS (every run is its own process, forked from a small launcher: `wait4`'s
ru_maxrss).

llama.cpp is found, in order: `--llama-cpp DIR`, the environment variable MOECHAT_LLAMA_CPP (a CMake build folder
holding bin/llama-bench and bin/llama-quantize, or a folder holding them), or `--build-llama-cpp`, which downloads
the llama-cpp-python sdist from PyPI (`pip download llama-cpp-python --no-deps --no-binary :all:`) and builds the
llama.cpp it vendors into `--work`/llama.cpp-build (`-DGGML_NATIVE=ON -DLLAMA_CURL=OFF`, Release, only
llama-bench and llama-quantize; 20-40 min on 2 cores). Without any of them the llama.cpp columns say why and
moechat still runs. The table's header says the build used: its source, commit, and the flags read back from its
CMakeCache.txt, including whether AMX is on (`GGML_NATIVE` = `-march=native` turns AMX on on a CPU that has it,
whatever the GGML_AMX_* options say). Converting needs the build's source (convert_hf_to_gguf.py and gguf-py, found
through CMakeCache.txt, or `--llama-src`) and its Python deps (torch, transformers, numpy: moechat's own).

The converter needs `architectures` in config.json (both writers put it there) and a tokenizer whose pre-tokenizer
hash it knows; the models get a GPT-2-style byte-level BPE tokenizer of the 256 bytes and 4 merges (llama.cpp
loads no BPE vocabulary without merges; the converter pads it to the full vocabulary with unused tokens), whose
hash is not in its table, so the bench runs the converter with `get_vocab_base_pre` returning "gpt-2" (patched in
that process only, nothing written to the llama.cpp source).
llama-bench feeds random token ids, so the tokenizer plays no part in the timings.

    python bench/vs_llamacpp.py --build-llama-cpp --work /tmp/vs            # build once, then:
    MOECHAT_LLAMA_CPP=/tmp/vs/llama.cpp-build python bench/vs_llamacpp.py --work /tmp/vs \
        [--qwen-layers 4] [--gpt-oss-layers 4] [--threads 1,2] [--rounds 3] [--prompt 128] [--tokens 32] \
        [--models qwen3,gpt-oss] [--formats bf16,int8,int4] [--q4 Q4_0]
    # the issue's sizes: --qwen-layers 8 --gpt-oss-layers 12 (about 13 + 8 GB of checkpoints, plus the GGUFs)

Disk: the Qwen3-shaped checkpoint is 1.5 GB per layer in bf16 + 0.6 GB (embedding and head), its GGUFs 1.9x that
together; the GPT-OSS-shaped one 0.5 GB per layer + 2.3 GB, its GGUF as much. Everything lands in `--work` and is
reused (moechat's int8/int4 repacked experts in `--work`/moechat-cache).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

QWEN3 = dict(vocab_size=151936, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
             moe_intermediate_size=768, intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
             norm_topk_prob=True, max_position_embeddings=4096, initializer_range=0.02, tie_word_embeddings=False)
GPT_OSS = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "pad_token_id": 199999, "experts_per_token": 4, "num_experts_per_tok": 4, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "max_position_embeddings": 131072, "num_attention_heads": 64,
    "num_key_value_heads": 8, "num_local_experts": 32, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False, "vocab_size": 201088,
    "dtype": "bfloat16",
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}
# row -> (moechat expert_format, moechat dense_format, llama.cpp type); "q4" is filled from --q4
# gguf-*: moechat runs the GGUF llama.cpp runs (experts in the file's types, attention dequantized to bf16 at load, the
# output matrix kept packed)
ROWS = {"bf16": (None, "native", "BF16"), "int8": ("int8", "int8", "Q8_0"), "int4": ("int4", "int4", "q4"),
        "mxfp4": (None, "native", "MXFP4"), "gguf-q8": (None, "native", "Q8_0"), "gguf-q4": (None, "native", "q4")}


class BenchError(Exception):
    """A setup problem the user fixes (printed as one line, no traceback)."""


# -- the models ----------------------------------------------------------------------------------------------------
MERGES = [("Ġ", "t"), ("h", "e"), ("i", "n"), ("e", "r")]  # llama.cpp refuses a BPE vocabulary without merges


def write_tokenizer(path: Path) -> None:
    """A GPT-2-style byte-level BPE: the 256 byte tokens, four merges, one end-of-text token (the last id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet(), key=lambda c: ord(c)))}  # 256 byte symbols
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
         "model_max_length": 131072}))


def qwen3_shaped(path: Path, layers: int) -> None:
    """Random bf16 weights from transformers (as bench/dense_format.py writes them), with a tokenizer."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model("qwen3_moe", num_hidden_layers=layers, **QWEN3)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)  # config.json carries architectures: ["Qwen3MoeForCausalLM"]
    del model
    write_tokenizer(path)


def gpt_oss_shaped(path: Path, layers: int) -> None:
    """Names and shapes from transformers' model on the meta device; dense weights gaussian in bf16, experts random
    MXFP4 codes with scales around 2^-8 (quantizing gaussians at this size takes minutes per layer on a CPU)."""
    import torch
    import transformers

    from moechat.engine.quant.writer import save_checkpoint

    config = dict(GPT_OSS, num_hidden_layers=layers,
                  layer_types=(["sliding_attention", "full_attention"] * layers)[:layers])
    hf = transformers.GptOssConfig(**{k: v for k, v in config.items() if k != "quantization_config"})
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(hf)
    g = torch.Generator().manual_seed(0)
    E, H, I = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    tensors = {}
    for name, t in model.state_dict().items():
        if ".mlp.experts." in name:
            continue
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(t.shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(t.shape, generator=g) * 0.02).bfloat16()
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp.experts."
        for proj, rows, cols in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            tensors[p + proj + "_blocks"] = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g,
                                                          dtype=torch.uint8)  # [E, out, in/32, 16]: 2 codes a byte
            tensors[p + proj + "_scales"] = torch.randint(117, 121, (E, rows, cols // 32), generator=g,
                                                          dtype=torch.uint8)  # [E, out, in/32]: e8m0 exponents
            tensors[p + proj + "_bias"] = (torch.randn(E, rows, generator=g) * 0.02).bfloat16()
    save_checkpoint(path, tensors, config, shards=max(1, layers // 4))
    write_tokenizer(path)


# -- llama.cpp -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaCpp:
    bin: Path  # holds llama-bench and llama-quantize
    src: Path | None  # the source tree (convert_hf_to_gguf.py, gguf-py), from CMakeCache.txt or --llama-src
    how: str  # one line: where it came from and how it was built

    def tool(self, name: str) -> str:
        return str(self.bin / name)


def _cmake_cache(build: Path) -> dict[str, str]:
    cache = build / "CMakeCache.txt"
    out = {}
    if cache.exists():
        for line in cache.read_text(errors="replace").splitlines():
            m = re.match(r"^([A-Za-z0-9_]+):[A-Z]+=(.*)$", line)
            if m:
                out[m.group(1)] = m.group(2)
    return out


def _cpu_has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def describe_build(build: Path, origin: str) -> tuple[Path | None, str]:
    """The source folder and one line saying how `build` was made (flags from its CMakeCache.txt)."""
    c = _cmake_cache(build)
    src = Path(c["CMAKE_HOME_DIRECTORY"]) if c.get("CMAKE_HOME_DIRECTORY") else None
    if not c:
        return src, f"{origin}: {build} (no CMakeCache.txt: flags unknown)"
    native = c.get("GGML_NATIVE", "?").upper() in ("ON", "1", "TRUE")
    amx_opts = {k: v for k, v in c.items() if k.startswith("GGML_AMX")}
    if native:
        amx = "AMX on (GGML_NATIVE: -march=native, CPU has AMX)" if _cpu_has_amx() else \
            "AMX off (GGML_NATIVE: -march=native, CPU has no AMX)"
    else:
        amx = "AMX " + ("on" if any(v.upper() == "ON" for v in amx_opts.values()) else "off") + \
            f" ({', '.join(f'{k}={v}' for k, v in sorted(amx_opts.items())) or 'no GGML_AMX options'})"
    flags = " ".join(f"{k}={c[k]}" for k in ("CMAKE_BUILD_TYPE", "GGML_NATIVE", "LLAMA_CURL", "GGML_BLAS",
                                              "GGML_OPENMP", "CMAKE_C_FLAGS") if k in c and c[k] != "")
    return src, f"{origin}: {build}, source {src}, {flags}; {amx}"


def find_llama_cpp(arg: Path | None, src_arg: Path | None) -> tuple[LlamaCpp | None, str]:
    """The llama.cpp build to use, or None and why not."""
    if arg is not None:
        folder, origin = arg, "--llama-cpp"
    elif os.environ.get("MOECHAT_LLAMA_CPP"):
        folder, origin = Path(os.environ["MOECHAT_LLAMA_CPP"]), "MOECHAT_LLAMA_CPP"
    else:
        return None, ("no llama.cpp build: pass --build-llama-cpp (builds it from the llama-cpp-python sdist), "
                      "--llama-cpp DIR or set MOECHAT_LLAMA_CPP=DIR")
    for bin_dir in (folder / "bin", folder):
        if (bin_dir / "llama-bench").exists() and (bin_dir / "llama-quantize").exists():
            break
    else:
        return None, f"{origin}={folder} has no bin/llama-bench and bin/llama-quantize: build those targets there"
    build = bin_dir.parent if bin_dir.name == "bin" else bin_dir
    src, how = describe_build(build, origin)
    return LlamaCpp(bin_dir, src_arg or src, how), ""


def build_llama_cpp(work: Path) -> Path:
    """Download the llama-cpp-python sdist and build the llama.cpp it vendors (once) into work/llama.cpp-build."""
    build = work / "llama.cpp-build"
    if (build / "bin" / "llama-bench").exists() and (build / "bin" / "llama-quantize").exists():
        return build
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise BenchError(f"building llama.cpp needs {tool} on PATH: install it or pass --llama-cpp DIR")
    sdist_dir = work / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    if not list(sdist_dir.glob("llama_cpp_python-*.tar.gz")):
        print("downloading the llama-cpp-python sdist ...", flush=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "llama-cpp-python", "--no-deps",
                            "--no-binary", ":all:", "-d", str(sdist_dir)], capture_output=True, text=True)
        if r.returncode:
            raise BenchError("pip download llama-cpp-python failed (is PyPI reachable?): "
                             + (r.stderr.strip().splitlines() or ["no output"])[-1])
    sdist = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))[-1]
    subprocess.run(["tar", "xzf", str(sdist), "-C", str(sdist_dir)], check=True)
    src = sdist_dir / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    print(f"building llama.cpp from {src} (about 20-40 min on 2 cores) ...", flush=True)
    cfg = ["cmake", "-S", str(src), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
           "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
    jobs = str(max(1, min(os.cpu_count() or 1, 4)))
    for cmd in (cfg, ["cmake", "--build", str(build), "-j", jobs, "--target", "llama-bench", "llama-quantize"]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise BenchError(f"{' '.join(cmd[:2])} failed: " + (r.stderr.strip().splitlines() or ["no output"])[-1])
    return build


# Runs llama.cpp's converter with the pre-tokenizer check answering "gpt-2" for the bench's byte-level tokenizer
# (its hash is not in the converter's table); nothing in the llama.cpp tree is changed.
CONVERT = """
import sys
try:
    from conversion import base  # the converter split into a package (2025-)
except ImportError:
    import convert_hf_to_gguf as base  # one file before that
model = getattr(base, "TextModel", None) or base.Model
model.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
convert_hf_to_gguf.main()
"""


def _gguf_env(llama: LlamaCpp) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(llama.src / "gguf-py"), str(llama.src), env.get("PYTHONPATH", "")])
    return env


def check_converter(llama: LlamaCpp) -> str:
    """'' when the converter can run, else why not."""
    if llama.src is None or not (llama.src / "convert_hf_to_gguf.py").exists():
        return ("no llama.cpp source beside the build (convert_hf_to_gguf.py): pass --llama-src DIR "
                "(the tree it was built from)")
    r = subprocess.run([sys.executable, "-c", "import gguf, convert_hf_to_gguf"], env=_gguf_env(llama),
                       capture_output=True, text=True, cwd=llama.src)
    if r.returncode:
        return ("llama.cpp's converter does not import (pip install gguf, or keep gguf-py in the source tree): "
                + (r.stderr.strip().splitlines() or ["no output"])[-1])
    return ""


def convert(llama: LlamaCpp, model: Path, out: Path, outtype: str) -> Path:
    if out.exists():
        return out
    tmp = out.with_suffix(".part")
    r = subprocess.run([sys.executable, "-c", CONVERT, str(model), "--outfile", str(tmp), "--outtype", outtype],
                       env=_gguf_env(llama), capture_output=True, text=True, cwd=llama.src)
    if r.returncode:
        raise BenchError(f"convert_hf_to_gguf.py on {model} failed: " + (r.stderr.strip().splitlines() or ["?"])[-1])
    tmp.rename(out)
    return out


def quantize(llama: LlamaCpp, src: Path, out: Path, qtype: str) -> Path:
    if not out.exists():
        tmp = out.with_suffix(".part")
        r = subprocess.run([llama.tool("llama-quantize"), str(src), str(tmp), qtype], capture_output=True, text=True)
        if r.returncode:
            raise BenchError(f"llama-quantize {qtype} failed: " + (r.stderr.strip().splitlines() or ["?"])[-1])
        tmp.rename(out)
    return out


# bytes one decode token reads from a GGUF: attention (+ biases, sinks), the output head, and K/E of every expert
# tensor; embeddings (one row), norms and routers left out, as on the moechat side
GGUF_BYTES = """
import json, re, sys
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
k, e = int(sys.argv[2]), int(sys.argv[3])
out = {"attention": 0, "lm_head": 0, "experts": 0}
for t in r.tensors:
    n = int(t.n_bytes)
    if re.search(r"_exps\\.", t.name):
        out["experts"] += n * k // e
    elif ".attn_" in t.name and "norm" not in t.name:
        out["attention"] += n
    elif t.name == "output.weight":
        out["lm_head"] += n
print(json.dumps(out))
"""


def gguf_token_bytes(llama: LlamaCpp, path: Path, k: int, e: int) -> dict[str, int]:
    r = subprocess.run([sys.executable, "-c", GGUF_BYTES, str(path), str(k), str(e)], env=_gguf_env(llama),
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


# -- one measured run per process ----------------------------------------------------------------------------------
# Linux keeps a process's peak RSS across exec, and a child forked from this (large) process starts from this
# process's size: a small launcher forks the measured command, so its peak is the command's own.
LAUNCH = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{usage.ru_maxrss} {os.waitstatus_to_exitcode(status)}")
"""


def run_measured(cmd: list[str], env: dict[str, str] | None = None) -> tuple[str, float]:
    """Run `cmd`, return (stdout, peak RSS in GB of that command alone)."""
    with tempfile.TemporaryFile() as err, tempfile.NamedTemporaryFile("r", suffix=".rss") as rss:
        r = subprocess.run([sys.executable, "-c", LAUNCH, rss.name, *cmd], stdout=subprocess.PIPE, stderr=err,
                           env=env)
        kib, code = (int(x) for x in (rss.read().split() or ["0", str(r.returncode or 1)]))
        if code or r.returncode:
            err.seek(0)
            tail = err.read().decode(errors="replace").strip().splitlines() or ["no output"]
            raise BenchError(f"{Path(cmd[0]).name} exited {code or r.returncode}: {tail[-1]}")
    return r.stdout.decode(), kib * 1024 / 1e9  # ru_maxrss is in KiB on Linux


def llama_bench(llama: LlamaCpp, gguf: Path, threads: int, prompt: int, tokens: int) -> dict:
    out, rss = run_measured([llama.tool("llama-bench"), "-m", str(gguf), "-p", str(prompt), "-n", str(tokens),
                             "-t", str(threads), "-r", "1", "-o", "json"])
    rec = {"rss_gb": rss}
    for test in json.loads(out):
        key = "prefill" if test["n_prompt"] and not test["n_gen"] else "decode"
        rec[key] = float(test["avg_ts"])
        rec["info"] = f"llama.cpp {test.get('build_commit', '?')} ({test.get('build_number', '?')}), " \
                      f"{test.get('backends', '?')}, {test.get('cpu_info', '?')}"
    return rec


def moechat_bench(model: Path, row: str, threads: int, prompt: int, tokens: int, cache: Path) -> dict:
    # the int8/int4 repacked experts go to `cache` (made by a warm-up run, so no round's RSS holds a conversion)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), XDG_CACHE_HOME=str(cache))
    from moechat.engine.plan.hardware.cores import quiet_openmp

    quiet_openmp(env)  # torch's OpenMP workers sleep between ops, as the moechat CLI sets it before importing torch
    out, rss = run_measured([sys.executable, __file__, "--worker", str(model), "--row", row, "--threads",
                             str(threads), "--prompt", str(prompt), "--tokens", str(tokens)], env=env)
    rec = json.loads(out.strip().splitlines()[-1])
    rec["rss_gb"] = rss
    return rec


def moechat_token_bytes(engine) -> dict[str, int]:
    """Bytes one decode token reads in moechat's weights, by part (as bench/dense_format.py counts them)."""
    from moechat.engine.models.base import Attention

    model, a = engine.model, engine.args
    attn = 0
    for layer in model.layer_list:
        sa = layer.self_attn
        if isinstance(sa, Attention):
            parts = (sa.qkv_q, sa.o_q) if sa.qkv_q is not None else (sa.qkv_t, sa.o_weight_t, sa.qkv_bias, sa.o_bias)
            attn += sum(p.nbytes if not hasattr(p, "element_size") else p.numel() * p.element_size()
                        for p in parts if p is not None)
    lm = model.lm_q.nbytes if model.lm_q is not None else model.lm_weight_t.numel() * model.lm_weight_t.element_size()
    cls = engine.loaded.cls
    expert = engine.loaded.expert_format.expert_bytes(a.hidden_size, a.moe_intermediate, engine.loaded.dtype,
                                                      getattr(cls, "expert_bias", False))
    return {"attention": attn, "lm_head": lm, "experts": len(cls.moe_layers(a)) * a.top_k * expert}


def worker(args) -> None:
    """One moechat measurement in this process: load, one generation, a JSON line on stdout."""
    import torch

    from moechat.engine.plan.hardware.cores import set_threads

    set_threads(torch, int(args.threads))  # as the CLI's --threads: up to 2, torch's ops on one, the pool on all
    from moechat.engine.runtime.generate import Engine
    from moechat.engine.runtime.sampling import SamplingParams

    expert_format, dense_format, _ = ROWS[args.row]
    t0 = time.perf_counter()
    engine = Engine.load(args.worker, dtype="bfloat16", expert_format=expert_format, dense_format=dense_format,
                         context=args.prompt + args.tokens + 8)
    load_s = time.perf_counter() - t0
    vocab = engine.args.vocab_size
    prompt = [(i * 7919 + 13) % vocab for i in range(args.prompt)]  # spread over the vocabulary, fixed
    greedy = SamplingParams(temperature=0.0, do_sample=False)
    # one warm-up generation first, as llama-bench runs one before it measures (the first pass over a freshly mapped
    # file pays its page faults: up to ~10x the prefill time); another prompt, so no prefix is reused
    for _ in engine.generate([(i * 104729 + 7) % vocab for i in range(args.prompt)], sampling=greedy, max_tokens=2,
                             stop_on_eos=False):
        pass
    last = None
    for chunk in engine.generate(prompt, sampling=greedy, max_tokens=args.tokens, stop_on_eos=False):
        last = chunk
    print(json.dumps({"prefill": last.prefill_tokens_per_s, "decode": last.decode_tokens_per_s, "load_s": load_s,
                      "bytes": moechat_token_bytes(engine), "tokens": last.generated_tokens}))


# -- the table -----------------------------------------------------------------------------------------------------
@dataclass
class Case:
    model: str  # "qwen3" or "gpt-oss"
    row: str  # key of ROWS
    hf: Path
    gguf: Path | None
    llama_type: str


def _med(xs: list[float], fmt: str = ".1f") -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):{fmt}}" + (f" ({min(xs):{fmt}}-{max(xs):{fmt}})" if len(xs) > 1 else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=None, help="scratch folder for checkpoints, GGUFs, a build")
    ap.add_argument("--qwen-layers", type=int, default=4, help="of Qwen3-30B-A3B's 48 (the issue: 8)")
    ap.add_argument("--gpt-oss-layers", type=int, default=4, help="of GPT-OSS-20B's 24 (the issue: 12)")
    ap.add_argument("--models", default="qwen3,gpt-oss")
    ap.add_argument("--formats", default="bf16,int8,int4",
                    help="Qwen3-shaped rows (GPT-OSS runs MXFP4); gguf-q8 / gguf-q4: moechat on llama.cpp's Q8_0 / "
                         "--q4 file")
    ap.add_argument("--q4", choices=["Q4_0", "Q4_K_M"], default="Q4_0", help="llama.cpp's type beside int4")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=128, help="prefill tokens")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--llama-cpp", type=Path, default=None, help="a llama.cpp build folder (or MOECHAT_LLAMA_CPP)")
    ap.add_argument("--llama-src", type=Path, default=None, help="its source tree, when not in its CMakeCache.txt")
    ap.add_argument("--build-llama-cpp", action="store_true", help="build llama.cpp from the llama-cpp-python sdist")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        return worker(args)
    try:
        run(args)
    except BenchError as e:
        sys.exit(f"vs_llamacpp: {e}")


def run(args) -> None:
    from moechat.engine.plan.calibration import measure_ram_read_gbps

    work = args.work or Path(tempfile.mkdtemp(prefix="vs_llamacpp_"))
    work.mkdir(parents=True, exist_ok=True)
    threads = [int(t) for t in args.threads.split(",")]
    models = args.models.split(",")
    llama_arg = build_llama_cpp(work) if args.build_llama_cpp and args.llama_cpp is None else args.llama_cpp
    llama, why = find_llama_cpp(llama_arg, args.llama_src)
    if llama is not None:
        why = check_converter(llama)
        if why:
            llama = None
    print(f"llama.cpp: {llama.how}" if llama else f"llama.cpp skipped: {why}", flush=True)

    cases: list[Case] = []
    for name in models:
        if name not in ("qwen3", "gpt-oss"):
            raise BenchError(f"--models knows qwen3 and gpt-oss, not {name!r}")
        layers = args.qwen_layers if name == "qwen3" else args.gpt_oss_layers
        hf = work / f"{name}-shaped-{layers}"
        if not (hf / "tokenizer.json").exists():
            t0 = time.perf_counter()
            (qwen3_shaped if name == "qwen3" else gpt_oss_shaped)(hf, layers)
            print(f"wrote {hf} in {time.perf_counter() - t0:.0f} s", flush=True)
        rows = args.formats.split(",") if name == "qwen3" else ["mxfp4"]
        for row in rows:
            if row not in ROWS or row == "mxfp4" and name == "qwen3":
                raise BenchError(f"--formats knows bf16, int8, int4, gguf-q8 and gguf-q4, not {row!r}")
            if row.startswith("gguf") and llama is None:
                print(f"{row} skipped: moechat runs llama.cpp's own GGUF there, and there is no llama.cpp", flush=True)
                continue
            ltype = args.q4 if ROWS[row][2] == "q4" else ROWS[row][2]
            gguf = None
            if llama is not None:
                t0 = time.perf_counter()
                base = convert(llama, hf, work / f"{hf.name}-bf16.gguf", "bf16")
                gguf = base if ltype in ("BF16", "MXFP4") else quantize(llama, base, work / f"{hf.name}-{ltype}.gguf",
                                                                       ltype)
                if time.perf_counter() - t0 > 1:
                    print(f"made {gguf.name} in {time.perf_counter() - t0:.0f} s", flush=True)
            cases.append(Case(name, row, hf, gguf, ltype))

    cache = work / "moechat-cache"
    def source(c: Case) -> Path:  # what moechat loads: the checkpoint, or for the gguf rows llama.cpp's own file
        return c.gguf if c.row.startswith("gguf") else c.hf

    for c in cases:  # warm-up: repack int8/int4 experts once, and page the files in, outside the rounds
        moechat_bench(source(c), c.row, threads[0], 8, 2, cache)
        if llama is not None:
            llama_bench(llama, c.gguf, threads[0], 8, 2)
    results: dict[tuple, dict[str, list]] = {}
    probes, info = [], ""
    for r in range(args.rounds):
        probes.append(measure_ram_read_gbps())
        for c in cases:
            for t in threads:
                engines = ["moechat", "llama.cpp"] if llama is not None else ["moechat"]
                for engine in engines if r % 2 == 0 else engines[::-1]:  # ABBA: neither always goes first
                    rec = moechat_bench(source(c), c.row, t, args.prompt, args.tokens, cache) if engine == "moechat" \
                        else \
                        llama_bench(llama, c.gguf, t, args.prompt, args.tokens)
                    info = rec.pop("info", info)
                    slot = results.setdefault((c.model, c.row, t, engine), {})
                    for k, v in rec.items():
                        slot.setdefault(k, []).append(v)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    gbps = max(probes)
    byte_cache: dict[Path, dict[str, int]] = {}

    print(f"\nmoechat vs llama.cpp, CPU, {args.rounds} interleaved rounds (ABBA), prefill {args.prompt} tokens, decode "
          f"{args.tokens} greedy tokens; read probe {gbps:.1f} GB/s (best of {len(probes)}, "
          f"{min(probes):.1f}-{max(probes):.1f}); {os.cpu_count()} cores")
    if llama is not None:
        print(f"llama.cpp: {llama.how}\n  {info}")
    shapes = {"qwen3": f"Qwen3-30B-A3B-shaped: {args.qwen_layers} of 48 layers",
              "gpt-oss": f"GPT-OSS-20B-shaped: {args.gpt_oss_layers} of 24 layers"}
    print("; ".join(shapes[m] for m in models) + "; full vocabularies, random weights")
    print("| model | moechat / llama.cpp | threads | engine | prefill tok/s | decode tok/s | MB/token | "
          "bound tok/s | of bound | peak RSS GB | moechat / llama.cpp: prefill, decode |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for c in cases:
        for t in threads:
            for engine in ("moechat", "llama.cpp"):
                res = results.get((c.model, c.row, t, engine))
                label = f"{c.row} / {c.llama_type}"
                if res is None:
                    print(f"| {c.model} | {label} | {t} | {engine} | - | - | - | - | - | - | skipped |")
                    continue
                if engine == "moechat":
                    b = res["bytes"][0]
                else:
                    if c.gguf not in byte_cache:
                        k, e = (QWEN3["num_experts_per_tok"], QWEN3["num_experts"]) if c.model == "qwen3" else \
                            (GPT_OSS["num_experts_per_tok"], GPT_OSS["num_local_experts"])
                        byte_cache[c.gguf] = gguf_token_bytes(llama, c.gguf, k, e)
                    b = byte_cache[c.gguf]
                total = sum(b.values())
                bound = gbps * 1e9 / total
                dec = statistics.median(res["decode"])
                peer = results.get((c.model, c.row, t, "llama.cpp"))
                ratio = "" if engine != "moechat" or peer is None else \
                    f"{statistics.median(res['prefill']) / statistics.median(peer['prefill']):.2f}x, " \
                    f"{dec / statistics.median(peer['decode']):.2f}x"
                print(f"| {c.model} | {label} | {t} | {engine} | {_med(res['prefill'])} | {_med(res['decode'], '.2f')} "
                      f"| {total / 1e6:.0f} | {bound:.1f} | {dec / bound:.2f} | {max(res['rss_gb']):.2f} | {ratio} |")

if __name__ == "__main__":
    main()
