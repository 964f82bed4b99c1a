"""`moechat fit` tells the truth and models the user's machine (issue 26): the decode it headlines is the --on-miss
mode `run` uses; what-if hardware (--gpu/--ram/--link presets, --ram-bw-gbs, --cores, --link-gbs) moves the
prediction as the formula says, every rate labelled with its source; the RAM read rate of a what-if machine is never
this machine's; the calibration keeps its best probe; the disk check is on the Hugging Face cache (or --disk-gb);
sizes and assumed bandwidths are said as the table uses them. Self-contained: configs are written here, the RAM
probe is faked, so no test needs ../shared."""

from __future__ import annotations

import json
import re
import shutil
import types
from pathlib import Path

import pytest

from moechat.app.cli.main import main
from moechat.engine.plan import (
    GB,
    GPU_EFFICIENCY,
    OVERHEAD_PER_LAYER_S,
    Preferences,
    calibration,
    make_plan,
    spec_from_config,
)
from moechat.engine.plan.hardware import (
    ASSUMED_RAM_GBPS,
    GPU_PRESETS,
    LINK_PRESETS,
    PER_THREAD_READ_GBPS,
    RAM_EFFICIENCY,
    RAM_PRESETS,
    DiskInfo,
    GiB,
    GpuInfo,
    Hardware,
    HostMemory,
    host_read_rate,
    pcie_link_gbps,
)

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "assets" / "demo-moe"
RANGE = re.compile(r"(\d+\.\d+)-(\d+\.\d+) (?:tok/s|\(bound)")

# A Qwen3-MoE-shaped model (24 layers x 64 experts of 9.4 MB, 13.5 GiB of experts): on a 4 GiB GPU most experts
# miss, so load, host and auto differ
CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "dtype": "bfloat16", "hidden_size": 2048,
    "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 64, "num_experts_per_tok": 8,
    "vocab_size": 32000, "max_position_embeddings": 32768, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "norm_topk_prob": True,
}


