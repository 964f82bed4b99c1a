"""GGUF files of the 2026 architectures end to end: a tiny transformers model written as llama.cpp's
convert_hf_to_gguf.py writes that family (its names, its metadata keys, its conventions: Qwen3-Next's -exp(A_log),
squeezed conv, 1 + w norms, split qkvz; Qwen3.5's value heads reordered to tiled), loaded by moechat: fp32 logits
and greedy tokens == transformers on the same (dequantized) weights, resident and cached at a small slot count."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from moechat.engine.cache.provider import CacheConfig  # noqa: E402
from moechat.engine.errors import CheckpointError  # noqa: E402
from moechat.engine.load.loader import load_model  # noqa: E402
from moechat.engine.quant.gguf import TYPES, dequantize  # noqa: E402
from moechat.engine.runtime.generate import Engine  # noqa: E402

from .test_gguf_load import GREEDY, _encode, _prompt  # noqa: E402

LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
QWEN_HYBRID = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, initializer_range=0.2, max_position_embeddings=512, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                   linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=32, layer_types=LAYERS, partial_rotary_factor=0.5,
                   rms_norm_eps=1e-6)
MODELS = {"qwen3_next": ("qwen3next", dict(intermediate_size=64, norm_topk_prob=True)),
          "qwen3_5_moe_text": ("qwen35moe", {})}


def tiny(model_type: str, seed: int = 0):
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **{**QWEN_HYBRID, **MODELS[model_type][1]})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers starts the norms at 0 (1 + w) and dt_bias at 1: make every weight count
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) * 0.3)
            elif n.endswith("A_log"):
                p.copy_(torch.rand_like(p) * 2 - 1)
    return model


# --- what convert_hf_to_gguf.py's Qwen3NextModel / _LinearAttentionVReorderBase do, written from its source ---

def _tile_v(t: np.ndarray, dim: int, hk: int, r: int, d: int) -> np.ndarray:
    """_reorder_v_heads: value heads grouped by key head [HK, r, d] -> tiled [r, HK, d] along `dim`."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], hk, r, d, *shape[dim + 1:])
    return np.ascontiguousarray(np.swapaxes(t, dim, dim + 1)).reshape(shape)


def _untile_v(t: torch.Tensor, dim: int, hk: int, r: int, d: int) -> torch.Tensor:
    """The reference's inverse of _tile_v, for the projections the file stores quantized in the tiled order."""
    shape = list(t.shape)
    return t.reshape(*shape[:dim], r, hk, d, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)


