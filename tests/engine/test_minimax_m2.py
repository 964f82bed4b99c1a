"""MiniMax-M2 / M2.5 (`minimax_m2`) end to end against transformers.

A tiny model in the Hub's spelling (rope_theta and `rotary_dim` at the top, no rope_parameters, torch_dtype, the
release's auto_map, attn_type_list, qk_norm_type, use_routing_bias, scoring_func, use_mtp with num_mtp_modules;
per-expert w1/w3/w2 tensors and the block's e_score_correction_bias): full q/k RMSNorm, partial rotary (8 of 16
dims), GQA, a sigmoid router whose correction bias steers the choice. The in-memory transformers model is the
oracle: fp32 logits to 1e-4, the same greedy tokens, resident and cached at 1, K, E and L*E slots; int8/int4
conversion; the same model written FP8 as the release ships it (e4m3 with block scales on attention and experts,
the gate and lm_head full precision) keeps FP8 experts and matches transformers on the dequantized weights.
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
TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rotary_dim=8, intermediate_size=16, num_local_experts=16, num_experts_per_tok=4,
            initializer_range=0.2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
AUTO_MAP = {"AutoConfig": "configuration_minimax_m2.MiniMaxM2Config",
            "AutoModelForCausalLM": "modeling_minimax_m2.MiniMaxM2ForCausalLM"}


def hub_spelling(config: dict) -> dict:
    """transformers 5's config.json as the Hub's MiniMax-M2.5 file spells it."""
    c = dict(config)
    rope = c.pop("rope_parameters")
    c.update(rope_theta=rope["rope_theta"], torch_dtype=c.pop("dtype"), auto_map=AUTO_MAP,
             attn_type_list=[1] * c["num_hidden_layers"], qk_norm_type="per_layer", use_qk_norm=True,
             use_routing_bias=True, scoring_func="sigmoid", shared_intermediate_size=0, use_mtp=True,
             num_mtp_modules=3, mtp_transformer_layers=1)
    return c


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("minimax_m2")
    config = transformers.AutoConfig.for_model("minimax_m2", **TINY)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers starts the correction bias at zero: make it steer the choice
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape) * 0.3)
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(hub_spelling(json.loads((path / "config.json").read_text()))))
    return path, model


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(engine, ids, n=24):
    return [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=n) for t in c.token_ids]


def _reference_greedy(ref, ids, n):
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=0, pad_token_id=0,
                           eos_token_id=None)
    return out[0, len(ids):].tolist()


def test_the_hub_config_reads_without_remote_code(tiny):
    from moechat.engine.load.loader import read_model_config

    path, _ = tiny
    cls, a, raw = read_model_config(path)
    assert raw["auto_map"] and cls.__name__ == "MiniMaxM2ForCausalLM"  # transformers has it natively
    assert (a.rotary_dim, a.head_dim, a.num_experts, a.top_k) == (8, 16, 16, 4)
    shapes = cls.dense_weight_names(a)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (4 * 16,)  # over the whole projection
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == (2 * 16,)
    assert shapes["model.layers.0.block_sparse_moe.e_score_correction_bias"] == (16,)


def test_logits_match_transformers_prefill_and_decode(tiny):
    path, ref = tiny
    engine = Engine.load(path, dtype="float32", prefill_chunk=16)
    for n in (1, 23, 40):
        ids = _prompt(n, seed=n)
        with torch.inference_mode():
            ours = engine._forward(engine.new_sequence(), ids)
            theirs = ref(torch.tensor([ids])).logits[0, -1]
        assert (ours - theirs).abs().max().item() < 1e-4, n
    seq = engine.new_sequence()
    with torch.inference_mode():
        logits = engine._forward(seq, _prompt(5, seed=7))
        for step in range(6):
            theirs = ref(torch.tensor([seq.tokens])).logits[0, -1]
            assert (logits - theirs).abs().max().item() < 1e-4, step
            logits = engine._forward(seq, [int(logits.argmax())])


def test_greedy_tokens_match_transformers_resident_and_cached(tiny):
    from moechat.engine.cache.provider import CacheConfig

    path, ref = tiny
    ids = _prompt(19, seed=121)
    expected = _reference_greedy(ref, ids, 24)
    resident = Engine.load(path, dtype="float32", prefill_chunk=8)
    assert _greedy(resident, ids) == expected
    args = resident.args
    assert resident.loaded.provider.layers == [0, 1, 2]
    for slots in (1, args.top_k, args.num_experts, 3 * args.num_experts):
        engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=slots, ram_cache_bytes=0))
        assert _greedy(engine, ids) == expected, slots
        engine.close()


def test_the_router_and_its_bias_stay_fp32_in_bfloat16(tiny):
    path, _ = tiny
    f32, bf16 = Engine.load(path, dtype="float32"), Engine.load(path, dtype="bfloat16")
    block = bf16.model.layer_list[0].ffn
    assert block.gate_weight.dtype == torch.float32 and block.correction_bias.dtype == torch.float32
    ids = _prompt(12, seed=3)
    with torch.inference_mode():
        a = torch.softmax(f32._forward(f32.new_sequence(), ids), -1)
        b = torch.softmax(bf16._forward(bf16.new_sequence(), ids), -1)
    assert (a - b).abs().max().item() < 0.05


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_int8_and_int4_experts_convert_and_cache_alike(tiny, fmt):
    from moechat.engine.cache.provider import CacheConfig

    path, _ = tiny
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


# -- FP8, as the release ships it ------------------------------------------------------------------------------

FP8_BLOCK = (24, 40)  # partial blocks on every projection
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
              "weight_block_size": list(FP8_BLOCK), "modules_to_not_convert": ["gate", "e_score_correction_bias",
                                                                               "lm_head"]}


@pytest.fixture(scope="module")
def fp8(tiny, tmp_path_factory):
    """The tiny model with q/k/v/o and every expert FP8 (block scales); the oracle is transformers on the
    dequantized weights."""
    from moechat.engine.quant.fp8 import dequantize_blocks, quantize_blocks

    src, ref = tiny
    path = tmp_path_factory.mktemp("minimax_m2_fp8")
    tensors = load_file(str(src / "model.safetensors"))
    out, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith(("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")):
            q, scale = quantize_blocks(t, FP8_BLOCK)
            out[name], out[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize_blocks(q, scale, FP8_BLOCK)
        else:
            out[name] = t
    save_file(out, str(path / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_CONFIG}))
    ref_dir = tmp_path_factory.mktemp("minimax_m2_dequantized")
    save_file({**tensors, **dequantized}, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    ref.config.save_pretrained(ref_dir)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    return path, oracle


def test_fp8_keeps_experts_fp8_and_matches_transformers(fp8):
    from moechat.engine.cache.provider import CacheConfig
    from moechat.engine.quant.fp8 import FP8_DTYPE

    path, oracle = fp8
    engine = Engine.load(path, dtype="float32", prefill_chunk=16)
    batch = engine.loaded.provider.prepare(0, torch.zeros(1, 4, dtype=torch.long))
    assert batch.format.name == "fp8" and batch.tensors["w13"].dtype == FP8_DTYPE
    for n in (1, 23):
        ids = _prompt(n, seed=n)
        with torch.inference_mode():
            ours = engine._forward(engine.new_sequence(), ids)
            theirs = oracle(torch.tensor([ids])).logits[0, -1]
        assert (ours - theirs).abs().max().item() < 1e-4, n
    ids = _prompt(11, seed=4)
    expected = _reference_greedy(oracle, ids, 24)
    assert _greedy(engine, ids) == expected
    cached = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=4, ram_cache_bytes=0))
    assert _greedy(cached, ids) == expected
    cached.close()


def test_hybrid_execution_and_prefetch_keep_the_output(tiny):
    """Misses computed on the host (in place, by the cost model, a whole layer there) and next-layer prefetch never
    change what is computed."""
    from moechat.engine.cache.provider import CacheConfig

    path, _ = tiny
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

REAL = (Path(__file__).resolve().parents[3] / "shared" / "model-configs" / "MiniMaxAI--MiniMax-M2.5"
        / "config.quantization-removed.json")


@pytest.fixture
def real(tmp_path):
    if not REAL.exists():
        pytest.skip(f"{REAL} is not here")
    # the copy's author deleted the release's quantization_config; put back what the release ships
    (tmp_path / "config.json").write_text(json.dumps({**json.loads(REAL.read_text()), "quantization_config": {
        **FP8_CONFIG, "weight_block_size": [128, 128]}}))
    return tmp_path


def test_real_minimax_m2_5_config(real):
    from moechat.engine.load.loader import checkpoint_format, read_model_config

    cls, a, raw = read_model_config(real)
    assert cls.__name__ == "MiniMaxM2ForCausalLM" and raw["auto_map"]
    assert (a.num_hidden_layers, a.num_experts, a.top_k, a.moe_intermediate, a.rotary_dim) == (62, 256, 8, 1536, 64)
    assert cls.moe_layers(a) == list(range(62)) and a.kv_cache_layout() == (8, 128, 128)
    shapes = cls.dense_weight_names(a)
    assert shapes["model.layers.61.self_attn.q_norm.weight"] == (48 * 128,)
    assert shapes["model.layers.61.self_attn.k_norm.weight"] == (8 * 128,)
    assert shapes["model.layers.61.block_sparse_moe.gate.weight"] == (256, 3072)
    assert not any(".experts." in n for n in shapes)
    assert checkpoint_format(raw).name == "fp8" and checkpoint_format(raw).block == (128, 128)


def test_fit_plans_minimax_m2_5(real, capsys):
    from moechat.app.cli.main import main

    code = main(["fit", str(real), "--vram-gb", "24", "--ram-gb", "256", "--disk-gb", "2000", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code in (0, 3) and data["runnable"]
    spec = data["spec"]
    assert spec["kv_bytes_per_token"] == 62 * 2 * 8 * 128 * 2 and spec["moe_layers"] == 62
    assert spec["expert_bytes"] == 3 * 1536 * 3072 + 3 * 4 * 12 * 24  # e4m3 + fp32 scales per 128 x 128 block
    assert any("use_mtp" in n and "never loaded" in n for n in spec["notes"])  # 3 MTP modules, noted
    assert any("auto_map" in n and "no remote code is needed" in n for n in spec["notes"])


def _loaded_dense_bytes(cls, args, float_bytes: int) -> int:
    """What the loader holds of the dense tensors: the model's dtype, the gate and its bias in fp32."""
    import math

    return sum(math.prod(shape) * (4 if name.endswith(cls.fp32_weights) else float_bytes)
               for name, shape in cls.dense_weight_names(args).items())


