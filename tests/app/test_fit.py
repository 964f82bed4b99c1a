"""`moechat fit`: the table, --json, exit 3 on refusal, what-ifs; and `moechat run` taking its cache
defaults from the plan only when a cache is needed."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moechat.app.cli.fit import EXIT_REFUSED, plan_for_run
from moechat.app.cli.main import main
from moechat.engine.plan.hardware import GiB, Hardware, HostMemory

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT.parent / "shared" / "model-configs"
QWEN = CONFIGS / "Qwen--Qwen3-30B-A3B"
DSV3 = CONFIGS / "deepseek-ai--DeepSeek-V3"
OSS20 = CONFIGS / "openai--gpt-oss-20b"
OSS120 = CONFIGS / "openai--gpt-oss-120b"
needs_configs = pytest.mark.skipif(not (QWEN / "config.json").exists() or not (DSV3 / "config.json").exists(),
                                   reason="../shared/model-configs not found")
WHAT_IF = ["--vram-gb", "12", "--ram-gb", "32", "--disk-gb", "1000", "--link-gbps", "25"]


def _fit(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["fit", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@needs_configs
def test_table_shows_every_decision_and_the_bound_next_to_the_prediction(capsys):
    code, out, err = _fit(capsys, str(QWEN), *WHAT_IF)
    assert code == 0 and err == ""
    assert "Qwen--Qwen3-30B-A3B (qwen3_moe): runs" in out and "(ESTIMATES)" in out
    for item in ("dense weights", "KV cache, 4,096 tokens", "workspace", "expert slots C = ", "host tier",
                 "disk tier", "download", "expected hit rate"):
        assert f"\n  {item}" in out, item
    decode = [line for line in out.splitlines() if line.startswith("  decode ")]
    assert len(decode) == 2  # the decision row, and the summary with the bound next to the prediction
    assert "tok/s predicted" in decode[1] and "(bound " in decode[1] and "docs/plan.md" in decode[1]
    assert "--expert-slots" in out  # how to run it
    misses = [line for line in out.splitlines() if line.startswith("  misses ")]  # load | host | auto, and the best
    assert len(misses) == 1 and all(f"{m} " in misses[0] for m in ("load", "host", "auto"))
    assert "best: --on-miss auto (the default)" in misses[0]


@needs_configs
def test_json_and_what_ifs(capsys):
    code, out, _ = _fit(capsys, str(QWEN), *WHAT_IF, "--json")
    data = json.loads(out)
    assert code == 0 and data["fits"] and data["runnable"]
    plan, spec, hw = data["plan"], data["spec"], data["hardware"]
    assert spec["expert_bytes"] == 9_437_184 and spec["estimated"] and spec["total_experts"] == 6144
    assert plan["device_budget_bytes"] == int(12 * GiB * 0.95) and plan["context"] == 4096
    assert plan["device_used_bytes"] <= plan["device_budget_bytes"]
    assert plan["decode"]["low"] <= plan["decode"]["high"] <= plan["decode"]["bound"]
    assert plan["decode"]["link_gbps"] == 25 and len(hw["what_if"]) == 4
    assert data["run_flags"][:4] == ["--context", "4096", "--expert-slots", str(plan["expert_slots"])]
    # more VRAM, more slots; a longer context, more KV
    code, out, _ = _fit(capsys, str(QWEN), *WHAT_IF, "--vram-gb", "24", "--context", "16384", "--json")
    bigger = json.loads(out)["plan"]
    assert bigger["expert_slots"] > plan["expert_slots"] and bigger["kv_bytes"] == 16384 * 98_304


@needs_configs
def test_refusal_exits_3_with_the_shortfall_and_force_exits_0(capsys):
    code, out, _ = _fit(capsys, str(DSV3), "--vram-gb", "8", "--ram-gb", "16", "--disk-gb", "10000")
    assert code == EXIT_REFUSED == 3
    refused = next(line for line in out.splitlines() if line.startswith("  REFUSED"))
    assert "short by" in refused and "GiB of VRAM" in refused
    code, out, _ = _fit(capsys, str(DSV3), "--vram-gb", "8", "--ram-gb", "16", "--disk-gb", "10000", "--json")
    data = json.loads(out)
    assert code == 3 and not data["fits"] and data["plan"]["refusal"]["resource"] == "VRAM"
    assert data["plan"]["refusal"]["short_bytes"] > 0 and data["plan"]["decode"] is None
    code, out, _ = _fit(capsys, str(DSV3), "--vram-gb", "8", "--ram-gb", "16", "--disk-gb", "10000", "--force")
    assert code == 0 and "loading anyway" in out


@needs_configs
def test_config_only_directory_and_a_disk_what_if(capsys, tmp_path):
    model = tmp_path / "just-a-config"
    model.mkdir()
    shutil.copy(QWEN / "config.json", model / "config.json")
    code, out, _ = _fit(capsys, str(model), *WHAT_IF, "--disk-gb", "20")
    assert code == 3 and "GiB of disk" in out and "free " in out and "an FP8 checkpoint of this model" in out
    assert "4-bit" not in out and "advice    no format fits this machine" in out  # int8/int4 need the download too


@pytest.mark.skipif(not (OSS20 / "config.json").exists() or not (OSS120 / "config.json").exists(),
                    reason="../shared/model-configs not found (gpt-oss configs)")
def test_gpt_oss_plans_with_packed_experts_and_is_runnable(capsys):
    code, out, err = _fit(capsys, str(OSS20), "--vram-gb", "8", "--ram-gb", "32", "--disk-gb", "100")
    assert code == 0 and err == "" and "openai--gpt-oss-20b (gpt_oss): runs" in out
    assert "moechat run: supported" in out and "planning only" not in out
    assert "experts: MXFP4, 12.6 MiB each (bf16 would be 47.5 MiB); stored as mxfp4" in out
    slots = next(line for line in out.splitlines() if line.startswith("  expert slots C = "))
    assert int(slots.split("C = ")[1].split()[0].replace(",", "")) >= 200
    # the embedding table goes to RAM (it buys 88 slots): bf16 experts would get 99 slots (75 with it on the GPU)
    assert "experts: MXFP4, 12.6 MiB each (bf16 would be 47.5 MiB: 99 slots)" in slots
    assert "+88 slots (285 -> 373)" in out and "--embeddings host" in out
    summary = [line for line in out.splitlines() if line.startswith("  decode ")][-1]
    assert "tok/s predicted" in summary and "(bound " in summary and "set by link" in summary
    # config.json names no dtype, so the loader would take float32: the run line asks for the planned bf16
    run = next(line for line in out.splitlines() if line.startswith("  run with"))
    assert "--dtype bfloat16" in run and "--expert-slots" in run
    code, out, _ = _fit(capsys, str(OSS20), "--vram-gb", "8", "--ram-gb", "32", "--disk-gb", "100", "--json")
    data = json.loads(out)
    assert data["runnable"] and data["plan"]["expert_slots"] >= 200 and data["spec"]["expert_bytes"] == 13_236_480
    assert data["spec"]["bf16_expert_bytes"] == 49_783_680 and data["spec"]["config_dtype"] is None
    d = data["plan"]["decode"]
    assert 0 < d["low"] <= d["high"] <= d["bound"] and d["bound_by"] == "link"
    assert data["run_flags"][2:4] == ["--dtype", "bfloat16"]
    code, out, _ = _fit(capsys, str(OSS120), "--vram-gb", "24", "--ram-gb", "64", "--disk-gb", "100")
    assert code == 0 and "openai--gpt-oss-120b (gpt_oss): runs" in out and "moechat run: supported" in out
    assert "host tier: all experts in RAM" in out and "experts: MXFP4, 12.6 MiB each" in out
    code, out, _ = _fit(capsys, str(OSS120), "--vram-gb", "24", "--ram-gb", "64", "--disk-gb", "40")
    assert code == EXIT_REFUSED and "GiB of disk" in out  # the 60.8 GiB download does not fit 40 GiB


@pytest.mark.skipif(not (OSS20 / "config.json").exists(), reason="../shared/model-configs not found (gpt-oss-20b)")
def test_run_plans_in_the_dtype_the_loader_picks(monkeypatch):
    from moechat.engine.load.loader import read_model_config, resolve_dtype
    from moechat.engine.plan.hardware import GpuInfo

    box = Hardware((GpuInfo(0, 0, "test GPU", "GPU-0", 8 * GiB, 8 * GiB, 4, 16, link_gbps=25.0),),
                   HostMemory(32 * GiB, 32 * GiB), None)
    monkeypatch.setattr("moechat.engine.plan.hardware.probe", lambda *a, **k: box)
    bf16 = plan_for_run(OSS20, device="cuda:0", dtype="bfloat16", context=None)
    assert bf16.dense_bytes == 3_595_648_128 and bf16.expert_slots >= 200 and bf16.context == 4096
    default = plan_for_run(OSS20, device="cuda:0", dtype=None, context=None)
    elem = resolve_dtype(None, read_model_config(OSS20)[1]).itemsize  # float32 while config.json names no dtype
    assert default.dense_bytes == 3_595_648_128 // 2 * elem
    assert default.expert_bytes == 13_236_480 + (elem - 2) * (5760 + 2880)  # only the biases follow the dtype


def test_errors_are_one_line(capsys, tmp_path, monkeypatch):
    code, out, err = _fit(capsys, str(tmp_path / "missing"))
    assert code == 1 and out == "" and err.count("\n") == 1 and "no such model directory" in err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a repo id not in the cache, and the Hub off limits
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    code, _, err = _fit(capsys, "no-such-org-moechat-test/no-such-model")
    assert code == 1 and err.startswith("moechat: error:") and "Hugging Face cache" in err
    with pytest.raises(SystemExit) as e:
        main(["fit", str(tmp_path), "--vram-gb", "-1"])
    assert e.value.code == 2


def test_fit_parser_does_not_import_torch(tmp_path):
    code = ("import sys\nfrom moechat.app.cli.main import build_parser\nbuild_parser().parse_args(['fit', 'x', "
            "'--vram-gb', '8'])\nassert 'torch' not in sys.modules, 'torch imported at start-up'")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_run_takes_cache_defaults_from_the_plan_only_when_needed(tiny_models, capsys, monkeypatch):
    path, _ = tiny_models["qwen3_moe"]
    args = [str(path), "--prompt-ids", "3,1,4,1,5", "--max-tokens", "6", "--temperature", "0", "--device", "cpu",
            "--json"]
    cpu_box = Hardware((), HostMemory(64 * GiB, 64 * GiB), None)
    monkeypatch.setattr("moechat.engine.plan.hardware.probe", lambda *a, **k: cpu_box)
    assert main(["run", *args]) == 0
    resident = json.loads(capsys.readouterr().out)
    assert resident["cache"]["mode"] == "resident"  # every expert fits: today's path, unchanged
    roomy = plan_for_run(path, device="cpu", dtype=None, context=None)
    assert roomy.resident and roomy.context == 512  # the tiny model's maximum
    # A RAM budget that leaves room for 5 of its 16 experts beyond the dense part, KV and workspace.
    fixed = roomy.device_used_bytes - roomy.total_experts * roomy.expert_bytes
    avail = math.ceil((fixed + 5.5 * roomy.expert_bytes + GiB) / 0.95)
    small_box = Hardware((), HostMemory(avail, avail), None)
    monkeypatch.setattr("moechat.engine.plan.hardware.probe", lambda *a, **k: small_box)
    plan = plan_for_run(path, device="cpu", dtype=None, context=None)
    assert plan.needs_cache and plan.expert_slots == 5 and plan.ram_cache_bytes == 0
    assert main(["run", *args]) == 0
    cached = json.loads(capsys.readouterr().out)
    assert cached["cache"]["slots"] == 5 and "mode" not in cached["cache"] and cached["cache"]["ram_cache_bytes"] == 0
    assert cached["token_ids"] == resident["token_ids"]
    # explicit flags still win
    assert main(["run", *args, "--expert-slots", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["cache"]["slots"] == 3


# -- expert formats ---------------------------------------------------------------------------------------

def _line(out: str, start: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(start))


def _format_rows(out: str) -> dict[str, tuple[bool, str]]:
    """The formats table: name -> (marked as recommended, the rest of its row), in the order printed."""
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("  formats "))
    rows = {}
    for line in lines[first:first + 3]:
        mark, name, rest = line[10], line[12:18].strip(), line[20:]
        rows[name] = (mark == "*", rest)
    return rows


def _slots(out: str) -> int:
    return int(_line(out, "  expert slots C = ").split("C = ")[1].split()[0].replace(",", ""))


@needs_configs
def test_qwen3_on_8_gib_vram_and_32_gib_ram_recommends_a_conversion(capsys):
    box = ["--vram-gb", "8", "--ram-gb", "32", "--disk-gb", "1000"]
    code, out, err = _fit(capsys, str(QWEN), *box)
    assert code == 0 and err == ""
    fmt = _line(out, "moechat fit").split("--expert-format ")[1].split()[0]
    assert fmt in ("int8", "int4") and out.splitlines()[0].endswith(f": runs with --expert-format {fmt}")
    rows = _format_rows(out)
    assert list(rows) == ["native", "int8", "int4"] and [n for n, (marked, _) in rows.items() if marked] == [fmt]
    assert rows["int8"][1].startswith("4.5 MiB an expert: ") and "quality: perplexity" in rows["int8"][1]
    advice = _line(out, "  advice    ")
    assert advice.startswith(f"  advice    with --expert-format {fmt}: ") and "RAM holds every expert" in advice
    assert "4-bit" not in out and "variant" not in out
    run = _line(out, "  run with")
    assert run.split(" --prompt")[0].endswith(f"--expert-format {fmt}") and "repacked experts" in out
    code, native_out, _ = _fit(capsys, str(QWEN), *box, "--expert-format", "native")
    assert code == 0 and native_out.splitlines()[0].endswith(": runs") and "--expert-format" not in \
        _line(native_out, "  run with")
    assert _slots(out) > _slots(native_out) and "the plan above is native's, as asked" in native_out
    data = json.loads(_fit(capsys, str(QWEN), *box, "--json")[1])
    formats = {o["name"]: o for o in data["formats"]["options"]}
    assert data["expert_format"] == data["formats"]["recommended"] == fmt
    assert data["run_flags"][-2:] == ["--expert-format", fmt] and data["plan"]["expert_slots"] == _slots(out)
    assert formats[fmt]["expert_slots"] > formats["native"]["expert_slots"]
    assert formats[fmt]["decode"]["low"] > formats["native"]["decode"]["high"]
    assert formats["int8"]["expert_bytes"] == 4_732_928 and formats["int4"]["expert_bytes"] == 2_654_208


@pytest.mark.skipif(not (OSS20 / "config.json").exists(), reason="../shared/model-configs not found (gpt-oss-20b)")
def test_gpt_oss_recommends_native_and_says_conversions_are_larger(capsys):
    code, out, _ = _fit(capsys, str(OSS20), "--vram-gb", "8", "--ram-gb", "32", "--disk-gb", "100")
    assert code == 0 and out.splitlines()[0].endswith("(gpt_oss): runs")
    rows = _format_rows(out)
    # 373 slots with the embedding table in RAM (285 with it on the GPU)
    assert rows["native"][0] and rows["native"][1].startswith("MXFP4, 12.6 MiB an expert: 373 slots, ")
    for fmt in ("int8", "int4"):
        marked, row = rows[fmt]
        assert not marked and "larger than native MXFP4" in row and "not measured from MXFP4" in row
    assert _line(out, "  advice    ").startswith("  advice    native: ")
    assert "--expert-format" not in _line(out, "  run with")
    data = json.loads(_fit(capsys, str(OSS20), "--vram-gb", "8", "--ram-gb", "32", "--disk-gb", "100", "--json")[1])
    assert data["formats"]["recommended"] == "native" and "--expert-format" not in data["run_flags"]


def test_repack_dir_is_the_store_s(tmp_path, monkeypatch):
    from moechat.app.cli.fit import repack_dir, repacked_formats
    from moechat.engine.cache.repacked import default_repack_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert repack_dir(model, "int4") == default_repack_dir(model, "int4")
    assert repacked_formats(model) == frozenset() and repacked_formats(None) == frozenset()
    (repack_dir(model, "int8")).mkdir(parents=True)
    (repack_dir(model, "int8") / "experts.bin").write_bytes(b"")
    assert repacked_formats(model) == {"int8"}


def test_run_plans_its_slots_in_the_expert_format(tiny_models, monkeypatch):
    from moechat.app.cli.fit import cache_defaults

    path, _ = tiny_models["qwen3_moe"]
    roomy = plan_for_run(path, device="cpu", dtype=None, context=None)
    fixed = roomy.device_used_bytes - roomy.total_experts * roomy.expert_bytes
    avail = math.ceil((fixed + 5.5 * roomy.expert_bytes + GiB) / 0.95)  # 5 bf16 experts' room beyond the rest
    monkeypatch.setattr("moechat.engine.plan.hardware.probe",
                        lambda *a, **k: Hardware((), HostMemory(avail, avail), None))
    native = plan_for_run(path, device="cpu", dtype=None, context=None)
    int8 = plan_for_run(path, device="cpu", dtype=None, context=None, expert_format="int8")
    assert native.expert_slots == 5 and int8.expert_slots > native.expert_slots
    assert int8.expert_bytes < native.expert_bytes / 1.5
    slots, ram = cache_defaults(path, device="cpu", dtype=None, context=None, expert_slots=None, ram_cache_mb=None,
                                expert_format="int8")
    assert (slots, ram) == ((int8.expert_slots, 0) if int8.needs_cache else (None, None))
    assert cache_defaults(path, device="cpu", dtype=None, context=None, expert_slots=None, ram_cache_mb=None)[0] == 5
