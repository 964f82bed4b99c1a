"""The bridge's pure parts: finding a model (dir or cached Hub repo), readable errors, effective cache state."""

from __future__ import annotations

import pytest

from moechat.app.tui.bridge import cache_state, describe, describe_error, resolve_model
from moechat.app.tui.sysmon import MemoryProbe
from moechat.engine.errors import ConfigError, NotDownloadedError, PromptTooLongError


def test_resolve_model_dir_and_cached_hub_repo(tmp_path, monkeypatch):
    assert resolve_model(str(tmp_path)) == tmp_path
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(NotDownloadedError, match=r"someone/tiny-moe is not downloaded .*run moechat pull "):
        resolve_model("someone/tiny-moe", cache_dir=hub)
    snapshot = tmp_path / "hub" / "models--someone--tiny-moe" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--someone--tiny-moe" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--tiny-moe" / "refs" / "main").write_text("a" * 40)
    # config.json without weights (an interrupted download): refused, never loaded as half a model
    with pytest.raises(NotDownloadedError, match=r"only partly downloaded \(no \*\.safetensors weights\)"):
        resolve_model("someone/tiny-moe", cache_dir=hub)
    (snapshot / "model.safetensors").write_bytes(b"weights")
    assert resolve_model("someone/tiny-moe", cache_dir=hub) == snapshot
    with pytest.raises(ConfigError, match="no such model directory"):
        resolve_model(str(tmp_path / "missing" / "deeper"))


def test_describe_error_is_one_readable_line():
    assert describe_error(PromptTooLongError("the prompt has 5000 tokens; raise --context")) == (
        "the prompt has 5000 tokens; raise --context")
    assert describe_error(MemoryError()).startswith("out of memory (MemoryError); lower --context")
    assert describe_error(ValueError("bad\nsecond line")) == "ValueError: bad"


def test_describe_and_cache_state_of_the_fake_engine(fakes):
    engine = fakes.Engine(num_layers=4, num_experts=16, slots=24)
    info = describe(engine, "/models/fake-moe")
    assert (info.name, info.num_layers, info.num_experts, info.top_k, info.dtype) == ("fake-moe", 4, 16, 2, "float32")
    assert info.sampling_defaults["temperature"] == 0.7 and info.generation_config["top_p"] == 0.8
    state = cache_state(engine, engine.retune_cache(ram_cache_bytes=8 << 20))
    assert (state.slots, state.max_slots, state.policy) == (24, 64, "lru")
    assert state.ram_budget_bytes == 8 << 20 and state.all_experts_bytes == 64 << 20


def test_memory_probe_without_nvidia():
    reading = MemoryProbe().read()
    assert reading.ram_total_bytes > 0 and 0 < reading.process_rss_bytes < reading.ram_total_bytes
    assert reading.gpus or reading.vram_note  # a GPU's numbers, or why there are none


def test_describe_says_the_expert_format_and_its_sizes(fakes):
    info = describe(fakes.Engine(num_layers=4, num_experts=16), "/models/fake-moe")
    n = 4 * 16
    assert (info.expert_format, info.native_format, info.repacked) == ("native", "", frozenset())
    # native from the store (1 MiB an expert); int8/int4 from the planner's formulas at hidden 256 x width 128, fp32
    # (int8: fp32 row scales; int4: fp16 group scales of 32)
    assert info.format_bytes == {"native": n << 20, "int8": n * (3 * 256 * 128 + 4 * (2 * 128 + 256)),
                                 "int4": n * (3 * 256 * 128 // 2 + 2 * (2 * 128 * 256 // 32 + 256 * 128 // 32))}


def test_load_engine_converts_the_experts_and_describes_them(tiny_models, monkeypatch, tmp_path):
    import torch

    from moechat.app.cli.fit import repack_dir
    from moechat.app.tui.bridge import LoadOptions, load_engine
    from moechat.engine.quant import get_format

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path, _ = tiny_models["qwen3_moe"]
    stages = []
    engine = load_engine(str(path), LoadOptions(device="cpu", expert_format="int8", prefetch="off"), stages.append)
    try:
        info = describe(engine, str(path))
        args = engine.args
        n = len(engine.loaded.cls.moe_layers(args)) * args.num_experts
        assert info.expert_format == "int8" and info.native_format == "dense" and info.repacked == {"int8"}
        assert (repack_dir(path, "int8") / "experts.bin").is_file()
        for fmt in ("int8", "int4"):
            want = get_format(fmt).expert_bytes(args.hidden_size, args.moe_intermediate, engine.loaded.dtype,
                                                args.expert_bias)
            assert info.format_bytes[fmt] == n * want
        assert info.format_bytes["native"] == n * args.hidden_size * args.moe_intermediate * 3 * \
            engine.loaded.dtype.itemsize
        assert any("with int8 experts (the first start converts every expert" in s for s in stages)
        assert engine.loaded.expert_format.name == "int8" and engine.loaded.dtype in (torch.float32, torch.bfloat16)
    finally:
        engine.close()
    stages.clear()
    engine = load_engine(str(path), LoadOptions(device="cpu", expert_format="int8", prefetch="off"), stages.append)
    engine.close()
    assert any("from the repacked file written at the first start" in s for s in stages)
