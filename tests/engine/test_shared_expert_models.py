"""DeepSeek-V2, DeepSeek-V3, GLM-4.5 and Qwen2-MoE end to end against transformers.

Two tiny configs per type, where the options differ: MLA with and without a low-rank query, interleaved and
plain RoPE, YaRN with mscale / mscale_all_dim; greedy, group-limited-softmax and sigmoid routing with a
non-zero correction bias in several groups (topk_group < n_group); 1 and 2 shared experts; first_k_dense_replace
0 and 1; partial rotary and q/k norm (GLM); a gated shared expert, a dense layer and a sliding window (Qwen2).
Each is saved by transformers, then its config.json is rewritten in the Hub's spelling (rope_theta +
rope_scaling with `type`), and the DeepSeek-V3 one gets a multi-token-prediction layer past the last layer, as
the Hub's checkpoint has. The in-memory transformers model is the oracle.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, do_sample=False)
TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, initializer_range=0.2,
            max_position_embeddings=512, rms_norm_eps=1e-6)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.9, "mscale_all_dim": 0.8,
        "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1}
MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, moe_intermediate_size=16,
           intermediate_size=48)
VARIANTS = {
    # sigmoid + correction bias, 4 groups keep 2, q_lora, YaRN (mscale != mscale_all_dim), interleaved rope, MTP layer
    "deepseek_v3": ("deepseek_v3", dict(MLA, q_lora_rank=24, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                        topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                                        rope_parameters=YARN)),
    # no q_lora, no groups, 2 shared experts, no dense layer, plain rope, attention biases, no renormalisation
    "deepseek_v3_plain": ("deepseek_v3", dict(MLA, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2,
                                              n_group=1, topk_group=1, n_shared_experts=2, first_k_dense_replace=0,
                                              rope_interleave=False, norm_topk_prob=False, routed_scaling_factor=1.5,
                                              attention_bias=True)),
    # V2-Lite's shape: no q_lora, greedy softmax, 2 shared experts, a dense first layer, YaRN with mscale 0.707
    "deepseek_v2_lite": ("deepseek_v2", dict(MLA, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=3,
                                             topk_method="greedy", n_shared_experts=2, first_k_dense_replace=1,
                                             rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.707))),
    # V2's shape: q_lora, group-limited greedy, routed_scaling_factor
    "deepseek_v2_grouped": ("deepseek_v2", dict(MLA, q_lora_rank=24, n_routed_experts=16, num_experts_per_tok=3,
                                                topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                n_shared_experts=1, first_k_dense_replace=0,
                                                routed_scaling_factor=2.0)),
    # partial rotary 0.5, q/k/v biases (none on o), q/k norm, sigmoid groups with a bias, a dense first layer
    "glm4_moe": ("glm4_moe", dict(head_dim=16, num_key_value_heads=2, n_routed_experts=16, num_experts_per_tok=4,
                                  n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                                  moe_intermediate_size=16, intermediate_size=48, attention_bias=True,
                                  use_qk_norm=True, routed_scaling_factor=2.5)),
    "glm4_moe_plain": ("glm4_moe", dict(head_dim=16, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                                        n_group=1, topk_group=1, n_shared_experts=2, first_k_dense_replace=0,
                                        moe_intermediate_size=16, intermediate_size=48, partial_rotary_factor=0.25,
                                        norm_topk_prob=False)),
    "qwen2_moe": ("qwen2_moe", dict(head_dim=16, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=16, intermediate_size=48,
                                    shared_expert_intermediate_size=40)),
    "qwen2_moe_window": ("qwen2_moe", dict(head_dim=16, num_key_value_heads=1, num_experts=6, num_experts_per_tok=3,
                                           moe_intermediate_size=16, intermediate_size=48,
                                           shared_expert_intermediate_size=24, norm_topk_prob=True,
                                           mlp_only_layers=[1], use_sliding_window=True, sliding_window=7,
                                           max_window_layers=2)),
}
MLA_VARIANTS = [n for n, (t, _) in VARIANTS.items() if t.startswith("deepseek")]
MTP = "deepseek_v3"  # the variant whose checkpoint carries a multi-token-prediction layer


def hub_spelling(config: dict) -> dict:
    """transformers 5's config.json rewritten as the Hub's files are: rope_theta + rope_scaling {type: ...},
    torch_dtype, partial_rotary_factor at the top, DeepSeek's topk_method / scoring_func, no derived keys."""
    c = dict(config)
    rope = dict(c.pop("rope_parameters", None) or {})
    c["rope_theta"] = rope.pop("rope_theta", 10000.0)
    if "partial_rotary_factor" in rope:
        c["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    kind = rope.pop("rope_type", "default")
    c["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    c["torch_dtype"] = c.pop("dtype", "float32")
    if c["model_type"] == "deepseek_v3":
        c.update(topk_method="noaux_tc", scoring_func="sigmoid")
    if c["model_type"].startswith("deepseek"):
        for derived in ("head_dim", "qk_head_dim"):
            c.pop(derived, None)
        c["num_key_value_heads"] = c["num_attention_heads"]
    return c


def _add_mtp_layer(path, num_layers: int) -> None:
    """Layer `num_layers` as DeepSeek-V3's checkpoint has it: a copy of the last layer plus the MTP projections."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    last = f"model.layers.{num_layers - 1}."
    for name, t in list(tensors.items()):
        if name.startswith(last):
            tensors[f"model.layers.{num_layers}." + name[len(last):]] = t.clone()
    H, V = tensors["model.embed_tokens.weight"].shape[1], tensors["model.embed_tokens.weight"].shape[0]
    p = f"model.layers.{num_layers}."
    tensors.update({p + "enorm.weight": torch.ones(H), p + "hnorm.weight": torch.ones(H),
                    p + "eh_proj.weight": torch.randn(H, 2 * H), p + "shared_head.norm.weight": torch.ones(H),
                    p + "shared_head.head.weight": torch.randn(V, H)})
    save_file(tensors, str(file), metadata={"format": "pt"})


def build_variant(path, name: str, seed: int):
    """Save a random tiny model of this variant with transformers (Hub spelling); return the transformers model."""
    import transformers

    model_type, overrides = VARIANTS[name]
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers starts the correction bias at zero: make it steer the choice
        for buf_name, buf in model.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape) * 0.3)
    model.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    spelled = hub_spelling(raw)
    if name == MTP:
        spelled["num_nextn_predict_layers"] = 1
        _add_mtp_layer(path, raw["num_hidden_layers"])
    (path / "config.json").write_text(json.dumps(spelled, indent=2))
    return model


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """variants(name) -> (directory, transformers model), each built once per module, on first use."""
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            built[name] = (path, build_variant(path, name, seed=list(VARIANTS).index(name)))
        return built[name]

    return get


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def _greedy(engine, ids, n=24, sequence=None):
    return [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=n, sequence=sequence) for t in c.token_ids]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_last_logits_match_transformers(variants, name):
    path, ref = variants(name)
    engine = Engine.load(path, dtype="float32", prefill_chunk=16)  # 70 tokens = 5 chunks
    for n in (1, 5, 23, 70):
        ids = _prompt(n, seed=n)
        seq = engine.new_sequence()
        with torch.inference_mode():
            ours = engine._forward(seq, ids)
            theirs = ref(torch.tensor([ids])).logits[0, -1]
        err = (ours - theirs).abs().max().item()
        assert err < 1e-4, f"{name}, {n} tokens: max |logit diff| {err:.2e}"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_decode_logits_track_transformers_step_by_step(variants, name):
    path, ref = variants(name)
    engine = Engine.load(path, dtype="float32")
    seq = engine.new_sequence()
    with torch.inference_mode():
        logits = engine._forward(seq, _prompt(5, seed=7))
        for step in range(10):  # past qwen2_moe_window's 7-token window
            theirs = ref(torch.tensor([seq.tokens])).logits[0, -1]
            err = (logits - theirs).abs().max().item()
            assert err < 1e-4, f"{name}, step {step}: {err:.2e}"
            logits = engine._forward(seq, [int(logits.argmax())])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_tokens_match_transformers_generate(variants, name):
    path, ref = variants(name)
    engine = Engine.load(path, dtype="float32", prefill_chunk=16)
    ids = _prompt(21, seed=121)  # two prefill chunks, then 32 decode steps
    ours = _greedy(engine, ids, 32)
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32, min_new_tokens=0, pad_token_id=0)
    assert ours == out[0, len(ids):].tolist()
    assert len(ours) == 32 or ours[-1] in engine.eos_token_ids


@pytest.mark.parametrize("name", MLA_VARIANTS)
def test_absorbed_mla_equals_the_expanded_form(variants, name):
    """Latent-space attention (W_UK folded into the query, W_UV after the sum) against per-head K/V, on a decode
    step and on a chunk after a cached prefix."""
    path, _ = variants(name)
    engine = Engine.load(path, dtype="float32")
    model = engine.model
    seq = engine.new_sequence()
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        engine._forward(seq, _prompt(9, seed=9))
        start = seq.kv.length
        for T in (1, 6):
            cos, sin = model.rope_cos[start : start + T], model.rope_sin[start : start + T]
            for layer in model.layer_list:
                x = torch.randn(T, model.args.hidden_size, generator=g)
                residual = torch.zeros_like(x)
                absorbed = layer.attn.forward(x, cos, sin, seq.kv, start, residual, absorbed=True)
                expanded = layer.attn.forward(x, cos, sin, seq.kv, start, residual, absorbed=False)
                scale = expanded.abs().max().item()
                assert (absorbed - expanded).abs().max().item() <= 1e-5 * max(1.0, scale), (name, T, layer.attn.layer)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2_lite", "glm4_moe"])
def test_kv_cache_bytes_per_token_are_what_the_plan_counts(variants, name):
    from moechat.engine.plan import read_model_spec

    path, _ = variants(name)
    engine = Engine.load(path, dtype="float32", context=64)
    args = engine.args
    kv = engine.new_sequence().kv
    if name.startswith("deepseek"):  # the latent and the shared RoPE key, once per token and layer: no V, no heads
        per_token = args.num_hidden_layers * (args.kv_lora_rank + args.qk_rope_head_dim) * 4
        assert kv.v == [] and kv.k[0].shape == (1, 64, args.kv_lora_rank + args.qk_rope_head_dim)
        expanded = args.num_hidden_layers * args.num_attention_heads * (
            args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim) * 4
        assert expanded / per_token > 2.5  # what caching expanded K/V would take (DeepSeek-V3: 71x)
    else:
        per_token = 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * 4
    assert kv.nbytes() == 64 * per_token
    spec = read_model_spec(path)
    assert spec.kv_bytes_per_token(4) == per_token


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2_lite", "glm4_moe", "qwen2_moe_window"])
@pytest.mark.parametrize("slots", ["1", "K", "E", "L*E"])
def test_cached_equals_resident_at_any_slot_count(variants, name, slots):
    from moechat.engine.cache.provider import CacheConfig

    path, _ = variants(name)
    ids = _prompt(13, seed=5)
    resident_engine = Engine.load(path, dtype="float32")
    resident = _greedy(resident_engine, ids)
    args = resident_engine.args
    moe_layers = resident_engine.loaded.cls.moe_layers(args)
    assert resident_engine.loaded.provider.layers == moe_layers  # dense first layers hold no experts
    E, K, L = args.num_experts, args.top_k, len(moe_layers)
    n = {"1": 1, "K": K, "E": E, "L*E": L * E}[slots]
    engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=n, ram_cache_bytes=0))
    assert _greedy(engine, ids) == resident
    # only routed experts are cached: one slot holds one routed expert, shared experts stay in the dense model
    H, I = args.hidden_size, args.moe_intermediate
    assert engine.provider.pool.slot_bytes == 3 * H * I * 4
    snap = engine.provider.snapshot()
    assert snap.bytes_from_disk == (snap.expert_loads_prefill + snap.expert_loads_decode) * 3 * H * I * 4
    engine.close()


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2_lite", "glm4_moe", "qwen2_moe"])
def test_hybrid_execution_keeps_the_output(variants, name):
    """Issue 16 on the shared-expert families: misses on the host (in place, from the RAM tier), by the cost
    model, or every expert of the first MoE layer on the host; the shared experts stay in the dense model."""
    from moechat.engine.cache.provider import CacheConfig

    path, _ = variants(name)
    ids = _prompt(9, seed=9)
    resident = _greedy(Engine.load(path, dtype="float32"), ids, 10)
    for on_miss, host_layers in (("host", 0), ("auto", 0), ("load", 1)):
        engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=3, on_miss=on_miss,
                                                                      host_layers=host_layers))
        assert _greedy(engine, ids, 10) == resident, (on_miss, host_layers)
        assert sum(engine.provider.snapshot().host_computed) > 0
        engine.close()


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen2_moe"])
def test_prefetch_keeps_the_output(variants, name):
    """Next-layer prediction reads the routers of MoE layers only (dense first layers have none) and never changes
    what is computed."""
    from moechat.engine.cache.provider import CacheConfig

    path, _ = variants(name)
    ids = _prompt(9, seed=8)
    resident = _greedy(Engine.load(path, dtype="float32"), ids, 12)
    engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=6, prefetch="both"))
    assert _greedy(engine, ids, 12) == resident
    assert sum(engine.provider.snapshot().prefetch_issued) > 0
    engine.close()


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2_lite"])
def test_multi_turn_equals_full_reprefill(variants, name):
    """A second turn on the kept latent cache, and a rewind to an earlier prefix, match a fresh prefill."""
    path, _ = variants(name)
    engine = Engine.load(path, dtype="float32", prefill_chunk=8)
    first, second, other = _prompt(11, seed=1), _prompt(6, seed=2), _prompt(4, seed=3)
    seq = engine.new_sequence()
    reply = _greedy(engine, first, 10, sequence=seq)
    assert seq.tokens == first + reply[:-1]  # the last sampled token is not fed yet
    turn = [reply[-1], *second]
    assert _greedy(engine, turn, 10, sequence=seq) == _greedy(engine, first + reply + second, 10)
    seq.truncate(len(first))  # the user edits the second turn: keep the first prompt's latents only
    assert _greedy(engine, other, 10, sequence=seq) == _greedy(engine, first + other, 10)


def test_mtp_layer_in_the_checkpoint_is_ignored(variants):
    from moechat.engine.io.checkpoint import Checkpoint
    from moechat.engine.plan import read_model_spec

    path, _ = variants(MTP)
    L = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    ckpt = Checkpoint.open(path)
    assert f"model.layers.{L}.eh_proj.weight" in ckpt and f"model.layers.{L}.mlp.experts.0.gate_proj.weight" in ckpt
    engine = Engine.load(path, dtype="float32")
    assert len(engine.model.layer_list) == L and engine.loaded.provider.layers == list(range(1, L))
    assert read_model_spec(path).unused_bytes > 0  # the plan leaves the MTP layer out too


def test_hub_and_transformers_5_spellings_parse_alike(variants, tmp_path):
    from moechat.engine.load.loader import read_model_config

    path, ref = variants("deepseek_v3")
    hub = json.loads((path / "config.json").read_text())
    assert hub["rope_scaling"]["type"] == "yarn" and "rope_parameters" not in hub
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "config.json").write_text(ref.config.to_json_string())
    _, a, _ = read_model_config(path)
    _, b, _ = read_model_config(tmp_path / "t5")
    keys = ("rope_type", "rope_theta", "factor", "mscale", "mscale_all_dim", "original_max_position_embeddings")
    assert [a.rope[k] for k in keys] == [b.rope[k] for k in keys] == ["yarn", 10000.0, 4.0, 0.9, 0.8, 128]
    assert (a.n_group, a.topk_group, a.q_lora_rank, a.rope_interleaved) == (b.n_group, b.topk_group, 24, True)


def test_routers_and_the_correction_bias_stay_fp32_in_bfloat16(variants):
    path, _ = variants("deepseek_v3")
    f32, bf16 = Engine.load(path, dtype="float32"), Engine.load(path, dtype="bfloat16")
    block = bf16.model.layer_list[1].ffn
    assert block.gate_weight.dtype == torch.float32 and block.correction_bias.dtype == torch.float32
    assert block.shared_experts.gate_proj.weight.dtype == torch.bfloat16
    ids = _prompt(12, seed=3)
    with torch.inference_mode():
        a = f32._forward(f32.new_sequence(), ids)
        b = bf16._forward(bf16.new_sequence(), ids)
    assert torch.softmax(a, -1).sub(torch.softmax(b, -1)).abs().max().item() < 0.05


# -- FP8 DeepSeek-V3, as the Hub ships it ----------------------------------------------------------------------

FP8_BLOCK = (24, 40)  # partial blocks on every projection (kv_a's 40 rows, the 112-row kv_b, 16-wide experts)


def _fp8_quantised(name: str) -> bool:
    """DeepSeek-V3's FP8 checkpoint quantises every linear layer but the router and lm_head."""
    return name.endswith(("proj.weight", "proj_with_mqa.weight")) and ".mlp.gate." not in name


@pytest.fixture(scope="module")
def fp8_deepseek_v3(variants, tmp_path_factory):
    """The deepseek_v3 variant written FP8 (block scales); the oracle is transformers on the dequantized weights."""
    import transformers

    from moechat.engine.quant.fp8 import dequantize_blocks, quantize_blocks

    src, ref = variants("deepseek_v3")
    path = tmp_path_factory.mktemp("fp8_deepseek_v3")
    tensors = load_file(str(src / "model.safetensors"))
    out, dequantized = {}, {}
    for name, t in tensors.items():
        if _fp8_quantised(name) and t.dim() == 2:
            q, scale = quantize_blocks(t, FP8_BLOCK)
            out[name], out[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize_blocks(q, scale, FP8_BLOCK)
        else:
            out[name] = t
    save_file(out, str(path / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(FP8_BLOCK)}
    (path / "config.json").write_text(json.dumps(config))
    ref_dir = tmp_path_factory.mktemp("fp8_deepseek_v3_dequantized")
    L = ref.config.num_hidden_layers
    save_file({k: v for k, v in {**tensors, **dequantized}.items() if not k.startswith(f"model.layers.{L}.")},
              str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    ref.config.save_pretrained(ref_dir)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    return path, oracle


def test_fp8_deepseek_v3_keeps_experts_fp8_and_matches_transformers(fp8_deepseek_v3):
    from moechat.engine.cache.provider import CacheConfig
    from moechat.engine.quant.fp8 import FP8_DTYPE

    path, oracle = fp8_deepseek_v3
    engine = Engine.load(path, dtype="float32", prefill_chunk=16)
    batch = engine.loaded.provider.prepare(1, torch.zeros(1, 4, dtype=torch.long))
    assert batch.format.name == "fp8" and batch.tensors["w13"].dtype == FP8_DTYPE
    for n in (1, 23):
        ids = _prompt(n, seed=n)
        with torch.inference_mode():
            ours = engine._forward(engine.new_sequence(), ids)
            theirs = oracle(torch.tensor([ids])).logits[0, -1]
        assert (ours - theirs).abs().max().item() < 1e-4, n
    ids = _prompt(11, seed=4)
    with torch.inference_mode():
        out = oracle.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32, min_new_tokens=0,
                              pad_token_id=0)
    expected = out[0, len(ids):].tolist()
    assert _greedy(engine, ids, 32) == expected
    cached = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=4, ram_cache_bytes=0))
    assert _greedy(cached, ids, 32) == expected
    cached.close()


# -- the real configs (../shared/model-configs), read in place ---------------------------------------------------

CONFIGS = Path(__file__).resolve().parents[3] / "shared" / "model-configs"
REAL = {
    "deepseek-v3": "deepseek-ai--DeepSeek-V3/config.json",
    "deepseek-v2-lite": "deepseek-ai--DeepSeek-V2-Lite-Chat/config.reserialized.json",
    "glm-4.5-air": "zai-org--GLM-4.5-Air/config.reserialized.json",
    "qwen1.5-moe": "Qwen--Qwen1.5-MoE-A2.7B/config.finetune-derived.json",
}


def _real(tmp_path, key):
    file = CONFIGS / REAL[key]
    if not file.exists():
        pytest.skip(f"{file} is not here")
    d = tmp_path / key
    d.mkdir()
    (d / "config.json").write_text(file.read_text())
    return d


def test_real_deepseek_v3_config(tmp_path):
    import math

    from moechat.engine.load.loader import checkpoint_format, read_model_config
    from moechat.engine.models.base import rope_frequencies
    from moechat.engine.models.mla import yarn_softmax_scale

    d = _real(tmp_path, "deepseek-v3")
    cls, a, raw = read_model_config(d)
    assert cls.__name__ == "DeepseekV3ForCausalLM"
    assert (a.num_hidden_layers, a.num_experts, a.top_k, a.moe_intermediate, a.n_group, a.topk_group) == \
        (61, 256, 8, 2048, 8, 4)
    assert cls.moe_layers(a) == list(range(3, 61)) and a.shared_intermediate == 2048
    assert a.renormalize and a.scaling_factor == 2.5 and a.grouped and a.rope_interleaved
    assert a.kv_cache_layout() == (1, 576, 0) and a.rotary_dim == 64
    mscale = 0.1 * math.log(40) + 1
    assert yarn_softmax_scale(a.rope, 192) == pytest.approx(192**-0.5 * mscale**2)
    assert rope_frequencies(a.rope, a.rotary_dim)[1] == 1.0  # mscale == mscale_all_dim: cos/sin unscaled
    shapes = cls.dense_weight_names(a)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (18432, 7168)  # a dense layer
    assert shapes["model.layers.3.mlp.shared_experts.gate_proj.weight"] == (2048, 7168)
    assert shapes["model.layers.3.mlp.gate.e_score_correction_bias"] == (256,)
    assert shapes["model.layers.60.self_attn.q_b_proj.weight"] == (128 * 192, 1536)
    assert shapes["model.layers.60.self_attn.kv_a_proj_with_mqa.weight"] == (576, 7168)
    assert shapes["model.layers.60.self_attn.kv_b_proj.weight"] == (128 * 256, 512)
    assert not any(".experts." in n or "layers.61." in n for n in shapes)
    assert checkpoint_format(raw).name == "fp8" and checkpoint_format(raw).block == (128, 128)


def test_real_deepseek_v2_lite_config(tmp_path):
    from moechat.engine.load.loader import read_model_config

    d = _real(tmp_path, "deepseek-v2-lite")
    cls, a, _ = read_model_config(d)
    assert (a.num_experts, a.top_k, a.moe_intermediate, a.shared_intermediate) == (64, 6, 1408, 2816)
    assert cls.moe_layers(a) == list(range(1, 27)) and not a.grouped and not a.renormalize
    shapes = cls.dense_weight_names(a)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (16 * 192, 2048)  # no q_lora
    assert "model.layers.0.self_attn.q_a_proj.weight" not in shapes
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in shapes
    assert a.kv_cache_layout() == (1, 576, 0)


def test_real_glm_4_5_air_config(tmp_path):
    from moechat.engine.load.loader import read_model_config

    d = _real(tmp_path, "glm-4.5-air")
    cls, a, _ = read_model_config(d)
    assert (a.num_hidden_layers, a.num_experts, a.top_k, a.head_dim, a.rotary_dim) == (46, 128, 8, 128, 64)
    assert cls.moe_layers(a) == list(range(1, 46)) and cls.qk_norm_for(a) is None and not a.grouped
    shapes = cls.dense_weight_names(a)
    assert shapes["model.layers.1.self_attn.q_proj.bias"] == (96 * 128,)
    assert "model.layers.1.self_attn.o_proj.bias" not in shapes
    assert shapes["model.layers.1.mlp.shared_experts.down_proj.weight"] == (4096, 1408)
    assert a.kv_cache_layout() == (8, 128, 128)


def test_real_qwen1_5_moe_config(tmp_path):
    from moechat.engine.load.loader import read_model_config

    d = _real(tmp_path, "qwen1.5-moe")
    cls, a, _ = read_model_config(d)
    assert (a.num_experts, a.top_k, a.moe_intermediate, a.renormalize) == (60, 4, 1408, False)
    assert all(a.layer_window(i) is None for i in range(24))  # sliding_window 32768, but not in use
    shapes = cls.dense_weight_names(a)
    assert shapes["model.layers.0.mlp.shared_expert.gate_proj.weight"] == (5632, 2048)
    assert shapes["model.layers.0.mlp.shared_expert_gate.weight"] == (1, 2048)
    assert shapes["model.layers.0.self_attn.k_proj.bias"] == (2048,)
    assert "model.layers.0.self_attn.o_proj.bias" not in shapes


@pytest.mark.parametrize("key", list(REAL))
def test_fit_plans_the_real_configs_as_runnable(tmp_path, capsys, key):
    from moechat.app.cli.main import main

    d = _real(tmp_path, key)
    code = main(["fit", str(d), "--vram-gb", "24", "--ram-gb", "64", "--disk-gb", "2000", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code in (0, 3) and data["runnable"]
    spec = data["spec"]
    if key.startswith("deepseek"):
        assert spec["kv_kind"] == "MLA latent" and spec["kv_bytes_per_token"] == \
            {"deepseek-v3": 61, "deepseek-v2-lite": 27}[key] * 576 * 2
    assert spec["shared_experts"] >= 1