def _qwen_hybrid_tensors(cfg, sd: dict, arch: str):
    """(gguf name, HF name, array, quantizable[, inverse: the file's dequantized tensor back to the HF layout]) in
    the converter's order and conventions."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
    reorder = arch == "qwen35moe" and hk != hv
    names = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
             "input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "post_attention_norm.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
             "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
             "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
             "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
             "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
             "linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias",
             "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.norm.weight": "ssm_norm.weight",
             "linear_attn.out_proj.weight": "ssm_out.weight", "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
             "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
             "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight"}
    out = [("token_embd.weight", "model.embed_tokens.weight", sd["model.embed_tokens.weight"], True),
           ("output_norm.weight", "model.norm.weight", sd["model.norm.weight"] + 1, False)]
    if "lm_head.weight" in sd:
        out.append(("output.weight", "lm_head.weight", sd["lm_head.weight"], True))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, g in names.items():
            if p + hf not in sd:
                continue
            t, quant, inverse = sd[p + hf], True, None
            if reorder and hf.startswith("linear_attn."):  # the projections quantized in the tiled order, as real
                # files hold them; the reference gets the dequantized values back in HF's order
                if hf.endswith("in_proj_qkv.weight"):
                    t = np.concatenate([t[:2 * hk * dk], _tile_v(t[2 * hk * dk:], 0, hk, r, dv)])
                    inverse = lambda b: torch.cat([b[:2 * hk * dk], _untile_v(b[2 * hk * dk:], 0, hk, r, dv)])  # noqa: E731
                elif hf.endswith("in_proj_z.weight"):
                    t, inverse = _tile_v(t, 0, hk, r, dv), lambda b: _untile_v(b, 0, hk, r, dv)
                elif hf.endswith(("in_proj_b.weight", "in_proj_a.weight")):
                    t, inverse = _tile_v(t, 0, hk, r, 1), lambda b: _untile_v(b, 0, hk, r, 1)
                elif hf.endswith(("A_log", "dt_bias")):
                    t, quant = _tile_v(t, 0, hk, r, 1), False
                elif hf.endswith("conv1d.weight"):
                    t = np.concatenate([t[:2 * hk * dk], _tile_v(t[2 * hk * dk:], 0, hk, r, dv)])
                elif hf.endswith("out_proj.weight"):
                    t, inverse = _tile_v(t, 1, hk, r, dv), lambda b: _untile_v(b, 1, hk, r, dv)
            if hf.endswith("A_log"):
                t, quant = -np.exp(t), False
            elif "conv1d" in hf:
                t, quant = t.squeeze(), False
            elif hf.endswith("norm.weight") and not hf.endswith("linear_attn.norm.weight"):
                t, quant = t + 1, False
            out.append((f"blk.{i}.{g}", p + hf, t, quant, inverse))
        if p + "linear_attn.in_proj_qkvz.weight" in sd:  # [q, k, v, z] per key head -> attn_qkv [q | k | v], z
            w = sd[p + "linear_attn.in_proj_qkvz.weight"]
            H = w.shape[1]
            per = w.reshape(hk, 2 * dk + 2 * r * dv, H)
            q, k, v, z = np.split(per, np.cumsum([dk, dk, r * dv])[:3], axis=1)
            qkv = np.concatenate([q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)])
            out.append((f"blk.{i}.attn_qkv.weight", p + "qkv_part", qkv, True))  # quantized as real files hold them
            out.append((f"blk.{i}.attn_gate.weight", p + "z_part", z.reshape(-1, H), True))
        if p + "mlp.experts.gate_up_proj" in sd:
            _experts(out, p, i, sd)
    return out


def _qwen_hybrid_meta(w, cfg, arch, blocks):
    _common_meta(w, cfg, blocks)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_full_attention_interval(getattr(cfg, "full_attention_interval", 4))
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.25)))
    if arch == "qwen35moe":
        w.add_rope_dimension_sections([11, 11, 10, 0])


def _experts(out, p, i, sd):
    """Stacked experts as the converters write them: gate_up [E, 2I, H] split into ffn_gate_exps / ffn_up_exps."""
    gate_up = sd[p + "mlp.experts.gate_up_proj"]  # [E, 2I, H]
    I = gate_up.shape[1] // 2
    out.append((f"blk.{i}.ffn_gate_exps.weight", p + "gate", np.ascontiguousarray(gate_up[:, :I]), "expert"))
    out.append((f"blk.{i}.ffn_up_exps.weight", p + "up", np.ascontiguousarray(gate_up[:, I:]), "expert"))
    out.append((f"blk.{i}.ffn_down_exps.weight", p + "mlp.experts.down_proj", sd[p + "mlp.experts.down_proj"], "down"))


def _common_meta(w, cfg, blocks):
    """TextModel.set_gguf_parameters' keys."""
    w.add_block_count(blocks)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if getattr(cfg, "intermediate_size", None):
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)


def _minimax_tensors(cfg, sd: dict, arch: str):
    """MiniMaxM2Model: the checkpoint's block_sparse_moe names mapped, experts stacked; nothing transformed."""
    names = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
             "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.e_score_correction_bias": "exp_probs_b.bias"}
    out = [("token_embd.weight", "model.embed_tokens.weight", sd["model.embed_tokens.weight"], True),
           ("output_norm.weight", "model.norm.weight", sd["model.norm.weight"], False),
           ("output.weight", "lm_head.weight", sd["lm_head.weight"], True)]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [(f"blk.{i}.{g}", p + hf, sd[p + hf], True) for hf, g in names.items()]
        _experts(out, p, i, sd)
    return out


def _minimax_meta(w, cfg, arch, blocks):
    _common_meta(w, cfg, blocks)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)  # the Hub config's scoring_func
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_rope_dimension_count(cfg.rotary_dim)


CONVERTERS = {"qwen3next": (_qwen_hybrid_tensors, _qwen_hybrid_meta),
              "qwen35moe": (_qwen_hybrid_tensors, _qwen_hybrid_meta),
              "minimax-m2": (_minimax_tensors, _minimax_meta)}


