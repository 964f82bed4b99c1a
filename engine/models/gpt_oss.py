"""GPT-OSS (`model_type: gpt_oss`): openai/gpt-oss-20b and gpt-oss-120b, MXFP4 experts as shipped.

Attention with q/k/v/o biases, GQA, a learned per-head sink logit joined to the softmax and dropped after
it, layers alternating a 128-token sliding window and full attention (`layer_types`), YaRN RoPE. The
router is a linear with a bias; top-k on the logits, softmax over the k chosen. Experts interleave gate
and up rows in one projection (even rows gate, odd rows up), carry biases on both projections, and use a
clamped SwiGLU. gpt-oss-20b: 24 layers x 32 experts, top-4, H = I = 2880: one expert is 13.2 MB of MXFP4
codes and scales (12.4 MB codes + 0.8 MB scales, plus 17 KB of bf16 biases) where bf16 would take 49.8 MB.

Only MXFP4 checkpoints are read (the Hub's form); the experts stay MXFP4 in every tier (engine/quant).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..io.validate import Rule, cfg
from ..layers.moe import ExpertActivation
from .base import BaseModelArgs, ExpertNaming, MoEForCausalLM, SparseMoeBlock

_EXPERTS = "model.layers.{layer}.mlp.experts."


@dataclass
class GptOssArgs(BaseModelArgs):
    aliases: ClassVar[dict[str, str]] = {"num_experts": "num_local_experts",
                                         "experts_per_token": "num_experts_per_tok"}
    attention_sinks: ClassVar[bool] = True
    expert_bias: ClassVar[bool] = True
    norm_in_fp32: ClassVar[bool] = True  # transformers keeps GPT-OSS's norms in fp32 (_keep_in_fp32_modules)
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    intermediate_size: int = 0
    swiglu_limit: float = cfg(7.0, gt=0)
    swiglu_alpha: float = cfg(1.702, gt=0)
    layer_types: list | None = cfg(None, items=Rule("str", choices=("sliding_attention", "full_attention")))
    attention_bias: bool = True
    sliding_window: int | None = 128
    quantization_config: dict | None = None

    def __post_init__(self):
        if self.rope_theta is None and not (self.rope_parameters or {}).get("rope_theta"):
            self.rope_theta = 150000.0  # transformers' default_theta for gpt_oss
        if not self.rope_parameters and not self.rope_scaling:
            # transformers' GptOssConfig default when the config names no RoPE scaling
            self.rope_parameters = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 4096}
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                for i in range(self.num_hidden_layers)]

    @property
    def checkpoint_dtype(self) -> str | None:
        # The Hub's config names no dtype; its dense weights are bf16 (float32 would double them to 6.7 GB).
        return super().checkpoint_dtype or "bfloat16"

    @property
    def num_experts(self) -> int:
        return self.num_local_experts

    @property
    def top_k(self) -> int:
        return self.num_experts_per_tok

    @property
    def moe_intermediate(self) -> int:
        return self.intermediate_size

    @property
    def renormalize(self) -> bool:
        return True  # softmax over the top-k logits

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


class GptOssMoeBlock(SparseMoeBlock):
    router_attr = "router"
    router_bias = True

    @classmethod
    def activation_for(cls, args: GptOssArgs) -> ExpertActivation:
        return ExpertActivation("clamped_swiglu", limit=float(args.swiglu_limit), alpha=float(args.swiglu_alpha))


class GptOssForCausalLM(MoEForCausalLM):
    args_class = GptOssArgs
    moe_attr = "mlp"
    qk_norm = None
    moe_block = GptOssMoeBlock
    expert_naming = ExpertNaming(packed={
        "mxfp4": {
            "w13_blocks": _EXPERTS + "gate_up_proj_blocks",  # [E, 2I, H/32, 16] U8, rows gate/up interleaved
            "w13_scales": _EXPERTS + "gate_up_proj_scales",  # [E, 2I, H/32] U8
            "w13_bias": _EXPERTS + "gate_up_proj_bias",  # [E, 2I]
            "w2_blocks": _EXPERTS + "down_proj_blocks",  # [E, H, I/32, 16] U8
            "w2_scales": _EXPERTS + "down_proj_scales",  # [E, H, I/32] U8
            "w2_bias": _EXPERTS + "down_proj_bias",  # [E, H]
        },
    })
