"""`fit`'s dense bytes and KV bytes are what the engine allocates, for every real config in ../shared/model-configs
whose family moechat runs: the dense tensors as the loader holds them (the model's dtype, routers in fp32 where the
class keeps them so, FP8 dense weights dequantized) and the sequence state's K/V buffers (a meta-device build)."""

import json
import math
from pathlib import Path

import pytest
import torch

from moechat.engine.layers.kv_cache import KVCache
from moechat.engine.load.loader import model_config
from moechat.engine.plan import spec_from_config

CONFIGS = Path(__file__).resolve().parents[3] / "shared" / "model-configs"
REAL = {"zai-org--GLM-4.7-Flash": "config.json", "deepseek-ai--DeepSeek-V3": "config.json",
        "zai-org--GLM-4.5-Air": "config.reserialized.json",
        "deepseek-ai--DeepSeek-V2-Lite-Chat": "config.reserialized.json",
        "openai--gpt-oss-20b": "config.json", "Qwen--Qwen3-30B-A3B": "config.json",
        "google--gemma-4-26B-A4B-it": "config.nvfp4-derivative.json",
        "MiniMaxAI--MiniMax-M2.5": "config.quantization-removed.json"}


@pytest.mark.parametrize("name", list(REAL))
def test_fit_counts_what_the_model_allocates(name):
    path = CONFIGS / name / REAL[name]
    if not path.exists():
        pytest.skip(f"{path} is not here")
    raw = json.loads(path.read_text())
    if name.startswith("google--"):
        raw.pop("quantization_config")  # the derivative's NVFP4; google's release is bf16
    if name.startswith("MiniMaxAI--"):  # the copy's author deleted the release's FP8 quantization_config
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "weight_block_size": [128, 128],
                                      "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
    cls, args, _ = model_config(raw, path.parent)
    spec = spec_from_config(raw)
    held = sum(math.prod(shape) * (4 if n.endswith(cls.fp32_weights) else spec.float_bytes)
               for n, shape in cls.dense_weight_names(args).items())
    assert spec.dense_bytes == held
    for context in (16, 32768):  # under every sliding window, and past it: a window layer holds a ring of its window
        kv = KVCache.for_model(args, context, torch.bfloat16, device="meta")
        assert spec.kv_bytes(context) == sum(t.numel() * t.element_size() for t in kv.k + kv.v), context
