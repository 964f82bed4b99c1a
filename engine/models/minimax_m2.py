"""MiniMax-M2 (`model_type: minimax_m2`): MiniMax-M2, M2.1 and M2.5.

Full GQA attention on every layer (`attn_type_list` all 1: none of MiniMax-01's lightning attention) with RMSNorm
over the whole q and k projections before the heads are split (`qk_norm_type: per_layer`, the "full" q/k norm of
engine/models/base.py), RoPE on the first `rotary_dim` (64) of each 128-dim head; every layer is MoE
(`block_sparse_moe`, experts w1/w3/w2 as Mixtral's) with a sigmoid router: experts chosen on sigmoid(logits) +
`e_score_correction_bias` (a tensor of the block, beside the gate; both kept in fp32), weighted by the uncorrected
scores renormalised to sum to 1. No shared expert (`shared_intermediate_size` 0). The release's config has an
`auto_map` to its own code; transformers has MiniMaxM2ForCausalLM natively, so no remote code is needed or run.
Its multi-token-prediction modules (`use_mtp`, `num_mtp_modules` x `mtp_transformer_layers`) are never read.

MiniMax-M2.5: 62 layers x 256 experts, top-8, I = 1536, H = 3072, shipped FP8 with 128 x 128 block scales
(engine/quant/fp8.py): one routed expert is 3 x 1536 x 3072 B = 13.5 MiB + 864 B of scales (27 MiB in bf16), and
the 15,872 of them are 209 GiB of the ~215 GiB checkpoint; KV is 62 x 2 x 8 x 128 x 2 B = 248 KiB a token. Its FP8
q/k/v/o (2.5 GiB with their scales) are dequantized to bf16 at load (loader.py): 5.1 GiB in memory, as fit counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, UnsupportedModelError
from ..layers.moe import grouped_choice, grouped_topk
from .base import BaseModelArgs, ExpertNaming, MoEForCausalLM, SparseMoeBlock


@dataclass
class MiniMaxM2Args(BaseModelArgs):
    aliases: ClassVar[dict[str, str]] = {"num_experts": "num_local_experts"}
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    intermediate_size: int = 0
    rotary_dim: int | None = None  # the release's spelling of partial rotary (transformers: partial_rotary_factor)
    partial_rotary_factor: float | None = None
    scoring_func: str = "sigmoid"
    use_routing_bias: bool = True
    use_qk_norm: bool = True
    qk_norm_type: str = "per_layer"
    shared_intermediate_size: int = 0
    attn_type_list: list[int] | None = None
    use_mtp: bool = False  # MTP modules in the checkpoint: never read here
    num_mtp_modules: int = 0
    mtp_transformer_layers: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.rotary_dim is None:
            factor = self.rope.get("partial_rotary_factor", self.partial_rotary_factor)
            self.rotary_dim = int(self.head_dim * float(1.0 if factor is None else factor))
        R = self.rotary_dim
        if not 0 < R <= self.head_dim or R % 2:
            raise ConfigError(f"config.json: rotary_dim {R} must be an even number between 2 and head_dim "
                              f"({self.head_dim})")
        checks = [(self.scoring_func == "sigmoid", f"scoring_func {self.scoring_func!r} (moechat has sigmoid)"),
                  (self.use_routing_bias, "use_routing_bias false (every release routes with its bias)"),
                  (self.use_qk_norm and self.qk_norm_type == "per_layer",
                   f"q/k norm {self.qk_norm_type!r} / use_qk_norm {self.use_qk_norm} (moechat has per_layer)"),
                  (not self.shared_intermediate_size, "a shared expert (shared_intermediate_size > 0)"),
                  (not self.attn_type_list or set(self.attn_type_list) == {1},
                   "lightning (linear) attention layers (attn_type_list has 0s; MiniMax-M2 is full attention)")]
        for ok, what in checks:
            if not ok:
                raise UnsupportedModelError(f"config.json: minimax_m2 with {what} is not supported")

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


class MiniMaxM2MoeBlock(SparseMoeBlock):
    """Sigmoid routing with the block's correction bias for the choice; top-k weights renormalised."""

    def __init__(self, args: MiniMaxM2Args, layer: int):
        super().__init__(args, layer)
        self.e_score_correction_bias = nn.Parameter(torch.empty(args.num_experts))

    def finalize(self) -> None:
        super().finalize()
        self.correction_bias = self.e_score_correction_bias.detach()  # [E], fp32

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # fp32 logits: the release stores the gate in fp32 (FP8's modules_to_not_convert), and vLLM routes in fp32;
        # transformers casts the gate to the model's dtype, which is the same thing in fp32
        router_logits = F.linear(x.float(), self.gate_weight)  # [T, E]
        return grouped_topk(router_logits, self.top_k, scoring="sigmoid", correction_bias=self.correction_bias,
                            renormalize=True)

    def choice_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The router's fp32 logits [T, E] -> what its top-k is taken over (sigmoid + correction bias): what the
        prefetcher ranks."""
        return grouped_choice(logits, scoring="sigmoid", correction_bias=self.correction_bias)[1]


class MiniMaxM2ForCausalLM(MoEForCausalLM):
    args_class = MiniMaxM2Args
    moe_attr = "block_sparse_moe"
    qk_norm = "full"
    moe_block = MiniMaxM2MoeBlock
    expert_naming = ExpertNaming(
        gate="model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
        up="model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
        down="model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",
        fused_gate_up="model.layers.{layer}.mlp.experts.gate_up_proj",
        fused_down="model.layers.{layer}.mlp.experts.down_proj",
    )
    fp32_weights = (".block_sparse_moe.gate.weight", ".block_sparse_moe.e_score_correction_bias")


ARCHITECTURES = {"minimax_m2": MiniMaxM2ForCausalLM}