def test_fit_counts_fp8_dense_weights_as_loaded_and_experts_by_their_names(real):
    """The loader dequantizes FP8 attention to bf16 (loader._dense_tensor): fit's dense bytes are that, the
    download stays the FP8 size, a note says both; the experts' tensors are w1/w3/w2 as the checkpoint's."""
    from moechat.engine.load.loader import read_model_config
    from moechat.engine.plan import spec_from_config

    cls, args, raw = read_model_config(real)
    spec = spec_from_config(raw)
    assert spec.dense_bytes == _loaded_dense_bytes(cls, args, 2)  # 7.47 GiB
    bf16 = spec_from_config({k: v for k, v in raw.items() if k != "quantization_config"})
    assert spec.dense_bytes == bf16.dense_bytes  # dense weights loaded alike
    fp8_attention = 62 * (2 * (6144 + 1024) * 3072 + 4 * (2 * 48 * 24 + 2 * 8 * 24))  # e4m3 + 128x128 block scales
    assert spec.checkpoint_bytes == bf16.checkpoint_bytes - spec.total_experts * (
        bf16.stored_expert_bytes - spec.stored_expert_bytes) - (dict(bf16.dense_parts)["attention"]
                                                                 - 62 * 2 * (48 + 8) * 128 - fp8_attention)
    assert any("FP8 dense weights" in n and "dequantized to bfloat16 at load" in n for n in spec.notes)
    assert [t.name for t in spec.expert_tensors] == ["w1.weight", "w1.weight_scale_inv", "w3.weight",
                                                     "w3.weight_scale_inv", "w2.weight", "w2.weight_scale_inv"]


def test_fit_reads_an_fp8_checkpoint_at_its_loaded_size(fp8):
    """From the safetensors headers: FP8 q/k/v/o counted at the float dtype they are loaded in, the scales not at
    all; the download is the files' bytes."""
    from moechat.engine.load.loader import read_model_config
    from moechat.engine.plan import read_model_spec

    path, _ = fp8
    cls, args, _ = read_model_config(path)
    spec = read_model_spec(path)
    assert spec.source == "safetensors headers"
    assert spec.dense_bytes == _loaded_dense_bytes(cls, args, 4)  # the tiny model is float32
    assert spec.checkpoint_bytes < (path / "model.safetensors").stat().st_size
    assert any("FP8 dense weights" in n and "dequantized to float32 at load" in n for n in spec.notes)


def test_the_catalog_lists_minimax_m2_5_as_runnable():
    from moechat.engine.plan.catalog import find

    entry = find("MiniMaxAI/MiniMax-M2.5")
    assert entry.supported and entry.family == "minimax_m2" and entry.format.startswith("fp8")
