"""The validation layer (engine/io/validate.py, engine/io/files.py): every bad value of config.json,
generation_config.json, tokenizer_config.json and the safetensors index is one typed line naming the file, the
key, the value and what is allowed; non-regular files are refused without blocking; headers are offset-checked."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from moechat.engine.errors import CheckpointError, ConfigError, MoechatError, TokenizerError
from moechat.engine.io import validate
from moechat.engine.io.checkpoint import Checkpoint, read_safetensors_header
from moechat.engine.io.files import atomic_write, read_json_object
from moechat.engine.load.loader import load_model, read_model_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def model_dir(tiny_models, tmp_path):
    src, _ = tiny_models["qwen3_moe"]
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _config(model_dir, **changes):
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DROP:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return path


_DROP = object()


# The list, and more: key -> (value, words the line must hold besides the file and the key)
BAD_CONFIG = [
    ("decoder_sparse_step", 0, "integer in 1..1024"),
    ("num_key_value_heads", 0, "integer in 1..1024"),
    ("num_key_value_heads", 3, "must divide num_attention_heads (4)"),
    ("head_dim", 0, "integer in 1..4096"),
    ("head_dim", -8, "integer in 1..4096"),
    ("rms_norm_eps", "x", "finite number > 0"),
    ("rms_norm_eps", float("nan"), "finite number > 0"),
    ("rms_norm_eps", -1e-6, "finite number > 0"),
    ("rope_theta", "abc", "finite number > 0"),
    ("rope_theta", 0, "finite number > 0"),
    ("rope_theta", -5.0, "finite number > 0"),
    ("rope_theta", float("inf"), "finite number > 0"),
    ("max_position_embeddings", -1, "integer in 1..16,777,216"),
    ("max_position_embeddings", "4096", "integer in 1..16,777,216"),
    ("mlp_only_layers", {"a": 1}, "a list"),
    ("mlp_only_layers", [0, "x"], "integer in 0..1024"),
    ("eos_token_id", "</s>", "an integer in 0..2,147,483,647, or a list"),
    ("eos_token_id", [1, -2], "integer in 0..2,147,483,647"),
    ("sliding_window", -4, "integer in 1..16,777,216 or null"),
    ("num_hidden_layers", 10**9, "integer in 1..1024"),
    ("vocab_size", 2**40, "integer in 1..4,194,304"),
    ("vocab_size", True, "integer"),
    ("hidden_size", 64.5, "integer"),
    ("num_experts", 0, "integer in 1..8192"),
    ("num_experts_per_tok", 9, "integer in 1..8 (top-k"),
    ("num_experts_per_tok", 0, "integer in 1..8192"),
    ("moe_intermediate_size", None, "integer in 1..1,048,576"),
    ("tie_word_embeddings", "yes", "true or false"),
    ("rope_scaling", [1], "JSON object"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 0}, "finite number > 0"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "YaRN RoPE needs it"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": -1.0}, "finite number > 0"),
    ("quantization_config", "fp8", "JSON object"),
    ("model_type", ["qwen3_moe"], "must be a string"),
    ("decoder_sparse_step", 9, "no layer is a Mixture-of-Experts layer"),
]


@pytest.mark.parametrize("key, value, allowed", BAD_CONFIG, ids=[f"{k}={v!r}"[:40] for k, v, _ in BAD_CONFIG])
def test_bad_config_values_are_one_line(model_dir, key, value, allowed):
    path = _config(model_dir, **{key: value})
    with pytest.raises(ConfigError) as e:
        read_model_config(model_dir)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{path}: ") and allowed in line and e.value.path == str(path)
    if value is None:
        assert f"{key} is missing" in line
    elif "no layer" in allowed:
        assert "num_hidden_layers = 3" in line
    elif not isinstance(value, (list, dict)) or key == "model_type":
        assert f"{key} = {validate.show(value)} is not allowed" in line and e.value.key == key
    else:  # the item or sub-key at fault is named
        assert e.value.key.startswith(key) and line.startswith(f"{path}: {e.value.key}")


def test_missing_required_key_names_it(model_dir):
    _config(model_dir, vocab_size=_DROP)
    with pytest.raises(ConfigError, match=r"vocab_size is missing: it must be an integer in 1\.\.4,194,304"):
        read_model_config(model_dir)


def test_null_means_unset_where_null_is_not_allowed(model_dir):
    _config(model_dir, rms_norm_eps=None, attention_bias=None)
    _, args, _ = read_model_config(model_dir)
    assert args.rms_norm_eps == 1e-6 and args.attention_bias is False


def test_a_huge_config_is_refused_before_anything_is_built(model_dir, monkeypatch):
    from moechat.engine.models.base import MoEForCausalLM

    def no_build(*a, **k):
        raise AssertionError("the model must not be built")

    monkeypatch.setattr(MoEForCausalLM, "__init__", no_build)
    for key, value in [("num_hidden_layers", 10**9), ("vocab_size", 10**12), ("max_position_embeddings", 2**40),
                       ("num_experts", 10**7)]:
        _config(model_dir, **{key: value})
        with pytest.raises(ConfigError, match=key):
            load_model(model_dir)
        _config(model_dir, **{key: {"num_hidden_layers": 3, "vocab_size": 256, "max_position_embeddings": 512,
                                    "num_experts": 8}[key]})


def test_fit_refuses_a_huge_config_too(tmp_path):
    from moechat.engine.plan import spec_from_config

    config = json.loads((ROOT / "assets" / "demo-moe" / "config.json").read_text())
    config["num_hidden_layers"] = 10**9
    with pytest.raises(ConfigError, match=r"num_hidden_layers = 1000000000 is not allowed"):
        spec_from_config(config, where="x/config.json")


def test_layers_must_match_the_checkpoint(model_dir):
    path = _config(model_dir, num_hidden_layers=4)
    with pytest.raises(ConfigError, match=r"num_hidden_layers = 4 is not allowed: the checkpoint has tensors for 3 "
                                          r"layers .*none for layer 3") as e:
        load_model(model_dir)
    assert e.value.path == str(path)


def test_new_model_fields_are_checked_by_their_annotation():
    """A model file added later gets its own fields validated with no code: by type, or by cfg() metadata."""
    from moechat.engine.models.qwen3_moe import Qwen3MoeArgs

    @dataclass
    class NewArgs(Qwen3MoeArgs):
        some_count: int = 1
        some_scale: float = 1.0
        some_flag: bool = False
        some_names: list[str] | None = None
        bounded: float = validate.cfg(0.5, gt=0, max=1)

    good = dict(model_type="x", vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                num_experts=2, num_experts_per_tok=1, moe_intermediate_size=4)
    assert NewArgs.from_dict({**good, "some_count": 3.0}).some_count == 3  # an integral float is an int
    for key, value, allowed in [("some_count", "3", "integer in 0..2,147,483,647"), ("some_count", -1, "integer"),
                                ("some_scale", float("nan"), "a finite number"), ("some_flag", 1, "true or false"),
                                ("some_names", ["a", 2], "some_names[1] = 2 is not allowed: must be a string"),
                                ("bounded", 2.0, "a finite number > 0 and <= 1")]:
        with pytest.raises(ConfigError, match=r"^x/config\.json: " + key) as e:
            NewArgs.from_dict({**good, key: value}, "x/config.json")
        assert allowed in str(e.value) and e.value.key.startswith(key)


def test_real_configs_of_every_family_pass():
    configs = ROOT.parent / "shared" / "model-configs"
    if not os.path.isdir(configs):
        pytest.skip("shared/model-configs not present")
    n = 0
    for root, _, files in os.walk(configs):
        for name in files:
            if name.endswith(".json"):
                data = json.load(open(os.path.join(root, name)))
                if name == "generation_config.json":
                    validate.check_generation_config(data, name)
                elif name.endswith("index.json"):
                    validate.check_index(data, name)
                else:
                    validate.check_common(data, name)
                n += 1
    assert n >= 10


# -- generation_config.json, tokenizer_config.json ------------------------------------------------------------

@pytest.mark.parametrize("key, value, allowed", [
    ("eos_token_id", "<|im_end|>", "an integer in 0..2,147,483,647, or a list"),
    ("max_new_tokens", -5, "integer in 1..16,777,216"),
    ("temperature", "hot", "finite number >= 0"),
    ("top_p", 1.5, "finite number in 0..1"),
    ("do_sample", "yes", "true or false"),
])
def test_bad_generation_config_fails_before_the_weights_are_read(tiny_chat_model, tmp_path, monkeypatch, key,
                                                                  value, allowed):
    from moechat.engine.runtime import generate

    src, _, _ = tiny_chat_model
    d = tmp_path / "m"
    shutil.copytree(src, d)
    (d / "generation_config.json").write_text(json.dumps({key: value}))
    monkeypatch.setattr(generate, "load_model", lambda *a, **k: pytest.fail("weights read before the check"))
    with pytest.raises(ConfigError) as e:
        generate.Engine.load(d)
    assert str(e.value).startswith(f"{d / 'generation_config.json'}: {key} = ") and allowed in str(e.value)


@pytest.mark.parametrize("config, fragment", [
    ({"eos_token": 5}, "eos_token = 5 is not allowed"),
    ({"eos_token": {"id": 3}}, "eos_token.content is missing"),
    ({"chat_template": 42}, "chat_template = 42 is not allowed"),
    ({"added_tokens_decoder": {"5": "x"}}, "added_tokens_decoder.5 = 'x' is not allowed"),
    ({"add_bos_token": "no"}, "add_bos_token = 'no' is not allowed: must be true or false or null"),
])
def test_bad_tokenizer_config(tiny_chat_model, tmp_path, config, fragment):
    from moechat.engine.text.tokenizer import Tokenizer

    src, _, _ = tiny_chat_model
    d = tmp_path / "m"
    shutil.copytree(src, d)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=str(d / "tokenizer_config.json")) as e:
        Tokenizer.from_model_dir(d)
    assert fragment in str(e.value)


# -- the safetensors index -------------------------------------------------------------------------------------

@pytest.mark.parametrize("index, fragment", [
    ({"weight_map": ["model.safetensors"]}, "weight_map = [\"model.safetensors\"] is not allowed: must be a JSON"),
    ({"weight_map": {"a.weight": 1}}, "weight_map.a.weight = 1 is not allowed: must be a string"),
    ({"weight_map": {}}, "weight_map is empty"),
    ({}, "weight_map is missing"),
    ({"weight_map": {"a.weight": "../x.safetensors"}}, "must be the name of a *.safetensors file"),
    ({"weight_map": {"a.weight": "model.bin"}}, "must be the name of a *.safetensors file"),
    ({"metadata": {"total_size": "big"}, "weight_map": {"a": "model.safetensors"}}, "metadata.total_size"),
    ([1, 2], "must be a JSON object, found list"),
])
def test_bad_index(model_dir, index, fragment):
    path = model_dir / "model.safetensors.index.json"
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(model_dir)
    assert fragment in str(e.value) and str(e.value).startswith(str(path)) and e.value.path == str(path)


# -- files that are not regular files --------------------------------------------------------------------------

def _returns_within(fn, seconds=20.0):
    """Run fn in a thread; the test fails (instead of hanging) if it blocks."""
    out = {}

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked on a non-regular file"
    return out.get("error")


@pytest.mark.parametrize("victim", ["config.json", "model.safetensors", "generation_config.json",
                                    "tokenizer_config.json", "tokenizer.json", "index"])
def test_a_fifo_is_refused_not_waited_on(tiny_chat_model, tmp_path, victim):
    from moechat.engine.runtime.generate import Engine

    src, _, _ = tiny_chat_model
    d = tmp_path / "m"
    shutil.copytree(src, d)
    name = victim
    if victim == "index":  # the index names a shard that is a FIFO
        (d / "model.safetensors").rename(d / "real.safetensors")
        names = list(read_safetensors_header(d / "real.safetensors"))
        weight_map = {n: "real.safetensors" for n in names}
        weight_map[names[0]] = "fifo.safetensors"
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        name = "fifo.safetensors"
    (d / name).unlink(missing_ok=True)
    os.mkfifo(d / name)
    error = _returns_within(lambda: Engine.load(d))
    assert isinstance(error, MoechatError), error
    assert "FIFO" in str(error) and str(d / name) in str(error)


def test_a_device_is_refused(model_dir):
    (model_dir / "model.safetensors").unlink()
    os.symlink("/dev/zero", model_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match="character device, not a regular file"):
        Checkpoint.open(model_dir)


def test_oversized_and_deep_json(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ConfigError, match="nested too deeply"):
        read_json_object(deep, "model config")
    big = tmp_path / "big.json"
    big.write_text('{"a": "' + "x" * 1000 + '"}')
    with pytest.raises(ConfigError, match="is 1,009 bytes, more than the 100"):
        read_json_object(big, "model config", max_bytes=100)
    digits = tmp_path / "digits.json"
    digits.write_text('{"vocab_size": ' + "9" * 5000 + "}")
    with pytest.raises(ConfigError, match="value JSON cannot represent"):
        read_json_object(digits, "model config")


# -- safetensors headers ---------------------------------------------------------------------------------------

def _shard(path, header: dict, data: bytes):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_header_offsets_are_checked(tmp_path):
    """An experts-only shard is read with preadv, never through safetensors' own checks: overlaps, negative
    offsets and header bytes as weights are refused here."""
    p = tmp_path / "x.safetensors"
    t = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    _shard(p, {"a": t, "b": {**t, "data_offsets": [4, 12]}}, bytes(16))
    with pytest.raises(CheckpointError, match=r"tensors 'a' \(bytes .*\) and 'b' .* overlap"):
        read_safetensors_header(p)
    _shard(p, {"a": {**t, "data_offsets": [-8, 0]}}, bytes(8))
    with pytest.raises(CheckpointError, match="header is inconsistent"):
        read_safetensors_header(p)
    for bad in ({**t, "shape": ["2"]}, {**t, "shape": [2.0]}, {**t, "data_offsets": [0]}, {**t, "dtype": 4},
                [1, 2], {**t, "shape": [True, 8]}):
        _shard(p, {"a": bad}, bytes(8))
        with pytest.raises(CheckpointError, match="malformed header entry|inconsistent"):
            read_safetensors_header(p)
    _shard(p, {"__metadata__": {"format": 1}, "a": t}, bytes(8))
    with pytest.raises(CheckpointError, match="__metadata__ must map strings to strings"):
        read_safetensors_header(p)
    _shard(p, {"a": t, "b": {**t, "data_offsets": [8, 16]}, "z": {**t, "shape": [0], "data_offsets": [8, 8]}},
           bytes(16))
    assert set(read_safetensors_header(p)) == {"a", "b", "z"}  # adjacent tensors and empty ones are fine


def test_deeply_nested_header(tmp_path):
    p = tmp_path / "x.safetensors"
    raw = b"[" * 100_000 + b"]" * 100_000
    p.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CheckpointError, match="nested too deeply") as e:
        read_safetensors_header(p)
    assert e.value.path == str(p)


def test_tokenizer_errors_stay_typed(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(b"\xff\xfe not json")
    from moechat.engine.text.tokenizer import Tokenizer

    with pytest.raises(TokenizerError, match="unreadable tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)


def test_atomic_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "f.json"
    atomic_write(path, "old")

    def boom(f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write(path, boom)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]
    leftover = tmp_path / ".f.json.999999999.abc.tmp"  # a writer killed mid-write: its pid is gone
    leftover.write_text("x")
    atomic_write(path, "new")
    assert path.read_text() == "new" and not leftover.exists()
