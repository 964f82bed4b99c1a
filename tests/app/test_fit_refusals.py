"""`moechat fit` says "cannot run" for exactly what `moechat run` refuses, in run's words (issue 25).

Each folder below is one way a checkpoint can be broken that the loader catches from config.json and the
safetensors headers alone; fit must give the same one-line reason (text and --json) and exit 3, and run its
error, from the same checks (engine/load/loader.py `check_model`)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moechat.app.cli.main import main
from moechat.engine.io.validate import INDEX_NAME

SHARD = "model.safetensors"


def _tensors(d):
    with safe_open(str(d / SHARD), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _index(d, weight_map):
    (d / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _pickle_only(d):
    (d / SHARD).unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04 pickle")


def _missing_tensor(d):
    t = _tensors(d)
    del t["model.norm.weight"]
    save_file(t, str(d / SHARD))


def _model_type_contradicts(d):
    _config(d, model_type="mixtral", num_local_experts=8)  # qwen3_moe's tensor names, mixtral's expected ones


def _three_heads(d):
    _config(d, num_attention_heads=3, num_key_value_heads=1)  # q_proj is [4 x 16, 64] in the weights


def _thousand_layers(d):
    _config(d, num_hidden_layers=1000)


def _int8_experts(d):
    t = _tensors(d)
    save_file({k: v.to(torch.int8) if ".experts." in k else v for k, v in t.items()}, str(d / SHARD))


def _index_escapes(d):
    _index(d, {name: f"../{d.name}/{SHARD}" for name in _tensors(d)})


def _weight_map_list(d):
    (d / INDEX_NAME).write_text(json.dumps({"weight_map": [1, 2]}))


def _fifo_shard(d):
    (d / SHARD).unlink()
    os.mkfifo(d / SHARD)


def _folder_shard(d):
    (d / SHARD).unlink()
    (d / SHARD).mkdir()


def _dev_zero_shard(d):
    (d / SHARD).unlink()
    (d / SHARD).symlink_to("/dev/zero")


def _integer_weights(d):
    t = _tensors(d)
    save_file({k: (v * 100).to(torch.int32) for k, v in t.items()}, str(d / SHARD))


def _expert_shape(d):
    t = _tensors(d)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    t[name] = t[name][:, :-1].contiguous()
    save_file(t, str(d / SHARD))


def _top_k_above_experts(d):
    _config(d, num_experts_per_tok=9)  # of 8 experts


def _index_names_a_tensor_the_shard_lacks(d):
    _index(d, {**{name: SHARD for name in _tensors(d)}, "model.extra.weight": SHARD})


BROKEN = {f.__name__.strip("_"): f for f in (
    _pickle_only, _missing_tensor, _model_type_contradicts, _three_heads, _thousand_layers, _int8_experts,
    _index_escapes, _weight_map_list, _fifo_shard, _folder_shard, _dev_zero_shard, _integer_weights, _expert_shape,
    _top_k_above_experts, _index_names_a_tensor_the_shard_lacks)}


def _run_error(capsys, d) -> str:
    code = main(["run", str(d), "--prompt-ids", "1,2", "--max-tokens", "1", "--device", "cpu"])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("moechat: error: "), err
    return lines[0].removeprefix("moechat: error: ")


@pytest.mark.parametrize("case", list(BROKEN))
def test_fit_refuses_what_run_refuses_with_its_words(tiny_models, tmp_path, capsys, case):
    d = tmp_path / "model"
    shutil.copytree(tiny_models["qwen3_moe"][0], d)
    BROKEN[case](d)
    why = _run_error(capsys, d)
    assert "unexpected" not in why, why  # a typed error, saying what to do
    code = main(["fit", str(d), "--ram-gb", "64", "--vram-gb", "0"])
    out, err = capsys.readouterr()
    assert code == 3 and err == "", err
    assert out.splitlines()[0].endswith(f": cannot run: {why}"), (out.splitlines()[0], why)
    code = main(["fit", str(d), "--ram-gb", "64", "--vram-gb", "0", "--json"])
    out, _ = capsys.readouterr()
    report = json.loads(out)
    assert code == 3 and report["why_not_runnable"] == why and report["headline"] == f"cannot run: {why}"
    assert report["runnable"] is False and report["verdict"] == "cannot run"


def test_the_intact_model_still_runs_in_both(tiny_models, tmp_path, capsys):
    d = tmp_path / "model"
    shutil.copytree(tiny_models["qwen3_moe"][0], d)
    _index(d, {name: SHARD for name in _tensors(d)})  # an index that agrees with the shard: no refusal
    assert main(["fit", str(d), "--ram-gb", "64", "--vram-gb", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["why_not_runnable"] is None
    assert main(["run", str(d), "--prompt-ids", "1,2", "--max-tokens", "1", "--device", "cpu"]) == 0


def _online(monkeypatch):
    """huggingface_hub keeps the HF_HUB_OFFLINE it read at import (an earlier test's 1): the local Hub is online."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


@pytest.mark.parametrize("case", ["three_heads", "missing_tensor", "weight_map_list", "index_escapes"])
def test_a_hub_repo_gets_the_same_checks_over_its_fetched_headers(hub, tiny_models, tmp_path, capsys, monkeypatch,
                                                                 case):
    _online(monkeypatch)
    d = tmp_path / "model"
    shutil.copytree(tiny_models["qwen3_moe"][0], d)
    if case == "index_escapes":
        _index(d, {name: f"../{SHARD}" for name in _tensors(d)})
    else:
        BROKEN[case](d)
    why = _run_error(capsys, d)
    repo = f"tiny-org/broken-{case.replace('_', '-')}"
    hub.server.add(hub.module.Repo.from_folder(repo, d))
    code = main(["fit", repo, "--ram-gb", "64", "--vram-gb", "0", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 3 and report["why_not_runnable"] == why.replace(str(d), repo), (report["why_not_runnable"], why)
    assert not [r for r in hub.server.requests if r.file == SHARD and r.method == "GET" and r.range is None], \
        "a weight file was downloaded"


def test_a_sound_hub_repo_still_runs(hub, capsys, monkeypatch):
    _online(monkeypatch)
    assert main(["fit", hub.repo, "--ram-gb", "64", "--vram-gb", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["why_not_runnable"] is None
