"""The model spec: the sizes that matter for planning, in one frozen `ModelSpec`.

Dense bytes, bytes per expert per named tensor in its stored format, MoE layers x experts x top-k, KV elements per
token (GQA, MLA's latent cache, sliding-window layers), shared experts. Read from the safetensors headers when the
weights are on disk (exact, `spec_headers.py`), else estimated from `config.json` and its `quantization_config`
(labelled estimates, `spec_config.py`). Pure Python over numbers: no torch, no device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..errors import ConfigError
from ..units import GiB, MiB

DEFAULT_CONTEXT = 4096  # what `moechat run` allocates when --context is not given (engine/runtime/generate.py)
# Expert formats moechat converts a checkpoint's experts into (`--expert-format`), kept equal to
# engine/quant/registry.py's CONVERTIBLE by a test; int4 groups along the input as engine/quant/intq.py does.
CONVERTIBLE_FORMATS = ("int8", "int4")
INT4_GROUPS = (32, 16, 8)

FLOAT_SIZES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}
FLOAT_DTAGS = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
DTAG_OF_SIZE = {4: "F32", 2: "BF16"}


def gib(n: float | None) -> str:
    if n is None:
        return "?"
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


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


UNGATED_EXPERTS = ("nemotron_h",)  # relu^2 over the up projection alone: w13 is [I, H] (models/base.py gated_experts)


def packed_expert_tensors(name: str, hidden: int, inter: int, float_bytes: int, bias: bool,
                          gated: bool = True) -> tuple[TensorSpec, ...]:
    """One expert as `--expert-format int8|int4` stores it (engine/quant/intq.py's layout, byte for byte):
    int8: q [out, in] + fp32 scale [out] per projection; int4: q [out, in/2] (two codes a byte) + fp16 scale
    [out, in/group] (4.5 bits a weight in groups of 32); biases, when the model has them, in the compute dtype.
    w13 is [2I, H] (gate and up), or [I, H] for ungated experts (`gated=False`); w2 [H, I]."""
    if name not in CONVERTIBLE_FORMATS:
        raise ConfigError(f"--expert-format {name!r}: use native or one of {', '.join(CONVERTIBLE_FORMATS)}")
    up = (2 if gated else 1) * inter
    out: list[TensorSpec] = []
    for which, (rows, cols) in (("w13", (up, hidden)), ("w2", (hidden, inter))):
        if name == "int8":
            out += [TensorSpec(f"{which}_q", (rows, cols), "I8", rows * cols),
                    TensorSpec(f"{which}_scale", (rows,), "F32", 4 * rows)]
        else:
            groups = cols // int4_group(cols)
            out += [TensorSpec(f"{which}_q", (rows, cols // 2), "U8", rows * (cols // 2)),
                    TensorSpec(f"{which}_scale", (rows, groups), "F16", 2 * rows * groups)]
    if bias:
        tag = DTAG_OF_SIZE.get(float_bytes, "BF16")
        out += [TensorSpec("w13_bias", (up,), tag, up * float_bytes),
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
    dense_format: str = "native"  # "int8" | "int4": attention projections held so, the LM head in int8 (--dense-format)
    # Recurrent layers (Gated DeltaNet, Mamba-2): their state is the same size at any context; counted with the
    # snapshots engine/layers/kv_cache.py keeps for prefix reuse (1 + MAX_SNAPSHOTS copies)
    recurrent_state_bytes: int = 0
    recurrent_detail: str = ""
    # K/V elements per context position that one attention layer's CPU prefill holds expanded to every query head
    # (engine/models/base.py repeats GQA's K/V for SDPA's flash kernel; MLA expands its latents into per-head keys
    # and values): 0 where the cached K/V are used as they are
    prefill_kv_expanded_elems: int = 0

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
                                        self.has_expert_bias, gated=self.model_type not in UNGATED_EXPERTS)
        label = ("int8 (per output channel, fp32 scales)" if name == "int8" else
                 f"int4 (groups of {int4_group(self.hidden_size)}, fp16 scales)")
        return replace(self, expert_tensors=tensors, expert_format=label, converted_from=self.expert_format_name,
                       notes=self.notes + (f"experts converted to {name} once, into a repacked file "
                                           f"(--expert-format {name})",))

    def in_dense_format(self, name: str | None) -> ModelSpec:
        """The same model as `--dense-format int8|int4` holds it (quant/dense_quant.py): attention's projections (GQA;
        MLA keeps its layout) in int8 (a byte a weight plus an fp32 scale per output row) or int4 (half a byte plus
        an fp16 scale per group of 32 inputs: 4.5 bits), the LM head in int8 under either; a tied LM head gets its own
        int8 copy beside the embedding table, which stays for lookups."""
        if name in (None, "native"):
            return self
        fb = max(1, self.float_bytes)

        def int8(nbytes: int) -> int:
            elems = nbytes // fb
            return elems + 4 * max(1, elems // max(1, self.hidden_size))  # + a scale per row of H inputs

        def int4(nbytes: int) -> int:
            elems = nbytes // fb
            group = int4_group(self.hidden_size) if self.hidden_size % 8 == 0 else 32  # (run refuses the latter)
            return elems // 2 + 2 * max(1, elems // group)  # + an fp16 scale a group

        attention = int4 if name == "int4" else int8
        parts = []
        for what, b in self.dense_parts:
            if what == "lm_head":
                b = int8(b)
            elif (what == "attention" and self.kv_kind != "MLA latent") or what == "Mamba-2 layers":
                b = attention(b)  # Nemotron-H's in/out projections too (its conv and per-head scalars, 0.1%, alike)
            parts.append((what, b))
        embedding = self.embedding_bytes
        if not any(what == "lm_head" for what, _ in self.dense_parts):  # tied: the table is now only looked up
            embedding = dict(self.dense_parts).get("embeddings", 0)
            parts.append(("lm_head", int8(embedding)))
        held = "attention projections in int4 and the LM head in int8" if name == "int4" else \
            "attention projections and the LM head in int8"
        return replace(self, dense_parts=tuple(parts), dense_format=name, embedding_bytes=embedding,
                       notes=self.notes + (f"{held} (--dense-format {name})",))

    def for_gpu(self) -> ModelSpec:
        """The spec as a GPU holds the model (where that differs from a CPU: a GGUF's packed head and table)."""
        return self

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

