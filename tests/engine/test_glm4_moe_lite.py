"""GLM-4.7-Flash (`glm4_moe_lite`) end to end against transformers.

Two tiny models in the Hub's spelling (rope_theta and rope_scaling at the top, partial_rotary_factor 1.0, no
mlp_layer_types but first_k_dense_replace, topk_method noaux_tc, per-expert tensors, one multi-token-prediction
layer past the last): MLA with a low-rank query and interleaved RoPE, a dense first layer, one shared expert, a
sigmoid router whose correction bias steers the choice; and one with mlp_layer_types (a dense layer between two
sparse ones), no low-rank query, plain RoPE, group-limited routing and two shared experts. The in-memory
transformers model is the oracle: fp32 logits to 1e-4, the same greedy tokens, resident and cached at 1, K, E and
L*E slots; int8 and int4 expert conversion; the real config (../shared/model-configs) read and planned by fit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, do_sample=False)
TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, initializer_range=0.2,
            max_position_embeddings=512, rms_norm_eps=1e-6, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12, moe_intermediate_size=16, intermediate_size=48)
VARIANTS = {
    # GLM-4.7-Flash's shape: q_lora, interleaved rope, one dense layer, one shared expert, an MTP layer
    "flash": dict(q_lora_rank=24, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                  routed_scaling_factor=1.8),
    # mlp_layer_types with a dense middle layer, no q_lora, plain rope, 4 groups keep 2, 2 shared experts
    "types": dict(q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                  n_shared_experts=2, rope_interleave=False, routed_scaling_factor=2.5,
                  mlp_layer_types=["sparse", "dense", "sparse"]),
}


def hub_spelling(config: dict, name: str) -> dict:
    """transformers 5's config.json as the Hub's GLM-4.7-Flash file spells it."""
    c = dict(config)
    rope = dict(c.pop("rope_parameters", None) or {})
    c["rope_theta"] = rope.pop("rope_theta", 10000.0)
    c["rope_scaling"] = None
    c["partial_rotary_factor"] = 1.0
    c["topk_method"] = "noaux_tc"
    c.pop("qk_head_dim", None)
    if name == "flash":  # the Hub's file has no mlp_layer_types: the first layer is dense by first_k_dense_replace
        c.pop("mlp_layer_types")
        c.update(first_k_dense_replace=1, num_nextn_predict_layers=1)
    return c


def _add_mtp_layer(path: Path, num_layers: int) -> None:
    """Layer `num_layers` as the Hub's checkpoint has it: a copy of the last layer plus the MTP projections."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    last = f"model.layers.{num_layers - 1}."
    for name, t in list(tensors.items()):
        if name.startswith(last):
            tensors[f"model.layers.{num_layers}." + name[len(last):]] = t.clone()
    V, H = tensors["model.embed_tokens.weight"].shape
    p = f"model.layers.{num_layers}."
    tensors.update({p + "enorm.weight": torch.ones(H), p + "hnorm.weight": torch.ones(H),
                    p + "eh_proj.weight": torch.randn(H, 2 * H), p + "shared_head.norm.weight": torch.ones(H)})
    save_file(tensors, str(file), metadata={"format": "pt"})


def build(path: Path, name: str, seed: int):
    config = transformers.AutoConfig.for_model("glm4_moe_lite", **{**TINY, **VARIANTS[name]})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers starts the correction bias at zero: make it steer the choice
        for buf_name, buf in model.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape) * 0.3)
    model.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    if name == "flash":
        _add_mtp_layer(path, raw["num_hidden_layers"])
    (path / "config.json").write_text(json.dumps(hub_spelling(raw, name), indent=2))
    return model


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(f"glm4_moe_lite_{name}")
            built[name] = (path, build(path, name, seed=list(VARIANTS).index(name)))
        return built[name]

    return get


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(engine, ids, n=24):
    return [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=n) for t in c.token_ids]


