"""OLMoE (`model_type: olmoe`): allenai/OLMoE-1B-7B and its instruct variants.

q/k RMSNorm over the whole projection (not per head, unlike Qwen3), optional clip_qkv, softmax top-8
of 64 without renormalisation by default. One expert: 3 x 1024 x 2048 x 2 B = 12.6 MB in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import BaseModelArgs, ExpertNaming, MoEForCausalLM


@dataclass
class OlmoeArgs(BaseModelArgs):
    aliases: ClassVar[dict[str, str]] = {"num_local_experts": "num_experts"}
    num_experts: int = 0
    num_experts_per_tok: int = 0
    intermediate_size: int = 0
    norm_topk_prob: bool = False
    clip_qkv: float | None = None

    @property
    def top_k(self) -> int:
        return self.num_experts_per_tok

    @property
    def moe_intermediate(self) -> int:
        return self.intermediate_size

    @property
    def renormalize(self) -> bool:
        return bool(self.norm_topk_prob)

    @property
    def attention_window(self) -> int | None:
        return None  # transformers' OLMoE builds a plain causal mask whatever sliding_window says


class OlmoeForCausalLM(MoEForCausalLM):
    args_class = OlmoeArgs
    moe_attr = "mlp"
    qk_norm = "full"
    expert_naming = ExpertNaming(
        gate="model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
        up="model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
        down="model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",
        fused_gate_up="model.layers.{layer}.mlp.experts.gate_up_proj",
        fused_down="model.layers.{layer}.mlp.experts.down_proj",
    )
