"""`moechat chat --temperature ... --max-tokens N`: the app's sampling settings start from the flags for that
session, are never saved, and a choice in the sampling dialog (F3) replaces them (issue 26)."""

from __future__ import annotations

import pytest

from moechat.app.tui.screens.chat import ChatScreen
from moechat.app.tui.settings import Settings
from moechat.app.tui.widgets.prompt import PromptInput

SIZE = (120, 36)
pytestmark = pytest.mark.anyio


async def _ready(pilot) -> ChatScreen:
    screen = pilot.app.screen
    for _ in range(500):
        if isinstance(screen, ChatScreen) and screen.info is not None:
            return screen
        await pilot.pause(0.02)
        screen = pilot.app.screen
    raise AssertionError("the model did not load")


async def _send(pilot, text: str) -> None:
    prompt = pilot.app.screen.query_one(PromptInput)
    prompt.focus()
    prompt.load_text(text)
    await pilot.press("enter")


def _done(screen: ChatScreen) -> bool:
    return screen.gen_id is None and bool(screen.session.turns) and screen.session.turns[-1].status != "streaming"


async def test_the_flags_reach_the_engine_over_the_settings_and_are_not_saved(build_app, fakes, app_env):
    settings = Settings(path=app_env / "settings.toml", sampling={"top_p": 0.5, "temperature": 0.9}, max_tokens=50)
    engine = fakes.Engine(replies=[fakes.Reply(["a"]), fakes.Reply(["b"])])
    app, _ = build_app(engine, settings=settings, sampling={"temperature": 0.2, "seed": 3}, max_tokens=5)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        await _send(pilot, "hi")
        await fakes.wait_for(pilot, lambda: _done(screen))
        first = engine.sends[0]
        assert (first.sampling.temperature, first.sampling.top_p, first.sampling.seed) == (0.2, 0.5, 3)
        assert first.max_tokens == 5
        await pilot.press("f3")  # the dialog starts from what this session uses
        await pilot.pause()
        dialog = app.screen
        assert dialog.query_one("#param-temperature").value == "0.2"
        assert dialog.query_one("#param-max_tokens").value == "5"
        dialog.query_one("#param-temperature").value = "0.4"
        await pilot.click("#save")
        await pilot.pause()
        await _send(pilot, "again")
        await fakes.wait_for(pilot, lambda: len(engine.sends) == 2 and _done(screen))
        second = engine.sends[1]
        assert second.sampling.temperature == 0.4 and second.sampling.seed == 3  # the dialog's choice, saved
    saved = Settings.load(app_env / "settings.toml")
    assert saved.sampling == {"temperature": 0.4, "top_p": 0.5, "seed": 3} and saved.max_tokens == 5


async def test_without_flags_the_saved_settings_apply(build_app, fakes, app_env):
    settings = Settings(path=app_env / "settings.toml", sampling={"temperature": 0.9}, max_tokens=50)
    engine = fakes.Engine(replies=[fakes.Reply(["a"])])
    app, _ = build_app(engine, settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        await _send(pilot, "hi")
        await fakes.wait_for(pilot, lambda: _done(screen))
    assert engine.sends[0].sampling.temperature == 0.9 and engine.sends[0].max_tokens == 50


def test_run_chat_hands_the_flags_to_the_app(monkeypatch, tmp_path):
    from moechat.app.cli import main as cli
    from moechat.app.tui import app as app_module
    from moechat.app.tui import launch

    (tmp_path / "config.json").write_text("{}")
    seen = {}
    monkeypatch.setattr(app_module, "make_app", lambda model, **kw: seen.update(kw, model=model) or "the app")
    monkeypatch.setattr(launch, "_run", lambda app: 0 if app == "the app" else pytest.fail(app))
    args = cli.build_parser().parse_args(["chat", str(tmp_path), "--temperature", "0", "--repetition-penalty",
                                          "1.2", "--max-tokens", "9"])
    assert launch.run_chat(args) == 0
    assert seen["sampling"] == {"temperature": 0.0, "repetition_penalty": 1.2} and seen["max_tokens"] == 9
