"""Qwen3-MoE (`model_type: qwen3_moe`): Qwen3-30B-A3B, Qwen3-235B-A22B and their -2507 updates.

Per-head q/k RMSNorm, softmax top-k routing with optional renormalisation (`norm_topk_prob`), and
optionally dense layers (`mlp_only_layers`, `decoder_sparse_step`). Qwen3-30B-A3B: 48 layers x 128
experts, top-8, I=768: one expert is 3 x 768 x 2048 x 2 B = 9.4 MB in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .base import BaseModelArgs, ExpertNaming, MoEForCausalLM


@dataclass
class Qwen3MoeArgs(BaseModelArgs):
    aliases: ClassVar[dict[str, str]] = {"num_local_experts": "num_experts"}
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    use_sliding_window: bool = False

    @property
    def top_k(self) -> int:
        return self.num_experts_per_tok

    @property
    def moe_intermediate(self) -> int:
        return self.moe_intermediate_size

    @property
    def renormalize(self) -> bool:
        return bool(self.norm_topk_prob)

    @property
    def attention_window(self) -> int | None:
        return self.sliding_window if self.use_sliding_window else None

    def is_moe_layer(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    args_class = Qwen3MoeArgs
    moe_attr = "mlp"
    qk_norm = "head"
    expert_naming = ExpertNaming(
        gate="model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
        up="model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
        down="model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",
        fused_gate_up="model.layers.{layer}.mlp.experts.gate_up_proj",
        fused_down="model.layers.{layer}.mlp.experts.down_proj",
    )
