"""Embeddings on the host: the plan's trade in slots and tok/s, and identical tokens with the table in RAM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moechat.engine.cache.provider import CacheConfig
from moechat.engine.errors import ConfigError
from moechat.engine.plan import Preferences, make_plan, spec_from_config
from moechat.engine.plan.hardware import DiskInfo, GiB, GpuInfo, Hardware, HostMemory
from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

CONFIGS = Path(__file__).resolve().parents[3].parent / "shared" / "model-configs"
GREEDY = SamplingParams(temperature=0.0, do_sample=False)
PROMPT = [(3 * i + 1) % 250 for i in range(11)]


def _spec(rel: str):
    if not (CONFIGS / rel).exists():
        pytest.skip(f"../shared/model-configs not found ({CONFIGS / rel})")
    return spec_from_config(json.loads((CONFIGS / rel).read_text()), name=rel)


def _gpu(vram_gib: float, ram_gib: float = 64) -> Hardware:
    gpus = [GpuInfo(0, 0, "test GPU", "GPU-0", int(vram_gib * GiB), int(vram_gib * GiB), 4, 16, link_gbps=25.2,
                    memory_gbps=500.0)]
    return Hardware(gpus, HostMemory(int(ram_gib * GiB), int(ram_gib * GiB)), DiskInfo("/models", 10_000 * GiB))


def test_the_plan_moves_the_table_to_ram_when_it_buys_slots():
    s = _spec("openai--gpt-oss-20b/config.json")
    hw = _gpu(8)
    dev, host, auto = (make_plan(s, hw, Preferences(embeddings=e)) for e in ("device", "host", "auto"))
    assert dev.embeddings == "device" and host.embeddings == "host" and auto.embeddings == "host"
    assert s.embedding_bytes == 201_088 * 2880 * 2  # untied: [V, H] in bf16, 1.08 GiB
    # the table's bytes become whole slots (13.2 MB each), and it is counted in RAM instead
    gained = host.expert_slots - dev.expert_slots
    assert gained == (dev.device_budget_bytes - dev.device_used_bytes + s.embedding_bytes) // s.expert_bytes
    assert gained > 80 and host.dense_bytes == dev.dense_bytes - s.embedding_bytes
    assert host.ram_used_bytes == dev.ram_used_bytes + s.embedding_bytes  # every expert in RAM both ways
    assert host.decode.high > dev.decode.high  # more slots, fewer misses: faster
    line = next(d for d in auto.decisions if d.item == "embeddings")
    assert f"+{gained} slots ({dev.expert_slots} -> {host.expert_slots})" in line.reason
    assert auto.expert_slots == host.expert_slots


def test_auto_keeps_the_table_where_it_buys_nothing():
    s = _spec("openai--gpt-oss-20b/config.json")
    big = make_plan(s, _gpu(80), Preferences(embeddings="auto"))  # every expert fits: nothing to buy
    assert big.resident and big.embeddings == "device"
    cpu = make_plan(s, _gpu(0), Preferences(embeddings="auto", device="cpu"))
    assert cpu.embeddings == "device"  # a CPU's device memory is its RAM
    with pytest.raises(ConfigError, match="--embeddings"):
        make_plan(s, _gpu(8), Preferences(embeddings="ram"))


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_tokens_are_identical_with_the_table_on_the_host(tiny_models, name):
    path, _ = tiny_models[name]
    ref = Engine.load(path, dtype="bfloat16", cache=CacheConfig(expert_slots=3, policy="lru"))
    want = [t for c in ref.generate(PROMPT, sampling=GREEDY, max_tokens=10) for t in c.token_ids]
    engine = Engine.load(path, dtype="bfloat16", cache=CacheConfig(expert_slots=3, policy="lru", embeddings="host"))
    model = engine.model
    assert model.embed_host is not None and model.embed_host.device.type == "cpu"
    got = [t for c in engine.generate(PROMPT, sampling=GREEDY, max_tokens=10) for t in c.token_ids]
    assert got == want
    with torch.inference_mode():
        ids = torch.tensor([0, 5, 17, 5])
        assert torch.equal(model.embed(ids), torch.nn.functional.embedding(ids, ref.model.embed_weight))


def test_run_resolves_the_flag(tiny_models):
    import argparse

    from moechat.app.cli.engine_args import _embeddings_for_run

    path, _ = tiny_models["mixtral"]
    ns = lambda **kw: argparse.Namespace(**{"embeddings": "auto", "expert_slots": None, "model_dir": str(path),
                                            "dtype": None, "context": None, "expert_format": None, **kw})
    assert _embeddings_for_run(ns(embeddings="host"), "cpu") == "device"  # a CPU's device memory is its RAM
    assert _embeddings_for_run(ns(embeddings="host"), "cuda") == "host"
    assert _embeddings_for_run(ns(embeddings="device"), "cuda:0") == "device"
    assert _embeddings_for_run(ns(expert_slots=4), "cuda") == "device"  # slots sized by hand: the table stays
