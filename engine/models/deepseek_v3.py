"""DeepSeek-V3 (`model_type: deepseek_v3`): DeepSeek-V3, V3-0324, V3.1, R1 (and other checkpoints of this shape).

DeepSeek-V2's layout (MLA with a low-rank query, first-k dense layers, shared experts) with V3's routing:
sigmoid scores, `e_score_correction_bias` added for the choice only (aux-loss-free balancing), the top-k within
the `topk_group` best of `n_group` groups (a group scores its two best experts), weights from the uncorrected
scores, renormalised (`norm_topk_prob`), times `routed_scaling_factor`. `rope_interleave` says the rope dims
are stored as interleaved pairs (true on the Hub). The checkpoint's multi-token-prediction layer (index
num_hidden_layers, `num_nextn_predict_layers`) is not part of the model and is never read.

DeepSeek-V3: 58 MoE layers x 256 experts, top-8 in 4 of 8 groups, I = 2048, one shared expert, shipped FP8
with 128 x 128 block scales (engine/quant/fp8.py): one routed expert is 3 x 2048 x 7168 B = 42 MiB + 10.5 KiB of
scales (84 MiB in bf16), and the 14,848 of them are 609 GiB of the 641 GiB checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.moe import grouped_choice, grouped_topk
from .base import MoEForCausalLM
from .deepseek_v2 import DEEPSEEK_EXPERTS, DeepseekV2Args, SharedExpertMoeBlock
from .mla import MLAttention


@dataclass
class DeepseekV3Args(DeepseekV2Args):
    # transformers' DeepseekV3Config defaults, for keys a config leaves out
    n_shared_experts: int | None = 1
    routed_scaling_factor: float = 2.5
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    n_group: int | None = 8
    topk_group: int | None = 4
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    q_lora_rank: int | None = 1536
    rope_interleave: bool = True
    num_nextn_predict_layers: int = 0  # MTP layers after the last layer: in the checkpoint, unused here

    topk_methods: ClassVar[tuple[str, ...]] = ("noaux_tc",)
    scoring: ClassVar[str] = "sigmoid"

    @property
    def grouped(self) -> bool:
        return self.n_group > 1

    @property
    def rope_interleaved(self) -> bool:
        return bool(self.rope_interleave)

    @property
    def renormalize(self) -> bool:
        return bool(self.norm_topk_prob)

    @property
    def scaling_factor(self) -> float:
        return float(self.routed_scaling_factor)


class DeepseekV3MoeBlock(SharedExpertMoeBlock):
    """Sigmoid routing with a correction bias in groups (DeepSeek-V3, GLM-4.5)."""

    def __init__(self, args, layer: int):
        super().__init__(args, layer)
        self.gate.e_score_correction_bias = nn.Parameter(torch.empty(args.num_experts))
        self.n_group = args.n_group if args.grouped else 1
        self.topk_group = args.topk_group if args.grouped else 1
        self.scaling_factor = args.scaling_factor

    def finalize(self) -> None:
        super().finalize()
        self.correction_bias = self.gate.e_score_correction_bias.detach()  # [E], fp32

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        router_logits = F.linear(x.float(), self.gate_weight)  # [T, E] in fp32, as transformers
        return grouped_topk(router_logits, self.top_k, self.n_group, self.topk_group, scoring="sigmoid",
                            correction_bias=self.correction_bias, renormalize=self.renormalize,
                            routed_scaling_factor=self.scaling_factor)

    def choice_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The router's fp32 logits [T, E] -> what its top-k is taken over (sigmoid + correction bias, the groups
        outside the best `topk_group` at -inf): what the prefetcher ranks."""
        return grouped_choice(logits, self.n_group, self.topk_group, scoring="sigmoid",
                              correction_bias=self.correction_bias)[1]


class DeepseekV3ForCausalLM(MoEForCausalLM):
    args_class = DeepseekV3Args
    moe_attr = "mlp"
    moe_block = DeepseekV3MoeBlock
    attention = MLAttention
    expert_naming = DEEPSEEK_EXPERTS
    fp32_weights = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")
