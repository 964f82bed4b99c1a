"""Real config.json files of published MoE models parse into the right architecture and sizes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moechat.engine.errors import UnsupportedModelError
from moechat.engine.load.loader import read_model_config

CONFIGS = Path(__file__).resolve().parents[2].parent / "shared" / "model-configs"

# model dir -> (config file, L, E, K, I, H, heads, kv heads, head_dim, renormalize, dense params without experts)
EXPECTED = {
    "Qwen--Qwen3-30B-A3B": ("config.json", 48, 128, 8, 768, 2048, 32, 4, 128, True),
    "Qwen--Qwen3-235B-A22B": ("config.json", 94, 128, 8, 1536, 4096, 64, 4, 128, True),
    "mistralai--Mixtral-8x7B-Instruct-v0.1": ("config.json", 32, 8, 2, 14336, 4096, 32, 8, 128, True),
    "mistralai--Mixtral-8x22B-v0.1": ("config.json", 56, 8, 2, 16384, 6144, 48, 8, 128, True),
    "allenai--OLMoE-1B-7B-0924-Instruct": ("config.finetune-derived.json", 16, 64, 8, 1024, 2048, 16, 16, 128, False),
}


def _model_dir(tmp_path, name: str, file: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    shutil.copy(CONFIGS / name / file, d / "config.json")
    return d


@pytest.mark.skipif(not CONFIGS.is_dir(), reason="shared/model-configs not present")
@pytest.mark.parametrize("name", list(EXPECTED))
def test_real_configs(tmp_path, name):
    file, L, E, K, I, H, nH, nKV, D, renorm = EXPECTED[name]
    cls, args, raw = read_model_config(_model_dir(tmp_path, name, file))
    assert (args.num_hidden_layers, args.num_experts, args.top_k, args.moe_intermediate, args.hidden_size,
            args.num_attention_heads, args.num_key_value_heads, args.head_dim, args.renormalize) == \
        (L, E, K, I, H, nH, nKV, D, renorm)
    assert cls.moe_layers(args) == list(range(L))
    shapes = cls.dense_weight_names(args)  # built on the meta device: no memory
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (nH * D, H)
    assert shapes[f"model.layers.{L - 1}.{cls.moe_attr}.gate.weight"] == (E, H)
    assert not any("experts" in n for n in shapes)


@pytest.mark.skipif(not CONFIGS.is_dir(), reason="shared/model-configs not present")
@pytest.mark.parametrize("name, file, model_type", [
    ("deepseek-ai--DeepSeek-V3", "config.json", "phimoe"),
])
def test_known_but_unsupported(tmp_path, name, file, model_type):
    # Every family with a real config here runs now (DeepSeek, GLM-4.5, Qwen2-MoE: test_shared_expert_models.py);
    # a real config relabelled as a family moechat knows but does not run yet says so.
    d = _model_dir(tmp_path, name, file)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    with pytest.raises(UnsupportedModelError, match=f"{model_type}.*not supported yet"):
        read_model_config(d)


@pytest.mark.skipif(not CONFIGS.is_dir(), reason="shared/model-configs not present")
@pytest.mark.parametrize("name, L, E, K, window_layers", [("openai--gpt-oss-20b", 24, 32, 4, 12),
                                                         ("openai--gpt-oss-120b", 36, 128, 4, 18)])
def test_real_gpt_oss_configs(tmp_path, name, L, E, K, window_layers):
    from moechat.engine.load.loader import checkpoint_format

    d = _model_dir(tmp_path, name, "config.json")
    cls, args, raw = read_model_config(d)
    assert (args.num_hidden_layers, args.num_experts, args.top_k, args.moe_intermediate) == (L, E, K, 2880)
    assert sum(args.layer_window(i) == 128 for i in range(L)) == window_layers
    assert args.rope["rope_type"] == "yarn" and args.rope["factor"] == 32.0 and args.rope_theta == 150000
    assert args.checkpoint_dtype == "bfloat16"  # the config names none; its dense weights are bf16
    assert checkpoint_format(raw).name == "mxfp4"
    shapes = cls.dense_weight_names(args)
    assert shapes["model.layers.0.self_attn.sinks"] == (64,)
    assert shapes["model.layers.0.mlp.router.bias"] == (E,)
    assert not any("experts" in n for n in shapes)
