"""The plan's prefill workspace is what the engine will hold: the chunk the engine picks and the K/V it expands.

On a CPU the engine sizes its prefill chunk from the last-level cache (engine/runtime/generate.py
default_prefill_chunk: 1024 tokens on this machine for Qwen3-30B-A3B, not the fixed 512 the plan used to count), and
its SDPA reads the keys and values expanded to every query head (GQA repeated; MLA's latents expanded) while its
flash kernel tiles the scores. The plan counts both.
"""

from __future__ import annotations

import resource

import torch
import torch.nn.functional as F

from moechat.engine.plan import Preferences, make_plan, spec_from_config
from moechat.engine.plan.hardware import DiskInfo, GiB, Hardware, HostMemory
from moechat.engine.plan.planner import prefill_chunk_for
from moechat.engine.quant.prefill import machine_chunk_size

QWEN3_30B = {  # Qwen/Qwen3-30B-A3B's config.json, the fields the plan reads
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "vocab_size": 151936, "max_position_embeddings": 40960, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0,
}
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400,
    "max_position_embeddings": 163840, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


def _cpu(ram_gib: float = 64) -> Hardware:
    return Hardware((), HostMemory(int(ram_gib * GiB), int(ram_gib * GiB)), DiskInfo("/models", 10_000 * GiB))


def _workspace(plan) -> tuple[int, str]:
    (d,) = [d for d in plan.decisions if "prefill activations" in d.reason]
    return d.bytes, d.reason


def test_a_cpu_plan_counts_the_chunk_the_engine_picks_and_a_gpu_plan_512():
    spec = spec_from_config(QWEN3_30B, name="qwen3-30b-a3b")
    chunk = machine_chunk_size(2048, 768)
    assert prefill_chunk_for(spec, False, None) == chunk
    assert prefill_chunk_for(spec, True, None) == 512
    assert prefill_chunk_for(spec, False, 96) == 96
    plan = make_plan(spec, _cpu(), Preferences(context=4096))
    _, detail = _workspace(plan)
    assert f"{chunk}-token prefill activations" in detail
    asked = make_plan(spec, _cpu(), Preferences(context=4096, prefill_chunk=64))
    assert "64-token prefill activations" in _workspace(asked)[1]


def test_the_expanded_kv_is_counted_per_query_head_for_gqa_and_mla():
    qwen = spec_from_config(QWEN3_30B, name="qwen3-30b-a3b")
    assert qwen.prefill_kv_expanded_elems == 2 * 32 * 128  # K and V, 32 query heads of 128 (4 KV heads cached)
    ds = spec_from_config(DEEPSEEK_V2_LITE, name="deepseek-v2-lite")
    assert ds.prefill_kv_expanded_elems == 16 * (128 + 64 + 128)
    small, large = (make_plan(qwen, _cpu(), Preferences(context=c, prefill_chunk=512)) for c in (4096, 8192))
    (b4, d4), (b8, _) = _workspace(small), _workspace(large)
    assert "K/V expanded per head" in d4
    assert b8 - b4 == 2 * 32 * 128 * 2 * 4096  # bf16, 4096 more positions


def test_cpu_sdpa_with_a_mask_does_not_build_the_score_tensor():
    # why the plan counts no [heads, T, S] scores: the 4-D masked call the engine makes stays far under their size
    h, T, S, D = 8, 512, 4096, 64
    q, k, v = torch.randn(1, h, T, D), torch.randn(1, h, S, D), torch.randn(1, h, S, D)
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert grown < 4 * h * T * S / 4  # a quarter of the fp32 scores' 64 MiB
