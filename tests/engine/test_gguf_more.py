"""gpt-oss and deepseek2 GGUF files: a tiny transformers model written as llama.cpp's convert_hf_to_gguf.py writes
that architecture, loaded by moechat, against transformers on the dequantized weights in fp32."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from moechat.engine.load.loader import load_model  # noqa: E402
from moechat.engine.quant.gguf import TYPES, dequantize  # noqa: E402
from moechat.engine.runtime.generate import Engine  # noqa: E402

from .test_gguf_load import GREEDY, _encode, _prompt  # noqa: E402


class _Writer:
    """A GGUFWriter plus the state dict the file holds after quantization (HF names, dequantized)."""

    def __init__(self, path, arch, seed=0, skip=()):
        self.skip = set(skip)  # tensors left out (a damaged conversion)
        self.w = gguf.GGUFWriter(str(path), arch)
        self.rng = np.random.default_rng(seed)
        self.path = path
        self.held: dict[str, torch.Tensor] = {}

    def put(self, gname, arr, typ="F32", hf=None):
        """Write `arr` (fp32 numpy) as `gname` in `typ`; return its dequantized values (and keep them as `hf`)."""
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        data = _encode(arr, typ, self.rng)
        if gname not in self.skip:
                self.w.add_tensor(gname, data, raw_dtype=None if typ in ("F32", "F16") else Q[typ])
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).copy())
        back = dequantize(raw.reshape(-1, raw.shape[-1]) if raw.dim() > 1 else raw[None], TYPES[typ], arr.shape[-1])
        back = back.reshape(arr.shape)
        if hf is not None:
            self.held[hf] = back
        return back

    def close(self):
        self.w.write_header_to_file(self.path)
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()
        return self.held


def _check(model, held, path, n_prompt=13, steps=8):
    """moechat on the file == transformers on the held weights: fp32 logits ~1e-4 and greedy tokens."""
    ref = copy.deepcopy(model)
    ref.load_state_dict(held, strict=True)
    engine = Engine(load_model(path, dtype="float32"), None, None, {}, 512, 16)
    assert engine.args.model_type == model.config.model_type
    for n, seed in ((1, 2), (n_prompt, 4)):
        ids = _prompt(n, seed=seed)
        with torch.inference_mode():
            ours = engine._forward(engine.new_sequence(), ids)
            theirs = ref(torch.tensor([ids])).logits[0, -1].float()
        assert (ours - theirs).abs().max().item() < 1e-4
    ids = _prompt(n_prompt, seed=4)
    got = [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=steps) for t in c.token_ids]
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=steps, min_new_tokens=0,
                           pad_token_id=0)
    assert got == out[0, n_prompt:].tolist() and len(got) == steps
    return engine


# -- gpt-oss -------------------------------------------------------------------------------------------------------

def tiny_gpt_oss():
    import transformers

    config = transformers.AutoConfig.for_model(
        "gpt_oss", vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=16,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=6,
        max_position_embeddings=512, initializer_range=0.2, eos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 150000.0})
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # the init leaves sinks and biases at zero: give them values the test can see
        for name, p in model.named_parameters():
            if "sinks" in name or name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


def write_gpt_oss_gguf(path, model, expert="MXFP4", dense="Q8_0", sinks_suffix=".weight", meta=None):
    """As GptOssModel in convert_hf_to_gguf.py: gate_up_proj [E, H, 2I] transposed and split by row parity into
    ffn_gate_exps (even) / ffn_up_exps (odd), their biases likewise, down_proj transposed, sinks as attn_sinks,
    post_attention_layernorm as post_attention_norm, the router as ffn_gate_inp with its bias; YaRN metadata."""
    cfg = model.config
    W = _Writer(path, "gpt-oss")
    w = W.w
    rope = cfg.rope_parameters
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if meta is not None:
        meta(w)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    W.put("token_embd.weight", sd["model.embed_tokens.weight"], dense, "model.embed_tokens.weight")
    W.put("output_norm.weight", sd["model.norm.weight"], "F32", "model.norm.weight")
    W.put("output.weight", sd["lm_head.weight"], dense, "lm_head.weight")
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "post_attention_norm", "mlp.router": "ffn_gate_inp"}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, g in names.items():
            for kind in ("weight", "bias"):
                if p + hf + "." + kind in sd:
                    arr = sd[p + hf + "." + kind]
                    typ = dense if arr.ndim == 2 and g != "ffn_gate_inp" else "F32"
                    W.put(f"blk.{i}.{g}.{kind}", arr, typ, p + hf + "." + kind)
        W.put(f"blk.{i}.attn_sinks{sinks_suffix}", sd[p + "self_attn.sinks"], "F32", p + "self_attn.sinks")
        e = p + "mlp.experts."
        expert_t = expert[i] if isinstance(expert, dict) else expert  # by layer, as mixes are
        gate_up = sd[e + "gate_up_proj"].swapaxes(1, 2)  # [E, 2I, H]
        g = W.put(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, ::2], expert_t)
        u = W.put(f"blk.{i}.ffn_up_exps.weight", gate_up[:, 1::2], expert_t)
        W.held[e + "gate_up_proj"] = torch.stack([g, u], dim=2).reshape(gate_up.shape).transpose(1, 2).contiguous()
        bias = sd[e + "gate_up_proj_bias"]  # [E, 2I]
        bg = W.put(f"blk.{i}.ffn_gate_exps.bias", bias[:, ::2])
        bu = W.put(f"blk.{i}.ffn_up_exps.bias", bias[:, 1::2])
        W.held[e + "gate_up_proj_bias"] = torch.stack([bg, bu], dim=2).reshape(bias.shape)
        d = W.put(f"blk.{i}.ffn_down_exps.weight", sd[e + "down_proj"].swapaxes(1, 2), expert_t)  # [E, H, I]
        W.held[e + "down_proj"] = d.transpose(1, 2).contiguous()
        W.put(f"blk.{i}.ffn_down_exps.bias", sd[e + "down_proj_bias"], "F32", e + "down_proj_bias")
    return W.close()


@pytest.fixture(scope="module")
def gpt_oss():
    return tiny_gpt_oss()


@pytest.mark.parametrize("expert,dense,sinks", [("MXFP4", "Q8_0", ".weight"), ("Q8_0", "F32", ""),
                                               ("BF16", "F16", ".weight")])
def test_gpt_oss_gguf_matches_transformers(tmp_path, gpt_oss, expert, dense, sinks):
    """MXFP4 experts re-interleaved from the split gate/up, per-projection biases, sinks, the sliding/full
    alternation (window 6 < the 13-token prompt), YaRN from the metadata: fp32 logits and greedy tokens."""
    path = tmp_path / "gpt-oss.gguf"
    held = write_gpt_oss_gguf(path, gpt_oss, expert, dense, sinks)
    engine = _check(gpt_oss, held, path)
    args = engine.args
    assert args.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert args.sliding_window == 6 and args.rope_parameters["factor"] == 8.0
    assert engine.loaded.expert_format.name == f"gguf-{expert}"


def test_cached_gpt_oss_gguf_experts_give_the_resident_tokens(tmp_path, gpt_oss):
    from moechat.engine.cache.provider import CacheConfig

    path = tmp_path / "gpt-oss.gguf"
    write_gpt_oss_gguf(path, gpt_oss)
    resident = Engine.load(path, dtype="float32")
    cached = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=2, ram_cache_bytes=0))
    ids = _prompt(9, seed=8)
    want = [t for c in resident.generate(ids, sampling=GREEDY, max_tokens=8) for t in c.token_ids]
    got = [t for c in cached.generate(ids, sampling=GREEDY, max_tokens=8) for t in c.token_ids]
    assert got == want and len(want) == 8
    assert sum(cached.cache_snapshot().misses) > 0
    cached.close()


# -- deepseek2 -----------------------------------------------------------------------------------------------------

DEEPSEEK = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
                kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=8, v_head_dim=32, first_k_dense_replace=1,
                n_shared_experts=1, max_position_embeddings=512, initializer_range=0.2, eos_token_id=None,
                pad_token_id=None, bos_token_id=None)
VARIANTS = {  # V3: sigmoid routing in groups with the correction bias, a low-rank query; V2-Lite: softmax, full q
    "deepseek_v3": dict(q_lora_rank=64, n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.8,
                                         "rope_theta": 10000.0}),
    "deepseek_v2": dict(q_lora_rank=None, routed_scaling_factor=1.0, norm_topk_prob=False, topk_method="greedy"),
}


def tiny_deepseek(model_type):
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **{**DEEPSEEK, **VARIANTS[model_type]})
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.5)
    return model


def write_deepseek2_gguf(path, model, split_kv_b=True, expert=("Q8_0", "Q8_0", "Q4_0"), dense="Q8_0", skip=()):
    """As DeepseekV2Model in convert_hf_to_gguf.py: MLA tensors under llama.cpp's names, kv_b_proj split per head into
    attn_k_b (its key rows, transposed: [nH, C, N]) and attn_v_b ([nH, V, C]) as recent converters write it (or
    whole as attn_kv_b, as older ones did), the key/value lengths of the absorbed form with the per-head ones as
    *_mla, the correction bias as exp_probs_b.bias; experts stacked."""
    cfg = model.config
    v3 = cfg.model_type == "deepseek_v3"
    W = _Writer(path, "deepseek2", skip=skip)
    w = W.w
    nope, rope, v_dim, C = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(C)
    if split_kv_b:  # the absorbed form: one latent "head" of C + R keys and C values; per-head sizes as *_mla
        w.add_head_count_kv(1)
        w.add_key_length(C + rope)
        w.add_value_length(C)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v_dim)
    else:
        w.add_head_count_kv(cfg.num_attention_heads)
        w.add_key_length(nope + rope)
        w.add_value_length(v_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if v3:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    w.add_rope_dimension_count(rope)
    scaling = cfg.rope_parameters
    if scaling.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    W.put("token_embd.weight", sd["model.embed_tokens.weight"], dense, "model.embed_tokens.weight")
    W.put("output_norm.weight", sd["model.norm.weight"], "F32", "model.norm.weight")
    W.put("output.weight", sd["lm_head.weight"], dense, "lm_head.weight")
    names = {"self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
             "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
             "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.o_proj": "attn_output",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
             "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
             "mlp.shared_experts.down_proj": "ffn_down_shexp", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    H = cfg.num_attention_heads
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, g in names.items():
            if p + hf + ".weight" in sd:
                arr = sd[p + hf + ".weight"]
                W.put(f"blk.{i}.{g}.weight", arr, dense if arr.ndim == 2 and g != "ffn_gate_inp" else "F32",
                      p + hf + ".weight")
        kv_b = sd[p + "self_attn.kv_b_proj.weight"]  # [nH * (N + V), C]
        if split_kv_b:
            per = kv_b.reshape(H, nope + v_dim, C)
            k_b = W.put(f"blk.{i}.attn_k_b.weight", per[:, :nope].swapaxes(1, 2), dense)  # [nH, C, N]
            v_b = W.put(f"blk.{i}.attn_v_b.weight", per[:, nope:], dense)  # [nH, V, C]
            W.held[p + "self_attn.kv_b_proj.weight"] = torch.cat([k_b.transpose(1, 2), v_b], 1).reshape(kv_b.shape)
        else:
            W.put(f"blk.{i}.attn_kv_b.weight", kv_b, dense, p + "self_attn.kv_b_proj.weight")
        if p + "mlp.gate.e_score_correction_bias" in sd:
            W.put(f"blk.{i}.exp_probs_b.bias", sd[p + "mlp.gate.e_score_correction_bias"], "F32",
                  p + "mlp.gate.e_score_correction_bias")
        if p + "mlp.experts.gate_up_proj" in sd:
            gate_up, I = sd[p + "mlp.experts.gate_up_proj"], cfg.moe_intermediate_size  # [E, 2I, H]
            ts = expert[i] if isinstance(expert, dict) else expert  # per layer, as Q4_K_M mixes them
            g = W.put(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :I], ts[0])
            u = W.put(f"blk.{i}.ffn_up_exps.weight", gate_up[:, I:], ts[1])
            W.held[p + "mlp.experts.gate_up_proj"] = torch.cat([g, u], dim=1)
            W.put(f"blk.{i}.ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"], ts[2],
                  p + "mlp.experts.down_proj")
    return W.close()


@pytest.mark.parametrize("model_type,split_kv_b", [("deepseek_v3", True), ("deepseek_v2", False),
                                                   ("deepseek_v2", True)])
def test_deepseek2_gguf_matches_transformers(tmp_path, model_type, split_kv_b):
    """MLA from attn_k_b / attn_v_b (recent converters) or attn_kv_b (older ones), a dense first layer, shared
    experts, V3's sigmoid routing in expert groups with exp_probs_b, V2's softmax: fp32 logits and greedy tokens."""
    model = tiny_deepseek(model_type)
    path = tmp_path / "deepseek2.gguf"
    held = write_deepseek2_gguf(path, model, split_kv_b)
    engine = _check(model, held, path)
    args = engine.args
    assert (args.qk_nope_head_dim, args.v_head_dim, args.kv_lora_rank) == (32, 32, 32)
    assert args.q_lora_rank == model.config.q_lora_rank and args.first_k_dense_replace == 1
    if model_type == "deepseek_v3":
        rope = args.rope_parameters
        assert rope["rope_type"] == "yarn" and rope["mscale_all_dim"] == pytest.approx(0.8)


def test_cached_deepseek2_gguf_experts_give_the_resident_tokens(tmp_path):
    from moechat.engine.cache.provider import CacheConfig

    path = tmp_path / "deepseek2.gguf"
    write_deepseek2_gguf(path, tiny_deepseek("deepseek_v3"))
    resident = Engine.load(path, dtype="float32")
    cached = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=3, ram_cache_bytes=0))
    ids = _prompt(9, seed=8)
    want = [t for c in resident.generate(ids, sampling=GREEDY, max_tokens=8) for t in c.token_ids]
    got = [t for c in cached.generate(ids, sampling=GREEDY, max_tokens=8) for t in c.token_ids]
    assert got == want and len(want) == 8
    assert sum(cached.cache_snapshot().misses) > 0
    cached.close()


def test_gpt_oss_gguf_experts_convert_to_int8_with_their_biases(tmp_path, gpt_oss):
    """--expert-format int8 from a gpt-oss GGUF: gate/up re-interleaved with their biases joined the same way; logits
    within int8's error of the packed MXFP4 file's own."""
    from moechat.engine.cache.provider import CacheConfig

    path = tmp_path / "gpt-oss.gguf"
    write_gpt_oss_gguf(path, gpt_oss)
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


def test_fit_reads_gpt_oss_and_deepseek2_gguf_headers(tmp_path, gpt_oss):
    """`fit` on both: the experts as packed (MXFP4: 17 bytes per 32 weights), the MoE layers (deepseek2's first is
    dense), the file's bytes per type with attn_k_b and attn_v_b both counted."""
    from moechat.engine.plan import read_model_spec

    path = tmp_path / "gpt-oss.gguf"
    write_gpt_oss_gguf(path, gpt_oss)
    spec = read_model_spec(path)
    H, I = 64, 32
    bias = (2 * I + H) * 2  # gate, up and down biases, bf16 (the file's dense tensors are Q8_0)
    assert spec.expert_bytes == 2 * I * (H // 32 * 17) + H * (I // 32 * 17) + bias and spec.num_moe_layers == 3
    assert spec.expert_format == "GGUF MXFP4/MXFP4/MXFP4" and spec.checkpoint_bytes == path.stat().st_size
    path = tmp_path / "deepseek2.gguf"
    write_deepseek2_gguf(path, tiny_deepseek("deepseek_v3"))
    spec = read_model_spec(path)
    assert spec.num_experts == 8 and spec.num_moe_layers == 2
    assert spec.expert_bytes == 2 * 32 * (64 // 32 * 34) + 64 * (32 // 32 * 18)  # Q8_0 gate/up, Q4_0 down
    reader = gguf.GGUFReader(path)
    q8 = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type.name == "Q8_0")
    assert any(f"Q8_0 {q8 / 1024:.1f} KiB" in n for n in spec.notes)


def test_deepseek2_gguf_whose_expert_types_change_by_layer(tmp_path):
    """DeepSeek's Q4_K_M-style releases change ffn_down_exps' type by layer: each MoE layer (after the dense first)
    computed resident in its own types, still transformers' tokens."""
    model = tiny_deepseek("deepseek_v3")
    path = tmp_path / "mixed.gguf"
    held = write_deepseek2_gguf(path, model, expert={1: ("Q8_0", "Q8_0", "Q5_0"), 2: ("Q4_0", "Q8_0", "Q4_1")})
    engine = _check(model, held, path, steps=6)
    assert [engine.loaded.provider.prepare(layer, torch.zeros(1, 2, dtype=torch.long)).format.types["w2"].name
            for layer in (1, 2)] == ["Q5_0", "Q4_1"]


def test_damaged_gpt_oss_and_deepseek2_files_are_one_typed_line(tmp_path, gpt_oss):
    from moechat.engine.errors import CheckpointError, UnsupportedModelError

    path = tmp_path / "no-v_b.gguf"
    write_deepseek2_gguf(path, tiny_deepseek("deepseek_v2"), skip={"blk.1.attn_v_b.weight"})
    with pytest.raises(CheckpointError, match=r"'blk.1.attn_k_b.weight' needs its pair 'blk.1.attn_v_b.weight'") as e:
        load_model(path, dtype="float32")
    assert "\n" not in str(e.value)
    path = tmp_path / "linear-rope.gguf"
    write_gpt_oss_gguf(path, gpt_oss, meta=lambda w: w.add_string("gpt-oss.rope.scaling.type", "linear"))
    with pytest.raises(UnsupportedModelError, match="not the YaRN gpt-oss is trained with") as e:
        load_model(path, dtype="float32")
    assert "\n" not in str(e.value)


def test_gpt_oss_gguf_whose_expert_types_change_by_layer(tmp_path, gpt_oss):
    """Experts MXFP4 in one layer, Q8_0 and Q4_0 in the others: resident, each layer in its own interleaved format
    with its biases (converted to the compute dtype); transformers' tokens in fp32, and a bf16 load runs."""
    path = tmp_path / "mixed.gguf"
    held = write_gpt_oss_gguf(path, gpt_oss, expert={0: "MXFP4", 1: "Q8_0", 2: "Q4_0"})
    engine = _check(gpt_oss, held, path, steps=6)
    fmts = [engine.loaded.provider.prepare(layer, torch.zeros(1, 2, dtype=torch.long)).format for layer in range(3)]
    assert [f.types["w1"].name for f in fmts] == ["MXFP4", "Q8_0", "Q4_0"] and all(f.interleaved for f in fmts)
    bf16 = Engine(load_model(path, dtype="bfloat16"), None, None, {}, 512, 16)
    batch = bf16.loaded.provider.prepare(1, torch.zeros(1, 2, dtype=torch.long))
    assert batch.tensors["w3_bias"].dtype == torch.bfloat16
    want = held["model.layers.1.mlp.experts.gate_up_proj_bias"][:, 1::2].to(torch.bfloat16)  # up's, every expert
    assert torch.equal(batch.tensors["w3_bias"][:want.shape[0]], want)
    got = [t for c in bf16.generate(_prompt(5, seed=3), sampling=GREEDY, max_tokens=4) for t in c.token_ids]
    assert len(got) == 4
