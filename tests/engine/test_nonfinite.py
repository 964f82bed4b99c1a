"""NaN and Inf: weights are checked as they are first read (dense at load, each expert on its first read into
any tier), a typed error naming the tensor; NaN logits end a generation with a clear error, never a "stop"."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moechat.engine.cache.provider import CacheConfig
from moechat.engine.errors import CheckpointError, NonFiniteLogitsError
from moechat.engine.io.checkpoint import check_finite
from moechat.engine.load.loader import load_model
from moechat.engine.runtime.generate import Engine

EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.fixture
def model_dir(tiny_models, tmp_path):
    src, _ = tiny_models["qwen3_moe"]
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _poison(model_dir, name, value=float("nan"), index=(0, 0)):
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    tensors[name][index] = value
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("name, value", [
    ("model.norm.weight", float("nan")),
    ("model.layers.0.mlp.gate.weight", float("inf")),
    ("model.embed_tokens.weight", -float("inf")),
    ("lm_head.weight", float("nan")),
])
def test_dense_weights_checked_at_load(model_dir, name, value):
    _poison(model_dir, name, value, (0,) if name.endswith("norm.weight") else (0, 0))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' holds NaN or Inf \(1 of ") as e:
        load_model(model_dir)
    assert e.value.tensor == name and e.value.path.endswith("model.safetensors")


def test_expert_checked_when_resident_experts_load(model_dir):
    _poison(model_dir, EXPERT, float("nan"), (5, 7))
    with pytest.raises(CheckpointError, match=rf"'{EXPERT}' \(expert 3 of layer 1\) holds NaN or Inf") as e:
        load_model(model_dir)
    assert e.value.tensor == EXPERT


def test_cached_expert_checked_on_its_first_read(model_dir):
    """With a cache, experts are read when routed to: the load succeeds, the generation that first needs the
    damaged expert fails with the typed error (from whichever tier reads it first)."""
    for e in range(8):
        _poison(model_dir, f"model.layers.0.mlp.experts.{e}.down_proj.weight", float("inf"), (1, 1))
    engine = Engine.load(model_dir, dtype="float32", cache=CacheConfig(expert_slots=2, ram_cache_bytes=0,
                                                                       warm_start=False))
    with pytest.raises(CheckpointError, match=r"down_proj.weight' \(expert \d of layer 0\) holds NaN or Inf"):
        list(engine.generate([1, 2, 3], max_tokens=2))


def test_check_finite_per_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.randn(3, 1000, dtype=dtype)
        check_finite(t, "ok", "f")
        t[2, 999] = float("nan")
        with pytest.raises(CheckpointError, match="'bad' holds NaN or Inf"):
            check_finite(t, "bad", "f")
    fp8 = torch.randn(64).to(torch.float8_e4m3fn)
    check_finite(fp8, "ok", "f")
    fp8.view(torch.uint8)[10] = 0x7F  # E4M3's NaN
    with pytest.raises(CheckpointError, match="holds NaN"):
        check_finite(fp8, "bad", "f")
    check_finite(torch.full((4,), 0xFF, dtype=torch.uint8), "packed", "f")  # integers: not floats, not checked


def test_nan_logits_end_the_generation_with_an_error(tiny_models, monkeypatch):
    engine = Engine.load(tiny_models["qwen3_moe"][0], dtype="float32")
    good = engine.model.logits
    calls = []

    def logits(hidden):
        calls.append(1)
        out = good(hidden)
        return out if len(calls) < 3 else torch.full_like(out, float("nan"))

    monkeypatch.setattr(engine.model, "logits", logits)
    chunks = []
    with pytest.raises(NonFiniteLogitsError, match="NaN or Inf logits at generated token 3"):
        for chunk in engine.generate([1, 2, 3], max_tokens=10):
            chunks.append(chunk)
    assert len(chunks) == 2 and all(c.finish_reason is None for c in chunks)  # no fake "stop"


def test_conversation_refuses_the_turn_when_logits_go_bad_at_once(tiny_chat_model, monkeypatch):
    engine = Engine.load(tiny_chat_model[0], dtype="float32")
    monkeypatch.setattr(engine.model, "logits", lambda h: torch.full((1, engine.args.vocab_size), float("inf")))
    conv = engine.conversation()
    with pytest.raises(NonFiniteLogitsError):
        list(conv.send("hi"))
    assert conv.messages == []  # refused before any token: the turn never happened, the chat goes on
