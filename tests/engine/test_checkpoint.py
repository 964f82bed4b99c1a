"""Bad checkpoints become typed errors naming the file and tensor, before torch sees them."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from moechat.engine.errors import CheckpointError, ConfigError, UnsupportedModelError
from moechat.engine.io.checkpoint import Checkpoint, read_safetensors_header
from moechat.engine.load.loader import load_model
from moechat.engine.runtime.generate import Engine

EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.fixture
def model_dir(tiny_models, tmp_path):
    """A private copy of the tiny qwen3_moe checkpoint to damage."""
    src, _ = tiny_models["qwen3_moe"]
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _rewrite(model_dir, edit):
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_good_checkpoint_is_lazy_and_complete(model_dir):
    ckpt = Checkpoint.open(model_dir)
    assert EXPERT in ckpt and ckpt.info(EXPERT).shape == (32, 64)
    ref = load_file(model_dir / "model.safetensors")[EXPERT]
    assert torch.equal(ckpt.get(EXPERT), ref)
    loaded = load_model(model_dir, dtype="float32")
    w13 = loaded.provider.expert_weights(1, 3)["w13"]  # [2I, H]: gate rows then up rows
    assert torch.equal(w13[32:], ref)


def test_truncated_shard(model_dir):
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated") as e:
        load_model(model_dir)
    assert e.value.path == str(path) and e.value.tensor is not None


def test_header_length_past_end(model_dir):
    path = model_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 2)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="header length .* past the end") as e:
        load_model(model_dir)
    assert e.value.path == str(path)


def test_header_not_json(model_dir):
    path = model_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff{[x"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_safetensors_header(path)


def test_file_shorter_than_a_header(model_dir):
    (model_dir / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="too short"):
        load_model(model_dir)


def test_bad_config_json(model_dir):
    (model_dir / "config.json").write_text('{"model_type": "qwen3_moe", ')
    with pytest.raises(ConfigError, match=r"config.json.*not valid JSON"):
        load_model(model_dir)


def test_missing_tensor(model_dir):
    _rewrite(model_dir, lambda t: t.pop(EXPERT))
    with pytest.raises(CheckpointError, match="missing") as e:
        load_model(model_dir)
    assert e.value.tensor == EXPERT


def test_missing_dense_tensor(model_dir):
    _rewrite(model_dir, lambda t: t.pop("model.layers.2.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError) as e:
        load_model(model_dir)
    assert e.value.tensor == "model.layers.2.self_attn.k_norm.weight"


def test_wrong_shape(model_dir):
    _rewrite(model_dir, lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 60)}))
    with pytest.raises(CheckpointError, match=r"shape \[64, 60\].*\[64, 64\]") as e:
        load_model(model_dir)
    assert e.value.tensor == "model.layers.0.self_attn.q_proj.weight"


def test_wrong_dtype(model_dir):
    _rewrite(model_dir, lambda t: t.update({EXPERT: torch.zeros(32, 64, dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match="stored as I32") as e:
        load_model(model_dir)
    assert e.value.tensor == EXPERT


def test_index_names_missing_shard(model_dir):
    names = list(load_file(model_dir / "model.safetensors"))
    weight_map = {n: "model.safetensors" for n in names}
    weight_map[names[0]] = "model-00002-of-00002.safetensors"
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors.*missing"):
        load_model(model_dir)


def test_index_names_tensor_absent_from_shard(model_dir):
    names = list(load_file(model_dir / "model.safetensors"))
    weight_map = {n: "model.safetensors" for n in names}
    weight_map["model.layers.9.ghost.weight"] = "model.safetensors"
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="ghost"):
        Checkpoint.open(model_dir)


def test_sharded_checkpoint_loads(model_dir):
    """Two shards plus an index, as the Hub ships big models."""
    tensors = load_file(model_dir / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, model_dir / shard)
    (model_dir / "model.safetensors").unlink()
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ckpt = Checkpoint.open(model_dir)
    assert len(ckpt.files()) == 2 and set(ckpt.tensors) == set(names)
    assert torch.equal(ckpt.get(names[-1]), tensors[names[-1]])


def test_fused_expert_layout_loads_the_same(tiny_models, model_dir):
    """transformers 5's fused [E, 2I, H] / [E, H, I] naming gives the same model as per-expert names."""
    def fuse(t):
        for layer in range(3):
            p = f"model.layers.{layer}.mlp.experts"
            gate_up = [torch.cat([t.pop(f"{p}.{e}.gate_proj.weight"), t.pop(f"{p}.{e}.up_proj.weight")])
                       for e in range(8)]
            down = [t.pop(f"{p}.{e}.down_proj.weight") for e in range(8)]
            t[f"{p}.gate_up_proj"] = torch.stack(gate_up)
            t[f"{p}.down_proj"] = torch.stack(down)
    src, _ = tiny_models["qwen3_moe"]
    _rewrite(model_dir, fuse)
    a, b = Engine.load(src, dtype="float32"), Engine.load(model_dir, dtype="float32")
    with torch.inference_mode():
        assert torch.equal(a._forward(a.new_sequence(), [1, 2, 3]), b._forward(b.new_sequence(), [1, 2, 3]))


