"""When a model does not fit one machine: how many GPUs of which size would serve it with vLLM or SGLang.

moechat runs one sequence on one machine; past that, the answer is an existing distributed engine with
expert parallelism (vLLM `--enable-expert-parallel`, SGLang `--ep-size`), and `moechat chat --remote`
in front of it. `moechat fit` prints this beside its refusal.

The estimate, per GPU size: the checkpoint's weights as they ship (vLLM and SGLang load MXFP4 and FP8
experts natively) plus the KV cache for `context` tokens (bf16), spread over N GPUs that each keep
10% free (vLLM's default --gpu-memory-utilization 0.9) and 3 GiB for activations, CUDA graphs and the
NCCL buffers. N is rounded up to a power of two (tensor parallelism must divide the attention heads)
and capped at 8 per node; more than 8 is several nodes (`--pipeline-parallel-size` / `--nnodes`).
DeepSeek-V3 (671B, FP8, 32k context): 8 x 141 GiB (one H200 node) or 16 x 80 GiB (two H100 nodes).

Pure Python over numbers (ModelSpec), like engine/plan/.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..units import GiB

UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
RESERVE = 3 * GiB  # per GPU: activations, CUDA graphs, NCCL
GPUS_PER_NODE = 8
SERVE_CONTEXT = 32768  # what a server is planned for, when the model allows it
# (GiB of memory, examples): the data-centre and workstation sizes people rent or own
GPU_SIZES = ((24, "RTX 4090 / L4"), (48, "L40S / RTX 6000 Ada"), (80, "H100 / A100 80GB"), (141, "H200"),
             (192, "B200 / MI300X"))


@dataclass(frozen=True)
class ScaleOutOption:
    gpu_gib: int
    examples: str
    gpus: int  # total, a power of two
    nodes: int
    per_gpu_bytes: int  # weights + KV each GPU holds

    def describe(self) -> str:
        where = f"{self.nodes} nodes x {self.gpus // self.nodes}" if self.nodes > 1 else f"{self.gpus}"
        return f"{where} x {self.gpu_gib} GiB ({self.examples}): {self.per_gpu_bytes / GiB:.1f} GiB each"


@dataclass(frozen=True)
class ScaleOut:
    model: str
    context: int
    weights_bytes: int
    kv_bytes: int
    options: tuple[ScaleOutOption, ...]  # one per GPU size that can hold it in at most 4 nodes
    recommended: ScaleOutOption | None  # the fewest nodes, then the least GPU memory in all

    def vllm_command(self) -> str:
        o = self.recommended
        if o is None:
            return ""
        per_node = o.gpus // o.nodes
        cmd = (f"vllm serve {self.model} --tensor-parallel-size {per_node} --enable-expert-parallel "
               f"--max-model-len {self.context}")
        if o.nodes > 1:
            cmd += f" --pipeline-parallel-size {o.nodes}"
        return cmd

    def sglang_command(self) -> str:
        o = self.recommended
        if o is None:
            return ""
        cmd = (f"python -m sglang.launch_server --model-path {self.model} --tp {o.gpus} --ep-size {o.gpus} "
               f"--context-length {self.context}")
        if o.nodes > 1:
            cmd += f" --nnodes {o.nodes} --node-rank R --dist-init-addr HEAD:5000"
        return cmd

    def to_json(self) -> dict:
        o = self.recommended
        return {"model": self.model, "context": self.context, "weights_bytes": self.weights_bytes,
                "kv_bytes": self.kv_bytes,
                "options": [{"gpu_gib": x.gpu_gib, "gpus": x.gpus, "nodes": x.nodes,
                             "per_gpu_bytes": x.per_gpu_bytes, "examples": x.examples} for x in self.options],
                "recommended": None if o is None else {"gpu_gib": o.gpu_gib, "gpus": o.gpus, "nodes": o.nodes},
                "vllm": self.vllm_command(), "sglang": self.sglang_command()}


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def scale_out(spec, model: str, context: int | None = None) -> ScaleOut:
    """GPUs needed to serve `spec` (engine/plan.ModelSpec) with vLLM/SGLang; `model` is what they load (a Hub
    repo id or a path)."""
    ctx = min(context or SERVE_CONTEXT, spec.max_context)
    weights = int(spec.checkpoint_bytes - spec.unused_bytes)
    kv = int(spec.kv_bytes(ctx, 2))
    need = weights + kv
    options = []
    for size, examples in GPU_SIZES:
        usable = size * GiB * UTILIZATION - RESERVE
        gpus = _pow2(math.ceil(need / usable))
        nodes = max(1, gpus // GPUS_PER_NODE)
        if nodes <= 4:
            options.append(ScaleOutOption(size, examples, gpus, nodes, math.ceil(need / gpus)))
    best = min(options, key=lambda o: (o.nodes, o.gpus * o.gpu_gib, o.gpus)) if options else None
    return ScaleOut(model, ctx, weights, kv, tuple(options), best)