def _reference_greedy(ref, ids, n):
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=0, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers_prefill_and_decode(variants, name):
    path, ref = variants(name)
    engine = Engine.load(path, dtype="float32", prefill_chunk=16)
    for n in (1, 23, 40):  # 40 tokens = 3 prefill chunks
        ids = _prompt(n, seed=n)
        with torch.inference_mode():
            ours = engine._forward(engine.new_sequence(), ids)
            theirs = ref(torch.tensor([ids])).logits[0, -1]
        assert (ours - theirs).abs().max().item() < 1e-4, (name, n)
    seq = engine.new_sequence()
    with torch.inference_mode():
        logits = engine._forward(seq, _prompt(5, seed=7))
        for step in range(6):  # the absorbed MLA decode, step by step
            theirs = ref(torch.tensor([seq.tokens])).logits[0, -1]
            assert (logits - theirs).abs().max().item() < 1e-4, (name, step)
            logits = engine._forward(seq, [int(logits.argmax())])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_tokens_match_transformers_resident_and_cached(variants, name):
    from moechat.engine.cache.provider import CacheConfig

    path, ref = variants(name)
    ids = _prompt(19, seed=121)
    expected = _reference_greedy(ref, ids, 24)
    resident = Engine.load(path, dtype="float32", prefill_chunk=8)
    assert _greedy(resident, ids) == expected
    args = resident.args
    moe_layers = resident.loaded.cls.moe_layers(args)
    assert resident.loaded.provider.layers == moe_layers == ([1, 2] if name == "flash" else [0, 2])
    E, K = args.num_experts, args.top_k
    for slots in (1, K, E, len(moe_layers) * E):
        engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=slots, ram_cache_bytes=0))
        assert _greedy(engine, ids) == expected, slots
        assert engine.provider.pool.slot_bytes == 3 * args.hidden_size * args.moe_intermediate * 4
        engine.close()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_int8_and_int4_experts_convert_and_cache_alike(variants, fmt):
    """The conversion runs; its logits stay near fp32's (int4 is coarser) and cached == resident in that format."""
    from moechat.engine.cache.provider import CacheConfig

    path, _ = variants("flash")
    ids = _prompt(12, seed=3)
    full = Engine.load(path, dtype="float32")
    quant = Engine.load(path, dtype="float32", expert_format=fmt)
    assert quant.loaded.expert_format.name == fmt
    with torch.inference_mode():
        a = torch.softmax(full._forward(full.new_sequence(), ids), -1)
        b = torch.softmax(quant._forward(quant.new_sequence(), ids), -1)
    assert 0 < (a - b).abs().max().item() < {"int8": 0.02, "int4": 0.2}[fmt]
    cached = Engine.load(path, dtype="float32", expert_format=fmt, cache=CacheConfig(expert_slots=4))
    assert _greedy(cached, ids, 12) == _greedy(quant, ids, 12)
    cached.close()


def test_the_mtp_layer_is_skipped_and_counted(variants):
    from moechat.engine.io.checkpoint import Checkpoint
    from moechat.engine.plan import read_model_spec

    path, _ = variants("flash")
    assert "model.layers.3.eh_proj.weight" in Checkpoint.open(path)
    engine = Engine.load(path, dtype="float32")
    assert len(engine.model.layer_list) == 3
    spec = read_model_spec(path)
    assert spec.unused_bytes > 0 and spec.kv_bytes_per_token(4) == 3 * (32 + 8) * 4


