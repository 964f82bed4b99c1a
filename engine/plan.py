"""Memory planning: what goes where, how fast decode will be, and a refusal in numbers when nothing fits.

Two parts, both pure Python over numbers (no torch, no device):

* `ModelSpec`: the sizes that matter, from the safetensors headers when the weights are on disk
  (exact), else from `config.json` and its `quantization_config` (labelled estimates): dense bytes,
  bytes per expert per named tensor in its stored format, MoE layers x experts x top-k, KV elements per
  token (GQA, MLA's latent cache, sliding-window layers), shared experts.
* `make_plan(spec, hardware, preferences) -> MemoryPlan`: a frozen result. Dense weights, KV cache and a
  workspace reserve go on the compute device (a GPU, or RAM on a CPU-only box); the rest of its budget
  becomes C expert slots; every expert then lives in pinned RAM if all fit, else in a RAM cache over the
  disk tier (the shards). Each decision carries a one-line reason in numbers; a plan that cannot work
  carries a `Refusal` naming the shortfall and the cheapest fix, and `check()` raises it unless the
  preferences say to load anyway.

Decode speed is predicted from bytes per token over each tier's bandwidth (docs/plan.md derives it):
with C slots out of N experts and hit rate h, a token moves L_moe x K x (1 - h) x expert bytes over
the link. Qwen3-30B-A3B in bf16 on a 12 GiB GPU: 862 slots of 9.4 MB (14% of 6,144 experts), so at
the conservative uniform-routing hit rate a token moves 3.1 GB over PCIe: at 25 GB/s, <= 8 tok/s from
the link alone. Packed experts are planned as packed: GPT-OSS-20B's MXFP4 expert is 13.2 MB (bf16:
49.8 MB), so an 8 GiB GPU holds 278 slots where bf16 would hold 74.
"""

from __future__ import annotations

import bisect
import fnmatch
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import ConfigError, MoechatError
from .files import read_json_object
from .hardware import (
    ASSUMED_DISK_GBPS,
    ASSUMED_GPU_MEMORY_GBPS,
    ASSUMED_LINK_GBPS,
    ASSUMED_RAM_GBPS,
    GB,
    GiB,
    GpuInfo,
    Hardware,
)
from .validate import check_common, check_index

MiB = 1 << 20
ON_MISS_MODES = ("load", "host", "auto")  # engine/cache/hybrid.py ON_MISS (a test keeps them equal)
REPACK_DIR_HINT = "$XDG_CACHE_HOME/moechat/repacked"  # engine/cache/store.py default_repack_dir
DEFAULT_CONTEXT = 4096  # what `moechat run` allocates when --context is not given (engine/generate.py)
MIN_CONTEXT = 512  # below this a chat is not worth planning for
CONTEXT_STEP = 256  # a lowered context is a multiple of this
PREFILL_CHUNK = 512
# engine/kv_cache.py allocates every layer for the whole context, sliding-window layers included, so the plan
# counts that by default; attention still reads only a window layer's last `window` keys.
KV_WINDOWED_ALLOCATION = False

# Stated assumptions of the plan (docs/plan.md explains each).
CUDA_CONTEXT_BYTES = 512 * MiB  # CUDA context + cuBLAS workspace + allocator slack on the GPU
PROCESS_RAM_GPU = int(1.5 * GiB)  # Python + torch + CUDA runtime host memory, when computing on a GPU
PROCESS_RAM_CPU = 1 * GiB  # Python + torch, CPU only
GPU_EFFICIENCY = 0.7  # fraction of peak memory bandwidth decode mat-vecs reach
# Eager PyTorch launch/dispatch per decoder layer. The CPU's is measured by `moechat run` where it has run
# (engine/calibration.py: 2.0-2.2 ms on the busy 2-core CI machine, the demo model at 70-78 tok/s; ~1 ms when it
# is quiet); this is the figure before that, within 2x of both.
OVERHEAD_PER_LAYER_S = {"gpu": 0.15e-3, "cpu": 1.5e-3}
OVERHEAD_PER_MISS_S = {"gpu": 0.03e-3, "cpu": 0.05e-3}  # policy + copy call (+ preadv) per expert load
TRACED_MISS_FACTOR = 0.6  # best LRU miss rate / uniform-routing miss rate seen on ../shared/traces
# Expert formats moechat converts a checkpoint's experts into (`--expert-format`), kept equal to
# engine/quant/registry.py's CONVERTIBLE by a test; int4 groups along the input as engine/quant/intq.py does.
CONVERTIBLE_FORMATS = ("int8", "int4")
INT4_GROUPS = (32, 16, 8)
# Expert compute of each format's path today, as a fraction of the rate the device reads dense weights at,
# counted on the format's packed bytes (1: the packed bytes are read once, as a fused kernel does). CPU: measured
# by bench/format_compute.py (one thread, one token, Qwen3-30B-A3B's and GPT-OSS's expert widths, medians of
# interleaved rounds, wall and thread clocks, rounded down) for the native kernels (quant/native.py: the path of a
# machine with a C compiler and AVX2; without them the torch paths run at int8 0.6-0.7, int4 0.06, mxfp4 0.045,
# fp8 0.15);
# GPU: 1 where a fused kernel reads the packed bytes and was measured (MXFP4, kernels/mxfp4_moe.py), else counted
# from the bytes the torch path moves per packed byte (int8: cast to bf16 + GEMM, 5 B; int4: codes to int32, a
# table lookup, the scale product and the GEMM, ~12.5 B per 0.625 B; fp8: blocks expanded in fp32, ~33 B).
# FP8/int8/int4 have a fused kernel too (kernels/quant_moe.py) whose rate no GPU has measured yet: raise their
# GPU rows when bench/gpu_check.sh has. The plan's speeds and the recommended format follow these numbers.
EXPERT_COMPUTE_EFFICIENCY = {
    "cpu": {"dense": 1.0, "int8": 1.0, "int4": 0.85, "mxfp4": 0.85, "fp8": 0.8},
    "gpu": {"dense": 1.0, "int8": 0.2, "int4": 0.05, "mxfp4": 1.0, "fp8": 0.03},
}

FLOAT_SIZES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}
FLOAT_DTAGS = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
DTAG_OF_SIZE = {4: "F32", 2: "BF16"}


class PlanRefusedError(MoechatError):
    """The model does not fit this machine; `refusal` has the numbers and the fixes."""

    def __init__(self, refusal: Refusal):
        super().__init__(refusal.message)
        self.refusal = refusal


# -- model spec ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of one expert, as stored (fused [E, ...] tensors are cut to one expert's share)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors tag: BF16, U8, F8_E4M3, F32...
    nbytes: int

    @property
    def is_float_weight(self) -> bool:
        """A float tensor that a compute dtype would convert (scales stay as stored)."""
        return self.dtype in FLOAT_DTAGS and "scale" not in self.name


def int4_group(cols: int) -> int:
    """The int4 group along an input of `cols` (engine/quant/intq.py's int4_group): 32, else 16 or 8."""
    for g in INT4_GROUPS:
        if cols % g == 0:
            return g
    raise ConfigError(f"int4 experts need an input size divisible by 8 (got {cols}): use --expert-format int8")


