"""`--warm-start imatrix:FILE` on the command line: the slots filled from llama.cpp's imatrix before the first
token (said on stderr), and a value that is not one a usage line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moechat.app.cli.main import main
from moechat.engine.cache.imatrix import write_gguf_imatrix


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_run_warm_starts_from_an_imatrix(tiny_models, tmp_path, capsys):
    path, model = tiny_models["qwen3_moe"]
    layers, experts = model.config.num_hidden_layers, model.config.num_experts
    counts = np.arange(layers * experts, dtype=np.float64).reshape(layers, experts) % 5 + 1
    imatrix = write_gguf_imatrix(tmp_path / "model.imatrix.gguf", counts, n_in=4)
    argv = ["run", str(path), "--prompt-ids", "1,2,3", "--max-tokens", "2", "--temperature", "0", "--dtype",
            "float32", "--expert-slots", "5", "--json", "--warm-start", f"imatrix:{imatrix}"]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    assert "warm start from model.imatrix.gguf: 3 MoE layers ranked by activation counts per expert" in err
    assert json.loads(out)["generated_tokens"] == 2


@pytest.mark.parametrize("value", ["imatrix:", "some/model/dir"])
def test_a_bad_value_is_a_usage_line(tiny_models, capsys, value):
    path, _ = tiny_models["qwen3_moe"]
    with pytest.raises(SystemExit) as info:
        main(["run", "--warm-start", value, str(path), "--prompt-ids", "1"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "takes imatrix:FILE" in err and "put MODEL before the flag" in err


def test_a_missing_imatrix_is_one_error_line(tiny_models, tmp_path, capsys):
    path, _ = tiny_models["qwen3_moe"]
    code, out, err = _run(capsys, "run", str(path), "--prompt-ids", "1", "--max-tokens", "1", "--expert-slots", "5",
                          "--warm-start", f"imatrix:{tmp_path / 'nope.dat'}")
    assert code == 1 and err.count("\n") == 1 and "cannot read the imatrix" in err
