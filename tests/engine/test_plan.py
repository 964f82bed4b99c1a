"""Model specs and memory plans on real model shapes, with the arithmetic checked by hand.

The real config.json files live in ../shared/model-configs (seen from the repository root); tests that
need them are skipped when it is absent. Hardware is built as data (no probe), so every number is fixed.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from moechat.engine.errors import ConfigError
from moechat.engine.plan import (
    OVERHEAD_PER_LAYER_S,
    OVERHEAD_PER_MISS_S,
    MissRatioCurve,
    PlanRefusedError,
    Preferences,
    make_plan,
    read_model_spec,
    spec_from_config,
)
from moechat.engine.plan.hardware import DiskInfo, GiB, GpuInfo, Hardware, HostMemory

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT.parent / "shared" / "model-configs"
needs_configs = pytest.mark.skipif(not CONFIGS.is_dir(), reason="../shared/model-configs not found")

MODELS = {
    "gpt-oss-20b": "openai--gpt-oss-20b/config.json",
    "gpt-oss-120b": "openai--gpt-oss-120b/config.json",
    "qwen3-30b-a3b": "Qwen--Qwen3-30B-A3B/config.json",
    "qwen3-235b-a22b": "Qwen--Qwen3-235B-A22B/config.json",
    "mixtral-8x7b": "mistralai--Mixtral-8x7B-v0.1/config.json",
    "deepseek-v3": "deepseek-ai--DeepSeek-V3/config.json",
    "olmoe": "allenai--OLMoE-1B-7B-0924-Instruct/config.finetune-derived.json",
    "deepseek-v2-lite": "deepseek-ai--DeepSeek-V2-Lite-Chat/config.reserialized.json",
}


def spec(name: str):
    path = CONFIGS / MODELS[name]
    if not path.exists():
        pytest.skip(f"../shared/model-configs not found ({path})")
    return spec_from_config(json.loads(path.read_text()), name=name)


def machine(vram_gib: float | None, ram_gib: float, disk_gib: float = 10_000, link: float = 25.2,
            membw: float = 500.0) -> Hardware:
    gpus = () if vram_gib is None else (
        GpuInfo(0, 0, "test GPU", "GPU-0", int(vram_gib * GiB), int(vram_gib * GiB), 4, 16, link_gbps=link,
                memory_gbps=membw),)
    return Hardware(gpus, HostMemory(int(ram_gib * GiB), int(ram_gib * GiB)), DiskInfo("/models", int(disk_gib * GiB)))


# -- specs, by hand -------------------------------------------------------------------------------------

@needs_configs
def test_gpt_oss_20b_mxfp4_bytes_by_hand():
    s = spec("gpt-oss-20b")
    # One expert, from the checkpoint's tensor shapes and formats (H = I = 2880, MXFP4 blocks of 32):
    #   gate_up_proj_blocks [5760, 90, 16] U8 = 8,294,400   gate_up_proj_scales [5760, 90] U8 = 518,400
    #   gate_up_proj_bias   [5760] BF16       =    11,520
    #   down_proj_blocks    [2880, 90, 16] U8 = 4,147,200   down_proj_scales    [2880, 90] U8 = 259,200
    #   down_proj_bias      [2880] BF16       =     5,760
    shapes = {t.name: (t.shape, t.dtype, t.nbytes) for t in s.expert_tensors}
    assert shapes == {
        "gate_up_proj_blocks": ((5760, 90, 16), "U8", 8_294_400), "gate_up_proj_scales": ((5760, 90), "U8", 518_400),
        "gate_up_proj_bias": ((5760,), "BF16", 11_520), "down_proj_blocks": ((2880, 90, 16), "U8", 4_147_200),
        "down_proj_scales": ((2880, 90), "U8", 259_200), "down_proj_bias": ((2880,), "BF16", 5_760)}
    assert s.expert_bytes == 13_236_480  # "1 slot of GPT-OSS-20B = 13.2 MB"
    assert (s.num_moe_layers, s.num_experts, s.top_k, s.total_experts) == (24, 32, 4, 768)
    # Dense, bf16: embeddings and lm_head 201088 x 2880 each; per layer q 4096x2880 + k, v 512x2880 + o 2880x4096
    # with biases, 64 sinks, a 32x2880 router + 32 bias, two norms; one final norm.
    attention = 24 * 2 * (4096 * 2880 + 4096 + 2 * (512 * 2880 + 512) + 2880 * 4096 + 2880 + 64)
    assert attention == 1_274_406_912
    dense = 2 * 2 * 201088 * 2880 + attention + 24 * 2 * (32 * 2880 + 32) + 2 * (24 * 2 * 2880 + 2880)
    assert s.dense_bytes == dense == 3_595_648_128
    # ... which adds up to the index's published total_size exactly
    assert s.dense_bytes + 24 * 32 * 13_236_480 == 13_761_264_768
    # KV: 8 KV heads x 64 x 2 (K, V) x 2 B = 2 KiB per layer and token; 12 of 24 layers keep only 128 tokens
    assert s.kv_bytes_per_token() == 24 * 2048
    assert s.kv_bytes(4096) == 12 * 2048 * 4096 + 12 * 2048 * 128
    assert s.kv_bytes(4096, windowed=False) == 24 * 2048 * 4096
    # The same expert as the engine's format stores it (engine/quant): what every cache tier holds.
    import torch

    from moechat.engine.quant import detect_format, get_format

    config = json.loads((CONFIGS / MODELS["gpt-oss-20b"]).read_text())
    assert detect_format(config) == "mxfp4"
    assert get_format("mxfp4").expert_bytes(2880, 2880, torch.bfloat16, True) == s.expert_bytes
    assert get_format("dense").expert_bytes(2880, 2880, torch.bfloat16, True) == s.bf16_expert_bytes == 49_783_680
    assert s.expert_format_line() == "experts: MXFP4, 12.6 MiB each (bf16 would be 47.5 MiB)"


def _gpt_oss_tensors(config: dict, names) -> dict:
    """Safetensors header entries (dtype, shape, nbytes) for GPT-OSS tensor names, shapes from config.json."""
    from types import SimpleNamespace

    H, V, E, I = config["hidden_size"], config["vocab_size"], config["num_local_experts"], config["intermediate_size"]
    nH, nKV, D = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    G = H // 32  # MXFP4 blocks of 32 along the input dimension (H = I here)
    shapes = {"embed_tokens.weight": ("BF16", (V, H)), "lm_head.weight": ("BF16", (V, H)),
              "norm.weight": ("BF16", (H,)),
              "input_layernorm.weight": ("BF16", (H,)), "post_attention_layernorm.weight": ("BF16", (H,)),
              "q_proj.weight": ("BF16", (nH * D, H)), "q_proj.bias": ("BF16", (nH * D,)),
              "k_proj.weight": ("BF16", (nKV * D, H)), "k_proj.bias": ("BF16", (nKV * D,)),
              "v_proj.weight": ("BF16", (nKV * D, H)), "v_proj.bias": ("BF16", (nKV * D,)),
              "o_proj.weight": ("BF16", (H, nH * D)), "o_proj.bias": ("BF16", (H,)), "sinks": ("BF16", (nH,)),
              "router.weight": ("BF16", (E, H)), "router.bias": ("BF16", (E,)),
              "gate_up_proj_blocks": ("U8", (E, 2 * I, G, 16)), "gate_up_proj_scales": ("U8", (E, 2 * I, G)),
              "gate_up_proj_bias": ("BF16", (E, 2 * I)), "down_proj_blocks": ("U8", (E, H, I // 32, 16)),
              "down_proj_scales": ("U8", (E, H, I // 32)), "down_proj_bias": ("BF16", (E, H))}
    out = {}
    for name in names:
        dtag, shape = next(v for k, v in shapes.items() if name.endswith("." + k) or name == k)
        out[name] = SimpleNamespace(dtype=dtag, shape=shape, nbytes=math.prod(shape) * (2 if dtag == "BF16" else 1))
    return out


@needs_configs
def test_gpt_oss_20b_from_headers_counts_packed_experts_and_adds_up_to_total_size():
    """The 459 tensors the index names, with the checkpoint's dtypes: U8 blocks/scales and BF16 biases under
    mlp.experts.* are expert bytes (never dense), and everything adds up to the published total_size."""
    from moechat.engine.plan import spec_from_headers

    folder = CONFIGS / "openai--gpt-oss-20b"
    if not (folder / "model.safetensors.index.json").exists():
        pytest.skip("../shared/model-configs not found (the gpt-oss-20b index)")
    config = json.loads((folder / "config.json").read_text())
    names = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    exact = spec_from_headers(config, _gpt_oss_tensors(config, names), name="gpt-oss-20b")
    est = spec("gpt-oss-20b")
    assert exact.source == "safetensors headers" and not exact.estimated
    assert exact.checkpoint_bytes == 13_761_264_768  # the index's total_size, to the byte
    assert exact.expert_bytes == est.expert_bytes == 13_236_480 and exact.total_experts == 768
    assert exact.dense_bytes == est.dense_bytes == 3_595_648_128  # no U8 block or scale counted as dense
    assert exact.dense_float_elems * 2 == exact.dense_bytes  # every dense tensor is bf16
    assert dict(exact.dense_parts)["attention"] == 1_274_406_912 and dict(exact.dense_parts)["routers"] == 24 * 2 * (
        32 * 2880 + 32)
    assert exact.expert_format.startswith("mxfp4") and exact.expert_params == 3 * 2880 * 2880 + 2 * 2880 + 2880
    assert exact.expert_format_line() == est.expert_format_line()
    assert (exact.window, exact.kv_bytes_per_token()) == (128, 24 * 2048)


@needs_configs
def test_gpt_oss_20b_on_8_gib_vram_and_32_gib_ram_by_hand():
    """The vLLM RFC's machine (../shared/reference/vllm-rfc-expert-offloading.md): tinyserve held 238 slots of
    GPT-OSS-20B MXFP4 on an 8 GB GPU and decoded ~30 tok/s at a 97-100% hit rate."""
    s = read_model_spec(CONFIGS / "openai--gpt-oss-20b")
    plan = make_plan(s, machine(8, 32, link=25.2, membw=500))
    budget = int(8 * GiB - 0.05 * 8 * GiB)  # 7.6 GiB
    kv = 12 * 2048 * 4096 + 12 * 2048 * 128  # full layers the context, window layers their 128-token ring (99 MiB)
    workspace = 512 * 2**20 + 4 * 512 * (8 * 2880 + 4 * 4 * 2880)
    assert (plan.device_budget_bytes, plan.kv_bytes, plan.workspace_bytes) == (budget, kv, workspace)
    room = budget - 3_595_648_128 - kv - workspace
    assert plan.ok and plan.expert_slots == room // 13_236_480 == 285 >= 200  # bf16 experts: room // 49.8 MB = 75
    assert plan.host_tier == "all experts in RAM" and plan.ram_cache_bytes is None  # 9.5 GiB in pinned RAM
    decisions = {d.item.split(" =")[0].split(",")[0]: d.reason for d in plan.decisions}
    assert decisions["expert slots C"].startswith("experts: MXFP4, 12.6 MiB each (bf16 would be 47.5 MiB: 75 slots); ")
    assert "window layers allocated 128 tokens each (93.0 MiB less than full length)" in decisions["KV cache"]
    # decode: dense reads (no embedding table) + 24 x 4 MXFP4 experts + KV read (window layers: 128 keys)
    c = 285 / 768
    device = (3_595_648_128 - 201088 * 2880 * 2) + 24 * 4 * 13_236_480 + 2048 * (12 * 2048 + 12 * 128)
    active = 24 * 4 * 13_236_480
    h_high = 1 - 0.6 * (1 - c)
    d = plan.decode
    assert d.device_bytes == device and d.hit_rate_low == pytest.approx(c)
    assert d.bound_by == "link" and d.bound == pytest.approx(25.2e9 / (active * (1 - h_high)))  # 52.6 tok/s
    assert 15 < d.low <= d.high < d.bound
    assert d.on_miss == "auto" and plan.best_placement.mode == "auto"  # auto predicts the better of load and host
    assert (f"{d.low:.1f}-{d.high:.1f} tok/s predicted with --on-miss auto; bound {d.bound:.1f} tok/s (link)"
            in decisions["decode"])
    # At the RFC's measured hit rate (98%) the link is nearly idle and device reads set the pace: 3.76 GB a token
    # at 0.7 x 288 GB/s (assumed for the RFC's 8 GB laptop RTX PRO 2000) + 24 layers of dispatch = 43 tok/s,
    # against the 30 it measured (the model counts no kernel or routing time beyond the per-layer dispatch).
    rfc = make_plan(s, machine(8, 32, link=25.2, membw=288), Preferences(hit_curve=MissRatioCurve(((c, 0.98),))))
    assert rfc.decode.bound_by == "device memory" and 30 <= rfc.decode.low <= 2 * 30


@needs_configs
def test_gpt_oss_120b_verdicts():
    s = read_model_spec(CONFIGS / "openai--gpt-oss-120b")
    assert (s.total_experts, s.expert_bytes, s.num_layers, s.window) == (36 * 128, 13_236_480, 36, 128)
    plan = make_plan(s, machine(24, 64))
    # 56.8 GiB of MXFP4 experts fit a 64 GiB machine's RAM budget (64 - 5% - 1.5 GiB process = 59.3 GiB)
    assert plan.ok and plan.host_tier == "all experts in RAM" and plan.decode.disk_bytes_low == 0
    room = int(24 * GiB * 0.95) - s.dense_bytes - 18 * 2048 * (4096 + 128) - plan.workspace_bytes
    assert plan.expert_slots == room // 13_236_480 == 1465 and plan.decode.bound_by == "link"
    assert 5 < plan.decode.low <= plan.decode.high < plan.decode.bound
    slots = next(d.reason for d in plan.decisions if d.item.startswith("expert slots"))
    assert slots.startswith(f"experts: MXFP4, 12.6 MiB each (bf16 would be 47.5 MiB: {room // 49_783_680} slots)")
    # with 32 GiB of RAM the experts no longer fit there: a RAM cache over the shards, and the disk sets the bound
    small = make_plan(s, machine(24, 32))
    assert small.ok and small.host_tier == "RAM cache" and small.decode.bound_by == "disk"
    assert small.decode.low < plan.decode.low


@needs_configs
def test_gpt_oss_20b_config_and_index_directory_uses_total_size():
    s = read_model_spec(CONFIGS / "openai--gpt-oss-20b")
    assert s.estimated and s.source == "config.json + index" and not s.weights_present
    assert s.checkpoint_bytes == 13_761_264_768
    assert any("+0.0%" in n for n in s.notes) and any("estimates" in n for n in s.notes)


@needs_configs
def test_qwen3_mixtral_deepseek_sizes_by_hand():
    q = spec("qwen3-30b-a3b")
    assert q.expert_bytes == 3 * 768 * 2048 * 2 == 9_437_184
    assert q.kv_bytes_per_token() == 48 * 2 * 4 * 128 * 2 == 98_304  # 96 KiB, as engine/layers/kv_cache.py says
    assert q.window is None  # use_sliding_window is false: its sliding_window value is inactive
    # embeddings + lm_head + 48 x (attention 2048x4096 + 2 x 2048x512 + 4096x2048 + q/k norms 2x128
    # + router 128x2048 + 2 norms of 2048) + final norm, in bf16
    per_layer = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 128 + 128 * 2048 + 2 * 2048
    assert q.dense_bytes == 2 * (2 * 151936 * 2048 + 48 * per_layer + 2048) == 3_082_186_752
    m = spec("mixtral-8x7b")
    assert m.expert_bytes == 3 * 14336 * 4096 * 2  # 352 MB
    assert m.checkpoint_bytes == 93_405_585_408  # the published total_size
    d = spec("deepseek-v3")
    # fp8 e4m3 weights + fp32 inverse scales per 128x128 block: [2048, 7168] -> 16 x 56 scales, three times
    assert d.expert_bytes == 3 * (2048 * 7168 + math.ceil(2048 / 128) * math.ceil(7168 / 128) * 4) == 44_050_944
    assert d.num_moe_layers == 61 - 3 and d.total_experts == 58 * 256
    assert d.kv_kind == "MLA latent" and d.kv_bytes_per_token() == 61 * (512 + 64) * 2
    assert d.shared_experts == 1 and d.shared_expert_bytes > 0 and d.unused_bytes > 0  # the MTP layer
    assert abs(d.checkpoint_bytes - 688_586_727_753) / 688_586_727_753 < 1e-4  # sum of the Hub's files
    lite = spec("deepseek-v2-lite")
    assert lite.shared_experts == 2 and lite.num_moe_layers == 26 and lite.kv_bytes_per_token() == 27 * 576 * 2
    assert lite.expert_bytes == 3 * 1408 * 2048 * 2


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    sizes = {"BF16": 2, "F32": 4, "U8": 1}
    header, offset = {}, 0
    for name, (dtag, shape) in tensors.items():
        n = math.prod(shape) * sizes[dtag]
        header[name] = {"dtype": dtag, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


TINY_QWEN = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                 intermediate_size=64, torch_dtype="bfloat16", max_position_embeddings=512, tie_word_embeddings=False)


def _tiny_qwen(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_QWEN))
    t = {"model.embed_tokens.weight": ("BF16", (64, 32)), "lm_head.weight": ("BF16", (64, 32)),
         "model.norm.weight": ("BF16", (32,))}
    for layer in range(2):
        p = f"model.layers.{layer}."
        t.update({p + "input_layernorm.weight": ("BF16", (32,)), p + "post_attention_layernorm.weight": ("BF16", (32,)),
                  p + "self_attn.q_proj.weight": ("BF16", (32, 32)), p + "self_attn.k_proj.weight": ("BF16", (16, 32)),
                  p + "self_attn.v_proj.weight": ("BF16", (16, 32)), p + "self_attn.o_proj.weight": ("BF16", (32, 32)),
                  p + "self_attn.q_norm.weight": ("BF16", (8,)), p + "self_attn.k_norm.weight": ("BF16", (8,)),
                  p + "mlp.gate.weight": ("BF16", (4, 32))})
        for e in range(4):
            t.update({f"{p}mlp.experts.{e}.gate_proj.weight": ("BF16", (16, 32)),
                      f"{p}mlp.experts.{e}.up_proj.weight": ("BF16", (16, 32)),
                      f"{p}mlp.experts.{e}.down_proj.weight": ("BF16", (32, 16))})
    _write_safetensors(path / "model.safetensors", t)
    return path


def test_spec_from_headers_matches_the_config_estimate(tmp_path):
    path = _tiny_qwen(tmp_path / "qwen")
    exact = read_model_spec(path)
    assert exact.source == "safetensors headers" and not exact.estimated and exact.weights_present
    assert exact.expert_bytes == 3 * 16 * 32 * 2 == 3072
    assert [t.name for t in exact.expert_tensors] == ["down_proj.weight", "gate_proj.weight", "up_proj.weight"]
    est = spec_from_config(TINY_QWEN)
    assert est.estimated and (est.expert_bytes, est.dense_bytes) == (exact.expert_bytes, exact.dense_bytes)
    assert exact.checkpoint_bytes == exact.dense_bytes + 2 * 4 * 3072
    as_f32 = exact.in_dtype(4, "float32")  # what `moechat run --dtype float32` holds
    assert as_f32.expert_bytes == 2 * exact.expert_bytes and as_f32.dense_bytes == 2 * exact.dense_bytes
    assert as_f32.kv_bytes_per_token() == 2 * exact.kv_bytes_per_token()


def test_fused_mxfp4_headers_match_the_config_estimate(tmp_path):
    cfg = dict(model_type="gpt_oss", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, num_local_experts=4, experts_per_token=2, num_experts_per_tok=2,
               intermediate_size=32, attention_bias=True, sliding_window=8,
               layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
               quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                   "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
    path = tmp_path / "oss"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    t = {"model.embed_tokens.weight": ("BF16", (64, 32)), "lm_head.weight": ("BF16", (64, 32)),
         "model.norm.weight": ("BF16", (32,))}
    for layer in range(2):
        p = f"model.layers.{layer}."
        t.update({p + "input_layernorm.weight": ("BF16", (32,)), p + "post_attention_layernorm.weight": ("BF16", (32,)),
                  p + "self_attn.q_proj.weight": ("BF16", (32, 32)), p + "self_attn.q_proj.bias": ("BF16", (32,)),
                  p + "self_attn.k_proj.weight": ("BF16", (16, 32)), p + "self_attn.k_proj.bias": ("BF16", (16,)),
                  p + "self_attn.v_proj.weight": ("BF16", (16, 32)), p + "self_attn.v_proj.bias": ("BF16", (16,)),
                  p + "self_attn.o_proj.weight": ("BF16", (32, 32)), p + "self_attn.o_proj.bias": ("BF16", (32,)),
                  p + "self_attn.sinks": ("BF16", (4,)), p + "mlp.router.weight": ("BF16", (4, 32)),
                  p + "mlp.router.bias": ("BF16", (4,)),
                  p + "mlp.experts.gate_up_proj_blocks": ("U8", (4, 64, 1, 16)),
                  p + "mlp.experts.gate_up_proj_scales": ("U8", (4, 64, 1)),
                  p + "mlp.experts.gate_up_proj_bias": ("BF16", (4, 64)),
                  p + "mlp.experts.down_proj_blocks": ("U8", (4, 32, 1, 16)),
                  p + "mlp.experts.down_proj_scales": ("U8", (4, 32, 1)),
                  p + "mlp.experts.down_proj_bias": ("BF16", (4, 32))})
    _write_safetensors(path / "model.safetensors", t)
    exact = read_model_spec(path)
    # per expert: blocks 64x16 + scales 64 + bias 64x2 + blocks 32x16 + scales 32 + bias 32x2
    assert exact.expert_bytes == 1024 + 64 + 128 + 512 + 32 + 64 == 1824
    est = spec_from_config(cfg)
    assert (est.expert_bytes, est.dense_bytes) == (exact.expert_bytes, exact.dense_bytes)
    assert exact.expert_format.startswith("mxfp4") and exact.window == 8
    assert exact.kv_bytes(100) == 2 * (2 * 2 * 8) * (100 + 8)  # one full layer, one 8-token window layer


def test_partial_download_and_config_only_dirs(tmp_path):
    path = tmp_path / "partial"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_QWEN))
    index = {"metadata": {"total_size": 40_000}, "weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "model-1.safetensors").write_bytes(bytes(15_000))
    s = read_model_spec(path)
    assert s.estimated and not s.weights_present and s.present_bytes == 15_000 and s.checkpoint_bytes == 40_000
    assert any("1 of 2 shards present" in n for n in s.notes)
    plan = make_plan(s, machine(None, 16, disk_gib=1))
    assert plan.disk_needed_bytes == 25_000
    only = tmp_path / "only_config"
    only.mkdir()
    (only / "config.json").write_text(json.dumps(TINY_QWEN))
    assert read_model_spec(only).source == "config.json"


def test_bad_inputs_are_typed_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such model directory"):
        read_model_spec(tmp_path / "nope")
    with pytest.raises(ConfigError, match="Hugging Face cache"):
        read_model_spec("no-such-org-moechat-test/no-such-model")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8, "vocab_size": 8,
                                                      "num_hidden_layers": 1, "num_attention_heads": 1,
                                                      "intermediate_size": 8}))
    with pytest.raises(ConfigError, match="not a Mixture-of-Experts"):
        read_model_spec(tmp_path)


# -- plans on the matrix the issue names -------------------------------------------------------------------

@needs_configs
@pytest.mark.parametrize("name", list(MODELS))
def test_plans_never_exceed_budgets_and_more_vram_never_gives_fewer_slots(name):
    s = spec(name)
    slots_by_ram = {}
    for ram in (16, 32, 64, 128):
        slots = []
        for vram in (8, 12, 16, 24):
            plan = make_plan(s, machine(vram, ram))
            items = [d.item for d in plan.decisions]
            for prefix in ("device", "dense weights", "KV cache", "workspace", "expert slots", "download"):
                assert any(i.startswith(prefix) for i in items), (prefix, items)
            assert all(d.reason and any(ch.isdigit() for ch in d.reason) for d in plan.decisions), plan.decisions
            if plan.ok:
                assert plan.device_used_bytes <= plan.device_budget_bytes
                assert plan.ram_used_bytes <= plan.ram_budget_bytes
                assert plan.disk_needed_bytes <= plan.disk_free_bytes
                assert s.top_k <= plan.expert_slots <= s.total_experts
                assert plan.device_used_bytes == (plan.dense_bytes + plan.kv_bytes + plan.workspace_bytes
                                                  + plan.expert_slots * s.expert_bytes)
                # every expert has a home: on the device, all in RAM, or the disk tier (the shards)
                if not plan.resident:
                    assert plan.experts_in_ram == s.total_experts or any(i == "disk tier" for i in items)
                    assert any(i.startswith("host tier") for i in items)
                d = plan.decode
                assert 0 < d.low <= d.high <= d.bound and any(i == "decode" for i in items)
                assert plan.context == 4096 or plan.context == s.max_context
            else:
                r = plan.refusal
                assert r.short_bytes > 0 and r.fixes and r.message.startswith("short by")
                with pytest.raises(PlanRefusedError):
                    plan.check()
            slots.append(plan.expert_slots)
        assert slots == sorted(slots), (ram, slots)
        slots_by_ram[ram] = slots
    for i in range(4):  # more RAM never takes slots away either
        col = [slots_by_ram[ram][i] for ram in (16, 32, 64, 128)]
        assert col == sorted(col)


@needs_configs
def test_more_ram_never_shrinks_the_host_tier():
    s = spec("qwen3-30b-a3b")
    in_ram = [make_plan(s, machine(12, ram)).experts_in_ram for ram in (8, 16, 24, 32, 48, 64, 96)]
    assert in_ram == sorted(in_ram) and in_ram[-1] == s.total_experts and in_ram[0] < in_ram[-1]


@needs_configs
def test_qwen3_30b_on_12_gib_by_hand():
    s = spec("qwen3-30b-a3b")
    plan = make_plan(s, machine(12, 128, link=25.2, membw=500))
    budget = int(12 * GiB - 0.05 * 12 * GiB)  # 11.4 GiB
    workspace = 512 * 2**20 + 4 * 512 * (8 * 2048 + 4 * 8 * 768)  # CUDA context + a 512-token chunk in fp32
    kv = 98_304 * 4096
    assert (plan.device_budget_bytes, plan.workspace_bytes, plan.kv_bytes) == (budget, workspace, kv)
    assert plan.expert_slots == (budget - 3_082_186_752 - kv - workspace) // 9_437_184 == 862
    assert plan.host_tier == "all experts in RAM" and plan.ram_cache_bytes is None
    # The decode formula of docs/plan.md, term by term (every expert in pinned RAM: no disk reads).
    c = 862 / 6144
    device = (3_082_186_752 - 151936 * 2048 * 2) + 48 * 8 * 9_437_184 + 98_304 * 2048
    active = 48 * 8 * 9_437_184

    def tok_s(h):
        t = device / (500e9 * 0.7) + active * (1 - h) / 25.2e9 + 48 * OVERHEAD_PER_LAYER_S["gpu"] \
            + 48 * 8 * (1 - h) * OVERHEAD_PER_MISS_S["gpu"]
        return 1 / t

    h_low, h_high = c, 1 - 0.6 * (1 - c)
    d = plan.decode
    assert d.hit_rate_low == pytest.approx(h_low) and d.hit_rate_high == pytest.approx(h_high)
    assert d.device_bytes == device and d.disk_bytes_low == 0
    assert (d.low, d.high) == (pytest.approx(tok_s(h_low)), pytest.approx(tok_s(h_high)))
    assert d.bound == pytest.approx(1 / max(device / 500e9, active * (1 - h_high) / 25.2e9)) and d.bound_by == "link"


@needs_configs
def test_where_misses_run_load_host_auto_by_hand():
    """`moechat fit` predicts --on-miss load, host and auto (issue 16), each with its bound, and picks the best."""
    from moechat.engine.cache.hybrid import ACTIVATION_COPY_S
    from moechat.engine.plan import compute_efficiency

    s = spec("qwen3-30b-a3b")
    box = machine(12, 128, link=25.2, membw=500)
    plan = make_plan(s, box, Preferences(host_read_gbps=40.0))
    load, host, auto = plan.placements
    d = make_plan(s, box, Preferences(host_read_gbps=40.0, on_miss="load")).decode  # the copy-every-miss estimate
    assert (load.mode, load.low, load.high, load.bound_by) == ("load", d.low, d.high, d.bound_by)
    # the plan's decode (what fit's headline, formats and --json show) is the mode asked for, auto by default
    for p in plan.placements:
        asked = make_plan(s, box, Preferences(host_read_gbps=40.0, on_miss=p.mode)).decode
        assert (asked.on_miss, asked.low, asked.high, asked.bound, asked.bound_by) == (p.mode, p.low, p.high, p.bound,
                                                                                      p.bound_by)
    assert plan.decode.on_miss == "auto" and (plan.decode.low, plan.decode.high) == (auto.low, auto.high)
    active = 48 * 8 * 9_437_184
    dense = d.device_bytes - active

    def host_tok_s(h):  # per MoE layer the longer of the GPU's slotted experts and the CPU's missed ones
        gpu = active * h / 350e9
        cpu = active * (1 - h) / (40e9 * compute_efficiency(s, "cpu"))
        return 1 / (dense / 350e9 + max(gpu, cpu) + 48 * (1 - h ** 8) * 2 * ACTIVATION_COPY_S
                    + 48 * OVERHEAD_PER_LAYER_S["gpu"])

    assert host.low == pytest.approx(host_tok_s(d.hit_rate_low))
    assert host.high == pytest.approx(host_tok_s(d.hit_rate_high))
    assert host.bound_by == "host RAM" and host.host_experts == pytest.approx(48 * 8 * (1 - d.hit_rate_low))
    assert auto.mode == "auto" and auto.low == max(load.low, host.low)
    assert plan.best_placement.mode == "auto"
    # A slow link makes the host the better way; a fast one and a slow CPU the load.
    slow_link = make_plan(s, machine(12, 128, link=2.0), Preferences(host_read_gbps=40.0))
    assert slow_link.placements[1].low > slow_link.placements[0].low
    assert slow_link.decode.low == slow_link.placements[1].low  # auto predicts the host's figure there
    assert slow_link.placements[2].low == slow_link.placements[1].low
    fast_link = make_plan(s, machine(12, 128, link=50.0), Preferences(host_read_gbps=5.0))
    assert fast_link.placements[0].low > fast_link.placements[1].low
    assert "where misses run" in [x.item for x in plan.decisions]
    assert plan.to_json()["best_on_miss"] == "auto" and len(plan.to_json()["placements"]) == 3
    # No placements where there is no choice: every expert resident, or a CPU-only machine.
    assert make_plan(s, machine(80, 128)).placements == () and make_plan(s, machine(None, 32)).placements == ()


@needs_configs
def test_cpu_only_plans():
    s = spec("qwen3-30b-a3b")
    small = make_plan(s, machine(None, 32))
    assert small.device == "cpu" and small.ok and small.needs_cache
    assert small.host_tier == "none" and small.ram_cache_bytes == 0  # the slots are the RAM tier
    assert small.device_budget_bytes == int(32 * GiB - 0.05 * 32 * GiB) - GiB
    assert small.ram_used_bytes <= small.ram_budget_bytes and small.decode.bound_by == "disk"
    big = make_plan(s, machine(None, 128))
    assert big.resident and not big.needs_cache and big.decode.link_bytes_low == 0


@needs_configs
def test_refusal_names_the_shortfall_and_fixes_and_override_loads_anyway():
    s = spec("deepseek-v3")
    plan = make_plan(s, machine(8, 16))
    r = plan.refusal
    assert r.resource == "VRAM" and r.short_bytes == r.need_bytes - r.have_bytes
    assert r.have_bytes == plan.device_budget_bytes and r.need_bytes > s.dense_bytes
    assert f"short by {r.short_bytes / GiB:.1f} GiB of VRAM" in r.message and "free VRAM" in r.message
    assert any("disk" in a for a in r.also) is False  # 10,000 GiB of disk: no disk shortfall
    with pytest.raises(PlanRefusedError) as err:
        plan.check()
    assert err.value.refusal is r
    forced = make_plan(s, machine(8, 16), Preferences(override=True))
    assert forced.overridden and forced.check() is forced and forced.decode is not None
    assert any(d.item == "override" for d in forced.decisions)
    # Qwen3-235B's 15 GiB of dense weights do not fit 8 GiB, but 128 GiB of RAM can run it on the CPU
    big = make_plan(spec("qwen3-235b-a22b"), machine(8, 128))
    assert big.refusal.resource == "VRAM" and any("--device cpu" in f for f in big.refusal.fixes)


@needs_configs
def test_explicit_context_refusal_offers_the_largest_context_that_fits():
    s = spec("qwen3-30b-a3b")
    plan = make_plan(s, machine(6, 32), Preferences(context=40960))
    fix = plan.refusal.fixes[0]
    assert fix.startswith("lower --context to ")
    n = int(fix.removeprefix("lower --context to ").replace(",", ""))
    assert make_plan(s, machine(6, 32), Preferences(context=n)).ok
    assert not make_plan(s, machine(6, 32), Preferences(context=n + 256)).ok


@needs_configs
def test_default_context_is_lowered_when_vram_is_tight_and_slots_stay_monotone():
    s = spec("qwen3-30b-a3b")
    tight = make_plan(s, machine(3.8, 32))
    assert tight.ok and 512 <= tight.context < 4096 and tight.context % 256 == 0
    assert tight.expert_slots == s.top_k
    assert any("lowered from 4,096" in d.reason for d in tight.decisions)
    sweep = [make_plan(s, machine(3.5 + 0.05 * i, 32)) for i in range(90)]
    slots = [p.expert_slots for p in sweep]
    contexts = [p.context for p in sweep if p.ok]
    assert slots == sorted(slots) and contexts == sorted(contexts) and not sweep[0].ok and sweep[-1].ok


@needs_configs
def test_prefer_context():
    s = spec("qwen3-30b-a3b")
    roomy = make_plan(s, machine(24, 64), Preferences(prefer="context"))
    assert roomy.context == 40960 and roomy.expert_slots >= 8 * 48
    tight = make_plan(s, machine(8, 64), Preferences(prefer="context"))
    assert tight.context == 40960 and 8 <= tight.expert_slots < make_plan(s, machine(8, 64)).expert_slots
    tighter = make_plan(s, machine(6, 64), Preferences(prefer="context"))  # 3.75 GiB of KV does not fit
    assert 4096 < tighter.context < 40960 and tighter.expert_slots == 8


@needs_configs
def test_disk_refusals():
    oss = make_plan(spec("gpt-oss-120b"), machine(8, 16, disk_gib=40))
    r = oss.refusal
    assert r.resource == "disk" and r.have_bytes == 40 * GiB and r.fixes[0].startswith("free ")
    assert not any("4-bit" in f for f in r.fixes)  # it already is 4-bit
    assert make_plan(spec("gpt-oss-120b"), machine(8, 16)).ok  # with the disk: slots + RAM cache + disk
    qwen = make_plan(spec("qwen3-30b-a3b"), machine(12, 32, disk_gib=10))
    # The advice names a format moechat loads: a bf16 model's FP8 checkpoint (experts 3 H I + block scales)
    assert qwen.refusal.resource == "disk" and "4-bit" not in qwen.refusal.message
    s = spec("qwen3-30b-a3b")
    fp8 = s.checkpoint_bytes - 6144 * (9_437_184 - (3 * 2048 * 768 + 4 * (2 * 6 * 16 + 16 * 6)))
    assert f"an FP8 checkpoint of this model, where one is published (about {fp8 / GiB:.2f} GiB" in qwen.refusal.message


def test_ram_refusal_on_a_gpu_box():
    plan = make_plan(spec_from_config(TINY_QWEN), machine(8, 1))
    assert plan.refusal.resource == "RAM" and "close programs" in plan.refusal.fixes[0]


# -- hit rates -------------------------------------------------------------------------------------------

def test_miss_ratio_curve_interpolation_and_replay_rows():
    curve = MissRatioCurve(((0.1, 0.3), (0.5, 0.8)), best=((0.5, 0.9),))
    assert curve.hit_at(0.3) == pytest.approx(0.55)  # halfway from (0.1, 0.3) to (0.5, 0.8)
    assert curve.hit_at(0.75) == pytest.approx(0.9) and curve.hit_at(0.05) == pytest.approx(0.15)
    assert curve.best_at(0.5) == pytest.approx(0.9)
    rows = [dict(trace="t.npz", policy=p, pool=pool, capacity_per_layer=c, hit_rate=h)
            for p, pool, c, h in [("lru", "global", 16, 0.5), ("lru", "global", 32, 0.7), ("lfru", "global", 16, 0.4),
                                  ("lfru", "global", 32, 0.6), ("belady", "global", 16, 0.65),
                                  ("belady", "global", 32, 0.85), ("lru", "per-layer", 16, 0.1)]]
    c = MissRatioCurve.from_json(rows, num_experts=64)
    assert c.points == ((0.25, 0.5), (0.5, 0.7)) and c.best == ((0.25, 0.65), (0.5, 0.85)) and "lru" in c.source
    with pytest.raises(ValueError):
        MissRatioCurve.from_json({"nope": 1}, 64)


@needs_configs
def test_a_better_curve_predicts_more_tokens_per_second():
    s = spec("qwen3-30b-a3b")
    default = make_plan(s, machine(12, 64))
    curve = MissRatioCurve(((0.05, 0.5), (0.25, 0.8)), source="test trace")
    traced = make_plan(s, machine(12, 64), Preferences(hit_curve=curve))
    c = traced.expert_slots / traced.total_experts
    assert traced.decode.hit_rate_low == pytest.approx(curve.hit_at(c)) and traced.decode.hit_source == "test trace"
    assert traced.decode.low > default.decode.low


def test_dense_reason_names_the_total_when_every_part_is_small():
    """The bundled model's dense parts are each a few MiB: the reason still says how much, not ' GiB'."""
    s = read_model_spec(ROOT / "assets" / "demo-moe")
    plan = make_plan(s, machine(None, 16))
    reason = next(d.reason for d in plan.decisions if d.item == "dense weights")
    assert reason.split()[0][0].isdigit() and "MiB in all" in reason, reason
