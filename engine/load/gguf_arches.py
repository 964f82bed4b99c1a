"""The 2026 architectures' GGUF files: llama.cpp's metadata as the engine's config, its tensor names as the engine's,
and its converter's conventions undone (engine/load/gguf.py reads the container and calls these).

Each convention below is what llama.cpp's convert_hf_to_gguf.py applies to that family, undone on read (`undo`, after
the tensor is dequantized to fp32), so the model classes load a GGUF file with the checks and the code they load a
safetensors folder with:

* Qwen3-Next (`qwen3next`) and Qwen3.5/3.6-MoE (`qwen35moe`): A_log stored as -exp(A_log) (`ssm_a`), dt_bias as
  `ssm_dt.bias`, the conv1d weight squeezed to [C, W], every zero-centred RMSNorm weight stored as 1 + w (the gated
  delta-rule norm `ssm_norm` excepted). Qwen3-Next's in_proj_qkvz (per key head [q | k | v | z]) is split into
  `attn_qkv` ([q all heads | k | v]) and `attn_gate` (z), joined again here; Qwen3.5 keeps the split projections but
  reorders the value heads from grouped by key head to tiled (v0 of every group, then v1, ...) in qkv's v rows, z,
  b, a, A_log, dt_bias, the conv's v channels and out_proj's columns, where there are more value than key heads.
  Layer kinds come from the tensors each layer holds (`ssm_a`: Gated DeltaNet), the MTP layers past the last
  (`nextn_predict_layers`) are not read.
* Nemotron-H MoE (`nemotron_h_moe`): Mamba-2's A as -exp(A_log) and D both [nH, 1], the gated norm as [G, Im / G],
  the conv squeezed, dt_bias as `ssm_dt.bias`; the attention layers' q/k rows permuted (GraniteHybridModel keeps
  LlamaModel's undo_permute; with no RoPE it changes no output, undone anyway so the weights are the checkpoint's);
  the relu^2 experts ungated (`ffn_up_exps`, `ffn_down_exps`: GGUFFormat without a gate). The layer pattern
  (M * E -) comes from each layer's tensors, the KV heads from the per-layer head_count_kv array's attention layers.
* Gemma 4 (`gemma4`, the 26B-A4B text MoE): no norm offset (Gemma4Model's norm_shift is 0); the experts' gate_up kept
  fused (`ffn_gate_up_exps`: GGUFFormat(fused=True)); router.scale as `ffn_gate_inp.scale`, per_expert_scale as
  `ffn_down_exps.scale`, layer_scalar as `layer_output_scale.weight`; sliding layers from sliding_window_pattern, the
  full layers' head dim (key_length; key_length_swa the sliding ones') and KV heads per layer, their proportional
  RoPE's rotated share from the `rope_freqs` table (1 rotated, 1e30 not); K as V where a full layer has no attn_v.
* MiniMax-M2 (`minimax-m2`): nothing transformed; Mixtral's block_sparse_moe names, full-width q/k norms,
  rotary_dim as rope.dimension_count, the correction bias as `exp_probs_b.bias`, sigmoid routing checked.
* GLM-4.7-Flash is written as `deepseek2` (gguf.py's table): its files carry no expert_gating_func, so the sigmoid
  llama.cpp's loader takes for them (since b7788: 47/48 blocks and GLM's vocabulary; here also the `glm4`
  pre-tokenizer) is taken, and it runs as glm4_moe_lite.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from ..errors import CheckpointError, UnsupportedModelError

# llama.cpp's architecture name -> (HF model_type, whether its converter permutes q/k rows)
ARCHES_2026 = {"qwen3next": ("qwen3_next", False), "qwen35moe": ("qwen3_5_moe_text", False),
               "minimax-m2": ("minimax_m2", False), "nemotron_h_moe": ("nemotron_h", False),
               "gemma4": ("gemma4_text", False)}

_ATTN = {"attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
         "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
         "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
         "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias"}
_SHARED = {"ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
           "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
           "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
           "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
           "ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
           "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}


def _qwen_hybrid_map(arch: str) -> dict[str, tuple[str, str]]:
    """blk.N.X -> (model.layers.N.Y, the transform undoing the converter's convention)."""
    out = {k: (v, "") for k, v in {**_ATTN, **_SHARED}.items()}
    tiled = "untile_v" if arch == "qwen35moe" else ""
    out.update({
        "attn_norm.weight": ("input_layernorm.weight", "minus_one"),
        "post_attention_norm.weight": ("post_attention_layernorm.weight", "minus_one"),
        "attn_q_norm.weight": ("self_attn.q_norm.weight", "minus_one"),
        "attn_k_norm.weight": ("self_attn.k_norm.weight", "minus_one"),
        "ssm_a": ("linear_attn.A_log", _steps(tiled + "_heads", "log_neg")),
        "ssm_dt.bias": ("linear_attn.dt_bias", _steps(tiled + "_heads")),
        "ssm_conv1d.weight": ("linear_attn.conv1d.weight", _steps(tiled + "_conv")),
        "ssm_norm.weight": ("linear_attn.norm.weight", ""),
        "ssm_out.weight": ("linear_attn.out_proj.weight", _steps(tiled + "_cols")),
    })
    if arch == "qwen3next":
        out.update({"attn_qkv.weight": ("linear_attn.in_proj_qkvz.weight", "qkvz"),
                    "ssm_ba.weight": ("linear_attn.in_proj_ba.weight", "")})
    else:
        out.update({"attn_qkv.weight": ("linear_attn.in_proj_qkv.weight", _steps(tiled + "_qkv")),
                    "attn_gate.weight": ("linear_attn.in_proj_z.weight", _steps(tiled + "_rows")),
                    "ssm_beta.weight": ("linear_attn.in_proj_b.weight", _steps(tiled + "_heads")),
                    "ssm_alpha.weight": ("linear_attn.in_proj_a.weight", _steps(tiled + "_heads"))})
    return out


def _minimax_map(arch: str) -> dict[str, tuple[str, str]]:
    """MiniMax-M2: Mixtral's names (block_sparse_moe) with full-width q/k norms and the router's correction bias."""
    out = {k: (v, "") for k, v in _ATTN.items()}
    out.update({"attn_q_norm.weight": ("self_attn.q_norm.weight", ""),
                "attn_k_norm.weight": ("self_attn.k_norm.weight", ""),
                "attn_norm.weight": ("input_layernorm.weight", ""),
                "ffn_norm.weight": ("post_attention_layernorm.weight", ""),
                "ffn_gate_inp.weight": ("block_sparse_moe.gate.weight", ""),
                "exp_probs_b.bias": ("block_sparse_moe.e_score_correction_bias", "")})
    return out


def _nemotron_map(arch: str) -> dict[str, tuple[str, str]]:
    """Nemotron-H: every layer one mixer (Mamba-2, attention, MoE or MLP) behind one norm, as the checkpoint's
    backbone.layers.N.mixer.*; the converter's q/k row permutation (GraniteHybridModel.undo_permute) undone."""
    out = {"attn_norm.weight": ("norm.weight", ""), "attn_q.weight": ("mixer.q_proj.weight", "permute_q"),
           "attn_k.weight": ("mixer.k_proj.weight", "permute_k"), "attn_v.weight": ("mixer.v_proj.weight", ""),
           "attn_output.weight": ("mixer.o_proj.weight", ""), "ssm_in.weight": ("mixer.in_proj.weight", ""),
           "ssm_in.bias": ("mixer.in_proj.bias", ""), "ssm_conv1d.weight": ("mixer.conv1d.weight", ""),
           "ssm_conv1d.bias": ("mixer.conv1d.bias", ""), "ssm_dt.bias": ("mixer.dt_bias", ""),
           "ssm_a": ("mixer.A_log", "log_neg"), "ssm_d": ("mixer.D", ""), "ssm_norm.weight": ("mixer.norm.weight", ""),
           "ssm_out.weight": ("mixer.out_proj.weight", ""), "ssm_out.bias": ("mixer.out_proj.bias", ""),
           "ffn_up.weight": ("mixer.up_proj.weight", ""), "ffn_down.weight": ("mixer.down_proj.weight", ""),
           "ffn_gate_inp.weight": ("mixer.gate.weight", ""),
           "exp_probs_b.bias": ("mixer.gate.e_score_correction_bias", ""),
           "ffn_up_shexp.weight": ("mixer.shared_experts.up_proj.weight", ""),
           "ffn_down_shexp.weight": ("mixer.shared_experts.down_proj.weight", "")}
    return out


def _gemma4_map(arch: str) -> dict[str, tuple[str, str]]:
    """Gemma 4: the dense MLP and the routed experts side by side, their norms, the router's scales (ffn_gate_inp.scale,
    and per_expert_scale written as ffn_down_exps.scale) and the layer scalar; no norm offset (Gemma4Model's
    norm_shift is 0)."""
    out = {k: (v, "") for k, v in _ATTN.items()}
    out.update({k: (v, "") for k, v in {
        "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
        "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
        "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
        "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
        "ffn_gate_inp.weight": "router.proj.weight", "ffn_gate_inp.scale": "router.scale",
        "ffn_down_exps.scale": "router.per_expert_scale", "layer_output_scale.weight": "layer_scalar"}.items()})
    return out


_MAPS = {"qwen3next": _qwen_hybrid_map, "qwen35moe": _qwen_hybrid_map, "minimax-m2": _minimax_map,
         "nemotron_h_moe": _nemotron_map, "gemma4": _gemma4_map}
_PREFIX = {"nemotron_h_moe": "backbone.layers."}  # the others: model.layers.
_TOP_NAMES = {"nemotron_h_moe": {"token_embd.weight": "backbone.embeddings.weight",
                                 "output_norm.weight": "backbone.norm_f.weight", "output.weight": "lm_head.weight"}}
_FLAT = {"ssm_a", "ssm_d", "ssm_norm.weight"}  # Mamba-2's A, D ([nH, 1]) and grouped norm ([G, Im / G]): 1-D in HF
_OFFSET_NORM = {"qwen3next", "qwen35moe"}  # model.norm stored as 1 + w


def _steps(*steps: str) -> str:
    return "+".join(s for s in steps if s and not s.startswith("_"))


_TOP = {"token_embd.weight": ("model.embed_tokens.weight", ""), "output.weight": ("lm_head.weight", "")}


def tensor_2026(arch: str, cfg: dict, name: str, shape: tuple, raw: dict, where: str):
    """The engine's (name, shape, transform, other tensor) for the GGUF tensor `name`, or None where the engine does not
    read it (an MTP layer, a rope table) or reads it joined into another (Qwen3-Next's attn_gate into in_proj_qkvz)."""
    m = re.match(r"^blk\.(\d+)\.(.+)$", name)
    if m is None and arch in _TOP_NAMES:
        hf = _TOP_NAMES[arch].get(name)
        return None if hf is None else (hf, shape, "", "")
    if m is None:
        if name == "output_norm.weight":
            return "model.norm.weight", shape, "minus_one" if arch in _OFFSET_NORM else "", ""
        hf = _TOP.get(name)
        return None if hf is None else (hf[0], shape, hf[1], "")
    layer, part = int(m.group(1)), m.group(2)
    if layer >= cfg["num_hidden_layers"]:
        return None  # a multi-token-prediction layer
    spec = _MAPS[arch](arch).get(part)
    if spec is None:
        return None
    hf, transform = spec
    hf = f"{_PREFIX.get(arch, 'model.layers.')}{layer}.{hf}"
    other = ""
    if arch == "nemotron_h_moe" and part in _FLAT:
        shape = (int(torch.Size(shape).numel()),)
    if part == "ssm_conv1d.weight" and len(shape) == 2:
        shape = (shape[0], 1, shape[1])  # the converter squeezed HF's [C, 1, W]
    if part == "ffn_gate_inp_shexp.weight" and len(shape) == 1:
        shape = (1, shape[0])
    if transform == "qkvz":
        other = f"blk.{layer}.attn_gate.weight"
        gate = raw.get(other)
        if gate is None:
            raise CheckpointError(f"{where}: tensor {name!r} needs its pair {other!r} (a damaged conversion? convert "
                                  "or download it again)", path=where, tensor=name)
        z_rows = int(gate[0].shape[1]) if len(gate[0].shape) == 2 else 0
        shape = (shape[0] + z_rows, shape[1])
    if arch == "qwen3next" and part == "attn_gate.weight":
        return None  # joined into in_proj_qkvz
    return hf, shape, transform, other


def _untile(w: torch.Tensor, dim: int, hk: int, r: int, d: int) -> torch.Tensor:
    """Undo _LinearAttentionVReorderBase._reorder_v_heads along `dim`: value heads tiled [r, HK, d] -> grouped by key
    head [HK, r, d]."""
    shape = list(w.shape)
    w = w.reshape(*shape[:dim], r, hk, d, *shape[dim + 1:])
    return w.transpose(dim, dim + 1).reshape(shape)


def undo(transform: str, w: torch.Tensor, cfg: dict, other: torch.Tensor | None = None) -> torch.Tensor:
    """The HF checkpoint's tensor from the GGUF one (fp32, in its file shape; `other` the tensor joined to it):
    `transform`'s steps, joined by '+', applied in order."""
    hk, hv = cfg.get("linear_num_key_heads", 1), cfg.get("linear_num_value_heads", 1)
    dk, dv = cfg.get("linear_key_head_dim", 0), cfg.get("linear_value_head_dim", 0)
    r = hv // hk if hk else 1
    for step in transform.split("+"):
        if step == "minus_one":
            w = w - 1
        elif step == "log_neg":
            w = torch.log(-w)
        elif step == "untile_v_heads":  # [HV] or [HV, H]
            w = _untile(w, 0, hk, r, 1)
        elif step == "untile_v_rows":  # [HV Dv, H]
            w = _untile(w, 0, hk, r, dv)
        elif step == "untile_v_cols":  # [H, HV Dv]
            w = _untile(w, 1, hk, r, dv)
        elif step == "untile_v_qkv":  # [2 HK Dk + HV Dv, H]: the v rows only
            qk, v = w[:2 * hk * dk], w[2 * hk * dk:]
            w = torch.cat([qk, _untile(v, 0, hk, r, dv)])
        elif step == "untile_v_conv":  # [2 HK Dk + HV Dv, 1, W]: the v channels only
            qk, v = w[:2 * hk * dk], w[2 * hk * dk:]
            w = torch.cat([qk, _untile(v, 0, hk, r, dv)])
        elif step == "qkvz":  # attn_qkv [q all | k all | v all] and attn_gate z -> per key head [q | k | v | z]
            z, H = other, w.shape[1]
            q, k, v = w.split([hk * dk, hk * dk, hv * dv])
            parts = [q.reshape(hk, dk, H), k.reshape(hk, dk, H), v.reshape(hk, r * dv, H), z.reshape(hk, r * dv, H)]
            w = torch.cat(parts, dim=1).reshape(-1, H)
        elif step:
            raise AssertionError(step)
    return w


def config_2026(arch: str, cfg: dict, key, need, tensors: dict, where: str) -> dict:
    """The rest of the config.json for the 2026 architectures (gguf.py's `_config` has filled the common keys)."""
    experts = int(need("expert_count"))
    if arch == "nemotron_h_moe":
        return _nemotron_config(cfg, key, need, tensors, experts, where)
    if arch == "gemma4":
        return _gemma4_config(cfg, key, need, tensors, experts, where)
    if arch == "minimax-m2":  # what MiniMaxM2Model.set_gguf_parameters writes
        gating = int(key("expert_gating_func", 2))
        if gating != 2:
            raise UnsupportedModelError(f"{where}: minimax-m2.expert_gating_func {gating} is not the sigmoid "
                                        "MiniMax-M2 routes with; convert the model again with a current llama.cpp")
        cfg.update(num_local_experts=experts, intermediate_size=int(need("expert_feed_forward_length")),
                   rotary_dim=int(key("rope.dimension_count", cfg["head_dim"])), scoring_func="sigmoid",
                   use_routing_bias=True, use_qk_norm=True, qk_norm_type="per_layer")
        return cfg
    layers = int(cfg["num_hidden_layers"]) - int(key("nextn_predict_layers", 0))
    moe_ff = int(need("expert_feed_forward_length"))
    ff = key("feed_forward_length", 0)
    ff = int(ff[0] if isinstance(ff, list) else ff)
    hk, hv = int(need("ssm.group_count")), int(need("ssm.time_step_rank"))
    head_dim = cfg["head_dim"]
    rope_dim = int(key("rope.dimension_count", head_dim // 4))
    kinds = ["linear_attention" if f"blk.{i}.ssm_a" in tensors else "full_attention" for i in range(layers)]
    cfg.update(num_hidden_layers=layers, num_experts=experts, moe_intermediate_size=moe_ff,
               intermediate_size=ff or moe_ff, norm_topk_prob=True,
               shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length", 0)),
               linear_conv_kernel_dim=int(need("ssm.conv_kernel")), linear_key_head_dim=int(need("ssm.state_size")),
               linear_num_key_heads=hk, linear_num_value_heads=hv,
               linear_value_head_dim=int(need("ssm.inner_size")) // hv, layer_types=kinds,
               partial_rotary_factor=rope_dim / head_dim,
               attention_bias=any(f"blk.{i}.attn_q.bias" in tensors for i in range(layers)))
    if arch == "qwen3next":  # the layers without a router are dense (mlp_only_layers)
        cfg["mlp_only_layers"] = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    return cfg


def _nemotron_config(cfg: dict, key, need, tensors: dict, experts: int, where: str) -> dict:
    """What NemotronHModel.set_gguf_parameters writes (via GraniteHybridModel's): the Mamba-2 sizes as ssm.*, the
    attention layers' KV heads and the MoE layers' widths as per-layer arrays; each layer's kind from its tensors."""
    layers = int(cfg["num_hidden_layers"]) - int(key("nextn_predict_layers", 0))

    def kind(i: int) -> str:
        for probe, c in (("ssm_in.weight", "M"), ("attn_q.weight", "*"), ("ffn_gate_inp.weight", "E"),
                         ("ffn_up.weight", "-")):
            if f"blk.{i}.{probe}" in tensors:
                return c
        raise CheckpointError(f"{where}: layer {i} has neither a Mamba-2, an attention, a MoE nor an MLP mixer (a "
                              "damaged conversion? convert or download it again)", path=where, tensor=f"blk.{i}")

    pattern = "".join(kind(i) for i in range(layers))
    heads_kv = key("attention.head_count_kv", cfg["num_key_value_heads"])
    inner, heads = int(need("ssm.inner_size")), int(need("ssm.time_step_rank"))
    dense = next((tensors[f"blk.{i}.ffn_up.weight"] for i in range(layers) if pattern[i] == "-"), None)
    eps = key("attention.layer_norm_rms_epsilon") or key("attention.layer_norm_epsilon") or 1e-5
    cfg.update(num_hidden_layers=layers, hybrid_override_pattern=pattern,
               num_key_value_heads=int(max(heads_kv) if isinstance(heads_kv, list) else heads_kv),
               rms_norm_eps=float(eps), n_routed_experts=experts,
               moe_intermediate_size=int(need("expert_feed_forward_length")),
               moe_shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length", 0)),
               n_shared_experts=int(key("expert_shared_count", 1)),
               intermediate_size=int(dense.shape[1]) if dense is not None else 0,  # ggml ne [H, I]
               routed_scaling_factor=float(key("expert_weights_scale", 1.0)),
               norm_topk_prob=bool(key("expert_weights_norm", True)), n_group=int(key("expert_group_count", 1)),
               topk_group=int(key("expert_group_used_count", 1)), mamba_num_heads=heads,
               mamba_head_dim=inner // heads, ssm_state_size=int(need("ssm.state_size")),
               n_groups=int(need("ssm.group_count")), conv_kernel=int(need("ssm.conv_kernel")),
               use_conv_bias=any(f"blk.{i}.ssm_conv1d.bias" in tensors for i in range(layers)),
               use_bias=any(f"blk.{i}.ssm_in.bias" in tensors for i in range(layers)),
               mlp_bias=any(f"blk.{i}.ffn_up.bias" in tensors for i in range(layers)),
               attention_bias=any(f"blk.{i}.attn_q.bias" in tensors for i in range(layers)))
    if key("moe_latent_size") is not None:
        cfg["moe_latent_size"] = int(key("moe_latent_size"))  # the model class says it does not run these yet
    return cfg


def _gemma4_config(cfg: dict, key, need, tensors: dict, experts: int, where: str) -> dict:
    """What Gemma4Model.set_gguf_parameters writes: sliding layers by sliding_window_pattern, the full layers' head
    dim as key_length (the sliding ones' as key_length_swa) and KV heads per layer in head_count_kv, both RoPE
    thetas; the full layers' proportional RoPE from the rope_freqs table the converter makes of it (1 for the
    rotated frequencies, 1e30 for the rest)."""
    layers = int(cfg["num_hidden_layers"])
    sliding = key("attention.sliding_window_pattern")
    if not isinstance(sliding, list) or len(sliding) != layers:
        raise CheckpointError(f"{where}: gemma4.attention.sliding_window_pattern must list every one of the {layers} "
                              "layers; the file is not a complete llama.cpp Gemma 4 conversion: convert it again",
                              path=where)
    kinds = ["sliding_attention" if s else "full_attention" for s in sliding]
    kv = key("attention.head_count_kv", cfg["num_key_value_heads"])
    kv = kv if isinstance(kv, list) else [kv] * layers
    full_dim, swa_dim = int(need("attention.key_length")), int(need("attention.key_length_swa"))
    factor = 0.25
    if (freqs := tensors.get("rope_freqs.weight")) is not None:
        table = np.asarray(freqs.data, dtype=np.float32).reshape(-1)  # [full_dim / 2]
        factor = float((table == 1.0).sum()) / table.size
    rope_swa = int(key("rope.dimension_count_swa", swa_dim))
    sliding_rope = {"rope_theta": float(key("rope.freq_base_swa", 10000.0)), "rope_type": "default"}
    if rope_swa != swa_dim:
        sliding_rope["partial_rotary_factor"] = rope_swa / swa_dim
    ff = key("feed_forward_length", 0)
    swa_layers = [i for i in range(layers) if sliding[i]] or [0]
    cfg.update(layer_types=kinds, head_dim=swa_dim, num_key_value_heads=int(kv[swa_layers[0]]),
               per_layer_config={str(i): {"head_dim": full_dim, "num_key_value_heads": int(kv[i])}
                                 for i in range(layers) if not sliding[i]},
               attention_k_eq_v=any(not sliding[i] and f"blk.{i}.attn_v.weight" not in tensors for i in range(layers)),
               rope_parameters={"sliding_attention": sliding_rope,
                                "full_attention": {"rope_theta": cfg["rope_theta"], "rope_type": "proportional",
                                                   "partial_rotary_factor": factor}},
               sliding_window=int(key("attention.sliding_window", 1024)),
               final_logit_softcapping=key("final_logit_softcapping"),
               intermediate_size=int(ff[0] if isinstance(ff, list) else ff),
               moe_intermediate_size=int(need("expert_feed_forward_length")), num_experts=experts,
               top_k_experts=cfg["num_experts_per_tok"], enable_moe_block=True,
               hidden_size_per_layer_input=int(key("embedding_length_per_layer_input", 0)),
               num_kv_shared_layers=int(key("attention.shared_kv_layers", 0)),
               attention_bias=any(f"blk.{i}.attn_q.bias" in tensors for i in range(layers)))
    cfg.pop("rope_theta", None)  # the two thetas are in rope_parameters
    return cfg
