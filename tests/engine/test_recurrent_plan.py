"""`moechat fit` on the real Gated DeltaNet configs: the KV line counts only the attention layers, the recurrent
state is its own line, and both are the bytes the engine's sequence state allocates (a meta-free tiny context)."""

import json
from pathlib import Path

import pytest
import torch

from moechat.engine.layers.kv_cache import MAX_SNAPSHOTS, KVCache
from moechat.engine.load.loader import model_config
from moechat.engine.plan import spec_from_config

CONFIGS = Path(__file__).resolve().parents[3] / "shared" / "model-configs"
REAL = {"Qwen--Qwen3.6-35B-A3B": "config.json", "Qwen--Qwen3-Next-80B-A3B": "config.transcribed.json"}


@pytest.mark.skipif(not CONFIGS.is_dir(), reason="shared/model-configs not present")
@pytest.mark.parametrize("name", list(REAL))
def test_plan_counts_what_the_sequence_state_allocates(name):
    raw = json.loads((CONFIGS / name / REAL[name]).read_text())
    spec = spec_from_config(raw)
    _, args, _ = model_config(raw, CONFIGS / name)
    context = 16
    kv = KVCache.for_model(args, context, torch.bfloat16, device="meta")
    attention = [i for i, t in enumerate(args.layer_types) if t == "full_attention"]
    assert len(kv.recurrent_layers) + len(attention) == args.num_hidden_layers
    kv_bytes = sum(t.numel() * t.element_size() for t in kv.k + kv.v)
    assert spec.kv_bytes(context) == kv_bytes
    assert spec.kv_bytes_per_token() == len(attention) * 2 * args.num_key_value_heads * args.head_dim * 2
    assert spec.recurrent_state_bytes == kv.state_nbytes() * (1 + MAX_SNAPSHOTS)
    assert f"{len(kv.recurrent_layers)} Gated DeltaNet layers" in spec.recurrent_detail
    assert f"{len(attention)} attention layers (of {args.num_hidden_layers})" in spec.kv_detail
    mtp = (raw.get("text_config") or raw).get("mtp_num_hidden_layers")
    assert (spec.unused_bytes > 0) == bool(mtp)  # an MTP layer: downloaded, not loaded


@pytest.mark.skipif(not CONFIGS.is_dir(), reason="shared/model-configs not present")
def test_qwen36_figures():
    raw = json.loads((CONFIGS / "Qwen--Qwen3.6-35B-A3B" / "config.json").read_text())
    spec = spec_from_config(raw)
    assert spec.kv_bytes_per_token() == 20 * 1024  # 10 attention layers x 2 x 2 heads x 256 x 2 B
    assert round(spec.recurrent_state_bytes / 3 / 2**20, 1) == 61.4