def packed_expert_tensors(name: str, hidden: int, inter: int, float_bytes: int, bias: bool) -> tuple[TensorSpec, ...]:
    """One expert as `--expert-format int8|int4` stores it (engine/quant/intq.py's layout, byte for byte):
    int8: q [out, in] + fp32 scale [out] per projection; int4: q [out, in/2] (two codes a byte) + fp16 scale
    [out, in/group] (4.5 bits a weight in groups of 32); biases, when the model has them, in the compute dtype. w13 is [2I, H], w2 [H, I]."""
    if name not in CONVERTIBLE_FORMATS:
        raise ConfigError(f"--expert-format {name!r}: use native or one of {', '.join(CONVERTIBLE_FORMATS)}")
    out: list[TensorSpec] = []
    for which, (rows, cols) in (("w13", (2 * inter, hidden)), ("w2", (hidden, inter))):
        if name == "int8":
            out += [TensorSpec(f"{which}_q", (rows, cols), "I8", rows * cols),
                    TensorSpec(f"{which}_scale", (rows,), "F32", 4 * rows)]
        else:
            groups = cols // int4_group(cols)
            out += [TensorSpec(f"{which}_q", (rows, cols // 2), "U8", rows * (cols // 2)),
                    TensorSpec(f"{which}_scale", (rows, groups), "F16", 2 * rows * groups)]
    if bias:
        tag = DTAG_OF_SIZE.get(float_bytes, "BF16")
        out += [TensorSpec("w13_bias", (2 * inter,), tag, 2 * inter * float_bytes),
                TensorSpec("w2_bias", (hidden,), tag, hidden * float_bytes)]
    return tuple(out)


@dataclass(frozen=True)
class ModelSpec:
    """What a model needs, in bytes. `estimated` when sizes come from config.json alone."""

    name: str
    model_type: str
    source: str  # "safetensors headers" | "config.json" | "config.json + index"
    estimated: bool
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int  # E, routed experts per MoE layer
    top_k: int  # K
    hidden_size: int
    num_heads: int
    expert_intermediate: int
    expert_tensors: tuple[TensorSpec, ...]  # one expert, stored format
    expert_format: str  # "bf16", "mxfp4 (blocks + e8m0 scales)", "fp8 e4m3, 128x128 block scales", ...
    expert_params: int  # weights per expert (what bf16 and an FP8 checkpoint are estimated from)
    dense_parts: tuple[tuple[str, int], ...]  # (what, bytes) for everything that is not a routed expert
    dense_float_elems: int  # float elements of the dense part (a compute dtype converts these)
    embedding_bytes: int  # the input embedding table (not tied to lm_head): on the device, read one row a token
    shared_experts: int  # per MoE layer, always active (part of the dense bytes)
    shared_expert_bytes: int  # all layers together
    kv_kind: str  # "GQA" | "MLA latent"
    kv_elems_full: int  # KV elements per token over all full-attention layers
    kv_elems_window: int  # KV elements per token over all sliding-window layers
    window: int | None
    kv_detail: str
    float_bytes: int  # element size of the stored float tensors (2 for bf16)
    float_dtype: str
    max_context: int
    checkpoint_bytes: int  # the whole download (incl. tensors moechat does not load, e.g. MTP layers)
    stored_expert_bytes: int  # one expert as the checkpoint stores it (expert_bytes may be in a compute dtype)
    weights_present: bool
    present_bytes: int = 0  # of the checkpoint already on disk
    unused_bytes: int = 0  # in the checkpoint but never loaded (multi-token-prediction layers)
    path: str | None = None
    notes: tuple[str, ...] = ()
    config_dtype: str | None = None  # the float dtype config.json names (None: none, and the loader takes float32)
    converted_from: str | None = None  # the checkpoint's format when moechat converts the experts (--expert-format)
    quant_method: str | None = None  # config.json's quantization_config.quant_method, as written
    remote_code: bool = False  # config.json has an auto_map (custom code shipped with the model)
    dense_format: str = "native"  # "int8": attention projections and LM head held in int8 (--dense-format int8)
    # Recurrent layers (Gated DeltaNet, Mamba-2): their state is the same size at any context; counted with the
    # snapshots engine/kv_cache.py keeps for prefix reuse (1 + MAX_SNAPSHOTS copies)
    recurrent_state_bytes: int = 0
    recurrent_detail: str = ""

    @property
    def expert_bytes(self) -> int:
        return sum(t.nbytes for t in self.expert_tensors)

    @property
    def expert_format_name(self) -> str:
        """A short name for the plan's lines: MXFP4, bfloat16, fp8 e4m3, ..."""
        fmt = self.expert_format
        return "MXFP4" if fmt.startswith("mxfp4") else fmt.split(" (")[0].split(",")[0]

    @property
    def bf16_expert_bytes(self) -> int:
        """One expert with every weight and bias in bf16: what a packed format is compared against."""
        return 2 * self.expert_params

    def expert_format_line(self, room: int | None = None) -> str:
        """"experts: MXFP4, 12.6 MiB each (bf16 would be 47.5 MiB)": why a packed model fits where bf16 would not.

        With `room` (bytes for slots), how many slots each would give: "... each, 277 slots (bf16 would be ...".
        """
        def slots(nbytes: int) -> str:
            return "" if room is None or not nbytes else f": {min(self.total_experts, max(0, room) // nbytes):,} slots"

        line = f"experts: {self.expert_format_name}, {gib(self.expert_bytes)} each"
        bf16 = self.bf16_expert_bytes
        if self.expert_params and abs(self.expert_bytes - bf16) > 0.01 * bf16:
            line += f" (bf16 would be {gib(bf16)}{slots(bf16)})"
        return line

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def total_experts(self) -> int:
        return self.num_moe_layers * self.num_experts

    @property
    def all_experts_bytes(self) -> int:
        return self.total_experts * self.expert_bytes

    @property
    def dense_bytes(self) -> int:
        return sum(b for _, b in self.dense_parts)

    @property
    def dense_read_bytes(self) -> int:
        """Dense bytes one decode token reads: all but the embedding table (one row of it)."""
        return self.dense_bytes - self.embedding_bytes

    def kv_bytes(self, context: int, elem_bytes: int | None = None, *, windowed: bool = True) -> int:
        """KV cache bytes for `context` tokens; sliding-window layers hold at most `window` when `windowed`."""
        e = self.float_bytes if elem_bytes is None else elem_bytes
        win = min(context, self.window) if (windowed and self.window) else context
        return e * (self.kv_elems_full * context + self.kv_elems_window * win)

    def kv_bytes_per_token(self, elem_bytes: int | None = None) -> int:
        return (self.float_bytes if elem_bytes is None else elem_bytes) * (self.kv_elems_full + self.kv_elems_window)

    @property
    def expert_bits(self) -> float:
        """Bits per expert weight as stored (16 for bf16, ~8 for fp8 with scales, ~4.6 for MXFP4 with biases)."""
        return 8 * self.stored_expert_bytes / max(1, self.expert_params)

    @property
    def format_key(self) -> str:
        """The expert format as the engine names it: dense, mxfp4, fp8, int8, int4 (gptq/awq: not loadable)."""
        fmt = self.expert_format.lower()
        for key in ("mxfp4", "fp8", "int8", "int4", "gptq", "awq"):
            if fmt.startswith(key):
                return key
        return "dense"

    @property
    def has_expert_bias(self) -> bool:
        return any(t.name.endswith("bias") for t in self.expert_tensors)

    def fp8_checkpoint_bytes(self) -> int:
        """About what a block-FP8 checkpoint of this model downloads: its experts at 8 bits + 128x128 block scales
        (the rest counted as stored, so the real file is a little smaller still)."""
        H, I = self.hidden_size, self.expert_intermediate
        blocks = 2 * math.ceil(I / 128) * math.ceil(H / 128) + math.ceil(H / 128) * math.ceil(I / 128)
        fp8 = 3 * H * I + 4 * blocks + (2 * I + H) * self.float_bytes * self.has_expert_bias
        return self.checkpoint_bytes - self.total_experts * max(0, self.stored_expert_bytes - fp8)

    def in_format(self, name: str | None) -> ModelSpec:
        """The same model with its experts converted by moechat (`--expert-format int8|int4`): every tier holds
        `packed_expert_tensors(name, ...)`, written once into a repacked file. `native` (or None): unchanged."""
        if name in (None, "native"):
            return self
        if self.converted_from is not None:
            raise ConfigError(f"{self.name}: experts already planned as {self.format_key}")
        tensors = packed_expert_tensors(name, self.hidden_size, self.expert_intermediate, self.float_bytes,
                                        self.has_expert_bias)
        label = ("int8 (per output channel, fp32 scales)" if name == "int8" else
                 f"int4 (groups of {int4_group(self.hidden_size)}, fp16 scales)")
        return replace(self, expert_tensors=tensors, expert_format=label, converted_from=self.expert_format_name,
                       notes=self.notes + (f"experts converted to {name} once, into a repacked file "
                                           f"(--expert-format {name})",))

    def in_dense_format(self, name: str | None) -> ModelSpec:
        """The same model as `--dense-format int8` holds it (quant/dense_int8.py): attention's projections (GQA; MLA
        keeps its layout) and the LM head at one byte a weight plus an fp32 scale per output row; a tied LM head
        gets its own int8 copy beside the embedding table, which stays for lookups."""
        if name in (None, "native"):
            return self
        fb = max(1, self.float_bytes)

        def int8(nbytes: int) -> int:
            elems = nbytes // fb
            return elems + 4 * max(1, elems // max(1, self.hidden_size))  # + a scale per row of H inputs

        parts = []
        for what, b in self.dense_parts:
            quantized = what == "lm_head" or (what == "attention" and self.kv_kind != "MLA latent")
            parts.append((what, int8(b) if quantized else b))
        embedding = self.embedding_bytes
        if not any(what == "lm_head" for what, _ in self.dense_parts):  # tied: the table is now only looked up
            embedding = dict(self.dense_parts).get("embeddings", 0)
            parts.append(("lm_head", int8(embedding)))
        return replace(self, dense_parts=tuple(parts), dense_format=name, embedding_bytes=embedding,
                       notes=self.notes + ("attention projections and the LM head in int8 (--dense-format int8)",))

    def in_dtype(self, elem_bytes: int, name: str) -> ModelSpec:
        """The same model as `moechat run --dtype` holds it: float weights converted, quantized ones kept."""
        if elem_bytes == self.float_bytes:
            return self
        tensors = tuple(replace(t, dtype=DTAG_OF_SIZE.get(elem_bytes, t.dtype),
                                nbytes=t.nbytes // FLOAT_DTAGS[t.dtype] * elem_bytes) if t.is_float_weight else t
                        for t in self.expert_tensors)
        ratio = elem_bytes / self.float_bytes
        float_share = min(1.0, self.dense_float_elems * self.float_bytes / max(1, self.dense_bytes))
        parts = tuple((what, int(b * float_share * ratio + b * (1 - float_share))) for what, b in self.dense_parts)
        fmt = name if all(t.is_float_weight for t in self.expert_tensors) else self.expert_format
        return replace(self, expert_tensors=tensors, dense_parts=parts,
                       embedding_bytes=int(self.embedding_bytes * ratio),
                       shared_expert_bytes=int(self.shared_expert_bytes * ratio), float_bytes=elem_bytes,
                       float_dtype=name, expert_format=fmt,
                       notes=self.notes + (f"sizes in the compute dtype {name} ({elem_bytes} B per weight)",))

    def to_json(self) -> dict:
        return {
            "name": self.name, "model_type": self.model_type, "source": self.source, "estimated": self.estimated,
            "num_layers": self.num_layers, "moe_layers": len(self.moe_layers), "num_experts": self.num_experts,
            "top_k": self.top_k, "total_experts": self.total_experts, "expert_bytes": self.expert_bytes,
            "expert_format": self.expert_format,
            "expert_tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "bytes": t.nbytes}
                               for t in self.expert_tensors],
            "all_experts_bytes": self.all_experts_bytes, "dense_bytes": self.dense_bytes,
            "dense_format": self.dense_format, "dense_read_bytes": self.dense_read_bytes,
            "dense_parts": dict(self.dense_parts), "shared_experts": self.shared_experts,
            "shared_expert_bytes": self.shared_expert_bytes, "kv_kind": self.kv_kind,
            "kv_bytes_per_token": self.kv_bytes_per_token(), "kv_sliding_window": self.window,
            "kv_detail": self.kv_detail, "dtype": self.float_dtype, "config_dtype": self.config_dtype,
            "max_context": self.max_context, "expert_format_line": self.expert_format_line(),
            "bf16_expert_bytes": self.bf16_expert_bytes,
            "format_key": self.format_key, "converted_from": self.converted_from,
            "checkpoint_bytes": self.checkpoint_bytes, "weights_present": self.weights_present,
            "unused_bytes": self.unused_bytes, "notes": list(self.notes),
        }


# -- config.json reading -----------------------------------------------------------------------------------

def _load_json(path: Path, what: str) -> dict:
    """Like checkpoint.read_json, without importing torch (so `moechat fit` on a config answers at once)."""
    return read_json_object(path, what)  # FIFOs and devices refused, size capped, every JSON failure one line


def _get(c: dict, *names, default=None):
    for n in names:
        v = c.get(n)
        if v is not None:
            return v
    return default


def _pos_int(c: dict, where: str, *names) -> int:
    v = _get(c, *names)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"{where}: needs a positive integer {names[0]} to plan (found {v!r})")
    return v


@dataclass(frozen=True)
class _Shape:
    """The architecture numbers every estimate needs, whatever the model_type calls them."""

    model_type: str
    L: int
    H: int
    V: int
    E: int
    K: int
    I: int
    dense_I: int
    n_heads: int
    n_kv: int
    head_dim: int
    moe_layers: tuple[int, ...]
    tied: bool
    float_dtype: str
    float_bytes: int
    max_context: int


def _shape(c: dict, where: str, notes: list[str]) -> _Shape:
    if isinstance(c.get("text_config"), dict) and "num_hidden_layers" not in c:
        c = {**c, **c["text_config"]}
    check_common(c, where)  # types, ranges and size caps of the common keys (engine/validate.py), before any loop
    L = _pos_int(c, where, "num_hidden_layers")
    H = _pos_int(c, where, "hidden_size")
    V = _pos_int(c, where, "vocab_size")
    E = _get(c, "n_routed_experts", "num_local_experts", "num_experts")
    K = _get(c, "num_experts_per_tok", "experts_per_token", "moe_topk", "top_k_experts")  # the last: Gemma 4
    if not isinstance(E, int) or E <= 1 or not isinstance(K, int) or not 0 < K <= E:
        raise ConfigError(f"{where}: not a Mixture-of-Experts config (experts={E!r}, top-k={K!r}); "
                          "moechat plans MoE models only")
    I = _pos_int(c, where, "moe_intermediate_size", "intermediate_size")
    dense_I = _get(c, "intermediate_size", default=I)
    n_heads = _pos_int(c, where, "num_attention_heads")
    n_kv = _get(c, "num_key_value_heads", default=n_heads)
    head_dim = _get(c, "head_dim", default=H // n_heads)
    if "first_k_dense_replace" in c or "moe_layer_freq" in c:  # DeepSeek, GLM-4.5
        k, f = c.get("first_k_dense_replace") or 0, c.get("moe_layer_freq") or 1
        moe = [i for i in range(L) if i >= k and i % f == 0]
    elif "decoder_sparse_step" in c or "mlp_only_layers" in c:  # Qwen2/3-MoE
        step, only = c.get("decoder_sparse_step") or 1, set(c.get("mlp_only_layers") or [])
        moe = [i for i in range(L) if i not in only and (i + 1) % step == 0]
    else:
        moe = list(range(L))
    dtype = _config_dtype(c) or ""
    if dtype not in FLOAT_SIZES:
        notes.append(f"config.json names no float dtype ({dtype or 'none'}): bf16 assumed for unquantized tensors")
        dtype = "bfloat16"
    return _Shape(c.get("model_type", "?"), L, H, V, E, K, I, dense_I, n_heads, n_kv, head_dim, tuple(moe),
                  bool(c.get("tie_word_embeddings", False)), dtype, FLOAT_SIZES[dtype],
                  int(_get(c, "max_position_embeddings", default=DEFAULT_CONTEXT)))


def _config_dtype(c: dict) -> str | None:
    """The float dtype config.json names, as the loader reads it (`dtype`, then `torch_dtype`), or None."""
    if "text_config" in c and "num_hidden_layers" not in c:
        c = {**c, **c["text_config"]}
    name = _get(c, "dtype", "torch_dtype")
    return str(name).removeprefix("torch.") if name else None


def _layer_heads(c: dict, s: _Shape) -> list[tuple[int, int, bool]]:
    """(head_dim, KV heads, has a v_proj) per layer: Gemma 4's full-attention layers have their own global_head_dim
    and num_global_key_value_heads, K as V with attention_k_eq_v (engine/models/gemma4.py); others one for all."""
    types, uniform = c.get("layer_types"), (s.head_dim, s.n_kv, True)
    if not c.get("global_head_dim") or not isinstance(types, list) or len(types) != s.L:
        return [uniform] * s.L
    k_eq_v = bool(c.get("attention_k_eq_v"))
    n_kv = int(c.get("num_global_key_value_heads") or s.n_kv) if k_eq_v else s.n_kv
    full = (int(c["global_head_dim"]), n_kv, not k_eq_v)
    return [full if t == "full_attention" else uniform for t in types]


def _kv(c: dict, s: _Shape) -> tuple[str, int, int, int | None, str]:
    """(kind, elements per token over full layers, over windowed layers, window, one-line detail)."""
    heads = _layer_heads(c, s)
    if c.get("kv_lora_rank"):  # MLA: one latent vector + the shared RoPE key per token and layer
        rope = c.get("qk_rope_head_dim") or 0
        per = c["kv_lora_rank"] + rope
        kind, detail = "MLA latent", f"{s.L} layers x (kv_lora_rank {c['kv_lora_rank']} + rope {rope})"
        per_layer = [per] * s.L
    else:
        per = 2 * s.n_kv * s.head_dim
        per_layer = [2 * n_kv * D for D, n_kv, _ in heads]  # K as V is still cached twice (V is K normed)
        kind = "GQA"
        counts = {h[:2]: sum(x[:2] == h[:2] for x in heads) for h in heads}
        detail = " + ".join(f"{n if len(counts) > 1 else s.L} layers x 2 (K, V) x {n_kv} KV heads x {D}"
                            for (D, n_kv), n in counts.items())
    window = c.get("sliding_window")
    types = c.get("layer_types")
    linear = _linear_layers(c, s.L)
    if linear:  # recurrent layers keep a fixed state, no K/V (engine/kv_cache.py)
        n = s.L - linear
        detail = detail.replace(f"{s.L} layers x", f"{n} attention layers (of {s.L}) x", 1)
        return kind, per * n, 0, None, detail
    if isinstance(types, list) and len(types) == s.L:
        sliding = [t == "sliding_attention" for t in types]
    elif "use_sliding_window" in c:  # Qwen2/3: layers from max_window_layers on, and only when enabled
        first = c.get("max_window_layers") or 0
        sliding = [bool(c["use_sliding_window"]) and i >= first for i in range(s.L)]
    else:
        sliding = [s.model_type != "olmoe"] * s.L  # Mixtral-style: every layer, when a window is set
    if not window:
        sliding = [False] * s.L
    n_win = sum(sliding)
    if n_win:
        detail += f"; {n_win} of {s.L} layers attend to the last {window} tokens only"
    full = sum(p for p, w in zip(per_layer, sliding) if not w)
    return kind, full, sum(per_layer) - full, (int(window) if n_win else None), detail


def _linear_layers(c: dict, L: int) -> int:
    """How many layers are Gated DeltaNet (Qwen3-Next, Qwen3.5/3.6: `layer_types` "linear_attention")."""
    types = c.get("layer_types")
    if isinstance(types, list) and len(types) == L:
        return sum(t == "linear_attention" for t in types)
    if c.get("linear_num_value_heads") and c.get("full_attention_interval"):
        return sum(1 for i in range(L) if (i + 1) % int(c["full_attention_interval"]))
    return 0


def _recurrent(c: dict, s: _Shape) -> tuple[int, str]:
    """The recurrent layers' state bytes (fp32 delta-rule matrices + conv windows in the float dtype), times the
    copies the sequence state keeps, and a one-line detail."""
    if isinstance(c.get("text_config"), dict) and "num_hidden_layers" not in c:
        c = {**c, **c["text_config"]}
    n = _linear_layers(c, s.L)
    if not n:
        return 0, ""
    from .kv_cache import MAX_SNAPSHOTS

    hk, hv = int(c.get("linear_num_key_heads") or 16), int(c.get("linear_num_value_heads") or 32)
    dk, dv = int(c.get("linear_key_head_dim") or 128), int(c.get("linear_value_head_dim") or 128)
    width = int(c.get("linear_conv_kernel_dim") or 4)
    one = n * (hv * dk * dv * 4 + (2 * hk * dk + hv * dv) * (width - 1) * s.float_bytes)
    copies = 1 + MAX_SNAPSHOTS
    return one * copies, (f"{n} Gated DeltaNet layers x ({hv} heads x {dk} x {dv} fp32 + a {width - 1}-step conv "
                          f"window) = {one / MiB:.1f} MiB at any context, x {copies} (the state and "
                          f"{MAX_SNAPSHOTS} prefix-reuse snapshots)")


class _Quant:
    """How `quantization_config` stores a Linear weight [out, in]: (float elements, other bytes)."""

    def __init__(self, qc: dict | None, float_bytes: int, notes: list[str]):
        self.method = (qc or {}).get("quant_method")
        self.skip = list((qc or {}).get("modules_to_not_convert") or [])
        self.fb = float_bytes
        self.block = (qc or {}).get("weight_block_size")
        self.bits = (qc or {}).get("bits")
        self.group = (qc or {}).get("group_size") or 128
        if self.method in ("gptq", "awq") and not self.bits:
            self.bits = 4
        if self.method and self.method not in ("mxfp4", "fp8", "gptq", "awq"):
            notes.append(f"quantization_config quant_method {self.method!r} is not understood: sizes assume "
                         "unquantized weights (probably overstated)")
            self.method = None

    def applies(self, module: str) -> bool:
        return self.method is not None and not any(fnmatch.fnmatch(module, p) for p in self.skip)

    def linear(self, out: int, inp: int, module: str) -> tuple[int, int]:
        if not self.applies(module):
            return out * inp, 0
        n = out * inp
        if self.method == "mxfp4":  # 4-bit blocks of 32 + one e8m0 scale byte per block
            return 0, n // 2 + out * math.ceil(inp / 32)
        if self.method == "fp8":  # e4m3 bytes + fp32 inverse scales, per 128x128 block or per tensor
            if self.block:
                bo, bi = self.block
                return 0, n + 4 * math.ceil(out / bo) * math.ceil(inp / bi)
            return 0, n + 4
        groups = math.ceil(inp / (self.group if self.group > 0 else inp))  # GPTQ/AWQ: packed ints + fp16 scales
        return 0, n * self.bits // 8 + groups * out * (2 + self.bits / 8)

    def tensors(self, name: str, out: int, inp: int, module: str, fdtag: str) -> list[TensorSpec]:
        """One expert weight as stored, by the checkpoint's tensor names."""
        if not self.applies(module):
            return [TensorSpec(f"{name}.weight", (out, inp), fdtag, out * inp * self.fb)]
        if self.method == "mxfp4":
            return [TensorSpec(f"{name}_blocks", (out, inp // 32, 16), "U8", out * inp // 2),
                    TensorSpec(f"{name}_scales", (out, math.ceil(inp / 32)), "U8", out * math.ceil(inp / 32))]
        if self.method == "fp8":
            scale = (math.ceil(out / self.block[0]), math.ceil(inp / self.block[1])) if self.block else ()
            return [TensorSpec(f"{name}.weight", (out, inp), "F8_E4M3", out * inp),
                    TensorSpec(f"{name}.weight_scale_inv", scale, "F32", 4 * (math.prod(scale) if scale else 1))]
        fe, other = self.linear(out, inp, module)
        return [TensorSpec(f"{name}.qweight+scales", (out, inp), f"{self.bits}-bit", int(other))]

    @property
    def format(self) -> str:
        if self.method == "mxfp4":
            return "mxfp4 (4-bit blocks of 32 + e8m0 scales)"
        if self.method == "fp8":
            blocks = f"{self.block[0]}x{self.block[1]} block scales" if self.block else "per-tensor scale"
            return f"fp8 e4m3, {blocks}"
        if self.method:
            return f"{self.method} {self.bits}-bit, group {self.group}"
        return ""


def _fp32_weights(model_type: str) -> tuple[str, ...]:
    """The name endings the model's class keeps in fp32 whatever the dtype (routers: MoEForCausalLM.fp32_weights)."""
    from .models import ARCHITECTURES

    cls = ARCHITECTURES.get(model_type)
    return tuple(cls.fp32_weights) if cls is not None else ()


def _expert_tensors(s: _Shape, q: _Quant, fdtag: str, layer: int) -> list[TensorSpec]:
    """One routed expert's tensors as the checkpoint names them (config-only estimate)."""
    H, I = s.H, s.I
    module = f"model.layers.{layer}.mlp.experts"
    if s.model_type == "gpt_oss":  # fused gate_up [2I, H] + biases, as the Hub checkpoint stores them
        out = [t for t in q.tensors("gate_up_proj", 2 * I, H, module, fdtag)]
        out.append(TensorSpec("gate_up_proj_bias", (2 * I,), fdtag, 2 * I * s.float_bytes))
        out += q.tensors("down_proj", H, I, module, fdtag)
        out.append(TensorSpec("down_proj_bias", (H,), fdtag, H * s.float_bytes))
        return out
    names = ("w1", "w3", "w2") if s.model_type in ("mixtral", "minimax_m2") else ("gate_proj", "up_proj", "down_proj")
    return (q.tensors(names[0], I, H, module, fdtag) + q.tensors(names[1], I, H, module, fdtag)
            + q.tensors(names[2], H, I, module, fdtag))


def spec_from_config(config: dict, *, name: str = "", index: dict | None = None, present_bytes: int = 0,
                     where: str = "config.json") -> ModelSpec:
    """Estimate a model's sizes from config.json alone (and its safetensors index, if given)."""
    notes: list[str] = []
    s = _shape(config, where, notes)
    q = _Quant(config.get("quantization_config"), s.float_bytes, notes)
    fdtag = DTAG_OF_SIZE.get(s.float_bytes, "BF16")
    H, V, L = s.H, s.V, s.L
    mt = s.model_type
    c = config if "num_hidden_layers" in config else {**config, **config.get("text_config", {})}

    parts: dict[str, list[int]] = {}  # what -> [float elements, other bytes]

    def add(what: str, fe: float, other: float = 0) -> None:
        p = parts.setdefault(what, [0, 0])
        p[0] += int(fe)
        p[1] += int(other)

    shipped = [0, 0]  # FP8 dense weights: [bytes in the checkpoint, bytes once loaded]
    router32 = [0, 0]  # routers the engine keeps in fp32: the same
    fp32_router = bool(_fp32_weights(mt))

    def lin(what: str, out: int, inp: int, module: str, bias: bool = False) -> None:
        fe, other = q.linear(out, inp, module)
        if q.method == "fp8" and other:  # the loader dequantizes FP8 dense weights to the float dtype (loader.py)
            shipped[0] += other
            shipped[1] += out * inp * s.float_bytes
            fe, other = out * inp, 0
        add(what, fe + (out if bias else 0), other)

    add("embeddings", V * H)
    if not s.tied:
        add("lm_head", V * H)
    add("norms", H)  # final norm

    def attention(layer: int) -> None:
        m = f"model.layers.{layer}.self_attn"
        if c.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3)
            nope, rope, vd = c.get("qk_nope_head_dim") or 0, c.get("qk_rope_head_dim") or 0, c.get("v_head_dim") or 0
            qd, r, qr = s.n_heads * (nope + rope), c["kv_lora_rank"], c.get("q_lora_rank")
            if qr:
                lin("attention", qr, H, m)
                lin("attention", qd, qr, m)
                add("attention", qr)
            else:
                lin("attention", qd, H, m)
            lin("attention", r + rope, H, m)
            add("attention", r)
            lin("attention", s.n_heads * (nope + vd), r, m)
            lin("attention", H, s.n_heads * vd, m)
            return
        D, n_kv, has_v = layer_heads[layer]
        q_dim, kv_dim = s.n_heads * D, n_kv * D
        qkv_bias = mt == "qwen2_moe" or bool(c.get("attention_bias"))
        lin("attention", q_dim, H, m, qkv_bias)
        lin("attention", kv_dim, H, m, qkv_bias)
        if has_v:
            lin("attention", kv_dim, H, m, qkv_bias)
        lin("attention", H, q_dim, m, bool(c.get("attention_bias")) and mt not in ("glm4_moe", "qwen2_moe"))
        if c.get("use_qk_norm") and c.get("qk_norm_type") == "per_layer":  # MiniMax-M2: over all of q and of k
            add("attention", q_dim + kv_dim)
        elif mt in ("qwen3_moe", "gemma4", "gemma4_text") or c.get("use_qk_norm"):
            add("attention", 2 * D)
        elif mt == "olmoe":
            add("attention", q_dim + kv_dim)
        if mt == "gpt_oss":
            add("attention", s.n_heads)  # sinks

    layer_heads = _layer_heads(c, s)
    n_shared = int(_get(c, "n_shared_experts", default=0) or 0)
    shared_I = c.get("shared_expert_intermediate_size") or 0

    def ffn(layer: int, moe: bool) -> None:
        m = f"model.layers.{layer}.mlp"
        if not moe:
            for out, inp in ((s.dense_I, H), (s.dense_I, H), (H, s.dense_I)):
                lin("dense MLP layers", out, inp, m)
            return
        bias = mt in ("gpt_oss", "deepseek_v3", "glm4_moe") or c.get("topk_method") == "noaux_tc"
        n = s.E * H + (s.E if bias or c.get("use_routing_bias") else 0)
        if fp32_router:  # the engine keeps the router in fp32 (its class's fp32_weights); shipped in the float dtype
            add("routers", 0, 4 * n)
            router32[0] += n * s.float_bytes
            router32[1] += 4 * n
        else:
            add("routers", n)
        if c.get("enable_moe_block") and c.get("intermediate_size"):  # Gemma 4: a dense MLP beside the experts
            add("routers", H + s.E)  # the router's scale and per_expert_scale
            add("norms", 5 * H + 1)  # the MLP's and the experts' pre/post norms, and the layer scalar
            for out, inp in ((c["intermediate_size"], H), (c["intermediate_size"], H), (H, c["intermediate_size"])):
                lin("dense MLP layers", out, inp, m)
        if n_shared or shared_I:
            width = n_shared * s.I if n_shared else shared_I
            for out, inp in ((width, H), (width, H), (H, width)):
                lin("shared experts", out, inp, f"{m}.shared_experts")
            if shared_I:
                add("shared experts", H)  # Qwen2-MoE's shared_expert_gate [1, H]

    moe_set = set(s.moe_layers)
    for layer in range(L):
        attention(layer)
        add("norms", 2 * H)
        ffn(layer, layer in moe_set)
    shared_total = 0
    if "shared experts" in parts:
        shared_total = parts["shared experts"][0] * s.float_bytes + parts["shared experts"][1]

    expert = _expert_tensors(s, q, fdtag, s.moe_layers[0] if s.moe_layers else 0)
    expert_params = 3 * H * s.I + (2 * s.I + H if mt == "gpt_oss" else 0)
    dense_parts = tuple((k, v[0] * s.float_bytes + v[1]) for k, v in parts.items())
    dense_bytes = sum(b for _, b in dense_parts)
    stored_dense = dense_bytes + shipped[0] - shipped[1] + router32[0] - router32[1]  # in the checkpoint
    experts_bytes = sum(t.nbytes for t in expert) * len(s.moe_layers) * s.E

    # Multi-token-prediction layers ship in the checkpoint but are not used to decode.
    mtp = int(c.get("num_nextn_predict_layers") or c.get("mtp_num_hidden_layers") or 0)  # the latter: Qwen3-Next/3.5
    unused = 0
    if not mtp and c.get("use_mtp") and c.get("num_mtp_modules"):
        # MiniMax-M2: MTP modules of mtp_transformer_layers layers each, named in config.json; its Hub checkpoint's
        # size (229 B parameters, ~230 GB) leaves no room for them, so their cost is noted, not counted
        n = int(c["num_mtp_modules"]) * int(c.get("mtp_transformer_layers") or 1)
        per_layer = (stored_dense - V * H * s.float_bytes * (1 if s.tied else 2)) / L + s.E * sum(
            t.nbytes for t in expert)
        notes.append(f"{n} multi-token-prediction layer(s) named in config.json (use_mtp) are never loaded; they "
                     f"would cost ~{n * per_layer / GiB:.1f} GiB")
    if mtp:
        per_layer_dense = (stored_dense - (V * H * s.float_bytes * (1 if s.tied else 2))) / L
        unused = mtp * (per_layer_dense + s.E * sum(t.nbytes for t in expert) + 2 * H * H * s.float_bytes
                        + (2 * V * H * s.float_bytes if mt == "deepseek_v3" else 0))
        notes.append(f"{mtp} multi-token-prediction layer(s) in the checkpoint (~{unused / GiB:.1f} GiB) are "
                     "downloaded but not loaded")
    checkpoint = int(stored_dense + experts_bytes + unused)
    if shipped[0]:
        notes.append(f"the checkpoint's FP8 dense weights ({shipped[0] / GiB:.2f} GiB with their scales) are "
                     f"dequantized to {s.float_dtype} at load: {shipped[1] / GiB:.2f} GiB in memory")
    source = "config.json"
    if index is not None:
        source = "config.json + index"
        total = (index.get("metadata") or {}).get("total_size")
        names = list((index.get("weight_map") or {}).keys())
        if isinstance(total, int) and total > 0:
            notes.append(f"index total_size {total / GB:.3f} GB; this estimate {checkpoint / GB:.3f} GB "
                         f"({(checkpoint - total) / total:+.1%})")
            checkpoint = total
        if q.method == "mxfp4" and names and not any(n.endswith("_blocks") for n in names):
            notes.append("quantization_config says mxfp4 but the index names no *_blocks tensors")
    kind, full, win, window, kv_detail = _kv(c, s)
    recurrent_bytes, recurrent_detail = _recurrent(c, s)
    fmt = q.format if q.applies("model.layers.0.mlp.experts") else s.float_dtype
    notes.insert(0, "sizes derived from config.json" + (" and its quantization_config" if q.method else "")
                 + ": estimates, not read from the weights")
    from .catalog import SUPPORTED_TYPES

    if isinstance(config.get("text_config"), dict) and config.get("vision_config") and mt in SUPPORTED_TYPES:
        notes.append(f"{config.get('model_type')} is multimodal: its vision tower's tensors are downloaded but not "
                     "loaded; moechat runs the text model only")
    if c.get("auto_map") and mt in SUPPORTED_TYPES:  # MiniMax-M2, DeepSeek-V3: code for older transformers
        notes.append(f"config.json's auto_map names custom code, but transformers has {mt} natively and moechat "
                     "runs its own implementation: no remote code is needed or run")
    return ModelSpec(
        name=name or str(c.get("_name_or_path") or mt), model_type=mt, source=source, estimated=True,
        num_layers=L, moe_layers=s.moe_layers, num_experts=s.E, top_k=s.K, hidden_size=H, num_heads=s.n_heads,
        expert_intermediate=s.I,
        expert_tensors=tuple(expert), expert_format=fmt, expert_params=expert_params, dense_parts=dense_parts,
        dense_float_elems=sum(v[0] for v in parts.values()), embedding_bytes=0 if s.tied else V * H * s.float_bytes,
        shared_experts=n_shared or (1 if shared_I else 0), shared_expert_bytes=shared_total, kv_kind=kind,
        kv_elems_full=full, kv_elems_window=win, window=window, kv_detail=kv_detail, float_bytes=s.float_bytes,
        recurrent_state_bytes=recurrent_bytes, recurrent_detail=recurrent_detail,
        float_dtype=s.float_dtype, max_context=s.max_context, checkpoint_bytes=checkpoint,
        stored_expert_bytes=sum(t.nbytes for t in expert), weights_present=False,
        present_bytes=present_bytes, unused_bytes=int(unused), notes=tuple(notes), config_dtype=_config_dtype(c),
        quant_method=_quant_method(c), remote_code=bool(c.get("auto_map")))


def _quant_method(config: dict) -> str | None:
    qc = config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    return str(method) if method is not None else None


_PER_EXPERT = re.compile(r"^(?:model\.)?layers\.(\d+)\.(?:.*\.)?experts\.(\d+)\.(.+)$")
_FUSED = re.compile(r"^(?:model\.)?layers\.(\d+)\.(?:.*\.)?experts\.([A-Za-z_][\w.]*)$")
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def _numel(shape) -> int:
    return math.prod(shape) if shape else 1


def spec_from_headers(config: dict, tensors: dict, *, name: str = "", where: str = "config.json") -> ModelSpec:
    """Exact sizes from the safetensors headers (`tensors`: name -> object with .dtype, .shape, .nbytes)."""
    est = spec_from_config(config, name=name, where=where)  # architecture numbers, KV, context
    notes: list[str] = []
    E, L = est.num_experts, est.num_layers
    per_expert: dict[tuple[int, int], dict[str, TensorSpec]] = {}
    parts: dict[str, int] = {}
    float_elems = embedding = shared = unused = 0
    fp8_dense: dict[str, list[int]] = {}  # what -> [bytes in the checkpoint, elements once dequantized]
    keep32 = _fp32_weights(est.model_type)
    for tname, info in tensors.items():
        dtag, shape, nbytes = info.dtype, tuple(info.shape), int(info.nbytes)
        layer_m = _LAYER.match(tname)
        if layer_m and int(layer_m.group(1)) >= L:
            unused += nbytes  # e.g. DeepSeek-V3's multi-token-prediction layer 61
            continue
        m = _PER_EXPERT.match(tname)
        if m:
            key = (int(m.group(1)), int(m.group(2)))
            per_expert.setdefault(key, {})[m.group(3)] = TensorSpec(m.group(3), shape, dtag, nbytes)
            continue
        m = _FUSED.match(tname)
        if m and shape and shape[0] == E:
            for e in range(E):
                per_expert.setdefault((int(m.group(1)), e), {})[m.group(2)] = TensorSpec(
                    m.group(2), shape[1:], dtag, nbytes // E)
            continue
        if "embed_tokens" in tname or tname.endswith("wte.weight"):
            what = "embeddings"
            embedding += nbytes
        elif tname.startswith("lm_head"):
            what = "lm_head"
        elif "shared_expert" in tname:
            what = "shared experts"
            shared += nbytes
        elif ".self_attn." in tname or ".attention." in tname:
            what = "attention"
        elif re.search(r"\.(gate|router)\.", tname) or "e_score_correction" in tname:
            what = "routers"
        elif "norm" in tname:
            what = "norms"
        elif ".mlp." in tname:
            what = "dense MLP layers"
        else:
            what = "other"
        if keep32 and tname.endswith(keep32):  # held in fp32 whatever the checkpoint stores it in
            nbytes = 4 * _numel(shape)
        parts[what] = parts.get(what, 0) + nbytes
        if dtag in FLOAT_DTAGS and "scale" not in tname and not (keep32 and tname.endswith(keep32)):
            float_elems += _numel(shape)
        if dtag.startswith("F8") or tname.endswith(".weight_scale_inv"):  # dequantized at load (loader.py)
            f8 = fp8_dense.setdefault(what, [0, 0])
            f8[0] += nbytes
            f8[1] += 0 if tname.endswith("_scale_inv") else _numel(shape)
    if not per_expert:
        raise ConfigError(f"{where}: no routed-expert tensors found in the safetensors headers (expected names "
                          "like model.layers.N.mlp.experts.E.* or fused model.layers.N.mlp.experts.*)")
    moe_layers = tuple(sorted({layer for layer, _ in per_expert}))
    sizes = {key: sum(t.nbytes for t in ts.values()) for key, ts in per_expert.items()}
    first = per_expert[min(per_expert)]
    if len(set(sizes.values())) > 1:
        notes.append(f"experts differ in size ({min(sizes.values())}..{max(sizes.values())} B); planning with "
                     "the largest")
        first = per_expert[max(sizes, key=sizes.get)]
    missing = len(moe_layers) * E - len(per_expert)
    if missing:
        notes.append(f"{missing} (layer, expert) pairs have no tensors in the headers")
    if moe_layers != est.moe_layers:
        notes.append(f"headers have experts on {len(moe_layers)} layers, config.json implies {len(est.moe_layers)}")
    expert = tuple(first[k] for k in sorted(first))
    dtags = {t.dtype for t in expert}
    fmt = est.expert_format if dtags - set(FLOAT_DTAGS) else "/".join(sorted(d.lower() for d in dtags))
    params = sum(_numel(t.shape) * (2 if t.dtype == "U8" and t.name.endswith("_blocks") else 1)
                 for t in expert if "scale" not in t.name)
    total = sum(int(i.nbytes) for i in tensors.values())
    float_by_size: dict[int, int] = {}
    for info in tensors.values():
        if info.dtype in FLOAT_DTAGS:
            float_by_size[FLOAT_DTAGS[info.dtype]] = float_by_size.get(FLOAT_DTAGS[info.dtype], 0) + int(info.nbytes)
    fbytes = max(float_by_size, key=float_by_size.get) if float_by_size else est.float_bytes
    fname = {4: "float32", 2: est.float_dtype if est.float_bytes == 2 else "bfloat16", 8: "float64"}[fbytes]
    if fp8_dense:
        stored = sum(b for b, _ in fp8_dense.values())
        for what, (b, n) in fp8_dense.items():
            parts[what] += n * fbytes - b
            float_elems += n
        loaded = sum(n for _, n in fp8_dense.values()) * fbytes
        notes.append(f"the checkpoint's FP8 dense weights ({stored / GiB:.2f} GiB with their scales) are "
                     f"dequantized to {fname} at load: {loaded / GiB:.2f} GiB in memory")
    notes.insert(0, "sizes read from the safetensors headers")
    return replace(
        est, source="safetensors headers", estimated=False, moe_layers=moe_layers, expert_tensors=expert,
        stored_expert_bytes=sum(t.nbytes for t in expert),
        expert_format=fmt, expert_params=params or est.expert_params, dense_parts=tuple(parts.items()),
        dense_float_elems=float_elems, embedding_bytes=embedding if "lm_head" in parts else 0,
        float_bytes=fbytes, float_dtype=fname,
        shared_expert_bytes=shared, checkpoint_bytes=total, weights_present=True, present_bytes=total,
        unused_bytes=unused, notes=tuple(notes + [n for n in est.notes if "multi-token" in n.lower()]))


def _resolve_model_dir(model: str | os.PathLike) -> Path:
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    text = str(model)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text) and not path.exists():
        try:
            from huggingface_hub import try_to_load_from_cache  # reads the local cache only, no network

            from .paths import default_cache_dir  # HF_HOME / HF_HUB_CACHE now (huggingface_hub read them at import)

            cached = try_to_load_from_cache(text, "config.json", cache_dir=default_cache_dir())
        except Exception:  # noqa: BLE001 - a broken cache is the same as no cache here
            cached = None
        if isinstance(cached, str):
            return Path(cached).parent
        raise ConfigError(f"{text}: not a local directory, and its config.json is not in the Hugging Face cache; "
                          f"moechat fit {text} reads it from the Hub when HF_HUB_OFFLINE is not set, and moechat pull "
                          f"{text} downloads the model")
    raise ConfigError(f"{model}: no such model directory")


def gguf_spec(path: str | os.PathLike) -> ModelSpec:
    """`moechat fit FILE.gguf`: the plan's ModelSpec from the header(s) alone. The routed experts count as the file
    packs them (their ggml types' bytes, every tier); every other tensor as the loader holds it, dequantized to the
    compute dtype; a note gives the file's packed bytes per ggml type."""
    import numpy as np

    from .checkpoint import TensorInfo
    from .load.gguf import open_gguf

    ckpt = open_gguf(path)
    cfg = ckpt.config
    fdtag, fbytes = ("F32", 4) if cfg["torch_dtype"] == "float32" else ("BF16", 2)
    held: dict[str, TensorInfo] = {}
    by_type: dict[str, int] = {}
    parts = {"ffn_gate_exps": "gate_gguf", "ffn_up_exps": "up_gguf", "ffn_down_exps": "down_gguf"}
    for reader in ckpt.readers:  # the file's bytes per type (deepseek2's attn_k_b + attn_v_b are one kv_b_proj below)
        for t in reader.tensors:
            by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
    for name, info in ckpt.tensors.items():
        m = re.match(r"^blk\.(\d+)\.(ffn_\w+_exps)\.(weight|bias)$", name)
        if m and m.group(3) == "weight":
            hf = f"model.layers.{m.group(1)}.mlp.experts.{parts[m.group(2)]}"
            held[hf] = TensorInfo(hf, info.file, "U8", info.shape, info.start, info.end)
        elif m:  # gpt-oss's expert biases: in every tier with their expert, in the compute dtype
            hf = f"model.layers.{m.group(1)}.mlp.experts.{parts[m.group(2)]}_bias"
            held[hf] = TensorInfo(hf, info.file, fdtag, info.shape, 0, int(np.prod(info.shape)) * fbytes)
        else:
            n = int(np.prod(info.shape)) * fbytes
            held[name] = TensorInfo(name, info.file, fdtag, info.shape, 0, n)
    spec = spec_from_headers(cfg, held, name=Path(path).name, where=str(ckpt.files_[0]))
    types = "/".join(t.name for t in ckpt.expert_format.types.values()) if ckpt.expert_format else "none"
    packed = ", ".join(f"{t} {gib(b)}" for t, b in sorted(by_type.items(), key=lambda kv: -kv[1]))
    size = sum(f.stat().st_size for f in ckpt.files_)
    notes = (f"GGUF file of {gib(size)}, packed per type: {packed}",
             f"experts kept packed as the file stores them ({types}, gate/up/down); the other tensors dequantized "
             f"at load to {cfg['torch_dtype']}")
    spec = replace(spec, expert_format=f"GGUF {types}", checkpoint_bytes=size, present_bytes=size,
                   path=str(path), notes=tuple(n for n in spec.notes if "safetensors" not in n) + notes)
    return spec


def read_model_spec(model: str | os.PathLike) -> ModelSpec:
    """The spec of a local model directory (or a Hub id already in the local cache).

    Complete safetensors weights: exact sizes from their headers. Only config.json (plus, perhaps, the
    index or some shards): estimates from the config, checked against the index's total_size.
    """
    path = Path(model).expanduser()
    if path.suffix == ".gguf" or (path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf"))):
        return gguf_spec(path)  # a GGUF model: sizes from its header(s), experts packed as stored
    model_dir = _resolve_model_dir(model)
    cfg_path = model_dir / "config.json"
    config = _load_json(cfg_path, "model config (config.json)")
    name = model_dir.name
    index_path = model_dir / "model.safetensors.index.json"
    index = check_index(_load_json(index_path, "safetensors index"), str(index_path)) if index_path.exists() else None
    if index is not None:
        shards = sorted({v for v in (index.get("weight_map") or {}).values() if isinstance(v, str)})
    else:
        shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    present = [s for s in shards if (model_dir / s).is_file()]
    if shards and len(present) == len(shards):
        from .checkpoint import Checkpoint  # torch is imported only when there are weights to read

        ckpt = Checkpoint.open(model_dir)
        spec = spec_from_headers(config, ckpt.tensors, name=name, where=str(cfg_path))
        return replace(spec, path=str(model_dir))
    present_bytes = sum((model_dir / s).stat().st_size for s in present)
    spec = spec_from_config(config, name=name, index=index, present_bytes=present_bytes, where=str(cfg_path))
    extra = []
    if present:
        extra.append(f"{len(present)} of {len(shards)} shards present: sizes estimated until the download completes")
    elif not shards and any((model_dir / n).exists() for n in ("pytorch_model.bin", "model.pt")):
        extra.append("only pickle weights here; moechat runs safetensors only")
    return replace(spec, path=str(model_dir), notes=spec.notes + tuple(extra))


# -- hit rates -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MissRatioCurve:
    """Hit rate against the fraction of experts cached, from replaying routing traces.

    `points`: (fraction, hit rate) for the policy the cache runs; `best`: the same for Belady (what any
    policy could reach), optional. Between points the curve is linear; (0, 0) and (1, 1) are implied.
    """

    points: tuple[tuple[float, float], ...]
    best: tuple[tuple[float, float], ...] | None = None
    source: str = "routing trace"

    @staticmethod
    def _at(points, fraction: float) -> float:
        pts = sorted({(0.0, 0.0), (1.0, 1.0), *((float(f), float(h)) for f, h in points)})
        xs = [p[0] for p in pts]
        i = bisect.bisect_left(xs, fraction)
        if i < len(xs) and xs[i] == fraction:
            return pts[i][1]
        (x0, y0), (x1, y1) = pts[max(0, i - 1)], pts[min(len(pts) - 1, i)]
        return y0 if x1 == x0 else y0 + (y1 - y0) * (fraction - x0) / (x1 - x0)

    def hit_at(self, fraction: float) -> float:
        return min(1.0, max(0.0, self._at(self.points, fraction)))

    def best_at(self, fraction: float) -> float:
        return self.hit_at(fraction) if not self.best else max(self.hit_at(fraction), self._at(self.best, fraction))

    @classmethod
    def from_json(cls, data, num_experts: int, *, policy: str | None = None) -> MissRatioCurve:
        """{"points": [[fraction, hit], ...], "best": [...], "source": ...}, or bench/replay.py --json rows."""
        if isinstance(data, dict) and "points" in data:
            return cls(tuple(tuple(p) for p in data["points"]),
                       tuple(tuple(p) for p in data["best"]) if data.get("best") else None,
                       str(data.get("source", "given curve")))
        if isinstance(data, list) and data and isinstance(data[0], dict) and "hit_rate" in data[0]:
            rows = [r for r in data if r.get("pool", "global") == "global"] or data
            names = [r["policy"] for r in rows if r["policy"] != "belady"]
            policy = policy or (max(set(names), key=lambda n: sum(r["hit_rate"] for r in rows if r["policy"] == n))
                                if names else "belady")
            pts = tuple((r["capacity_per_layer"] / num_experts, r["hit_rate"]) for r in rows if r["policy"] == policy)
            best = tuple((r["capacity_per_layer"] / num_experts, r["hit_rate"]) for r in rows
                         if r["policy"] == "belady")
            traces = sorted({str(r.get("trace", "")) for r in rows})
            return cls(pts, best or None, f"bench/replay.py, {policy}, {', '.join(traces)}")
        raise ValueError("a miss-ratio curve is {\"points\": [[fraction, hit_rate], ...]} or bench/replay.py "
                         "--json output")


# -- preferences, decisions, plan ------------------------------------------------------------------------

@dataclass(frozen=True)
class Preferences:
    context: int | None = None  # tokens; None: DEFAULT_CONTEXT capped at the model's, lowered if needed
    prefer: str = "speed"  # "speed": spare device memory -> expert slots; "context": -> KV cache
    margin: float = 0.05  # fraction of each memory total left free
    device: str | None = None  # "cpu", "cuda", "cuda:N"; None: the GPU with most free memory, else the CPU
    hit_curve: MissRatioCurve | None = None
    disk_read_gbps: float | None = None
    host_read_gbps: float | None = None  # the CPU's read rate over packed experts (None: ASSUMED_RAM_GBPS)
    host_read_source: str = ""  # where host_read_gbps comes from, for the plan's lines ("measured on this machine")
    cpu_layer_s: float | None = None  # measured seconds per layer on the CPU beyond the reads (engine/calibration.py)
    override: bool = False  # load anyway: a refused plan is still made, best effort, and check() passes
    # True: sliding-window layers are allocated `window` tokens, as a ring would need; False: every layer the
    # whole context, as engine/kv_cache.py allocates today (the plan then names the saving a ring would bring)
    windowed_kv: bool = KV_WINDOWED_ALLOCATION
    prefill_chunk: int = PREFILL_CHUNK
    repacked: frozenset[str] = frozenset()  # converted formats whose repacked file is already written (reused)
    # where misses run (`moechat run --on-miss`, default auto): the mode `decode` predicts; the others are in
    # `MemoryPlan.placements`
    on_miss: str = "auto"
    # where the input embedding table lives on a GPU (`--embeddings`): "host" gathers each token's row in RAM and
    # copies it in (a few KB a token) so its VRAM becomes slots; "auto": host when that buys slots (`moechat fit`)
    embeddings: str = "device"


@dataclass(frozen=True)
class Decision:
    item: str
    bytes: int | None
    where: str
    reason: str


@dataclass(frozen=True)
class Refusal:
    resource: str  # "VRAM" | "RAM" | "disk"
    need_bytes: int
    have_bytes: int
    fixes: tuple[str, ...]  # cheapest first
    detail: str = ""
    also: tuple[str, ...] = ()  # further shortfalls

    @property
    def short_bytes(self) -> int:
        return max(0, self.need_bytes - self.have_bytes)

    @property
    def message(self) -> str:
        text = (f"short by {self.short_bytes / GiB:.1f} GiB of {self.resource}"
                + (f" ({self.detail})" if self.detail else "") + ": " + self.fixes[0])
        if len(self.fixes) > 1:
            text += "; or " + "; or ".join(self.fixes[1:])
        if self.also:
            text += "; also " + "; ".join(self.also)
        return text


@dataclass(frozen=True)
class DecodeEstimate:
    """Predicted decode tok/s (a range) and the bandwidth bound; see docs/plan.md for the formula."""

    low: float
    high: float
    bound: float
    bound_by: str
    hit_rate_low: float
    hit_rate_high: float
    hit_source: str
    device_bytes: int  # read from device memory per token (dense + active experts + KV)
    link_bytes_low: int  # over the host->device link per token, at the low hit rate
    link_bytes_high: int
    disk_bytes_low: int
    disk_bytes_high: int
    device_gbps: float
    link_gbps: float | None
    disk_gbps: float
    compute_efficiency: float = 1.0  # the expert format's compute rate / the dense read rate (EXPERT_COMPUTE_...)
    on_miss: str | None = None  # the --on-miss mode low/high/bound are for (None: no miss runs anywhere else)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class MemoryPlan:
    model: str
    device: str  # "cuda:0" | "cpu"
    device_name: str
    context: int
    expert_slots: int  # C
    total_experts: int
    expert_bytes: int
    host_tier: str  # "none" | "all experts in RAM" | "RAM cache" | "disk only"
    ram_cache_bytes: int | None  # what `moechat run --ram-cache-mb` gets: None = every expert in RAM
    dense_bytes: int
    kv_bytes: int
    workspace_bytes: int
    device_budget_bytes: int
    device_used_bytes: int
    ram_budget_bytes: int
    ram_used_bytes: int
    disk_free_bytes: int | None
    disk_needed_bytes: int
    decisions: tuple[Decision, ...]
    decode: DecodeEstimate | None
    refusal: Refusal | None = None
    overridden: bool = False
    estimated: bool = False
    notes: tuple[str, ...] = ()
    placements: tuple[MissPlacement, ...] = ()  # decode per --on-miss mode (a GPU with misses from RAM)
    embeddings: str = "device"  # where the input embedding table lives ("host": RAM, one row copied in a token)

    @property
    def best_placement(self) -> MissPlacement | None:
        """The --on-miss mode predicted fastest (auto when it ties the better of load and host)."""
        if not self.placements:
            return None
        return max(self.placements, key=lambda p: (round(p.low, 6), p.mode == "auto"))

    @property
    def ok(self) -> bool:
        return self.refusal is None

    @property
    def resident(self) -> bool:
        """Every expert on the compute device: no cache needed (moechat run's resident path)."""
        return self.expert_slots >= self.total_experts

    @property
    def needs_cache(self) -> bool:
        return not self.resident

    @property
    def experts_in_ram(self) -> int:
        if self.device == "cpu":
            return self.expert_slots
        if self.ram_cache_bytes is None:
            return self.total_experts
        return self.ram_cache_bytes // self.expert_bytes if self.expert_bytes else 0

    def check(self) -> MemoryPlan:
        """This plan, or PlanRefusedError when it was refused and not overridden."""
        if self.refusal is not None and not self.overridden:
            raise PlanRefusedError(self.refusal)
        return self

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("decisions", "decode", "refusal")}
        out["fits"] = self.ok
        out["resident"] = self.resident
        out["decisions"] = [{"item": d.item, "bytes": d.bytes, "where": d.where, "reason": d.reason}
                            for d in self.decisions]
        out["decode"] = None if self.decode is None else self.decode.to_json()
        out["placements"] = [p.to_json() for p in self.placements]
        out["best_on_miss"] = None if self.best_placement is None else self.best_placement.mode
        out["refusal"] = None if self.refusal is None else {
            "resource": self.refusal.resource, "short_bytes": self.refusal.short_bytes,
            "need_bytes": self.refusal.need_bytes, "have_bytes": self.refusal.have_bytes,
            "fixes": list(self.refusal.fixes), "also": list(self.refusal.also), "message": self.refusal.message}
        out["notes"] = list(self.notes)
        return out


def gib(n: float | None) -> str:
    if n is None:
        return "?"
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def _workspace(spec: ModelSpec, context: int, chunk: int, on_gpu: bool) -> tuple[int, str]:
    """Activation/workspace reserve for a prefill chunk of `chunk` tokens, and its one-line breakdown."""
    T = min(chunk, context)
    H, I, K = spec.hidden_size, spec.expert_intermediate, spec.top_k
    # fp32 upper bound: ~8 [T, H] tensors (hidden, residual, norm, q/k/v, attention out) + the K experts' [T, 2I]
    # gate/up intermediates, twice for the SwiGLU product
    act = 4 * T * (8 * H + 4 * K * I)
    scores = 0 if on_gpu else 4 * T * context * spec.num_heads  # CPU SDPA with a mask builds [heads, T, S]
    base = CUDA_CONTEXT_BYTES if on_gpu else 0
    parts = [f"CUDA context {gib(base)}"] if base else []
    parts.append(f"{T}-token prefill activations {gib(act)}")
    if scores:
        parts.append(f"attention scores {gib(scores)}")
    return base + act + scores, " + ".join(parts)


def _hit_rates(spec: ModelSpec, fraction: float, curve: MissRatioCurve | None) -> tuple[float, float, str]:
    if fraction >= 1:
        return 1.0, 1.0, "every expert resident"
    if curve is not None:
        return curve.hit_at(fraction), curve.best_at(fraction), curve.source
    low = fraction  # uniform independent routing: any online policy hits the resident fraction
    high = 1 - TRACED_MISS_FACTOR * (1 - fraction)
    return low, high, (f"conservative default: uniform routing ({low:.1%}) to {TRACED_MISS_FACTOR:g}x its miss "
                       f"rate ({high:.1%}), the best LRU reached on the shared real traces")


def _decode(spec: ModelSpec, kind: str, context: int, slots: int, ram_experts: int, link: float | None,
            devbw: float, diskbw: float, curve: MissRatioCurve | None, layer_s: float | None = None) -> DecodeEstimate:
    N, K, Lm, eb = spec.total_experts, spec.top_k, spec.num_moe_layers, spec.expert_bytes
    c = min(1.0, slots / N) if N else 1.0
    h_lo, h_hi, source = _hit_rates(spec, c, curve)
    # RAM tier (inclusive of the slots): a slot miss goes to disk unless RAM holds the expert.
    r = max(c, min(1.0, ram_experts / N)) if N else 1.0
    if kind == "cpu":
        d_lo, d_hi = 1 - h_lo, 1 - h_hi  # slots are RAM; every slot miss reads the shards
    elif r >= 1:
        d_lo = d_hi = 0.0
    else:
        rd_lo, rd_hi, _ = _hit_rates(spec, r, curve)
        d_lo, d_hi = 1 - rd_lo, 1 - rd_hi
    active = Lm * K * eb
    # Attention reads a window layer's last `window` keys whatever was allocated; averaged over a filling context.
    kv_read = spec.kv_bytes(max(1, context // 2), windowed=True)
    dev_bytes = spec.dense_read_bytes + active + kv_read
    # A format whose compute path runs below the dense read rate costs as if it read active / f bytes.
    f = compute_efficiency(spec, kind)
    dev_work = dev_bytes - active + active / f
    eff = GPU_EFFICIENCY if kind == "gpu" else 1.0

    def seconds(h: float, d: float) -> tuple[float, float, float, float]:
        link_b = active * (1 - h) if kind == "gpu" else 0.0
        disk_b = active * d
        misses = Lm * K * (1 - h)
        t = (dev_work / (devbw * GB * eff) + (link_b / (link * GB) if link_b else 0.0) + disk_b / (diskbw * GB)
             + spec.num_layers * (layer_s or OVERHEAD_PER_LAYER_S[kind]) + misses * OVERHEAD_PER_MISS_S[kind])
        return t, link_b, disk_b, misses

    t_lo, link_lo, disk_lo, _ = seconds(h_lo, d_lo)
    t_hi, link_hi, disk_hi, _ = seconds(h_hi, d_hi)
    device = "device memory" if active / f - active <= dev_bytes - active else f"{spec.format_key} expert compute"
    limits = {device: dev_work / (devbw * GB)}
    if link_hi:
        limits["link"] = link_hi / (link * GB)
    if disk_hi:
        limits["disk"] = disk_hi / (diskbw * GB)
    bound_by = max(limits, key=limits.get)
    return DecodeEstimate(
        low=1 / t_lo, high=1 / t_hi, bound=1 / limits[bound_by], bound_by=bound_by, hit_rate_low=h_lo,
        hit_rate_high=h_hi, hit_source=source, device_bytes=int(dev_bytes), link_bytes_low=int(link_lo),
        link_bytes_high=int(link_hi), disk_bytes_low=int(disk_lo), disk_bytes_high=int(disk_hi),
        device_gbps=devbw * eff, link_gbps=link if kind == "gpu" else None, disk_gbps=diskbw, compute_efficiency=f)


@dataclass(frozen=True)
class MissPlacement:
    """Predicted decode tok/s with every miss served one way (`--on-miss`): load (over the link into a slot),
    host (computed on the CPU from the RAM tier while the GPU computes the slotted experts) or auto (per miss,
    the cheaper of the two: at least the better of them, which is what is predicted)."""

    mode: str  # load | host | auto
    low: float
    high: float
    bound: float
    bound_by: str
    host_experts: float = 0.0  # experts computed on the host per token, at the low hit rate

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _placements(spec: ModelSpec, decode: DecodeEstimate, hostbw: float) -> tuple[MissPlacement, ...]:
    """load / host / auto on a GPU with a RAM tier (docs/plan.md, "Where misses run").

    Host: per MoE layer the GPU computes its slotted experts while the CPU computes the missed ones from RAM
    (reading their packed bytes at `hostbw` x the format's CPU compute efficiency), so the layer costs the
    longer of the two plus two activation copies; nothing crosses the link but activations. Attention and
    the dense weights do not overlap with it. Disk reads (experts beyond the RAM tier) cost the same either
    way."""
    from .cache.hybrid import ACTIVATION_COPY_S  # pure Python

    Lm, K, eb = spec.num_moe_layers, spec.top_k, spec.expert_bytes
    active = Lm * K * eb
    f_dev = decode.compute_efficiency
    f_host = compute_efficiency(spec, "cpu")
    dev_rate = decode.device_gbps * GB
    out = [MissPlacement("load", decode.low, decode.high, decode.bound, decode.bound_by)]
    rates = []
    for h, disk_b in ((decode.hit_rate_low, decode.disk_bytes_low), (decode.hit_rate_high, decode.disk_bytes_high)):
        dense_t = (decode.device_bytes - active) / dev_rate
        dev_experts_t = active * h / f_dev / dev_rate
        host_t = active * (1 - h) / (hostbw * GB * f_host)
        copies = Lm * (1 - h ** K) * 2 * ACTIVATION_COPY_S  # layers with at least one miss
        t = (dense_t + max(dev_experts_t, host_t) + copies + disk_b / (decode.disk_gbps * GB)
             + spec.num_layers * OVERHEAD_PER_LAYER_S["gpu"])
        limits = {"device memory": dense_t + dev_experts_t, "host RAM": host_t + dense_t}
        if disk_b:
            limits["disk"] = disk_b / (decode.disk_gbps * GB)
        rates.append((1 / t, limits, Lm * K * (1 - h)))
    (lo, lo_limits, n_host), (hi, hi_limits, _) = rates
    limits = hi_limits if hi >= lo else lo_limits  # the bound of the faster end, so that high <= bound
    bound_by = max(limits, key=limits.get)
    # low-high as rates, not as hit rates: with a slow device path (int4 on a GPU today) more hits are slower
    host = MissPlacement("host", min(lo, hi), max(lo, hi), 1 / limits[bound_by], bound_by, host_experts=n_host)
    best = max((out[0], host), key=lambda p: p.low)
    out += [host, replace(best, mode="auto")]
    return tuple(out)


def rate(x: float) -> str:
    """A tok/s figure: one decimal, two significant digits below 1 (a bound of 0.145 is "0.15", not "0.1")."""
    return f"{x:.1f}" if x >= 1 else f"{x:.2g}"


def rate_range(low: float, high: float) -> str:
    """"11.0-14.2", or one number when the two are the same: with as many decimals (up to 3) as it takes for two
    different rates to read differently, so a range never shows as "5.2-5.2"; always low-high, whichever end a
    caller names first (a host placement is faster at the *low* hit rate when its GPU path is slow)."""
    low, high = min(low, high), max(low, high)
    for decimals in (1, 2, 3):
        a, b = f"{low:.{decimals}f}", f"{high:.{decimals}f}"
        if a != b:
            return f"{a}-{b}"
    return f"{low:.1f}" if abs(low) >= 0.05 else f"{low:.3g}"


def compute_efficiency(spec: ModelSpec, kind: str) -> float:
    """How fast the experts' format computes on `kind` ("cpu" | "gpu"), as a fraction of the dense read rate."""
    return EXPERT_COMPUTE_EFFICIENCY[kind].get(spec.format_key, 1.0)


def _pick_device(hw: Hardware, prefs: Preferences) -> tuple[GpuInfo | None, str]:
    dev = prefs.device
    if dev == "cpu":
        return None, "CPU (asked for)"
    if dev is None:
        g = hw.best_gpu()
        if g is None:
            return None, "no usable GPU" + (" (see notes)" if hw.gpu_notes else "")
        if g.source == "what-if":
            return g, "what-if"
        n = len([x for x in hw.gpus if x.usable])
        return g, "the GPU with the most free memory" + (f" of {n}" if n > 1 else "")
    m = re.fullmatch(r"cuda(?::(\d+))?", dev)
    if not m:
        raise ConfigError(f"device {dev!r}: use cpu, cuda or cuda:N")
    idx = int(m.group(1) or 0)
    g = hw.gpu(idx)
    if g is None or not g.usable:
        found = ", ".join(f"{x.label} {x.name}" for x in hw.gpus) or "none"
        raise ConfigError(f"device {dev}: no such usable GPU (found: {found}); "
                          "pass --vram-gb to plan for one anyway")
    return g, f"{dev} (asked for)"


def make_plan(spec: ModelSpec, hw: Hardware, prefs: Preferences = Preferences()) -> MemoryPlan:
    """Where everything goes, why, and how fast decode will be. Pure: same inputs, same plan."""
    if prefs.prefer not in ("speed", "context"):
        raise ConfigError(f"prefer {prefs.prefer!r}: use speed or context")
    if prefs.on_miss not in ON_MISS_MODES:
        raise ConfigError(f"--on-miss {prefs.on_miss!r}: use one of {', '.join(ON_MISS_MODES)}")
    if prefs.embeddings not in ("auto", "host", "device"):
        raise ConfigError(f"--embeddings {prefs.embeddings!r}: use auto, host or device")
    gpu, device_why = _pick_device(hw, prefs)
    if prefs.embeddings != "device" and (gpu is None or not spec.embedding_bytes):
        prefs = replace(prefs, embeddings="device")  # a CPU's device is its RAM; a tied table is the LM head too
    if prefs.embeddings == "auto":
        return _choose_embeddings(spec, hw, prefs)
    host_embed = spec.embedding_bytes if prefs.embeddings == "host" else 0
    kind = "gpu" if gpu else "cpu"
    notes = list(spec.notes) + list(hw.all_notes)
    decisions: list[Decision] = []
    eb, N, K, Lm = spec.expert_bytes, spec.total_experts, spec.top_k, spec.num_moe_layers
    elem = spec.float_bytes

    ram_total = hw.ram.total_bytes or 0
    ram_avail = hw.ram.available_bytes
    if ram_avail is None:
        notes.append("RAM size unknown: planning with none; pass --ram-gb")
        ram_avail = 0
    ram_budget = int(ram_avail - prefs.margin * ram_total)
    process = (PROCESS_RAM_GPU if gpu else PROCESS_RAM_CPU) + host_embed  # a host embedding table lives in RAM
    if gpu:
        dev_label, dev_name = gpu.label, gpu.name
        total = gpu.total_bytes or gpu.free_bytes
        budget = int(gpu.free_bytes - prefs.margin * total)
        link = gpu.link_gbps
        if link is None:
            link = ASSUMED_LINK_GBPS
            notes.append(f"PCIe link not reported: {link:g} GB/s assumed (PCIe 4.0 x16); pass --link-gbs or --link "
                         "PRESET")
        devbw = gpu.memory_gbps
        if devbw is None:
            devbw = ASSUMED_GPU_MEMORY_GBPS
            # the table's figure is the peak x GPU_EFFICIENCY: say both, so the note and the table agree
            notes.append(f"GPU memory bandwidth not reported: {devbw:g} GB/s peak assumed, so decode reads at "
                         f"{devbw * GPU_EFFICIENCY:g} GB/s ({GPU_EFFICIENCY:.0%} of it, the figure the table uses); "
                         "pass --gpu PRESET")
        why = " (what-if)" if device_why == "what-if" else f": {device_why}"
        decisions.append(Decision("device", total, dev_label,
                                  f"{gpu.name}, {gib(gpu.free_bytes)} free of {gib(total)}{why}; budget "
                                  f"{gib(budget)} after a {prefs.margin:.0%} margin"))
    else:
        dev_label, dev_name = "cpu", "CPU"
        budget = ram_budget - process
        link = None
        devbw = prefs.host_read_gbps or ASSUMED_RAM_GBPS
        decisions.append(Decision("device", ram_avail, "cpu",
                                  f"CPU: {device_why}; the compute device is RAM, {gib(ram_avail)} available: budget "
                                  f"{gib(budget)} after a {prefs.margin:.0%} margin and {gib(process)} for the "
                                  "process"))
    diskbw = prefs.disk_read_gbps or ASSUMED_DISK_GBPS

    dense = spec.dense_bytes - host_embed  # on the device
    chunk = prefs.prefill_chunk

    def fixed(ctx: int) -> int:
        return (dense + spec.kv_bytes(ctx, windowed=prefs.windowed_kv) + spec.recurrent_state_bytes
                + _workspace(spec, ctx, chunk, bool(gpu))[0])

    max_ctx = spec.max_context
    auto_ctx = prefs.context is None
    # "speed" starts from the default context and gives the rest to slots; "context" starts from the
    # model's maximum. Either way at least one layer's top-k must fit, and a context that was not asked
    # for is lowered until it does.
    want = min(prefs.context or (max_ctx if prefs.prefer == "context" else DEFAULT_CONTEXT), max_ctx)
    c_min = min(N, K)

    first = min(MIN_CONTEXT, want)
    candidates = sorted({first, want, *range(math.ceil(first / CONTEXT_STEP) * CONTEXT_STEP, want, CONTEXT_STEP)})

    def largest_context(slots: int) -> int | None:
        """The longest candidate context that still leaves `slots` expert slots (fixed() grows with context)."""
        def fits(i: int) -> bool:
            return fixed(candidates[i]) + slots * eb <= budget

        if not fits(0):
            return None
        lo, hi = 0, len(candidates) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return candidates[lo]

    refusal_parts: list[Refusal] = []
    context, slots = want, 0
    room = budget - fixed(want)
    ctx_reason = ""
    if room >= c_min * eb:
        slots = min(N, room // eb) if eb else N
        if prefs.context:
            ctx_reason = "as asked" + (f" (capped at the model maximum {max_ctx:,})" if prefs.context > max_ctx else "")
        elif prefs.prefer == "context":
            ctx_reason = f"the model maximum ({max_ctx:,}), preferring context"
        else:
            ctx_reason = f"the default {DEFAULT_CONTEXT:,}" + (", capped at the model maximum" if want < DEFAULT_CONTEXT
                                                               else "")
    else:
        found = largest_context(c_min) if auto_ctx else None
        if found is not None:
            # Exactly top-k slots: the leftover below one context step stays free, so more memory never
            # means fewer slots.
            context, slots = found, c_min
            ctx_reason = f"lowered from {want:,} so that top-k = {c_min} expert slots fit"
        else:
            need = fixed(min(want, MIN_CONTEXT) if auto_ctx else want) + c_min * eb
            refusal_parts.append(_device_refusal(spec, hw, prefs, gpu, budget, need, want, auto_ctx,
                                                 largest_context(c_min), c_min))
            context = min(want, MIN_CONTEXT) if auto_ctx else want
            slots = c_min
    kv = spec.kv_bytes(context, windowed=prefs.windowed_kv)
    ws, ws_detail = _workspace(spec, context, chunk, bool(gpu))
    dev_used = dense + kv + spec.recurrent_state_bytes + ws + slots * eb

    parts = sorted(((w, b) for w, b in spec.dense_parts if b and not (host_embed and w == "embeddings")),
                   key=lambda p: -p[1])  # a host table is in RAM: its line is "embeddings"
    big = [(w, b) for w, b in parts if b >= 0.01 * GiB][:5]
    rest = dense - sum(b for _, b in big)
    shown = " + ".join(f"{w} {b / GiB:.2f}" for w, b in big) + (f" + other {rest / GiB:.2f}" if rest >= 0.005 * GiB
                                                                   else "")
    shown = f"{shown} GiB" if shown else f"{gib(dense)} in all, each part under 0.01 GiB"
    decisions.append(Decision("dense weights", dense, dev_label,
                              f"{shown} ({spec.float_dtype}); every token reads "
                              f"{gib(spec.dense_read_bytes)} of it"))
    kvpt = spec.kv_bytes_per_token()
    kv_full, kv_ring = spec.kv_bytes(context, windowed=False), spec.kv_bytes(context, windowed=True)
    if kv_ring >= kv_full:
        alloc = ""
    elif prefs.windowed_kv:
        alloc = f"; window layers allocated {spec.window} tokens each ({gib(kv_full - kv_ring)} less than full length)"
    else:
        alloc = (f"; every layer allocated full length, as engine/kv_cache.py does (a {spec.window}-token ring on the "
                 f"window layers would need {gib(kv_ring)}, {gib(kv_full - kv_ring)} less)")
    decisions.append(Decision(f"KV cache, {context:,} tokens", kv, dev_label,
                              f"{gib(kvpt)}/token ({spec.kv_kind}: {spec.kv_detail}, {elem} B); context "
                              f"{ctx_reason or 'as far as it fits'}{alloc}"))
    if spec.recurrent_state_bytes:
        decisions.append(Decision("recurrent state", spec.recurrent_state_bytes, dev_label, spec.recurrent_detail))
    decisions.append(Decision("workspace", ws, dev_label, ws_detail))
    frac = slots / N if N else 1.0
    if slots >= N:
        why = (f"all {N:,} experts ({gib(spec.all_experts_bytes)}) fit the {gib(budget)} budget with "
               f"{gib(budget - dev_used)} to spare: no cache, no copies")
    elif refusal_parts:
        why = f"the minimum, top-k = {K}, and it does not fit"
    else:
        share = f"{frac:.1%} of {N:,} experts ({Lm} layers x {spec.num_experts})"
        if ctx_reason.startswith("lowered"):
            why = (f"{slots:,} x {gib(eb)} = {gib(slots * eb)}: held there so the context is as long as it can be; "
                   f"{share}")
        else:
            why = f"{slots:,} x {gib(eb)} = {gib(slots * eb)}: the rest of the {gib(budget)} budget; {share}"
    fmt = spec.expert_format_line(None if refusal_parts else budget - (dense + kv + ws))
    decisions.append(Decision(f"expert slots C = {slots:,}", slots * eb, dev_label, f"{fmt}; {why}"))

    # Host tier.
    all_bytes = spec.all_experts_bytes
    ram_cache: int | None = None
    host = "none"
    ram_experts = 0
    if slots >= N:
        ram_used = process + (dev_used if not gpu else 0)
        decisions.append(Decision("host tier", None, "-", f"not needed: all {N:,} experts ({gib(all_bytes)}) are on "
                                  f"{dev_label}"))
    elif gpu:
        room_ram = ram_budget - process
        if all_bytes <= room_ram:
            host, ram_cache, ram_experts = "all experts in RAM", None, N
            ram_used = process + all_bytes
            decisions.append(Decision("host tier: all experts in RAM", all_bytes, "RAM",
                                      f"{N:,} experts = {gib(all_bytes)} fit the {gib(room_ram)} RAM budget "
                                      f"({gib(ram_avail)} available - {prefs.margin:.0%} - {gib(process)} process); "
                                      "pinned, so misses are DMA copies"))
        else:
            ram_experts = max(0, int(room_ram // eb)) if eb else 0
            ram_cache = ram_experts * eb
            host = "RAM cache" if ram_experts else "disk only"
            ram_used = process + ram_cache
            decisions.append(Decision(f"host tier: RAM cache of {ram_experts:,} experts", ram_cache, "RAM",
                                      f"all experts ({gib(all_bytes)}) exceed the {gib(max(0, room_ram))} RAM "
                                      f"budget; it holds {ram_experts / N:.1%} of them, the rest stream from disk"))
    else:
        host, ram_cache = "none", 0
        ram_used = process + dev_used
        decisions.append(Decision("host tier", None, "-", f"none: on a CPU the {slots:,} slots are the RAM tier; "
                                  f"the other {N - slots:,} experts stream from disk"))
    if gpu and ram_budget < process:
        refusal_parts.append(Refusal("RAM", process, max(0, ram_budget), (
            f"close programs to free {gib(process - ram_budget)} of RAM",),
            detail=f"the process itself needs {gib(process)}, {gib(max(0, ram_budget))} is left after the margin"))
    converted = spec.converted_from is not None
    to_write = converted and spec.format_key not in prefs.repacked
    if converted:
        how = (f"are converted from {spec.converted_from} once, at the first start, into a {gib(all_bytes)} file"
               if to_write else f"converted from {spec.converted_from} are already in a {gib(all_bytes)} file")
        decisions.append(Decision("repacked experts", all_bytes, "disk",
                                  f"--expert-format {spec.format_key}: the {N:,} experts {how} ({REPACK_DIR_HINT}, "
                                  "or --repack-dir), reused on later starts"))
    if slots < N:
        src = ("the repacked file holds" if converted else
               "the shards on disk hold" if spec.weights_present else "the shards (once downloaded) hold")
        decisions.append(Decision("disk tier", all_bytes, "disk",
                                  f"{src} every expert ({gib(all_bytes)}); read at {diskbw:g} GB/s "
                                  f"({'given' if prefs.disk_read_gbps else 'assumed NVMe'})"))

    # Disk: a model that is not (fully) downloaded needs room for the rest of it, and converted experts for the
    # repacked file (counted on the same disk; an existing file is reused, so a second start needs nothing).
    disk_free = hw.disk.free_bytes if hw.disk else None
    download = 0 if spec.weights_present else max(0, spec.checkpoint_bytes - spec.present_bytes)
    disk_need = download + (all_bytes if to_write else 0)
    where = hw.disk.describe() if hw.disk else "disk"
    if download:
        decisions.append(Decision("download", download, "disk",
                                  f"{gib(download)} of weights to download"
                                  f"{'' if disk_free is None else f'; {gib(disk_free)} free on {where}'}"))
    if disk_need and disk_free is not None and disk_free < disk_need:
        fixes = [f"free {gib(disk_need - disk_free)} on {where}"]
        if to_write:
            fixes.append(f"--repack-dir on a disk with {gib(all_bytes)} free")
            if download <= disk_free:
                fixes.append("the native format (no repacked file)")
        if download > disk_free and spec.format_key == "dense" and spec.expert_bits >= 16:
            fixes.append(f"an FP8 checkpoint of this model, where one is published (about "
                         f"{gib(spec.fp8_checkpoint_bytes())}; moechat loads block-FP8 as shipped)")
        fixes.append(f"--disk-gb {math.ceil(disk_need / GiB)} to plan for a disk with that much free")
        if download and to_write:
            needs = f"the download ({gib(download)}) and the repacked experts ({gib(all_bytes)}) need"
        else:
            needs = "the download needs" if download else "the repacked experts need"
        refusal_parts.append(Refusal("disk", disk_need, disk_free, tuple(fixes),
                                     detail=f"{needs} {gib(disk_need)}, {gib(disk_free)} free on {where}"))
    if not download and disk_free is not None and hw.disk:
        notes.append(f"weights already on disk ({gib(spec.checkpoint_bytes)}): no disk needed for them; "
                     f"{gib(disk_free)} free on {where}")

    refusal = None
    if refusal_parts:
        first = refusal_parts[0]
        refusal = replace(first, also=tuple(r.message for r in refusal_parts[1:]))
    overridden = refusal is not None and prefs.override
    decode = None
    if refusal is None or overridden:
        decode = _decode(spec, kind, context, slots, ram_experts if gpu else 0, link, devbw, diskbw,
                         prefs.hit_curve, None if gpu else prefs.cpu_layer_s)
        hit = (f"{decode.hit_rate_low:.1%}" if decode.hit_rate_low == decode.hit_rate_high
               else f"{decode.hit_rate_low:.1%}-{decode.hit_rate_high:.1%}")
        decisions.append(Decision("expected hit rate", None, "-", f"{hit} at C = {slots:,} ({frac:.1%} of experts): "
                                  f"{decode.hit_source}"))
    placements: tuple[MissPlacement, ...] = ()
    hostbw = prefs.host_read_gbps or ASSUMED_RAM_GBPS
    host_src = prefs.host_read_source or ("given" if prefs.host_read_gbps else "assumed")
    if decode is not None and gpu and slots < N and ram_experts:
        placements = _placements(spec, decode, hostbw)
    load_decode = decode
    if placements:  # the headline, the formats and --json all predict the mode `run` will use
        chosen = next(p for p in placements if p.mode == prefs.on_miss)
        decode = replace(decode, low=chosen.low, high=chosen.high, bound=chosen.bound, bound_by=chosen.bound_by,
                         on_miss=chosen.mode)
    if decode is not None:
        moved = []
        if load_decode.link_bytes_low:
            moved.append(f"{load_decode.link_bytes_high / GB:.2f}-{load_decode.link_bytes_low / GB:.2f} GB over the "
                         f"{link:.3g} GB/s link" + ("" if decode.on_miss in (None, "load") else " if every miss loads"))
        if decode.disk_bytes_low:
            moved.append(f"{decode.disk_bytes_high / GB:.2f}-{decode.disk_bytes_low / GB:.2f} GB from disk")
        mode = "" if decode.on_miss is None else f" with --on-miss {decode.on_miss}"
        decisions.append(Decision("decode", None, "-",
                                  f"{rate_range(decode.low, decode.high)} tok/s predicted{mode}; bound "
                                  f"{rate(decode.bound)} tok/s ({decode.bound_by}); per token "
                                  f"{decode.device_bytes / GB:.2f} GB of {dev_label} reads at "
                                  f"{decode.device_gbps:.0f} GB/s"
                                  + (f" ({spec.format_key} experts compute at {decode.compute_efficiency:.0%} of "
                                     "that rate today)" if decode.compute_efficiency < 1 else "")
                                  + ("; " + ", ".join(moved) if moved else "")))
    if placements:
        load, host_p = placements[0], placements[1]
        decisions.append(Decision("where misses run", None, "-",
                                  f"load {rate_range(load.low, load.high)} tok/s (bound {rate(load.bound)}, "
                                  f"{load.bound_by})"
                                  f" | host {rate_range(host_p.low, host_p.high)} (bound {rate(host_p.bound)}, "
                                  f"{host_p.bound_by}; {host_p.host_experts:.0f} experts/token on the CPU at "
                                  f"{hostbw:.3g} GB/s, {host_src}) | auto: per miss the cheaper, "
                                  f"at least the better ({rate_range(placements[2].low, placements[2].high)})"))
    if overridden:
        decisions.append(Decision("override", None, "-", f"loading anyway as asked: {refusal.message}"))
    return MemoryPlan(
        model=spec.name, device=dev_label, device_name=dev_name, context=context, expert_slots=slots,
        total_experts=N, expert_bytes=eb, host_tier=host, ram_cache_bytes=ram_cache, dense_bytes=dense, kv_bytes=kv,
        workspace_bytes=ws, device_budget_bytes=budget, device_used_bytes=dev_used, ram_budget_bytes=ram_budget,
        ram_used_bytes=ram_used, disk_free_bytes=disk_free, disk_needed_bytes=disk_need, decisions=tuple(decisions),
        decode=decode, refusal=refusal, overridden=overridden, estimated=spec.estimated, notes=tuple(notes),
        placements=placements, embeddings=prefs.embeddings)


def _choose_embeddings(spec: ModelSpec, hw: Hardware, prefs: Preferences) -> MemoryPlan:
    """A GPU with an untied embedding table: plan it on the device and on the host, keep the host plan when it has
    more slots (and is not refused where the device plan is not), and say the trade in slots and tok/s."""
    dev = make_plan(spec, hw, replace(prefs, embeddings="device"))
    host = make_plan(spec, hw, replace(prefs, embeddings="host"))
    use_host = host.expert_slots > dev.expert_slots and (host.ok or not dev.ok)
    pick = host if use_host else dev

    def speed(p: MemoryPlan) -> str:
        return f"{rate_range(p.decode.low, p.decode.high)} tok/s" if p.decode is not None else "no estimate"

    gained = host.expert_slots - dev.expert_slots
    if use_host:
        row = spec.hidden_size * spec.float_bytes
        why = (f"{gib(spec.embedding_bytes)} table in RAM, each token's row ({row:,} B) "
               f"gathered there and copied in: +{gained} slots ({dev.expert_slots} -> {host.expert_slots}), "
               f"{speed(dev)} -> {speed(host)}; --embeddings device keeps it on the GPU")
    elif gained <= 0:
        why = f"on the device: every expert already fits, or moving the {gib(spec.embedding_bytes)} table buys no slot"
    else:
        why = (f"on the device: in RAM it would buy {gained} slots but {host.refusal.message if host.refusal else ''}"
               if not host.ok else f"on the device ({speed(dev)}; host would give {speed(host)})")
    line = Decision("embeddings", spec.embedding_bytes, "cpu" if use_host else pick.device, why)
    return replace(pick, decisions=(*pick.decisions, line))


def _device_refusal(spec: ModelSpec, hw: Hardware, prefs: Preferences, gpu: GpuInfo | None, budget: int,
                    need: int, want: int, auto_ctx: bool, ctx_fit: int | None, c_min: int) -> Refusal:
    """Short of device memory: the fixes, cheapest first."""
    short = need - budget
    fixes = []
    if not auto_ctx and ctx_fit is not None:
        fixes.append(f"lower --context to {ctx_fit:,}")
    if gpu is not None:
        others = (gpu.total_bytes or 0) - (gpu.free_bytes or 0)
        if others >= short:
            fixes.append(f"close programs using the GPU (they hold {gib(others)})")
        if prefs.device != "cpu":
            cpu_plan = make_plan(spec, hw, replace(prefs, device="cpu", override=False))
            if cpu_plan.ok:
                fixes.append(f"run on the CPU (--device cpu): RAM holds it, ~"
                             f"{rate_range(cpu_plan.decode.low, cpu_plan.decode.high)} tok/s")
    if spec.format_key == "dense" and spec.converted_from is None:  # converting is measured from full precision
        for name in CONVERTIBLE_FORMATS:
            try:
                small = spec.in_format(name).expert_bytes
            except ConfigError:
                continue
            if c_min * (spec.expert_bytes - small) >= short:
                fixes.append(f"--expert-format {name} ({gib(small)} an expert instead of {gib(spec.expert_bytes)})")
                break
    what = "GPU" if gpu is not None else "machine"
    fixes.append(f"a {what} with at least {gib(need + prefs.margin * ((gpu.total_bytes or 0) if gpu else 0))} "
                 f"{'free VRAM' if gpu is not None else 'of available RAM'}")
    resource = "VRAM" if gpu is not None else "RAM"
    ctx = min(want, MIN_CONTEXT) if auto_ctx else want
    detail = (f"dense {gib(spec.dense_bytes)} + KV for {ctx:,} tokens + workspace + {c_min} expert "
              f"slot{'' if c_min == 1 else 's'} need "
              f"{gib(need)}, the budget is {gib(budget)}")
    return Refusal(resource, need, max(0, budget), tuple(fixes), detail=detail)