def write_2026(path, model, arch: str, experts=("Q8_0", "Q8_0", "Q8_0"), dense="F32", seed=0, mtp: int = 0,
               drop=()):
    """`model` as llama.cpp's converter writes `arch`; returns the state dict the reference loads (HF names, what the
    file holds dequantized where a tensor is stored quantized, the HF weights where a convention was applied)."""
    rng = np.random.default_rng(seed)
    cfg = model.config
    tensors_of, meta = CONVERTERS[arch]
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    held = {k: torch.from_numpy(v.copy()) for k, v in sd.items()}
    w = gguf.GGUFWriter(str(path), arch)
    meta(w, cfg, arch, cfg.num_hidden_layers + mtp)  # an MTP layer counts in block_count, as the converter writes
    if mtp:
        w.add_nextn_predict_layers(mtp)
    parts = {}
    tensors = tensors_of(cfg, sd, arch)
    if mtp:
        L = cfg.num_hidden_layers
        tensors += [(f"blk.{L}.nextn.eh_proj.weight", None, rng.standard_normal((64, 128)).astype(np.float32), False),
                    (f"blk.{L}.attn_norm.weight", None, np.ones(64, np.float32), False)]
    for gname, hfname, arr, quant, *inverse in tensors:
        if gname in drop:
            continue
        typ = "F32"
        if quant == "expert" or quant == "down":
            typ = experts[2] if quant == "down" else experts[0 if "gate" in gname else 1]
        elif quant and arr.ndim == 2 and arr.shape[-1] % 32 == 0 and "gate_inp" not in gname:
            typ = dense
        data = _encode(np.ascontiguousarray(arr, dtype=np.float32), typ, rng)
        w.add_tensor(gname, data, raw_dtype=None if typ in ("F32", "F16") else Q[typ])
        if hfname is None or (typ == "F32" and not hfname.endswith("_part")):
            continue
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).copy())
        back = dequantize(raw.reshape(-1, raw.shape[-1]) if raw.dim() > 1 else raw[None], typ, arr.shape[-1])
        back = back.reshape(arr.shape)
        if hfname.endswith(("gate", "up", "_part")):
            parts[hfname] = back
        else:
            held[hfname] = inverse[0](back) if inverse and inverse[0] else back
    if "lm_head.weight" in held and not any(t[0] == "output.weight" for t in tensors):  # tied: the table is both
        held["lm_head.weight"] = held["model.embed_tokens.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if p + "gate" in parts:
            held[p + "mlp.experts.gate_up_proj"] = torch.cat([parts[p + "gate"], parts[p + "up"]], dim=1)
        if p + "qkv_part" in parts and p + "z_part" in parts:  # Qwen3-Next: in_proj_qkvz from the file's halves
            hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
            dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
            q, k, v = parts[p + "qkv_part"].split([hk * dk, hk * dk, hv * dv])
            z = parts[p + "z_part"]
            H = z.shape[1]
            held[p + "linear_attn.in_proj_qkvz.weight"] = torch.cat(
                [q.reshape(hk, dk, H), k.reshape(hk, dk, H), v.reshape(hk, r * dv, H), z.reshape(hk, r * dv, H)],
                dim=1).reshape(-1, H)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert all(t in TYPES for t in (*experts, dense))
    return held


def _reference(model, held):
    import copy

    ref = copy.deepcopy(model)
    ref.load_state_dict(held, strict=True)
    return ref


pytestmark = pytest.mark.usefixtures("one_thread")


def _check(path, ref, model_type, slots=3):
    """fp32 logits after a prefill and greedy tokens, resident == transformers; cached at `slots` slots == resident."""
    loaded = load_model(path, dtype="float32")
    assert loaded.args.model_type == model_type
    engine = Engine(loaded, None, None, {}, 512, 16)
    for n in (1, 19):
        ids = _prompt(n, seed=n + 3)
        with torch.inference_mode():
            ours = engine._forward(engine.new_sequence(), ids)
            theirs = ref(torch.tensor([ids])).logits[0, -1].float()
        err = (ours - theirs).abs().max().item()
        assert err < 1e-4, f"{model_type}, {n} tokens: max |logit diff| {err:.2e}"
    ids = _prompt(7, seed=70)
    got = [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=12) for t in c.token_ids]
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12, min_new_tokens=0, pad_token_id=0)
    assert got == out[0, 7:].tolist() and len(got) == 12
    cached = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=slots, ram_cache_bytes=0))
    assert [t for c in cached.generate(ids, sampling=GREEDY, max_tokens=12) for t in c.token_ids] == got
    assert sum(cached.cache_snapshot().misses) > 0
    cached.close()


@pytest.mark.parametrize("model_type,experts,dense", [("qwen3_5_moe_text", ("F32", "F32", "F32"), "F32"),
                                                      ("qwen3_5_moe_text", ("Q8_0", "Q8_0", "Q4_0"), "Q8_0"),
                                                      ("qwen3_next", ("F32", "F32", "F32"), "F32"),
                                                      ("qwen3_next", ("Q8_0", "Q8_0", "Q4_0"), "Q8_0")])