@pytest.fixture()
def env(tmp_path, monkeypatch):
    """A private cache dir (calibration, repacks), a private HF cache, and a RAM probe that reads 16 GB/s."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(calibration, "measure_ram_read_gbps", lambda *a, **k: 16.0)
    return tmp_path


def _model(tmp_path: Path, **changes) -> Path:
    d = tmp_path / "qwen3-moe-test"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(CONFIG | changes))
    return d


def _fit_json(capsys, *args: str) -> dict:
    code = main(["fit", *args, "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == (0 if data["fits"] else 3), data["headline"]
    return data


def _fit_text(capsys, *args: str) -> str:
    main(["fit", *args])
    return capsys.readouterr().out


def _line(out: str, start: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(start))


# -- the headline is the mode that runs --------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["auto", "load", "host"])
def test_decode_headline_formats_and_json_are_the_on_miss_mode_that_runs(env, capsys, mode):
    model = _model(env)
    box = ["--vram-gb", "4", "--ram-gb", "64", "--disk-gb", "1000", "--expert-format", "native"]
    asked = [] if mode == "auto" else ["--on-miss", mode]
    data = _fit_json(capsys, str(model), *box, *asked)
    placements = {p["mode"]: p for p in data["plan"]["placements"]}
    assert set(placements) == {"load", "host", "auto"}
    assert placements["load"]["low"] != placements["host"]["low"]  # the modes differ here, so the test can fail
    d, p = data["plan"]["decode"], placements[mode]
    assert data["on_miss"] == mode and d["on_miss"] == mode
    assert (d["low"], d["high"], d["bound"], d["bound_by"]) == (p["low"], p["high"], p["bound"], p["bound_by"])
    native = next(o for o in data["formats"]["options"] if o["name"] == "native")
    assert (native["decode"]["low"], native["decode"]["high"]) == (p["low"], p["high"])
    assert ("--on-miss" in data["run_flags"]) == (mode != "auto")
    out = _fit_text(capsys, str(model), *box, *asked)
    summary = _line(out, "  decode    ")
    low, high = (float(x) for x in RANGE.search(summary).groups())
    assert f"predicted with --on-miss {mode}" in summary
    assert (low, high) == (round(p["low"], 1), round(p["high"], 1))
    assert f"{p['low']:.1f}-{p['high']:.1f} tok/s predicted" in _line(out, "  formats ")
    assert (f"--on-miss {mode}" in _line(out, "  run with")) == (mode != "auto")


def test_every_range_reads_low_high_even_where_more_hits_are_slower(env, capsys):
    """int4 experts compute at 5% of the read rate on a GPU today, so the host placement is faster at the *low* hit
    rate: its range was printed reversed ("16.2-12.6")."""
    model = _model(env)
    data = _fit_json(capsys, str(model), "--vram-gb", "4", "--ram-gb", "64", "--disk-gb", "1000", "--expert-format",
                     "int4")
    host = next(p for p in data["plan"]["placements"] if p["mode"] == "host")
    assert host["low"] <= host["high"] <= host["bound"] * (1 + 1e-9)
    out = _fit_text(capsys, str(model), "--vram-gb", "4", "--ram-gb", "64", "--disk-gb", "1000", "--expert-format",
                    "int4")
    ranges = [(float(a), float(b)) for a, b in RANGE.findall(out)]
    assert len(ranges) >= 6 and all(a <= b for a, b in ranges), ranges


# -- what-if hardware ---------------------------------------------------------------------------------------------

def _cpu_resident_tok_s(data: dict, ram_gbps: float) -> float:
    """docs/plan.md on a CPU with every expert in RAM: bytes per token / read rate + the per-layer dispatch."""
    return 1 / (data["plan"]["decode"]["device_bytes"] / (ram_gbps * GB) + 24 * OVERHEAD_PER_LAYER_S["cpu"])


@pytest.mark.parametrize("flags, expected", [
    (["--ram", "ddr5-dual", "--cores", "8"], min(RAM_EFFICIENCY * 2 * 8 * 5600 / 1000, 7 * PER_THREAD_READ_GBPS)),
    (["--ram", "ddr5-dual", "--cores", "2"], min(RAM_EFFICIENCY * 89.6, 1 * PER_THREAD_READ_GBPS)),
    (["--ram", "ddr4-dual", "--cores", "16"], min(RAM_EFFICIENCY * 51.2, 15 * PER_THREAD_READ_GBPS)),
    (["--ram-bw-gbs", "100", "--cores", "4"], min(RAM_EFFICIENCY * 100, 3 * PER_THREAD_READ_GBPS)),
    (["--ram-bw-gbs", "40", "--ram", "ddr5-quad", "--cores", "32"], RAM_EFFICIENCY * 40),  # the number beats a preset
])
def test_ram_and_cores_move_the_cpu_prediction_as_the_formula_says(env, capsys, flags, expected):
    data = _fit_json(capsys, str(_model(env)), "--vram-gb", "0", "--ram-gb", "64", "--disk-gb", "1000",
                     "--expert-format", "native", *flags)
    rate = data["rates"]["RAM read"]
    assert rate["gbps"] == pytest.approx(expected) and data["plan"]["decode"]["device_gbps"] == pytest.approx(expected)
    assert data["plan"]["resident"] and data["plan"]["decode"]["low"] == pytest.approx(
        _cpu_resident_tok_s(data, expected))
    assert ("--ram ddr" in rate["source"]) == ("--ram-bw-gbs" not in flags)


def test_gpu_and_link_presets_and_numbers_move_the_gpu_prediction(env, capsys):
    model = _model(env)
    base = [str(model), "--ram-gb", "64", "--disk-gb", "1000", "--expert-format", "native", "--on-miss", "load"]
    data = _fit_json(capsys, *base, "--gpu", "rtx-4070")
    rtx = GPU_PRESETS["rtx-4070"]
    d = data["plan"]["decode"]
    assert data["plan"]["device_budget_bytes"] == int(12 * GiB * 0.95)  # the preset's 12 GiB
    assert d["device_gbps"] == pytest.approx(504 * GPU_EFFICIENCY) and d["link_gbps"] == pytest.approx(
        pcie_link_gbps(4, 16))
    assert data["rates"]["GPU memory"] == {"gbps": 504, "source": "from --gpu rtx-4070 preset (NVIDIA spec: 504 GB/s)"}
    assert data["rates"]["link"]["source"].startswith("from --gpu rtx-4070 preset (PCIe 4.0 x16")
    assert (rtx.vram_gib, rtx.memory_gbps) == (12, 504)
    # the load-mode decode is reads / device rate + misses / link + dispatch (docs/plan.md): a slower link costs
    # exactly the link term
    slow = _fit_json(capsys, *base, "--gpu", "rtx-4070", "--link", "pcie3-x16")
    s = slow["plan"]["decode"]
    assert s["link_gbps"] == pytest.approx(LINK_PRESETS["pcie3-x16"].gbps) == pytest.approx(0.985 * 16 * 0.8)
    assert slow["rates"]["link"]["source"].startswith("from --link pcie3-x16 preset (PCI-SIG PCIe 3.0 x16")
    for end, moved in (("low", "link_bytes_low"), ("high", "link_bytes_high")):
        extra = d[moved] / (s["link_gbps"] * GB) - d[moved] / (d["link_gbps"] * GB)
        assert 1 / s[end] == pytest.approx(1 / d[end] + extra)
    given = _fit_json(capsys, *base, "--gpu", "rtx-4070", "--link", "pcie3-x16", "--link-gbs", "10", "--vram-gb", "8")
    assert given["plan"]["decode"]["link_gbps"] == 10 and given["rates"]["link"]["source"] == "given (--link-gbs)"
    assert given["plan"]["device_budget_bytes"] == int(8 * GiB * 0.95)  # --vram-gb beside a preset wins


def test_presets_resolve_and_are_labelled_in_the_table(env, capsys):
    for p in GPU_PRESETS.values():
        assert p.memory_gbps > 0 and p.vram_gib > 0 and p.source and p.pcie_gen in (3, 4, 5)
    assert {n: p.peak_gbps for n, p in RAM_PRESETS.items()} == {"ddr4-single": 25.6, "ddr4-dual": 51.2,
                                                                 "ddr5-dual": 89.6, "ddr5-quad": 179.2}
    assert LINK_PRESETS["pcie4-x16"].gbps == pytest.approx(1.969 * 16 * 0.8)
    out = _fit_text(capsys, str(_model(env)), "--gpu", "rtx-4070", "--ram", "ddr5-dual", "--cores", "8", "--link",
                    "pcie4-x16", "--ram-gb", "32", "--disk-gb", "1000")
    rates = out.split("\n  rates     ")[1].split("\n\n")[0]
    assert "GPU memory 504 GB/s peak (decode reads at 70% of it: 353 GB/s): from --gpu rtx-4070 preset (NVIDIA " \
           "spec: 504 GB/s)" in rates
    assert "link 25.2 GB/s: from --link pcie4-x16 preset (PCI-SIG PCIe 4.0 x16" in rates
    assert "RAM read 62.7 GB/s: 70% of 89.6 GB/s peak, from --ram ddr5-dual preset (JEDEC DDR5-5600" in rates
    assert "disk read 2 GB/s: assumed" in rates
    assert _line(out, "  hardware").startswith("  hardware  cuda:0 NVIDIA GeForce RTX 4070 12.00 GiB free (what-if)")
    with pytest.raises(SystemExit) as e:
        main(["fit", "x", "--gpu", "rtx-9999"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no gpu preset 'rtx-9999': use one of rtx-3060," in err and "rtx-4070" in err


def test_a_what_if_machine_never_plans_with_this_machine_s_ram_read_rate(env, capsys):
    model = _model(env)
    calibration._save(calibration.Calibration(16.0, __import__("time").time(), ram_quick_gbps=16.0),
                      calibration.calibration_path())
    here = _fit_json(capsys, str(model), "--vram-gb", "0", "--disk-gb", "1000", "--expert-format", "native")
    assert here["rates"]["RAM read"] == {"gbps": 16.0, "source": "measured on this machine, one thread"}
    for what_if in (["--vram-gb", "8", "--ram-gb", "32"], ["--ram-gb", "32"], ["--gpu", "rtx-4070"]):
        data = _fit_json(capsys, str(model), *what_if, "--disk-gb", "1000", "--expert-format", "native")
        rate = data["rates"]["RAM read"]
        assert rate["gbps"] == ASSUMED_RAM_GBPS and rate["source"].startswith("assumed: a what-if machine"), what_if
        assert not data["calibration_used"]
    out = _fit_text(capsys, str(model), "--vram-gb", "8", "--ram-gb", "32", "--disk-gb", "1000")
    assert "RAM read 20 GB/s: assumed: a what-if machine's RAM; --ram PRESET or --ram-bw-gbs sets it" in out
    assert "16 GB/s" not in out and "measured here" not in out


def test_host_read_rate_formula():
    from moechat.engine.plan.hardware import Rate

    assert host_read_rate(measured_gbps=12.5) == Rate(12.5, "measured on this machine, one thread")
    assert host_read_rate(measured_gbps=12.5, what_if=True).gbps == ASSUMED_RAM_GBPS
    assert host_read_rate().source.startswith("assumed")
    r = host_read_rate(cores=4, cores_source="given (--cores)")  # no RAM figure: a dual-channel DDR4 peak assumed
    assert r.gbps == pytest.approx(min(RAM_EFFICIENCY * 51.2, 3 * PER_THREAD_READ_GBPS))
    assert "assumed dual-channel DDR4-3200" in r.source
    one = host_read_rate(peak=Rate(89.6, "x"), cores=1)  # one core still computes on one thread
    assert one.gbps == PER_THREAD_READ_GBPS and "1 thread x" in one.source


# -- calibration --------------------------------------------------------------------------------------------------

def test_the_probe_keeps_the_fastest_of_several(monkeypatch):
    durations = iter([0.0, 0.50, 0.0, 0.10, 0.0, 0.30, 0.0, 0.20, 0.0, 0.40])  # start, end of each of 5 probes
    clock = types.SimpleNamespace(perf_counter=lambda: next(durations), time=calibration.time.time)
    monkeypatch.setattr(calibration, "time", clock)
    assert calibration.measure_ram_read_gbps(1 << 20, reps=5) == pytest.approx((1 << 20) / 0.10 / 1e9)
    assert calibration.PROBE_REPS >= 3


def _cal(path: Path, gbps: float, quick: float | None, age_s: float = 0.0) -> None:
    import time

    calibration._save(calibration.Calibration(gbps, time.time() - age_s, ram_quick_gbps=quick), path)


def _probes(monkeypatch, full: float, quick: float) -> list[int]:
    calls: list[int] = []

    def measure(nbytes=calibration.PROBE_BYTES, reps=calibration.PROBE_REPS):
        calls.append(nbytes)
        return quick if nbytes == calibration.QUICK_BYTES else full

    monkeypatch.setattr(calibration, "measure_ram_read_gbps", measure)
    return calls


def test_a_saved_probe_from_a_busy_machine_is_replaced(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    _cal(path, 1.9, 2.0)  # taken while the machine was busy
    calls = _probes(monkeypatch, full=12.0, quick=14.0)
    assert calibration.ensure_ram_read_gbps(path).ram_read_gbps == 12.0
    assert calls == [calibration.QUICK_BYTES, calibration.PROBE_BYTES, calibration.QUICK_BYTES]
    assert calibration.load(path).ram_read_gbps == 12.0 and calibration.load(path).ram_quick_gbps == 14.0
    # busy again: the quick probe reads low, and the best saved rate stays
    calls = _probes(monkeypatch, full=3.0, quick=3.5)
    assert calibration.ensure_ram_read_gbps(path).ram_read_gbps == 12.0 and calls == [calibration.QUICK_BYTES]
    # a full probe that reads lower than the fresh saved one keeps the saved one (the best, not the last)
    _cal(path, 12.0, 5.0)
    _probes(monkeypatch, full=9.0, quick=14.0)
    assert calibration.ensure_ram_read_gbps(path).ram_read_gbps == 12.0
    # an old one is measured again, whatever it said
    _cal(path, 30.0, 30.0, age_s=calibration.MAX_AGE_S + 1)
    _probes(monkeypatch, full=9.0, quick=10.0)
    assert calibration.ensure_ram_read_gbps(path).ram_read_gbps == 9.0


def test_a_run_faster_than_the_saved_rate_allows_probes_again(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    _cal(path, 1.9, 2.0)
    _probes(monkeypatch, full=12.0, quick=13.0)
    # 1 GB a token at 4 tok/s reads at >= 4 GB/s: a saved 1.9 GB/s cannot be right
    layer_s = calibration.record_cpu_decode("m", 10, 1_000_000_000, 4.0, 64, path)
    assert calibration.load(path).ram_read_gbps == 12.0
    assert layer_s == pytest.approx((1 / 4.0 - 1e9 / 12e9) / 10)
    # one that agrees probes nothing
    calls = _probes(monkeypatch, full=99.0, quick=99.0)
    assert calibration.record_cpu_decode("m", 10, 1_000_000_000, 2.0, 64, path) is not None and calls == []


# -- the disk check ----------------------------------------------------------------------------------------------

def test_the_download_is_checked_on_the_hugging_face_cache(env, capsys):
    data = _fit_json(capsys, str(_model(env)), "--vram-gb", "0", "--ram-gb", "64", "--expert-format", "native")
    disk = data["hardware"]["disk"]
    assert disk["path"] == str(env / "hf-cache") and "the Hugging Face cache" in disk["what"]
    download = next(d for d in data["plan"]["decisions"] if d["item"] == "download")
    assert f"free on {env / 'hf-cache'} (the Hugging Face cache" in download["reason"]
    short = _fit_json(capsys, str(_model(env)), "--vram-gb", "0", "--ram-gb", "64", "--expert-format", "native",
                      "--disk-gb", "5")
    refusal = short["plan"]["refusal"]
    assert refusal["resource"] == "disk" and "(given by --disk-gb)" in refusal["message"]
    need = math_ceil_gib(refusal["need_bytes"])
    assert f"--disk-gb {need} to plan for a disk with that much free" in refusal["fixes"]
    assert _fit_json(capsys, str(_model(env)), "--vram-gb", "0", "--ram-gb", "64", "--expert-format", "native",
                     "--disk-gb", str(need))["fits"]


def math_ceil_gib(n: int) -> int:
    return -(-n // GiB)


def test_a_downloaded_model_needs_no_disk_for_its_weights(env, capsys):
    model = env / "demo"
    shutil.copytree(DEMO, model)
    data = _fit_json(capsys, str(model), "--ram-gb", "16", "--disk-gb", "0", "--expert-format", "native")
    assert data["fits"] and data["plan"]["disk_needed_bytes"] == 0
    assert "download" not in [d["item"] for d in data["plan"]["decisions"]]
    assert any("weights already on disk" in n and "no disk needed for them" in n for n in data["plan"]["notes"])
    here = _fit_json(capsys, str(model), "--ram-gb", "16", "--expert-format", "native")
    assert here["hardware"]["disk"]["path"] == str(env / "xdg" / "moechat" / "repacked")  # where a repack would go
    assert "repack cache" in here["hardware"]["disk"]["what"]


# -- the wording bugs ----------------------------------------------------------------------------------------------

def test_int8_beside_fp8_is_said_larger_in_sizes_that_differ():
    """DeepSeek-V3's experts (7168 x 2048) in block FP8 and in int8: int8's per-row fp32 scales make it 34 KiB
    larger on 42 MiB, which printed "larger than native fp8 e4m3 (42.0 MiB vs 42.0 MiB an expert)"."""
    from moechat.engine.plan.format_plan import plan_formats, sizes_apart

    config = CONFIG | {"hidden_size": 7168, "moe_intermediate_size": 2048, "num_attention_heads": 56,
                       "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    spec = spec_from_config(config, name="fp8-test")
    box = Hardware((), HostMemory(512 * GiB, 512 * GiB), DiskInfo("/", 10_000 * GiB))
    int8 = plan_formats(spec, box).option("int8")
    assert int8.spec.expert_bytes > spec.expert_bytes
    m = re.fullmatch(r"larger than native fp8 e4m3 \((\S+) MiB vs (\S+) MiB an expert\)", int8.note)
    assert m and float(m.group(1)) > float(m.group(2)), int8.note
    assert sizes_apart((100 << 20) + 40_000, 100 << 20) == ("100.04 MiB", "100.00 MiB")
    assert sizes_apart((100 << 20) + 1, 100 << 20) == ("104,857,601 B", "104,857,600 B")  # bytes when it must


def test_the_same_size_is_said_the_same(monkeypatch):
    from moechat.engine.plan import format_plan

    spec = spec_from_config(CONFIG, name="t")
    monkeypatch.setattr(type(spec), "in_format", lambda self, name: self if name == "native" else
                        __import__("dataclasses").replace(self, converted_from="bfloat16"))
    box = Hardware((), HostMemory(512 * GiB, 512 * GiB), DiskInfo("/", 10_000 * GiB))
    opt = format_plan._option("int8", spec, box, Preferences())
    assert opt.note == f"the same size as native bfloat16 ({spec.expert_bytes:,} B an expert)"


def test_the_assumed_gpu_bandwidth_in_the_notes_is_the_table_s():
    spec = spec_from_config(CONFIG, name="t")
    gpu = GpuInfo(0, 0, "no-NVML GPU", None, 4 * GiB, 4 * GiB)  # memory bandwidth not reported
    plan = make_plan(spec, Hardware((gpu,), HostMemory(64 * GiB, 64 * GiB), DiskInfo("/", 10_000 * GiB)),
                     Preferences(on_miss="load"))
    note = next(n for n in plan.notes if n.startswith("GPU memory bandwidth not reported"))
    said = float(re.search(r"decode reads at (\S+) GB/s", note).group(1))
    assert said == pytest.approx(plan.decode.device_gbps)
    decode = next(d.reason for d in plan.decisions if d.item == "decode")
    assert f"reads at {plan.decode.device_gbps:.0f} GB/s" in decode and f"{said:g} GB/s" in note


def test_this_machine_s_gpu_figures_are_labelled_measured_and_the_on_miss_modes_are_run_s():
    from moechat.app.cli.fit import machine_rates
    from moechat.engine.cache.hybrid import ON_MISS
    from moechat.engine.plan import ON_MISS_MODES

    assert ON_MISS_MODES == ON_MISS
    gpu = GpuInfo(0, 0, "probed GPU", "GPU-0", 4 * GiB, 4 * GiB, 4, 16, link_gbps=pcie_link_gbps(4, 16),
                  link_source="PCIe 4.0 x16 at 80% of raw", memory_gbps=1008.1)  # as hardware._probe_nvml fills it
    box = Hardware((gpu,), HostMemory(64 * GiB, 64 * GiB), DiskInfo("/", 10_000 * GiB))
    prefs = Preferences(host_read_gbps=14.0, host_read_source="measured on this machine, one thread")
    rates = machine_rates(make_plan(spec_from_config(CONFIG, name="t"), box, prefs), box, prefs)
    assert rates["GPU memory"].source == "measured on this machine (NVML: max memory clock x 2 x bus width)"
    assert rates["link"].source == "measured on this machine (PCIe 4.0 x16 at 80% of raw)"
    assert rates["RAM read"].gbps == 14.0 and rates["disk read"].source.startswith("assumed")
    unknown = Hardware((GpuInfo(0, 0, "torch-only GPU", None, 4 * GiB, 4 * GiB, source="torch"),), box.ram, box.disk)
    rates = machine_rates(make_plan(spec_from_config(CONFIG, name="t"), unknown, prefs), unknown, prefs)
    assert rates["GPU memory"].source.startswith("assumed") and rates["link"].source.startswith("assumed")


def test_the_presets_fit_s_help_names_exist():
    from moechat.app.cli.main import build_parser

    text = build_parser()._subparsers._group_actions[0].choices["fit"].format_help()
    text = " ".join(text.split())
    for table in (GPU_PRESETS, RAM_PRESETS, LINK_PRESETS):
        named = [n for n in re.findall(r"[a-z0-9]+(?:-[a-z0-9]+)+", text) if n.split("-")[0] in
                 {k.split("-")[0] for k in table}]
        assert named and all(n in table for n in named), named
