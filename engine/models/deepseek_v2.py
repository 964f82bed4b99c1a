"""DeepSeek-V2 (`model_type: deepseek_v2`): DeepSeek-V2, V2-Lite, V2.5 and DeepSeek-Coder-V2.

Multi-head latent attention (engine/models/mla.py; V2-Lite has no low-rank query) with YaRN RoPE on the
interleaved rope dims; the first `first_k_dense_replace` layers are dense; each MoE layer has
`n_shared_experts` always-on experts (one MLP n_shared times as wide, a dense weight that stays on the compute
device) beside the routed ones. Routing: softmax over the fp32 router logits, then top-k (`greedy`) or top-k
within the `topk_group` best of `n_group` groups (`group_limited_greedy`), weights times
`routed_scaling_factor`. DeepSeek-V2-Lite: 26 MoE layers x 64 experts, top-6, I = 1408, 2 shared experts:
one routed expert is 3 x 1408 x 2048 x 2 B = 16.5 MiB in bf16; the 1664 of them are 26.8 GiB of the 29.3 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..errors import ConfigError, UnsupportedModelError
from ..layers.moe import ExpertProvider, grouped_topk
from .base import MLP, BaseModelArgs, ExpertNaming, MoEForCausalLM, SparseMoeBlock
from .mla import MLAttention

_EXPERTS = "model.layers.{layer}.mlp.experts."

# The routed experts of the Hub's checkpoints, one tensor per expert (and transformers 5's fused layout)
DEEPSEEK_EXPERTS = ExpertNaming(
    gate=_EXPERTS + "{expert}.gate_proj.weight",
    up=_EXPERTS + "{expert}.up_proj.weight",
    down=_EXPERTS + "{expert}.down_proj.weight",
    fused_gate_up=_EXPERTS + "gate_up_proj",
    fused_down=_EXPERTS + "down_proj",
)


@dataclass
class DeepseekV2Args(BaseModelArgs):
    aliases: ClassVar[dict[str, str]] = {"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts"}
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    intermediate_size: int = 0
    n_shared_experts: int | None = None
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mlp_bias: bool = False

    topk_methods: ClassVar[tuple[str, ...]] = ("greedy", "group_limited_greedy")
    scoring: ClassVar[str] = "softmax"

    def __post_init__(self):
        self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim  # q and k; values are v_head_dim
        self.num_key_value_heads = self.num_attention_heads  # MLA has no KV heads (configs carry any number)
        super().__post_init__()
        if self.topk_method not in self.topk_methods:
            raise UnsupportedModelError(f"config.json: {self.model_type} topk_method {self.topk_method!r} is not "
                                        f"supported (moechat has {', '.join(self.topk_methods)})")
        if self.scoring_func != self.scoring:
            raise UnsupportedModelError(f"config.json: {self.model_type} scoring_func {self.scoring_func!r} is not "
                                        f"supported (moechat has {self.scoring})")
        if self.mlp_bias:
            raise UnsupportedModelError("config.json: mlp_bias is not supported (no DeepSeek checkpoint has it)")
        self.n_group, self.topk_group = self.n_group or 1, self.topk_group or 1
        if self.grouped:
            E, G = self.n_routed_experts, self.n_group
            if E % G or not 0 < self.topk_group <= G or self.num_experts_per_tok > self.topk_group * (E // G):
                raise ConfigError(f"config.json: group-limited routing needs n_routed_experts ({E}) divisible by "
                                  f"n_group ({G}), 0 < topk_group ({self.topk_group}) <= n_group, and top-k "
                                  f"({self.num_experts_per_tok}) <= topk_group x experts per group")
        if not self.moe_layer_freq or self.moe_layer_freq < 1:
            raise ConfigError(f"config.json: moe_layer_freq must be a positive integer, found {self.moe_layer_freq!r}")

    @property
    def grouped(self) -> bool:
        return self.topk_method == "group_limited_greedy" and self.n_group > 1

    @property
    def rope_interleaved(self) -> bool:
        return True  # V2 rotates (x0, x1), (x2, x3), ... as complex numbers

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
        # DeepSeek's own code renormalises only for top-k > 1, and then does not scale (transformers never
        # renormalises V2; every released V2 has norm_topk_prob false, where the two agree)
        return bool(self.norm_topk_prob) and self.num_experts_per_tok > 1

    @property
    def scaling_factor(self) -> float:
        return 1.0 if self.renormalize else float(self.routed_scaling_factor)

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def shared_intermediate(self) -> int:
        return self.moe_intermediate_size * (self.n_shared_experts or 0)

    def kv_cache_layout(self) -> tuple[int, int, int]:
        return 1, self.kv_lora_rank + self.qk_rope_head_dim, 0  # one latent + the shared RoPE key, no values

    def is_moe_layer(self, layer: int) -> bool:
        return (self.n_routed_experts > 0 and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)


class SharedExpertMoeBlock(SparseMoeBlock):
    """Routed experts through the provider plus always-on shared experts (a dense MLP on the compute device).

    The shared output joins the residual first, the routed experts then accumulate onto it."""

    def __init__(self, args, layer: int):
        super().__init__(args, layer)
        width = args.shared_intermediate
        self.shared_experts = MLP(args.hidden_size, width) if width else None

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if self.shared_experts is None else self.shared_experts.forward(x)  # [T, H]

    def forward(self, x: torch.Tensor, provider: ExpertProvider, residual: torch.Tensor) -> torch.Tensor:
        shared = self.shared(x)
        return super().forward(x, provider, residual if shared is None else residual + shared)


class DeepseekV2MoeBlock(SharedExpertMoeBlock):
    def __init__(self, args: DeepseekV2Args, layer: int):
        super().__init__(args, layer)
        self.n_group = args.n_group if args.grouped else 1
        self.topk_group = args.topk_group if args.grouped else 1
        self.scaling_factor = args.scaling_factor

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        router_logits = F.linear(x.float(), self.gate_weight)  # [T, E] in fp32, as transformers
        return grouped_topk(router_logits, self.top_k, self.n_group, self.topk_group, scoring="softmax",
                            renormalize=self.renormalize, routed_scaling_factor=self.scaling_factor)


class DeepseekV2ForCausalLM(MoEForCausalLM):
    args_class = DeepseekV2Args
    moe_attr = "mlp"
    moe_block = DeepseekV2MoeBlock
    attention = MLAttention
    expert_naming = DEEPSEEK_EXPERTS
    fp32_weights = (".mlp.gate.weight",)

