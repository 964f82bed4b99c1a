"""A sigmoid router's `choice_scores` is what its top-k is taken over, so the prefetcher ranks what the router ranks.

DeepSeek-V3 (and GLM-4.5 / GLM-4.7-Flash, which route through its block), MiniMax-M2 and Nemotron-H choose experts on
sigmoid(logits) + a correction bias, within the best groups; a top-k of the raw logits (what the predictor ranked
before) is not that choice once the bias is large enough to matter. engine/cache/prefetch.py reads `choice_scores`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moechat.engine.models.deepseek_v3 import DeepseekV3Args, DeepseekV3MoeBlock
from moechat.engine.models.minimax_m2 import MiniMaxM2Args, MiniMaxM2MoeBlock

BASE = {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64}
DEEPSEEK = {**BASE, "model_type": "deepseek_v3", "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4,
            "topk_group": 2, "n_shared_experts": 1, "first_k_dense_replace": 0, "kv_lora_rank": 16, "q_lora_rank": None,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "norm_topk_prob": True,
            "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
MINIMAX = {**BASE, "model_type": "minimax_m2", "num_local_experts": 16, "num_experts_per_tok": 4, "head_dim": 8,
           "scoring_func": "sigmoid", "use_routing_bias": True}


def _block(cls, args_cls, config):
    args = args_cls.from_dict(config)
    block = cls(args, 0)
    torch.manual_seed(0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    gate = block.gate  # DeepSeek-V3 keeps the bias on its gate, MiniMax-M2 on the block
    bias = gate.e_score_correction_bias if hasattr(gate, "e_score_correction_bias") else block.e_score_correction_bias
    with torch.no_grad():
        bias.copy_(torch.linspace(-0.6, 0.6, bias.numel()))  # large against sigmoid's spread: it moves the choice
    block.finalize()
    return block


@pytest.mark.parametrize("cls,args_cls,config", [(DeepseekV3MoeBlock, DeepseekV3Args, DEEPSEEK),
                                                 (MiniMaxM2MoeBlock, MiniMaxM2Args, MINIMAX)],
                         ids=["deepseek_v3", "minimax_m2"])
def test_the_top_k_of_choice_scores_is_the_routers_choice_and_the_raw_logits_are_not(cls, args_cls, config):
    block = _block(cls, args_cls, config)
    x = torch.randn(64, 32)
    _, ids = block.route(x)  # [T, K]
    logits = F.linear(x.float(), block.gate_weight)  # [T, E]
    choice = block.choice_scores(logits)
    K = ids.shape[1]
    got = choice.topk(K, dim=-1).indices
    assert all(set(a.tolist()) == set(b.tolist()) for a, b in zip(got, ids, strict=True))
    raw = logits.topk(K, dim=-1).indices
    assert sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(raw, ids, strict=True)) > 0
    if config.get("n_group", 1) > 1:  # the groups left out are never ranked
        assert (torch.isinf(choice).sum(dim=-1) == 16 // 4 * 2).all()