def test_qwen_hybrids_match_transformers(tmp_path, model_type, experts, dense):
    """Qwen3.5/3.6-MoE (`qwen35moe`: value heads tiled by the converter, 4 value heads over 2 key heads) and
    Qwen3-Next (`qwen3next`: qkvz split into attn_qkv + attn_gate, a dense layer), with an MTP layer in the file."""
    arch = MODELS[model_type][0]
    model = tiny(model_type, seed=len(arch))
    path = tmp_path / f"{arch}.gguf"
    ref = _reference(model, write_2026(path, model, arch, experts, dense, mtp=1))
    _check(path, ref, model_type)


def test_qwen3next_without_its_attn_gate_is_one_typed_line(tmp_path):
    path = tmp_path / "cut.gguf"
    write_2026(path, tiny("qwen3_next"), "qwen3next", drop=("blk.0.attn_gate.weight",))
    with pytest.raises(CheckpointError, match="attn_gate.weight") as e:
        load_model(path, dtype="float32")
    assert "\n" not in str(e.value)


MINIMAX = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               head_dim=32, rotary_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
               initializer_range=0.2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=None,
               eos_token_id=None)


@pytest.mark.parametrize("experts,dense", [(("F32", "F32", "F32"), "F32"), (("Q8_0", "Q8_0", "Q4_0"), "Q8_0")])
def test_minimax_m2_matches_transformers(tmp_path, experts, dense):
    """MiniMax-M2 (`minimax-m2`): full-width q/k norms, partial rotary from rope.dimension_count, sigmoid routing
    with the correction bias (exp_probs_b.bias)."""
    import transformers

    config = transformers.AutoConfig.for_model("minimax_m2", **MINIMAX)
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape) * 0.3)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + torch.randn_like(p) * 0.3)
    path = tmp_path / "minimax-m2.gguf"
    ref = _reference(model, write_2026(path, model, "minimax-m2", experts, dense))
    _check(path, ref, "minimax_m2")


# -- GLM-4.7-Flash: llama.cpp's Glm4MoeLiteModel writes it as deepseek2 ---------------------------------------------

GLM_LITE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
                kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=8, v_head_dim=32, q_lora_rank=64,
                first_k_dense_replace=1, mlp_layer_types=["dense", "sparse", "sparse"], n_shared_experts=1,
                routed_scaling_factor=1.8, max_position_embeddings=512, initializer_range=0.2, eos_token_id=None,
                pad_token_id=None, bos_token_id=None)


def write_glm4_moe_lite(path, model, gating_key: bool, pre: str | None = "glm4", experts=("Q8_0", "Q8_0", "Q4_0")):
    """As Glm4MoeLiteModel (a DeepseekV2Model) in convert_hf_to_gguf.py: arch deepseek2, MLA in the absorbed form's
    key/value lengths, kv_b_proj split per head into attn_k_b (transposed) and attn_v_b, the correction bias as
    exp_probs_b.bias, the MTP layer past the last (block_count + 1, nextn_predict_layers), and no
    expert_gating_func (GLM's config has no scoring_func: the files on the Hub have none) unless `gating_key`."""
    from .test_gguf_more import _Writer

    cfg = model.config
    W = _Writer(path, "deepseek2")
    w = W.w
    nope, rope, v_dim, C, nH = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank,
                                cfg.num_attention_heads)
    L = cfg.num_hidden_layers
    w.add_block_count(L + 1)
    w.add_nextn_predict_layers(1)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(nH)
    w.add_head_count_kv(1)  # MLA converted to MQA
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    if gating_key:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_vocab_size(cfg.vocab_size)
    w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(C)
    w.add_key_length(C + rope)
    w.add_value_length(C)
    w.add_key_length_mla(nope + rope)
    w.add_value_length_mla(v_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope)
    if pre:
        w.add_tokenizer_pre(pre)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    W.put("token_embd.weight", sd["model.embed_tokens.weight"], "Q8_0", "model.embed_tokens.weight")
    W.put("output_norm.weight", sd["model.norm.weight"], "F32", "model.norm.weight")
    W.put("output.weight", sd["lm_head.weight"], "Q8_0", "lm_head.weight")
    names = {"self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
             "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
             "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.o_proj": "attn_output",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
             "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
             "mlp.shared_experts.down_proj": "ffn_down_shexp", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(L):
        p = f"model.layers.{i}."
        for hf, g in names.items():
            if p + hf + ".weight" in sd:
                arr = sd[p + hf + ".weight"]
                typ = "Q8_0" if arr.ndim == 2 and g != "ffn_gate_inp" else "F32"
                W.put(f"blk.{i}.{g}.weight", arr, typ, p + hf + ".weight")
        per = sd[p + "self_attn.kv_b_proj.weight"].reshape(nH, nope + v_dim, C)
        k_b = W.put(f"blk.{i}.attn_k_b.weight", per[:, :nope].swapaxes(1, 2), "Q8_0")  # [nH, C, N]
        v_b = W.put(f"blk.{i}.attn_v_b.weight", per[:, nope:], "Q8_0")  # [nH, V, C]
        kv_b = torch.cat([k_b.transpose(1, 2), v_b], 1)  # [nH, N + V, C]
        W.held[p + "self_attn.kv_b_proj.weight"] = kv_b.reshape(nH * (nope + v_dim), C)
        if p + "mlp.gate.e_score_correction_bias" in sd:
            W.put(f"blk.{i}.exp_probs_b.bias", sd[p + "mlp.gate.e_score_correction_bias"], "F32",
                  p + "mlp.gate.e_score_correction_bias")
        if p + "mlp.experts.gate_up_proj" in sd:
            gate_up, I = sd[p + "mlp.experts.gate_up_proj"], cfg.moe_intermediate_size  # [E, 2I, H]
            g = W.put(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :I], experts[0])
            u = W.put(f"blk.{i}.ffn_up_exps.weight", gate_up[:, I:], experts[1])
            W.held[p + "mlp.experts.gate_up_proj"] = torch.cat([g, u], dim=1)
            W.put(f"blk.{i}.ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"], experts[2],
                  p + "mlp.experts.down_proj")
    W.put(f"blk.{L}.nextn.eh_proj.weight", np.zeros((64, 128), np.float32), "F32")  # the MTP layer: never read
    W.put(f"blk.{L}.attn_norm.weight", np.ones(64, np.float32), "F32")
    return W.close()


