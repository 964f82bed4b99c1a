"""`moechat fit`'s first line (issue 18): exactly one of "runs", "runs with ..." and "cannot run: <why>", the exit
status following it; planned on total RAM with what is free now as a condition; never "runs" for what the engine
cannot load; ranges that never read "5.2-5.2"; the decode prediction from measured numbers
(engine/plan/calibration.py)."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from moechat.app.cli.fit import EXIT_REFUSED, headline, least_free_ram
from moechat.app.cli.main import main
from moechat.engine.plan import Preferences, calibration, make_plan, rate_range, read_model_spec
from moechat.engine.plan.hardware import DiskInfo, GiB, Hardware, HostMemory

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "assets" / "demo-moe"
HEADLINE = re.compile(r"^moechat fit \S+ \(\w+\): (runs|runs with .+|cannot run: .+)$")


def _fit(capsys, *args: str) -> tuple[int, str]:
    code = main(["fit", *args])
    out = capsys.readouterr().out
    assert HEADLINE.match(out.splitlines()[0]), out.splitlines()[0]
    return code, out.splitlines()[0]


def _model(tmp_path: Path, **changes) -> Path:
    """The demo model's config.json (weights left out: fit plans from the config) with `changes`."""
    d = tmp_path / "model"
    d.mkdir()
    config = json.loads((DEMO / "config.json").read_text()) | changes
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_the_demo_runs(capsys):
    code, line = _fit(capsys, str(DEMO), "--ram-gb", "16")
    assert code == 0 and line.endswith("(qwen3_moe): runs")


@pytest.mark.parametrize("changes, why", [
    ({"model_type": "phimoe"}, "cannot run: model_type 'phimoe' is not supported yet (needs SparseMixer "
                                   "routing"),
    ({"model_type": "mything", "auto_map": {"AutoModelForCausalLM": "x.Y"}},
     "cannot run: model_type 'mything' needs trust_remote_code"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}},
     "cannot run: its weights are quantized with 'gptq', which moechat does not read"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "cannot run: its weights are quantized with "
                                                                 "'bitsandbytes'"),
])
def test_what_the_engine_cannot_load_is_cannot_run_with_exit_3(capsys, tmp_path, changes, why):
    code = main(["fit", str(_model(tmp_path, **changes)), "--ram-gb", "16", "--disk-gb", "100"])
    out = capsys.readouterr().out
    assert code == EXIT_REFUSED and HEADLINE.match(out.splitlines()[0]) and why in out.splitlines()[0]
    assert "\n  advice    none: moechat cannot load this checkpoint" in out and "run with" not in out
    assert "--expert-format int" not in "\n".join(out.splitlines()[1:])  # no conversion advised for it


def test_a_refused_plan_is_cannot_run_and_force_says_so_with_exit_0(capsys):
    code, line = _fit(capsys, str(DEMO), "--ram-gb", "0.5")
    assert code == EXIT_REFUSED and ": cannot run: short by " in line and "of RAM" in line
    code, line = _fit(capsys, str(DEMO), "--ram-gb", "0.5", "--force")
    assert code == 0 and "cannot run: " in line and line.endswith("(--force: below is the plan loading anyway "
                                                                    "would use)")


def test_the_loader_and_fit_agree_on_quantization_methods():
    from moechat.engine.plan.catalog import LOADABLE_QUANT_METHODS
    from moechat.engine.quant.registry import QUANT_METHODS

    assert tuple(LOADABLE_QUANT_METHODS) == tuple(QUANT_METHODS)


def _machine(total_gib: float, free_gib: float) -> Hardware:
    ram = HostMemory(int(total_gib * GiB), int(free_gib * GiB))
    return Hardware((), ram, DiskInfo("/", 100 * GiB, 200 * GiB)).on_total_ram()


