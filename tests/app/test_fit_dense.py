"""`moechat fit --dense-format int8`: the plan holds attention's projections and the LM head at one byte a weight
(plus a row scale), as `moechat run --dense-format int8` does (quant/dense_int8.py), and shows the int8 figure
beside the native one on a CPU plan."""

from __future__ import annotations

import json

from moechat.app.cli.main import main
from moechat.engine.plan import read_model_spec


def test_the_spec_in_int8_dense(tiny_models):
    for name in ("qwen3_moe", "deepseek_v3"):
        if name not in tiny_models:
            continue
        path, _ = tiny_models[name]
        spec = read_model_spec(path)
        int8 = spec.in_dense_format("int8")
        assert spec.in_dense_format("native") is spec and int8.dense_format == "int8"
        before, after = dict(spec.dense_parts), dict(int8.dense_parts)
        H, fb = spec.hidden_size, spec.float_bytes
        for what in ("attention", "lm_head"):
            if what not in before:
                continue
            if what == "attention" and spec.kv_kind == "MLA latent":
                assert after[what] == before[what]  # MLA keeps its layout
                continue
            elems = before[what] // fb
            assert after[what] == elems + 4 * max(1, elems // H)
        if "lm_head" not in before:  # tied: an int8 copy of the table, the table itself only looked up
            assert after["lm_head"] < before["embeddings"] and int8.embedding_bytes == before["embeddings"]
        assert after["embeddings"] == before["embeddings"] and after.get("norms") == before.get("norms")
        assert int8.dense_read_bytes < spec.dense_read_bytes


def test_fit_plans_it_and_shows_both(tiny_models, capsys):
    path, _ = tiny_models["qwen3_moe"]
    assert main(["fit", str(path), "--device", "cpu", "--json"]) == 0
    native = json.loads(capsys.readouterr().out)
    assert native["dense_format"] == "native" and native["dense_int8"] is not None
    assert native["dense_int8"]["dense_read_bytes"] < native["spec"]["dense_read_bytes"]
    assert native["dense_int8"]["decode"]["high"] >= native["plan"]["decode"]["high"]
    assert main(["fit", str(path), "--device", "cpu", "--json", "--dense-format", "int8"]) == 0
    int8 = json.loads(capsys.readouterr().out)
    assert int8["dense_format"] == "int8" and "--dense-format" in int8["run_flags"]
    assert int8["spec"]["dense_read_bytes"] == native["dense_int8"]["dense_read_bytes"]
    assert main(["fit", str(path), "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "with --dense-format int8:" in text
    assert main(["fit", str(path), "--device", "cuda", "--dense-format", "int8"]) != 0
    assert "CPU only" in capsys.readouterr().err
