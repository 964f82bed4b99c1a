"""Mixtral (`model_type: mixtral`): Mixtral-8x7B / 8x22B and their instruct variants.

No q/k norm, softmax top-2 of 8 always renormalised, optional sliding-window attention. The MoE block
is `block_sparse_moe` with experts named w1 (gate), w3 (up), w2 (down). Mixtral-8x7B: one expert is
3 x 14336 x 4096 x 2 B = 352 MB in bf16, so 8 experts x 32 layers = 90 GB of the 94 GB model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import BaseModelArgs, ExpertNaming, MoEForCausalLM


@dataclass
class MixtralArgs(BaseModelArgs):
    aliases: ClassVar[dict[str, str]] = {"num_experts": "num_local_experts"}
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    intermediate_size: int = 0

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
        return True


class MixtralForCausalLM(MoEForCausalLM):
    args_class = MixtralArgs
    moe_attr = "block_sparse_moe"
    qk_norm = None
    expert_naming = ExpertNaming(
        gate="model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
        up="model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
        down="model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",
        fused_gate_up="model.layers.{layer}.mlp.experts.gate_up_proj",
        fused_down="model.layers.{layer}.mlp.experts.down_proj",
    )