def test_planned_on_total_ram_and_runs_with_enough_free_when_not_enough_is_free_now():
    spec = read_model_spec(DEMO)
    hw = _machine(8, 0.5)  # the process alone needs 1 GiB of RAM on a CPU
    assert hw.ram.available_bytes == 8 * GiB and hw.ram.free_now_bytes == GiB // 2
    plan = make_plan(spec, hw, Preferences())
    now = make_plan(spec, replace(hw, ram=replace(hw.ram, available_bytes=hw.ram.free_now_bytes)), Preferences())
    assert plan.ok and not now.ok and now.refusal.resource == "RAM"
    need = least_free_ram(spec, hw, Preferences())
    assert make_plan(spec, replace(hw, ram=replace(hw.ram, available_bytes=need)), Preferences()).ok
    assert not make_plan(spec, replace(hw, ram=replace(hw.ram, available_bytes=need - (64 << 20))), Preferences()).ok
    text, code = headline(plan, spec, hw, None, "native", now, need)
    assert code == 0 and re.fullmatch(r"runs with 1\.\d\d GiB of RAM free \(this machine has 8\.00 GiB, 512\.0 MiB "
                                      r"is free now: close programs first\)", text), text
    hw = _machine(8, 6)
    now = make_plan(spec, replace(hw, ram=replace(hw.ram, available_bytes=hw.ram.free_now_bytes)), Preferences())
    assert headline(plan, spec, hw, None, "native", now) == ("runs", 0)
    assert headline(plan, spec, hw, None, "int8", now) == ("runs with --expert-format int8", 0)
    what_if = replace(hw, ram=HostMemory(GiB, GiB, source="what-if"))
    assert what_if.on_total_ram() is what_if  # a what-if is planned as given


@pytest.mark.parametrize("low, high, text", [(5.21, 5.24, "5.21-5.24"), (5.2, 5.2, "5.2"), (0.57, 0.63, "0.57-0.63"),
                                             (11.04, 14.2, "11.0-14.2"), (3.0001, 3.0004, "3.0"),
                                             (0.0123, 0.0123, "0.0123")])
def test_rate_ranges_never_collapse(low, high, text):
    assert rate_range(low, high) == text


def test_calibration_round_trip_and_damage(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    monkeypatch.setattr(calibration, "measure_ram_read_gbps", lambda *a, **k: 10.0)
    assert calibration.load(path) == calibration.Calibration()
    assert calibration.record_cpu_decode("m", 6, 1_000_000, 100.0, 16, path) is None  # too short to say
    layer_s = calibration.record_cpu_decode("m", 6, 1_000_000, 100.0, 64, path)
    assert layer_s == pytest.approx((1 / 100 - 1e6 / 10e9) / 6)
    for tok_s in (50.0, 200.0):
        calibration.record_cpu_decode("m", 6, 1_000_000, tok_s, 64, path)
    cal = calibration.load(path)
    assert cal.ram_read_gbps == 10.0 and cal.ram_fresh and len(cal.cpu_decodes) == 3
    assert cal.cpu_layer_s == pytest.approx(layer_s)  # the median
    path.write_text('{"ram_read_gbps": "fast", "cpu_decodes": [{"layer_s": -1}, 7]}')
    assert calibration.load(path) == calibration.Calibration()
    path.write_text("[" * 100_000)
    assert calibration.load(path) == calibration.Calibration()


def test_the_demo_prediction_uses_the_measured_numbers(tmp_path, monkeypatch, capsys):
    # A recorded decode of the demo at R tok/s makes the next prediction R (bandwidth and per-layer time both measured)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(calibration, "measure_ram_read_gbps", lambda *a, **k: 8.0)
    model = tmp_path / "demo"
    shutil.copytree(DEMO, model)
    assert calibration.record_run(model, 120.0, 64) is not None
    assert main(["fit", str(model), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["headline"] == "runs" and data["verdict"] == "runs" and data["plan"]["device"] == "cpu"
    # (the plan also reads the KV cache of a half-full 4k context, which the 64-token decode did not)
    assert data["plan"]["decode"]["low"] == pytest.approx(120.0, rel=0.1)
    assert "RAM read 8.0 GB/s measured" in data["calibration"]
