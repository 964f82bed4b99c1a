"""`moechat chat` and bare `moechat`: the parser, the model they open, and errors before any TUI."""

from __future__ import annotations

import argparse

import pytest

from moechat.app.tui import launch
from moechat.app.tui.bridge import LoadOptions, default_policy
from moechat.app.tui.screens.welcome import WelcomeScreen
from moechat.app.tui.settings import Settings


def _parse(*argv):
    parser = argparse.ArgumentParser(prog="moechat")
    launch.add_chat_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(list(argv))


def test_chat_parser_mirrors_run_options(tmp_path):
    args = _parse("chat", str(tmp_path), "--dtype", "bfloat16", "--context", "2048", "--expert-slots", "64",
                  "--policy", "lfu", "--ram-cache-mb", "512")
    assert args.handler is launch.run_chat
    assert launch.options_from_args(args) == LoadOptions(dtype="bfloat16", context=2048, expert_slots=64,
                                                         policy="lfu", ram_cache_mb=512)
    assert _parse("chat", "x").policy == default_policy()
    hybrid = launch.options_from_args(_parse("chat", "x", "--on-miss", "host", "--host-layers", "2"))
    assert (hybrid.on_miss, hybrid.host_layers) == ("host", 2)
    assert launch.options_from_args(_parse("chat", "x")).on_miss == "auto"  # as `moechat run`
    for bad in (["--expert-slots", "0"], ["--policy", "nope"], ["--ram-cache-mb", "-1"], ["--on-miss", "gpu"],
                ["--host-layers", "-1"]):
        with pytest.raises(SystemExit):
            _parse("chat", "x", *bad)


@pytest.fixture
def captured(monkeypatch, app_env):
    apps = []
    monkeypatch.setattr(launch, "_run", lambda app: apps.append(app) or 0)
    return apps


def test_run_chat_opens_the_model(captured, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    assert launch.run_chat(_parse("chat", str(model), "--expert-slots", "8")) == 0
    (app,) = captured
    assert app.model == str(model.resolve()) and app.load_options.expert_slots == 8



def test_run_chat_passes_the_reasoning_effort_for_the_session(captured, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    assert launch.run_chat(_parse("chat", str(model), "--reasoning-effort", "high")) == 0
    assert launch.run_chat(_parse("chat", str(model))) == 0
    assert [app.reasoning_effort for app in captured] == ["high", None]
    assert captured[0].settings.reasoning_effort is None  # not written to the settings
    with pytest.raises(SystemExit):
        _parse("chat", "x", "--reasoning-effort", "extreme")

def test_run_chat_takes_the_expert_format_for_that_model_this_session(captured, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    assert launch.run_chat(_parse("chat", str(model), "--expert-format", "int4")) == 0
    assert launch.run_chat(_parse("chat", str(model))) == 0
    flagged, plain = captured
    assert flagged.load_options.expert_format == "int4" and plain.load_options.expert_format is None
    path = str(model.resolve())
    assert flagged.expert_format(path) == "int4" and flagged.expert_format("/other/model") == "native"
    assert flagged.settings.expert_formats == {}  # the flag is not written to the settings
    assert plain.expert_format(path) == "native"
    with pytest.raises(SystemExit):
        _parse("chat", "x", "--expert-format", "int3")


def test_run_chat_on_a_missing_dir_is_one_line(captured, capsys):
    assert launch.run_chat(_parse("chat", "/no/such/dir")) == 1
    assert capsys.readouterr().err.strip() == ("moechat: error: /no/such/dir: no such model directory; pass a "
                                               "directory with config.json and *.safetensors (or a .gguf file), "
                                               "or a Hub repo id")
    assert captured == []


def test_default_model_prefers_the_demo_then_the_last_used(tmp_path):
    demo, used = tmp_path / "demo", tmp_path / "used"
    used.mkdir()
    settings = Settings(recent_models=[str(tmp_path / "deleted"), str(used)])
    assert launch.default_model(demo, settings) == str(used)  # no demo yet; the deleted one is skipped
    demo.mkdir()
    (demo / "config.json").write_text("{}")
    assert launch.default_model(demo, settings) == str(demo)
    assert launch.default_model(tmp_path / "none", Settings()) is None


@pytest.mark.anyio
async def test_run_default_without_any_model_shows_the_welcome_screen(captured, monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "DEMO_MODEL", tmp_path / "no-demo")
    assert launch.run_default() == 0
    (app,) = captured
    assert app.model is None
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        assert isinstance(app.screen, WelcomeScreen)
        assert "moechat chat" in app.screen.query_one("#welcome-text").source


def test_a_gguf_file_and_a_gguf_quant_are_models_for_the_app(tmp_path):
    from moechat.app.tui.bridge import is_local_model, looks_like_repo_id, resolve_model

    f = tmp_path / "Qwen3-30B-A3B-Q4_K_M.gguf"
    f.write_bytes(b"GGUF")
    assert is_local_model(f) and is_local_model(tmp_path) and resolve_model(str(f)) == f
    assert not is_local_model(tmp_path / "notes.txt")
    assert looks_like_repo_id("unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M") and looks_like_repo_id("org/name")
    assert not looks_like_repo_id("org/name:Q4:x")


def test_run_chat_takes_a_gguf_file(captured, tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    assert launch.run_chat(_parse("chat", str(f))) == 0
    (app,) = captured
    assert app.model == str(f.resolve())