@pytest.fixture(scope="module")
def glm_lite():
    import transformers

    config = transformers.AutoConfig.for_model("glm4_moe_lite", **GLM_LITE)
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("gating_key", [False, True])
def test_glm_4_7_flash_as_llama_cpp_writes_it_matches_transformers(tmp_path, glm_lite, gating_key):
    """GLM-4.7-Flash's deepseek2 file without a gating key (every file on the Hub) routes with sigmoid as llama.cpp's
    loader does since its fix (b7788) and runs as glm4_moe_lite; with the key it is the same."""
    path = tmp_path / "glm-4.7-flash.gguf"
    ref = _reference(glm_lite, write_glm4_moe_lite(path, glm_lite, gating_key))
    _check(path, ref, "glm4_moe_lite")
    assert load_model(path, dtype="float32").args.num_hidden_layers == 3  # the MTP layer left out


def test_a_deepseek2_file_without_a_gating_key_is_deepseek_v2s_softmax(tmp_path, glm_lite):
    """Not GLM (no glm4 pre-tokenizer, not its vocabulary): llama.cpp's default for DeepSeek-V2's older files."""
    path = tmp_path / "v2.gguf"
    write_glm4_moe_lite(path, glm_lite, gating_key=False, pre=None)
    from moechat.engine.load.gguf import open_gguf

    cfg = open_gguf(path).config
    assert cfg["model_type"] == "deepseek_v2" and cfg["scoring_func"] == "softmax"

def _int8_from_gguf(path, tmp_path):
    """--expert-format int8 from the file: each expert dequantized from its ggml parts (ungated up alone, or the fused
    gate_up) and requantized once into the repacked file; logits within int8's error of the packed GGUF's own."""
    native = Engine.load(path, dtype="float32")
    int8 = Engine.load(path, dtype="float32", expert_format="int8",
                       cache=CacheConfig(expert_slots=4, repack_dir=str(tmp_path / "repacked")))
    assert int8.loaded.expert_format.name == "int8"
    ids = _prompt(9, seed=1)
    with torch.inference_mode():
        a = native._forward(native.new_sequence(), ids)
        b = int8._forward(int8.new_sequence(), ids)
    assert 0 < (a - b).abs().max().item() < 0.05 * a.abs().max().item()
    int8.close()


# -- Nemotron-H MoE: NemotronHModel (a GraniteHybridModel) ------------------------------------------------------

NEMOTRON_PATTERN = "M*EM-E"
NEMOTRON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=64, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2,
                conv_kernel=4, chunk_size=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                moe_shared_expert_intermediate_size=32, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                initializer_range=0.2, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
                pad_token_id=None)


