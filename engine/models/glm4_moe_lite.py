"""GLM-4.7-Flash (`model_type: glm4_moe_lite`): GLM's small MoE with DeepSeek's multi-head latent attention.

DeepSeek-V3's layout (engine/models/deepseek_v3.py): MLA with a low-rank query (engine/models/mla.py, the latent as
the KV cache), interleaved RoPE pairs (`rope_interleave`, true by default), sigmoid routing with
`e_score_correction_bias` for the choice, renormalised and times `routed_scaling_factor` (1.8), one shared
expert, the first layer dense. What differs is the config: which layers are dense comes from `mlp_layer_types`
("dense" / "sparse" per layer; transformers' default, one dense layer then sparse ones, when the file has none;
`first_k_dense_replace` is read only when `mlp_layer_types` is absent, and agrees with it on the Hub's file), and
the defaults are GLM-4.7-Flash's. The checkpoint's multi-token-prediction layer (index num_hidden_layers,
`num_nextn_predict_layers` 1) is never read; `moechat fit` counts its bytes as unused.

GLM-4.7-Flash: 46 MoE layers x 64 experts, top-4, I = 1536, one shared expert: one routed expert is
3 x 1536 x 2048 x 2 B = 18 MiB in bf16, and the 2944 of them are 52.9 GiB of its ~58 GiB of weights; the latent
cache is 47 x (512 + 64) x 2 B = 52.9 KiB a token (expanded K/V would be 20 heads x (256 + 256) values: 940 KiB).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .base import MoEForCausalLM
from .deepseek_v2 import DEEPSEEK_EXPERTS
from .deepseek_v3 import DeepseekV3Args, DeepseekV3MoeBlock
from .mla import MLAttention


@dataclass
class Glm4MoeLiteArgs(DeepseekV3Args):
    # transformers' Glm4MoeLiteConfig defaults, for keys a config leaves out
    n_shared_experts: int | None = 1
    routed_scaling_factor: float = 1.8
    n_group: int | None = 1
    topk_group: int | None = 1
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1
    q_lora_rank: int | None = 768
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    rope_interleave: bool = True
    partial_rotary_factor: float | None = None
    mlp_layer_types: list[str] | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.mlp_layer_types is not None:
            L = self.num_hidden_layers
            if len(self.mlp_layer_types) != L or not set(self.mlp_layer_types) <= {"dense", "sparse"}:
                raise ConfigError(f"config.json: mlp_layer_types must have one entry per layer ({L}), each \"dense\" "
                                  f"or \"sparse\"; found {self.mlp_layer_types[:8]!r} ({len(self.mlp_layer_types)})")
        factor = self.rope.get("partial_rotary_factor", self.partial_rotary_factor)
        if factor is not None and float(factor) != 1.0:  # MLA's RoPE part is qk_rope_head_dim already
            raise ConfigError(f"config.json: partial_rotary_factor {factor!r} is not allowed for glm4_moe_lite: MLA "
                              "rotates all qk_rope_head_dim dims (1.0, as GLM-4.7-Flash's config says)")

    def is_moe_layer(self, layer: int) -> bool:
        if self.n_routed_experts <= 0:
            return False
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[layer] == "sparse"
        return layer >= self.first_k_dense_replace


class Glm4MoeLiteForCausalLM(MoEForCausalLM):
    args_class = Glm4MoeLiteArgs
    moe_attr = "mlp"
    moe_block = DeepseekV3MoeBlock
    attention = MLAttention
    expert_naming = DEEPSEEK_EXPERTS
    fp32_weights = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")


ARCHITECTURES = {"glm4_moe_lite": Glm4MoeLiteForCausalLM}
