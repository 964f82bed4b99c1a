"""GLM-4.5 (`model_type: glm4_moe`): GLM-4.5, GLM-4.5-Air (and GLM-4.6 of the same shape).

GQA attention with biases on q/k/v (none on o), optional per-head q/k RMSNorm (`use_qk_norm`), RoPE on the
first half of each head only (`partial_rotary_factor`, 0.5 by default); the first `first_k_dense_replace`
layers are dense; MoE layers route as DeepSeek-V3 does (sigmoid scores, `e_score_correction_bias` for the
choice, groups, `routed_scaling_factor`) and add `n_shared_experts` always-on experts kept on the compute
device. The checkpoint's multi-token-prediction layer (index num_hidden_layers) is never read.
GLM-4.5-Air: 45 MoE layers x 128 experts, top-8, I = 1408, one shared expert: one routed expert is
3 x 1408 x 4096 x 2 B = 33 MiB in bf16, and the 5760 of them are 186 GiB of its ~199 GiB of weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..errors import ConfigError
from .base import BaseModelArgs, MoEForCausalLM
from .deepseek_v2 import DEEPSEEK_EXPERTS
from .deepseek_v3 import DeepseekV3MoeBlock


@dataclass
class Glm4MoeArgs(BaseModelArgs):
    aliases: ClassVar[dict[str, str]] = {"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts"}
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    intermediate_size: int = 0
    # transformers' Glm4MoeConfig defaults, for keys a config leaves out
    n_shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    use_qk_norm: bool = False
    partial_rotary_factor: float = 0.5
    num_nextn_predict_layers: int = 0  # MTP layers after the last layer: in the checkpoint, unused here

    def __post_init__(self):
        super().__post_init__()
        self.n_group, self.topk_group = self.n_group or 1, self.topk_group or 1
        E, G = self.n_routed_experts, self.n_group
        if self.grouped and (E % G or not 0 < self.topk_group <= G
                             or self.num_experts_per_tok > self.topk_group * (E // G)):
            raise ConfigError(f"config.json: group-limited routing needs n_routed_experts ({E}) divisible by "
                              f"n_group ({G}), 0 < topk_group ({self.topk_group}) <= n_group, and top-k "
                              f"({self.num_experts_per_tok}) <= topk_group x experts per group")
        R = self.rotary_dim
        if not 0 < R <= self.head_dim or R % 2:
            raise ConfigError(f"config.json: partial_rotary_factor gives {R} rotary dims of a {self.head_dim}-dim "
                              "head; it must be an even number between 2 and head_dim")

    @property
    def rotary_dim(self) -> int:
        # transformers 5 keeps the factor in rope_parameters, older configs at the top level
        return int(self.head_dim * float(self.rope.get("partial_rotary_factor", self.partial_rotary_factor)))

    @property
    def attention_out_bias(self) -> bool:
        return False

    @property
    def grouped(self) -> bool:
        return self.n_group > 1

    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

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
    def scaling_factor(self) -> float:
        return float(self.routed_scaling_factor)

    @property
    def shared_intermediate(self) -> int:
        return self.moe_intermediate_size * (self.n_shared_experts or 0)

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace


class Glm4MoeForCausalLM(MoEForCausalLM):
    args_class = Glm4MoeArgs
    moe_attr = "mlp"
    moe_block = DeepseekV3MoeBlock
    expert_naming = DEEPSEEK_EXPERTS
    fp32_weights = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")

    @classmethod
    def qk_norm_for(cls, args: Glm4MoeArgs) -> str | None:
        return "head" if args.use_qk_norm else None