def _nemotron_tensors(cfg, sd: dict, arch: str):
    """NemotronHModel.modify_tensors: conv1d squeezed, A_log -> -exp as [nH, 1], D as [nH, 1], the gated norm as
    [G, Im / G], dt_bias as ssm_dt.bias, up/down experts stacked, and (through LlamaModel, undo_permute) the
    attention layers' q/k rows permuted."""
    from .test_gguf_load import _permute

    out = [("token_embd.weight", "model.embeddings.weight", sd["model.embeddings.weight"], True),
           ("output_norm.weight", "model.norm_f.weight", sd["model.norm_f.weight"], False),
           ("output.weight", "lm_head.weight", sd["lm_head.weight"], True)]
    G = cfg.n_groups
    for i, kind in enumerate(NEMOTRON_PATTERN):
        p = f"model.layers.{i}."
        out.append((f"blk.{i}.attn_norm.weight", p + "norm.weight", sd[p + "norm.weight"], False))
        m = p + "mixer."
        if kind == "M":
            out += [(f"blk.{i}.ssm_in.weight", m + "in_proj.weight", sd[m + "in_proj.weight"], True),
                    (f"blk.{i}.ssm_conv1d.weight", None, sd[m + "conv1d.weight"].squeeze(), False),
                    (f"blk.{i}.ssm_conv1d.bias", None, sd[m + "conv1d.bias"], False),
                    (f"blk.{i}.ssm_dt.bias", None, sd[m + "dt_bias"], False),
                    (f"blk.{i}.ssm_a", None, -np.exp(sd[m + "A_log"]).reshape(-1, 1), False),
                    (f"blk.{i}.ssm_d", None, sd[m + "D"].reshape(-1, 1), False),
                    (f"blk.{i}.ssm_norm.weight", None, sd[m + "norm.weight"].reshape(G, -1), False),
                    (f"blk.{i}.ssm_out.weight", m + "out_proj.weight", sd[m + "out_proj.weight"], True)]
        elif kind == "*":
            out += [(f"blk.{i}.attn_q.weight", None, _permute(sd[m + "q_proj.weight"], cfg.num_attention_heads),
                     False),
                    (f"blk.{i}.attn_k.weight", None, _permute(sd[m + "k_proj.weight"], cfg.num_key_value_heads),
                     False),
                    (f"blk.{i}.attn_v.weight", m + "v_proj.weight", sd[m + "v_proj.weight"], True),
                    (f"blk.{i}.attn_output.weight", m + "o_proj.weight", sd[m + "o_proj.weight"], True)]
        elif kind == "E":
            out += [(f"blk.{i}.ffn_gate_inp.weight", m + "gate.weight", sd[m + "gate.weight"], False),
                    (f"blk.{i}.exp_probs_b.bias", None, sd[m + "gate.e_score_correction_bias"], False),
                    (f"blk.{i}.ffn_up_exps.weight", m + "experts.up_proj", sd[m + "experts.up_proj"], "expert"),
                    (f"blk.{i}.ffn_down_exps.weight", m + "experts.down_proj", sd[m + "experts.down_proj"], "down"),
                    (f"blk.{i}.ffn_up_shexp.weight", m + "shared_experts.up_proj.weight",
                     sd[m + "shared_experts.up_proj.weight"], True),
                    (f"blk.{i}.ffn_down_shexp.weight", m + "shared_experts.down_proj.weight",
                     sd[m + "shared_experts.down_proj.weight"], True)]
        else:
            out += [(f"blk.{i}.ffn_up.weight", m + "up_proj.weight", sd[m + "up_proj.weight"], True),
                    (f"blk.{i}.ffn_down.weight", m + "down_proj.weight", sd[m + "down_proj.weight"], True)]
    return out