def test_pickle_only_checkpoint_refused(model_dir):
    (model_dir / "model.safetensors").unlink()
    (model_dir / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickle.*safetensors"):
        load_model(model_dir)


def test_no_weights_at_all(model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no .*safetensors"):
        load_model(model_dir)


@pytest.mark.parametrize("config, message", [
    ({"model_type": "my_moe", "auto_map": {"AutoModelForCausalLM": "modeling_my.MyMoe"}}, "trust_remote_code"),
    ({"model_type": "llama"}, "dense model"),
    ({"model_type": "phimoe"}, "not supported yet"),
    ({"model_type": "wat"}, "unknown"),
])
def test_unsupported_architectures(model_dir, config, message):
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(model_dir)


def test_config_with_nonsense_sizes(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    config["num_experts_per_tok"] = 99
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="top-k"):
        load_model(model_dir)


def test_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match="no such model directory"):
        load_model(tmp_path / "nope")


@pytest.mark.parametrize("weight_map", [[1, 2], "model.safetensors", 7, None])
def test_an_index_whose_weight_map_is_not_an_object_is_one_typed_line(model_dir, weight_map):
    """Every reader of the index (the loader, and the planner `run` and `fit` consult first) names the file."""
    from moechat.engine.plan import read_model_spec

    index = model_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    for read in (Checkpoint.open, read_model_spec):
        with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: weight_map") as e:
            read(model_dir)
        assert e.value.path == str(index) and "\n" not in str(e.value)


def test_check_model_reads_no_weight_and_fetched_headers_get_the_same_checks(model_dir, monkeypatch):
    """check_model (what `moechat fit` calls) reads headers only; over a Hub repo's fetched entries it holds each
    to a local header's rules and finds the same mismatch the folder's own headers show."""
    from types import SimpleNamespace

    from moechat.engine.io import checkpoint
    from moechat.engine.io.checkpoint import tensors_from_entries
    from moechat.engine.load.loader import check_model

    monkeypatch.setattr(checkpoint.Checkpoint, "get", lambda *a: pytest.fail("a weight was read"))
    checked = check_model(model_dir)
    checked.disk.close()
    entries = {name: SimpleNamespace(dtype=t.dtype, shape=list(t.shape), nbytes=t.nbytes)
               for name, t in checked.checkpoint.tensors.items()}
    raw = json.loads((model_dir / "config.json").read_text())
    tensors = tensors_from_entries("org/m", entries, dict.fromkeys(entries, "model.safetensors"))
    check_model("org/m", raw_config=raw, tensors=tensors).disk.close()
    with pytest.raises(CheckpointError, match=r"^org/m/model\.safetensors: tensor 'model\.layers\.0\.self_attn\."
                                              r"q_proj\.weight' has shape \[64, 64\], the config implies \[48, 64\]"):
        check_model("org/m", raw_config={**raw, "num_attention_heads": 3, "num_key_value_heads": 1}, tensors=tensors)
    bad = {**entries, EXPERT: SimpleNamespace(dtype="BF16", shape=[32, 64], nbytes=5)}
    with pytest.raises(CheckpointError, match="header is inconsistent"):
        tensors_from_entries("org/m", bad)
    with pytest.raises(CheckpointError, match="unknown dtype 'Q3'"):
        tensors_from_entries("org/m", {EXPERT: SimpleNamespace(dtype="Q3", shape=[1], nbytes=1)})
