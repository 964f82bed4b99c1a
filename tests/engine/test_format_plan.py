"""Planning each expert format: the byte formulas equal the quant module's, plans in int8/int4 by hand, the
compute-efficiency term, the repacked file on disk, refusal advice that names only loadable formats, and the
recommendation on the real configs in ../shared/model-configs (skipped when absent)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moechat.engine.errors import ConfigError
from moechat.engine.plan import (
    CONVERTIBLE_FORMATS,
    EXPERT_COMPUTE_EFFICIENCY,
    GB,
    OVERHEAD_PER_LAYER_S,
    Preferences,
    int4_group,
    make_plan,
    packed_expert_tensors,
    spec_from_config,
)
from moechat.engine.plan.format_plan import QUALITY, SPEEDUP, plan_formats
from moechat.engine.plan.hardware import DiskInfo, GiB, GpuInfo, Hardware, HostMemory
from moechat.engine.quant import get_format
from moechat.engine.quant.intq import int4_group as quant_int4_group
from moechat.engine.quant.registry import CONVERTIBLE

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT.parent / "shared" / "model-configs"
QWEN = CONFIGS / "Qwen--Qwen3-30B-A3B" / "config.json"
OSS20 = CONFIGS / "openai--gpt-oss-20b" / "config.json"
MIXTRAL = CONFIGS / "mistralai--Mixtral-8x7B-v0.1" / "config.json"


def real_spec(path: Path):
    if not path.exists():
        pytest.skip(f"../shared/model-configs not found ({path})")
    return spec_from_config(json.loads(path.read_text()), name=path.parent.name)


def machine(vram_gib: float | None, ram_gib: float, disk_gib: float = 10_000, link: float = 25.2,
            membw: float = 300.0) -> Hardware:
    gpus = () if vram_gib is None else (
        GpuInfo(0, 0, "test GPU", "GPU-0", int(vram_gib * GiB), int(vram_gib * GiB), 4, 16, link_gbps=link,
                memory_gbps=membw),)
    return Hardware(gpus, HostMemory(int(ram_gib * GiB), int(ram_gib * GiB)), DiskInfo("/models", int(disk_gib * GiB)))


# -- the byte formulas, against engine/quant ---------------------------------------------------------------

def test_planner_formats_are_the_engine_s():
    assert CONVERTIBLE_FORMATS == CONVERTIBLE
    for cols in range(8, 4097, 8):
        assert int4_group(cols) == quant_int4_group(cols)
    for cols in (7, 12, 2050):
        with pytest.raises(ConfigError):
            int4_group(cols)
        with pytest.raises(ConfigError):
            quant_int4_group(cols)


@pytest.mark.parametrize("name", CONVERTIBLE)
@pytest.mark.parametrize(("hidden", "inter", "bias"), [(2048, 768, False), (2880, 2880, True), (4096, 14336, False),
                                                        (64, 40, True), (48, 24, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_bytes_equal_the_quant_layout(name, hidden, inter, bias, dtype):
    fmt = get_format(name)
    planned = packed_expert_tensors(name, hidden, inter, dtype.itemsize, bias)
    layout = fmt.layout(hidden, inter, dtype, bias)
    assert {t.name: t.shape for t in planned} == {k: tuple(shape) for k, (shape, _) in layout.items()}
    tags = {torch.int8: "I8", torch.uint8: "U8", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    assert {t.name: t.dtype for t in planned} == {k: tags[d] for k, (_, d) in layout.items()}
    assert {t.name: t.nbytes for t in planned} == {k: torch.Size(shape).numel() * d.itemsize
                                                   for k, (shape, d) in layout.items()}
    assert sum(t.nbytes for t in planned) == fmt.expert_bytes(hidden, inter, dtype, bias)


def test_unknown_or_unloadable_formats_are_typed_errors():
    with pytest.raises(ConfigError, match="--expert-format 'int3'"):
        packed_expert_tensors("int3", 64, 64, 2, False)
    with pytest.raises(ConfigError, match="divisible by 8"):
        packed_expert_tensors("int4", 64, 36, 2, False)  # w2's input, 36, has no group


# -- specs and plans in a converted format ----------------------------------------------------------------

def test_qwen3_in_int8_and_int4_by_hand():
    s = real_spec(QWEN)
    H, I = 2048, 768
    int8 = s.in_format("int8")
    assert int8.expert_bytes == 2 * I * H + 4 * 2 * I + H * I + 4 * H == 4_732_928
    int4 = s.in_format("int4")
    # codes and fp16 group scales: 4.5 bits a weight (5.0 with the fp32 scales before)
    assert int4.expert_bytes == 2 * I * H // 2 + 2 * 2 * I * H // 32 + H * I // 2 + 2 * H * I // 32 == 2_654_208
    assert 8 * int4.expert_bytes / (3 * H * I) == 4.5
    assert (int8.format_key, int4.format_key, int8.converted_from) == ("int8", "int4", "bfloat16")
    assert int4.expert_format_line() == "experts: int4, 2.5 MiB each (bf16 would be 9.0 MiB)"
    assert s.in_format("native") is s and s.in_format(None) is s
    with pytest.raises(ConfigError):
        int8.in_format("int4")  # from the native spec only
    # gpt-oss keeps its biases (in the compute dtype) beside the int8 codes
    oss = real_spec(OSS20).in_format("int8")
    assert oss.expert_bytes == get_format("int8").expert_bytes(2880, 2880, torch.bfloat16, True)


def test_a_converted_plan_counts_the_repacked_file_and_its_compute_rate():
    s = real_spec(QWEN)
    int8 = s.in_format("int8")
    plan = make_plan(int8, machine(None, 128))  # every expert in RAM on the CPU
    assert plan.resident and plan.expert_bytes == 4_732_928
    repack = next(d for d in plan.decisions if d.item == "repacked experts")
    assert repack.bytes == 6144 * 4_732_928 and repack.where == "disk" and "from bfloat16 once" in repack.reason
    assert plan.disk_needed_bytes == s.checkpoint_bytes + 6144 * 4_732_928  # config only: the download too
    # decode on the CPU: the int8 experts cost active / f of device reads (the dense part and KV as read)
    f = EXPERT_COMPUTE_EFFICIENCY["cpu"]["int8"]
    active = 48 * 8 * 4_732_928
    work = (s.dense_read_bytes + int8.kv_bytes(2048, windowed=True)) + active / f
    t = work / (20 * GB) + 48 * OVERHEAD_PER_LAYER_S["cpu"]
    d = plan.decode
    assert d.compute_efficiency == f and d.device_bytes == s.dense_read_bytes + active + int8.kv_bytes(2048)
    assert d.low == pytest.approx(1 / t) and d.bound == pytest.approx(20 * GB / work)
    reason = next(x for x in plan.decisions if x.item == "decode").reason
    # a format computing slower than it reads says so (int8 measures at the dense rate on the CPU: nothing to say)
    assert (f"int8 experts compute at {f:.0%} of that rate today" in reason) == (f < 1)
    assert ("compute at" in reason) == (f < 1)
    native = make_plan(s, machine(None, 128))
    assert native.decode.compute_efficiency == 1 and not any(x.item == "repacked experts" for x in native.decisions)


def test_disk_for_the_repacked_file_and_advice_that_names_loadable_formats():
    s = real_spec(QWEN)
    download = s.checkpoint_bytes / GiB
    roomy = machine(12, 32, disk_gib=download + 1)
    assert make_plan(s, roomy).ok  # the native plan needs the download only
    r = make_plan(s.in_format("int8"), roomy).refusal
    assert r.resource == "disk" and "the repacked experts" in r.detail
    assert any("--repack-dir" in f for f in r.fixes) and "the native format (no repacked file)" in r.fixes
    # VRAM short by less than top-k int8 experts save: the fix is a format moechat converts to
    for hundredths in range(300, 450):
        hw = machine(hundredths / 100, 32)
        plan = make_plan(s, hw)
        if not plan.ok and make_plan(s.in_format("int8"), hw).ok:
            break
    else:
        pytest.fail("no VRAM size where int8 fits and bf16 does not")
    assert plan.refusal.resource == "VRAM" and "--expert-format int8 (4.5 MiB an expert instead of 9.0 MiB)" in \
        plan.refusal.message
    for p in (plan, make_plan(s, machine(12, 32, disk_gib=10))):
        assert "4-bit" not in p.refusal.message and "variant" not in p.refusal.message


# -- the recommendation ---------------------------------------------------------------------------------

def test_qwen3_30b_on_8_gib_vram_and_32_gib_ram_recommends_a_conversion():
    s = real_spec(QWEN)
    advice = plan_formats(s, machine(8, 32))
    native, best = advice.option("native"), advice.best
    assert advice.recommended in ("int8", "int4") and best.flags == ["--expert-format", advice.recommended]
    assert best.plan.expert_slots > native.plan.expert_slots
    assert best.plan.decode.low > native.plan.decode.high  # faster even against native's optimistic end
    assert best.plan.host_tier == "all experts in RAM" and native.plan.host_tier == "RAM cache"
    assert "native's predicted speed" in advice.reason and QUALITY[best.name].describe() in advice.reason
    assert best.headline().startswith(f"with --expert-format {best.name}: {best.plan.expert_slots:,} slots, RAM "
                                      "holds every expert, ")
    assert all(o.keeps_quality for o in advice.options)
    assert advice.to_json()["recommended"] == advice.recommended


def test_gpt_oss_recommends_its_own_mxfp4():
    s = real_spec(OSS20)
    for hw in (machine(8, 32), machine(None, 32), machine(80, 256)):
        advice = plan_formats(s, hw)
        assert advice.recommended == "native" and advice.flags == []
        for name in ("int8", "int4"):
            o = advice.option(name)
            assert not o.keeps_quality and o.note.startswith("larger than native MXFP4")
            assert "not measured from MXFP4" in o.quality
        assert "int8 and int4 would be larger than native" in advice.reason


def test_a_small_speedup_keeps_the_native_format():
    s = real_spec(QWEN)
    advice = plan_formats(s, machine(80, 256))  # every format resident on the GPU
    native = advice.option("native")
    assert native.plan.resident and advice.recommended == "native"
    assert all(o.speed < SPEEDUP * native.speed for o in advice.options[1:])
    assert "the checkpoint's own format" in advice.reason


def test_when_only_a_conversion_fits_it_is_recommended_and_when_none_fits_none_is():
    s = real_spec(MIXTRAL)
    hw = machine(None, 64, disk_gib=10_000)
    advice = plan_formats(s, hw, Preferences())
    assert advice.recommended is not None
    for twentieths in range(20, 120):
        advice = plan_formats(s, machine(twentieths / 20, 64))
        native = advice.option("native")
        if not native.fits and advice.recommended is not None:
            assert advice.recommended in ("int8", "int4") and advice.reason.startswith("native does not fit")
            break
    else:
        pytest.fail("no VRAM size where only a conversion fits")
    nothing = plan_formats(s, machine(0.5, 64))
    assert nothing.recommended is None and nothing.best.name == "native" and "no format fits" in nothing.reason


def test_a_hub_verdict_is_the_recommended_format_s():
    from moechat.engine.plan.hub import FitVerdict

    s = real_spec(QWEN)
    hw = machine(8, 32)
    advice = plan_formats(s, hw)
    v = FitVerdict("Qwen/Qwen3-30B-A3B", None, s, advice.option("native").plan, hw, True, None, s.checkpoint_bytes, 0,
                   "Hub config.json (estimate)", advice)
    best = advice.best.plan
    assert v.expert_format == advice.recommended != "native" and v.best_plan is best
    assert v.fits and v.decode_tok_s == (best.decode.low, best.decode.high)
    assert v.summary().startswith(f"fits with --expert-format {advice.recommended}, {best.decode.low:.1f}-")
    assert v.to_json()["formats"]["recommended"] == advice.recommended
    none = plan_formats(s, machine(0.5, 32))
    tight = FitVerdict("q", None, s, none.option("native").plan, hw, True, None, 1, 0, "x", none)
    assert not tight.fits and tight.expert_format == "native" and tight.summary().startswith("does not fit: short by")