def _nemotron_meta(w, cfg, arch, blocks):
    L = len(NEMOTRON_PATTERN)
    w.add_block_count(blocks)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length([cfg.moe_intermediate_size if c == "E" else 0 for c in NEMOTRON_PATTERN])
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([cfg.num_key_value_heads if c == "*" else 0 for c in NEMOTRON_PATTERN])
    w.add_layer_norm_eps(cfg.layer_norm_epsilon)  # the config's layer_norm_epsilon, as TextModel writes it
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(cfg.moe_shared_expert_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_ssm_conv_kernel(cfg.conv_kernel)
    w.add_ssm_state_size(cfg.ssm_state_size)
    w.add_ssm_group_count(cfg.n_groups)
    w.add_ssm_inner_size(cfg.mamba_num_heads * cfg.mamba_head_dim)
    w.add_ssm_time_step_rank(cfg.mamba_num_heads)
    assert blocks == L


CONVERTERS["nemotron_h_moe"] = (_nemotron_tensors, _nemotron_meta)


@pytest.mark.parametrize("experts,dense", [(("F32", "F32", "F32"), "F32"), (("Q8_0", "Q8_0", "Q4_0"), "Q8_0")])
def test_nemotron_h_moe_matches_transformers(tmp_path, experts, dense):
    """Nemotron-H MoE (`nemotron_h_moe`): Mamba-2, attention (q/k permuted by the converter), ungated relu^2 experts
    (ffn_up_exps and ffn_down_exps only, kept packed) with a shared expert, a dense MLP layer."""
    import transformers

    config = transformers.NemotronHConfig(hybrid_override_pattern=NEMOTRON_PATTERN, **NEMOTRON)
    torch.manual_seed(2)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms at 1, D at 1, the correction bias at 0: random, so every weight counts
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(".D"):
                p.copy_(1 + torch.randn_like(p) * 0.3)
            elif n.endswith("A_log"):
                p.copy_(torch.rand_like(p) * 2 - 1)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    path = tmp_path / "nemotron_h_moe.gguf"
    ref = _reference(model, write_2026(path, model, "nemotron_h_moe", experts, dense))
    loaded = load_model(path, dtype="float32")
    assert loaded.expert_format.name == "gguf-" + "-".join(dict.fromkeys(experts[1:]))
    assert "w1" not in loaded.expert_format.types
    _check(path, ref, "nemotron_h")
    from moechat.engine.plan import read_model_spec

    spec = read_model_spec(path)  # fit: up I rows (Q8_0: 68 B per 64 inputs) + down H rows (Q4_0: 18 B per 32)
    want = 32 * 64 * 4 + 64 * 32 * 4 if experts[0] == "F32" else 32 * 68 + 64 * 18
    assert (spec.expert_bytes, spec.num_experts, spec.num_moe_layers) == (want, 8, 2)
    if experts[0] != "F32":
        _int8_from_gguf(path, tmp_path)


# -- Gemma 4 (its text MoE): Gemma4Model (a Gemma3Model) -------------------------------------------------------

GEMMA4_ROPE = {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
               "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}
GEMMA4 = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, global_head_dim=64, num_global_key_value_heads=1, intermediate_size=64,
              moe_intermediate_size=32, num_experts=8, top_k_experts=2, enable_moe_block=True, attention_k_eq_v=True,
              sliding_window=5, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
              hidden_size_per_layer_input=0, final_logit_softcapping=30.0, max_position_embeddings=512,
              initializer_range=0.2, rope_parameters=GEMMA4_ROPE, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)


def _gemma4_tensors(cfg, sd: dict, arch: str):
    """Gemma4Model.modify_tensors: the tensor map's names, router.scale as ffn_gate_inp.scale, per_expert_scale as
    ffn_down_exps.scale, layer_scalar as layer_output_scale.weight, the experts' gate_up kept fused
    (ffn_gate_up_exps), no norm offset; generate_extra_tensors' rope_freqs for the full layers."""
    names = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
             "input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "post_attention_norm.weight",
             "pre_feedforward_layernorm.weight": "ffn_norm.weight",
             "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
             "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
             "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
             "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight", "router.proj.weight": "ffn_gate_inp.weight",
             "router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale",
             "layer_scalar": "layer_output_scale.weight"}
    full = cfg.rope_parameters["full_attention"]
    full_dim = GEMMA4["global_head_dim"]  # transformers moves it into per_layer_config
    rot = int(full_dim * full["partial_rotary_factor"] / 2)
    freqs = np.array([1.0] * rot + [1e30] * (full_dim // 2 - rot), np.float32)
    out = [("token_embd.weight", "model.embed_tokens.weight", sd["model.embed_tokens.weight"], True),
           ("output_norm.weight", "model.norm.weight", sd["model.norm.weight"], False),
           ("rope_freqs.weight", None, freqs, False)]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [(f"blk.{i}.{g}", p + hf, sd[p + hf], hf.endswith("proj.weight") and "router" not in hf)
                for hf, g in names.items() if p + hf in sd]
        out.append((f"blk.{i}.ffn_gate_up_exps.weight", p + "experts.gate_up_proj", sd[p + "experts.gate_up_proj"],
                    "expert"))
        out.append((f"blk.{i}.ffn_down_exps.weight", p + "experts.down_proj", sd[p + "experts.down_proj"], "down"))
    return out


def _gemma4_meta(w, cfg, arch, blocks):
    """From the Hub config's spelling (GEMMA4: global_head_dim, num_global_key_value_heads), as the converter reads
    config.json; transformers' config object moves those into per_layer_config."""
    c = GEMMA4
    swa = [t == "sliding_attention" for t in c["layer_types"]]
    w.add_block_count(blocks)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_rope_freq_base(c["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(c["rope_parameters"]["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(c["num_experts"])
    w.add_expert_used_count(c["top_k_experts"])
    w.add_final_logit_softcapping(c["final_logit_softcapping"])
    w.add_sliding_window(c["sliding_window"])
    w.add_shared_kv_layers(0)
    w.add_embedding_length_per_layer_input(0)
    w.add_sliding_window_pattern(swa)
    w.add_key_length(c["global_head_dim"])
    w.add_value_length(c["global_head_dim"])
    w.add_key_length_swa(c["head_dim"])
    w.add_value_length_swa(c["head_dim"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_head_count_kv([c["num_key_value_heads"] if s else c["num_global_key_value_heads"] for s in swa])
    w.add_rope_dimension_count(c["global_head_dim"])
    w.add_rope_dimension_count_swa(c["head_dim"])


CONVERTERS["gemma4"] = (_gemma4_tensors, _gemma4_meta)


@pytest.mark.parametrize("experts,dense", [(("F32", "F32", "F32"), "F32"), (("Q8_0", "Q8_0", "Q4_0"), "Q8_0")])
def test_gemma4_matches_transformers(tmp_path, experts, dense):
    """Gemma 4's text MoE (`gemma4`): sliding and full layers of their own head dims and KV heads, K as V on the full
    layer, proportional RoPE from rope_freqs, fused gate_up experts kept packed (ffn_gate_up_exps), router and
    per-expert scales, layer scalars, soft-capped logits, tied embeddings."""
    import transformers

    config = transformers.AutoConfig.for_model("gemma4_text", **GEMMA4)
    torch.manual_seed(4)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms, scales and layer scalars away from their initial values, so each is checked
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(("_1.weight", "_2.weight")) or "scale" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand_like(b) + 0.5)
    path = tmp_path / "gemma4.gguf"
    ref = _reference(model, write_2026(path, model, "gemma4", experts, dense))
    loaded = load_model(path, dtype="float32")
    assert loaded.expert_format.types.keys() == {"w13", "w2"}
    _check(path, ref, "gemma4_text")
    from moechat.engine.plan import read_model_spec

    spec = read_model_spec(path)  # fit: gate_up 2I rows (Q8_0: 68 B per 64 inputs) + down H rows (Q4_0: 18 B / 32)
    want = 64 * 64 * 4 + 64 * 32 * 4 if experts[0] == "F32" else 64 * 68 + 64 * 18
    assert (spec.expert_bytes, spec.num_experts, spec.num_moe_layers) == (want, 8, 3)
    if experts[0] != "F32":
        _int8_from_gguf(path, tmp_path)


def test_the_2026_families_dense_siblings_and_an_arch_moechat_lacks_are_one_typed_line(tmp_path):
    from moechat.engine.errors import UnsupportedModelError

    for arch, words in (("qwen35", "dense model"), ("nemotron_h", "dense model"), ("falcon-h1", "not supported")):
        path = tmp_path / f"{arch}.gguf"
        w = gguf.GGUFWriter(str(path), arch)
        w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(UnsupportedModelError, match=words) as e:
            load_model(path, dtype="float32")
        assert "\n" not in str(e.value) and "qwen35moe" in str(e.value) and "gemma4" in str(e.value)


def test_moechat_run_on_a_qwen35moe_gguf_gives_transformers_greedy_tokens(tmp_path, capsys):
    """`moechat run FILE.gguf` end to end on a 2026 family (Qwen3.6's qwen35moe, Q4_K/Q6_K experts as a Q4_K_M file
    ships them): greedy tokens == transformers on the dequantized weights in fp32."""
    import json

    from moechat.app.cli import main as cli

    wide = dict(QWEN_HYBRID, hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                num_experts=4)
    import transformers

    config = transformers.AutoConfig.for_model("qwen3_5_moe_text", **wide)
    torch.manual_seed(9)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path / "qwen3.6-tiny-Q4_K_M.gguf"
    ref = _reference(model, write_2026(path, model, "qwen35moe", ("Q4_K", "Q4_K", "Q6_K"), "Q8_0"))
    ids = _prompt(5, seed=21)
    with torch.inference_mode():
        want = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8, min_new_tokens=0,
                            pad_token_id=0)[0, 5:].tolist()
    code = cli.main(["run", str(path), "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "8",
                     "--temperature", "0", "--dtype", "float32", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert json.loads(out)["token_ids"] == want