def test_bad_mlp_layer_types_and_partial_rotary_are_one_typed_line(tmp_path):
    from moechat.engine.errors import ConfigError
    from moechat.engine.load.loader import read_model_config

    base = {"model_type": "glm4_moe_lite", **TINY, "n_routed_experts": 8, "num_experts_per_tok": 2}
    for bad, key in (({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
                     ({"mlp_layer_types": ["sparse"]}, "mlp_layer_types"),
                     ({"partial_rotary_factor": 0.5}, "partial_rotary_factor")):
        (tmp_path / "config.json").write_text(json.dumps({**base, **bad}))
        with pytest.raises(ConfigError) as e:
            read_model_config(tmp_path)
        assert "\n" not in str(e.value) and key in str(e.value)


def test_hybrid_execution_and_prefetch_keep_the_output(variants):
    """Misses computed on the host (in place, by the cost model, a whole layer there) and next-layer prefetch never
    change what is computed."""
    from moechat.engine.cache.provider import CacheConfig

    path, _ = variants("flash")
    ids = _prompt(9, seed=9)
    resident = _greedy(Engine.load(path, dtype="float32"), ids, 10)
    for on_miss, host_layers in (("host", 0), ("auto", 0), ("load", 1)):
        engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=3, on_miss=on_miss,
                                                                      host_layers=host_layers))
        assert _greedy(engine, ids, 10) == resident, (on_miss, host_layers)
        assert sum(engine.provider.snapshot().host_computed) > 0
        engine.close()
    engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=6, prefetch="both"))
    assert _greedy(engine, ids, 10) == resident
    assert sum(engine.provider.snapshot().prefetch_issued) > 0
    engine.close()


# -- the real config (../shared/model-configs), read in place ----------------------------------------------------

REAL = Path(__file__).resolve().parents[3] / "shared" / "model-configs" / "zai-org--GLM-4.7-Flash" / "config.json"


@pytest.fixture
def real(tmp_path):
    if not REAL.exists():
        pytest.skip(f"{REAL} is not here")
    (tmp_path / "config.json").write_text(REAL.read_text())
    return tmp_path


def test_real_glm_4_7_flash_config(real):
    from moechat.engine.load.loader import read_model_config

    cls, a, _ = read_model_config(real)
    assert cls.__name__ == "Glm4MoeLiteForCausalLM"
    assert (a.num_hidden_layers, a.num_experts, a.top_k, a.moe_intermediate, a.shared_intermediate) == \
        (47, 64, 4, 1536, 1536)
    assert cls.moe_layers(a) == list(range(1, 47)) and not a.grouped and a.renormalize and a.scaling_factor == 1.8
    assert a.kv_cache_layout() == (1, 576, 0) and a.rotary_dim == 64 and a.rope_interleaved
    shapes = cls.dense_weight_names(a)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (10240, 2048)
    assert shapes["model.layers.1.self_attn.q_b_proj.weight"] == (20 * 256, 768)
    assert shapes["model.layers.1.self_attn.kv_b_proj.weight"] == (20 * (192 + 256), 512)
    assert shapes["model.layers.1.self_attn.o_proj.weight"] == (2048, 20 * 256)
    assert shapes["model.layers.46.mlp.shared_experts.down_proj.weight"] == (2048, 1536)
    assert not any(".experts." in n or "layers.47." in n for n in shapes)


def test_fit_plans_glm_4_7_flash(real, capsys):
    from moechat.app.cli.main import main

    code = main(["fit", str(real), "--vram-gb", "24", "--ram-gb", "64", "--disk-gb", "2000", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code in (0, 3) and data["runnable"]
    spec = data["spec"]
    assert spec["kv_kind"] == "MLA latent" and spec["kv_bytes_per_token"] == 47 * 576 * 2
    assert spec["shared_experts"] >= 1 and spec["unused_bytes"] > 0  # the MTP layer's bytes, noted
    assert (spec["moe_layers"], spec["num_experts"], spec["expert_bytes"]) == (46, 64, 3 * 1536 * 2048 * 2)
    # 29.9 B parameters in bf16 (the catalog's figure), plus the MTP layer
    assert spec["all_experts_bytes"] + spec["dense_bytes"] == pytest.approx(2 * 29.94e9, rel=1e-3)


def test_the_catalog_lists_glm_4_7_flash_as_runnable():
    from moechat.engine.plan.catalog import SUPPORTED_TYPES, find

    entry = find("zai-org/GLM-4.7-Flash")
    assert "glm4_moe_lite" in SUPPORTED_TYPES and entry.supported and entry.family == "glm4_moe_lite"
    assert (entry.total_params_b, entry.active_params_b) == (29.9, 3.6)
