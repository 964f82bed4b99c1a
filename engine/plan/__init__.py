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
49.8 MB), so an 8 GiB GPU holds 285 slots where bf16 would hold 76.

The package, by seam (each module imports only those above it):

* `spec.py`: `ModelSpec`, `TensorSpec`, the byte formulas of packed expert formats, `gib`.
* `spec_config.py`: `spec_from_config`, the labelled estimate from `config.json`.
* `spec_headers.py`: `spec_from_headers`, `gguf_spec`, `read_model_spec` (exact, from the files).
* `rates.py`: the rate model: `MissRatioCurve`, `DecodeEstimate`, `MissPlacement`, `rate`, `rate_range`.
* `memory_plan.py`: `Preferences`, `Decision`, `Refusal`, `PlanRefusedError`, `MemoryPlan`.
* `planner.py`: `make_plan`, its device choice, embeddings placement and refusals.
"""

from __future__ import annotations

from ..units import GB, GiB  # re-exported: callers have always taken the units from plan
from .memory_plan import (
    CONTEXT_STEP,
    CUDA_CONTEXT_BYTES,
    KV_WINDOWED_ALLOCATION,
    MIN_CONTEXT,
    ON_MISS_MODES,
    PREFILL_CHUNK,
    PROCESS_RAM_CPU,
    PROCESS_RAM_GPU,
    REPACK_DIR_HINT,
    Decision,
    MemoryPlan,
    PlanRefusedError,
    Preferences,
    Refusal,
)
from .planner import (
    make_plan,
)
from .rates import (
    EXPERT_COMPUTE_EFFICIENCY,
    GPU_EFFICIENCY,
    OVERHEAD_PER_LAYER_S,
    OVERHEAD_PER_MISS_S,
    TRACED_MISS_FACTOR,
    DecodeEstimate,
    MissPlacement,
    MissRatioCurve,
    compute_efficiency,
    rate,
    rate_range,
)
from .spec import (
    CONVERTIBLE_FORMATS,
    DEFAULT_CONTEXT,
    DTAG_OF_SIZE,
    FLOAT_DTAGS,
    FLOAT_SIZES,
    INT4_GROUPS,
    MiB,
    ModelSpec,
    TensorSpec,
    gib,
    int4_group,
    packed_expert_tensors,
)
from .spec_config import (
    spec_from_config,
)
from .spec_headers import (
    gguf_spec,
    read_model_spec,
    spec_from_headers,
)

__all__ = [
    "GB",
    "GiB",
    "CONTEXT_STEP",
    "CONVERTIBLE_FORMATS",
    "CUDA_CONTEXT_BYTES",
    "DEFAULT_CONTEXT",
    "DTAG_OF_SIZE",
    "Decision",
    "DecodeEstimate",
    "EXPERT_COMPUTE_EFFICIENCY",
    "FLOAT_DTAGS",
    "FLOAT_SIZES",
    "GPU_EFFICIENCY",
    "INT4_GROUPS",
    "KV_WINDOWED_ALLOCATION",
    "MIN_CONTEXT",
    "MemoryPlan",
    "MiB",
    "MissPlacement",
    "MissRatioCurve",
    "ModelSpec",
    "ON_MISS_MODES",
    "OVERHEAD_PER_LAYER_S",
    "OVERHEAD_PER_MISS_S",
    "PREFILL_CHUNK",
    "PROCESS_RAM_CPU",
    "PROCESS_RAM_GPU",
    "PlanRefusedError",
    "Preferences",
    "REPACK_DIR_HINT",
    "Refusal",
    "TRACED_MISS_FACTOR",
    "TensorSpec",
    "compute_efficiency",
    "gguf_spec",
    "gib",
    "int4_group",
    "make_plan",
    "packed_expert_tensors",
    "rate",
    "rate_range",
    "read_model_spec",
    "spec_from_config",
    "spec_from_headers",
]
