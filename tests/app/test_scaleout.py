"""`moechat fit` on a model that does not fit this machine: the vLLM / SGLang launch line and the GPUs it needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moechat.app.cli.main import main
from moechat.engine.plan import read_model_spec
from moechat.engine.plan.scaleout import RESERVE, UTILIZATION, GiB, scale_out

CONFIGS = Path(__file__).resolve().parents[2].parent / "shared" / "model-configs"
DSV3 = CONFIGS / "deepseek-ai--DeepSeek-V3"
OSS20 = CONFIGS / "openai--gpt-oss-20b"
needs_configs = pytest.mark.skipif(not (DSV3 / "config.json").exists() or not (OSS20 / "config.json").exists(),
                                   reason="../shared/model-configs is not here")
SMALL_BOX = ["--vram-gb", "8", "--ram-gb", "16", "--disk-gb", "10000"]


@needs_configs
def test_refusal_prints_the_launch_lines_and_the_gpus(capsys):
    code = main(["fit", str(DSV3), *SMALL_BOX])
    out = capsys.readouterr().out
    assert code == 3
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  REFUSED"))
    assert lines[at + 1].startswith("  scale out") and "32,768 tokens" in lines[at + 1]
    vllm = next(line for line in lines if line.startswith("    vLLM"))
    sglang = next(line for line in lines if line.startswith("    SGLang"))
    assert f"vllm serve {DSV3} --tensor-parallel-size" in vllm and "--enable-expert-parallel" in vllm
    assert "--max-model-len 32768" in vllm
    assert f"--model-path {DSV3} --tp" in sglang and "--ep-size" in sglang
    assert "moechat chat --remote" in out
    assert any("x 80 GiB (H100" in line for line in lines)
    data = json.loads((main(["fit", str(DSV3), *SMALL_BOX, "--json"]), capsys.readouterr().out)[1])
    s = data["scale_out"]
    assert s["vllm"] == vllm.split("vLLM", 1)[1].strip() and s["recommended"]["gpus"] >= 4


@needs_configs
def test_the_arithmetic_holds_for_every_gpu_size():
    spec = read_model_spec(DSV3)
    s = scale_out(spec, "deepseek-ai/DeepSeek-V3")
    assert s.context == 32768 and s.kv_bytes == spec.kv_bytes(32768, 2)  # MLA latents: 68.6 KiB a token
    need = s.weights_bytes + s.kv_bytes
    assert 600 * GiB < s.weights_bytes < 700 * GiB  # the FP8 checkpoint as vLLM loads it
    for o in s.options:
        usable = o.gpu_gib * GiB * UTILIZATION - RESERVE
        assert o.gpus & (o.gpus - 1) == 0  # a power of two: tensor parallelism divides the heads
        assert o.per_gpu_bytes * o.gpus >= need and o.per_gpu_bytes <= usable  # it fits
        assert o.gpus == 1 or need > usable * (o.gpus // 2)  # and half as many would not
    by_size = {o.gpu_gib: o for o in s.options}
    assert (by_size[80].gpus, by_size[80].nodes) == (16, 2) and by_size[141].gpus == 8
    assert "--pipeline-parallel-size" not in s.vllm_command() or s.recommended.nodes > 1


@needs_configs
def test_a_model_that_fits_prints_no_scale_out(capsys):
    code = main(["fit", str(OSS20), "--vram-gb", "24", "--ram-gb", "64", "--disk-gb", "1000"])
    out = capsys.readouterr().out
    assert code == 0 and "scale out" not in out and "vllm serve" not in out
