"""No flag value is lowered silently (issue 25): absurd values are usage errors at parse time, and every value the
engine had to lower (or could not apply) is one stderr line, asked -> got and why, and an entry of --json's
"clamps"; contradicting flags are refused rather than one ignored."""

from __future__ import annotations

import json

import pytest

from moechat.app.cli import main as cli


@pytest.mark.parametrize("argv, message", [
    (["run", "--prompt-ids", "1", "--context", "99999999999"], "expected at most 16,777,216 tokens"),
    (["run", "--prompt-ids", "1", "--context", str(2**70)], "expected at most 16,777,216 tokens"),
    (["run", "--prompt-ids", "1", "--max-tokens", "99999999999"], "expected at most 16,777,216 tokens"),
    (["run", "--prompt-ids", "1", "--expert-slots", "99999999999"], "expected at most 8,388,608 slots"),
    (["run", "--prompt-ids", "1", "--host-layers", "5000"], "expected at most 1,024 layers"),
    (["run", "--prompt-ids", "1", "--ram-cache-mb", str(2**63)], "expected at most 1,073,741,824 MiB"),
    (["fit", "x", "--context", "99999999999"], "expected at most 16,777,216 tokens"),
    (["serve", "--context", "99999999999"], "expected at most 16,777,216 tokens"),
    (["run", "--prompt", "hi", "--raw", "--system", "be brief"], "--system is a chat-template message and --raw"),
    (["run", "--prompt-ids", "1,2", "--system", "be brief"], "--system is a chat-template message and --prompt-ids"),
])
def test_refused_at_parse_time(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err


def test_every_clamp_of_run_is_said_and_in_the_json(tiny_models, capsys):
    path = tiny_models["qwen3_moe"][0]  # 512 positions, 3 MoE layers x 8 experts
    code = cli.main(["run", str(path), "--prompt-ids", "1,2,3", "--max-tokens", "600", "--temperature", "0",
                     "--device", "cpu", "--context", "8192", "--expert-slots", "1000", "--host-layers", "9",
                     "--json"])
    out, err = capsys.readouterr()
    assert code == 0
    clamps = {c["flag"]: c for c in json.loads(out)["clamps"]}
    assert clamps["--context"] == {"flag": "--context", "asked": 8192, "got": 512,
                                   "why": "the model has 512 positions (max_position_embeddings)"}
    assert (clamps["--expert-slots"]["asked"], clamps["--expert-slots"]["got"]) == (1000, 24)
    assert (clamps["--host-layers"]["asked"], clamps["--host-layers"]["got"]) == (9, 3)
    assert (clamps["--max-tokens"]["asked"], clamps["--max-tokens"]["got"]) == (600, 509)
    assert set(clamps) == {"--context", "--expert-slots", "--host-layers", "--max-tokens"}
    lines = err.splitlines()
    for c in clamps.values():
        assert f"moechat: warning: {c['flag']} {c['asked']}: using {c['got']}: {c['why']}" in lines


def test_host_layers_with_every_expert_resident_is_said(tiny_models, capsys):
    code = cli.main(["run", str(tiny_models["qwen3_moe"][0]), "--prompt-ids", "1", "--max-tokens", "1", "--device",
                     "cpu", "--host-layers", "2", "--json"])
    out, err = capsys.readouterr()
    assert code == 0
    (clamp,) = json.loads(out)["clamps"]
    assert (clamp["flag"], clamp["asked"], clamp["got"]) == ("--host-layers", 2, 0)
    assert "every expert is resident" in clamp["why"] and "--host-layers 2: using 0: every expert" in err


def test_values_within_bounds_are_not_clamps(tiny_models, capsys):
    code = cli.main(["run", str(tiny_models["qwen3_moe"][0]), "--prompt-ids", "1", "--max-tokens", "2", "--device",
                     "cpu", "--context", "256", "--expert-slots", "4", "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and json.loads(out)["clamps"] == [] and "warning" not in err


def test_fit_says_its_context_clamp(tiny_models, capsys):
    path = tiny_models["qwen3_moe"][0]
    assert cli.main(["fit", str(path), "--context", "8192", "--ram-gb", "64", "--vram-gb", "0", "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["clamps"] == [{"flag": "--context", "asked": 8192, "got": 512,
                                 "why": "the model has 512 positions (max_position_embeddings)"}]
    assert report["plan"]["context"] == 512
    assert "moechat: warning: --context 8192: using 512: the model has 512 positions" in err
    assert cli.main(["fit", str(path), "--context", "300", "--ram-gb", "64", "--vram-gb", "0", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["clamps"] == [] and err == ""
