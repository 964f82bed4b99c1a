"""Qwen2-MoE (`model_type: qwen2_moe`): Qwen1.5-MoE-A2.7B and Qwen2-57B-A14B (and their chat versions).

Qwen3-MoE's routing (softmax top-k, `norm_topk_prob`) without q/k norm, with biases on q/k/v (`qkv_bias`,
none on o), and one shared expert per MoE layer (its own width, `shared_expert_intermediate_size`) scaled by
a sigmoid gate, sigmoid(x . w_gate), per token. The shared expert and its gate are dense weights that stay on
the compute device. Qwen1.5-MoE-A2.7B: 24 layers x 60 experts, top-4, I = 1408, shared width 5632: one routed
expert is 3 x 1408 x 2048 x 2 B = 16.5 MiB in bf16, 23.2 GiB for the 1440 of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.moe import ExpertProvider
from .base import MLP, ExpertNaming, MoEForCausalLM, SparseMoeBlock
from .qwen3_moe import Qwen3MoeArgs


@dataclass
class Qwen2MoeArgs(Qwen3MoeArgs):
    shared_expert_intermediate_size: int = 0
    qkv_bias: bool = True
    max_window_layers: int = 28
    layer_types: list | None = None

    @classmethod
    def from_dict(cls, d: dict, *args, **kwargs) -> Qwen2MoeArgs:
        if d.get("sliding_window") == 0:  # transformers 5 saves 0 when use_sliding_window is false: no window
            d = {**d, "sliding_window": None}
        return super().from_dict(d, *args, **kwargs)

    def __post_init__(self):
        super().__post_init__()
        if self.layer_types is None:  # transformers' Qwen2MoeConfig rule
            self.layer_types = ["sliding_attention" if (i + 1) % 2 and i < self.max_window_layers
                                and self.use_sliding_window else "full_attention"
                                for i in range(self.num_hidden_layers)]

    @property
    def attention_qkv_bias(self) -> bool:
        return bool(self.qkv_bias)

    @property
    def attention_out_bias(self) -> bool:
        return False

    def layer_window(self, layer: int) -> int | None:
        sliding = self.use_sliding_window and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding and self.sliding_window else None


class Qwen2MoeBlock(SparseMoeBlock):
    """Routed experts through the provider plus the gated shared expert (dense, on the compute device)."""

    def __init__(self, args: Qwen2MoeArgs, layer: int):
        super().__init__(args, layer)
        width = args.shared_expert_intermediate_size
        self.shared_expert = MLP(args.hidden_size, width) if width else None
        self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False) if width else None

    def forward(self, x: torch.Tensor, provider: ExpertProvider, residual: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is not None:
            gate = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))  # [T, 1]
            residual = residual + gate * self.shared_expert.forward(x)  # [T, H]
        return super().forward(x, provider, residual)


class Qwen2MoeForCausalLM(MoEForCausalLM):
    args_class = Qwen2MoeArgs
    moe_attr = "mlp"
    qk_norm = None
    moe_block = Qwen2MoeBlock
    expert_naming = ExpertNaming(
        gate="model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
        up="model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
        down="model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",
        fused_gate_up="model.layers.{layer}.mlp.experts.gate_up_proj",
        fused_down="model.layers.{layer}.mlp.experts.down_proj",
    )
