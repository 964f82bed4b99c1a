"""The expert format in the app: the panel's knob shows it with every expert's size per format; a change is
confirmed in a dialog that says what the first start writes, saved per model, and reloads the model through the
bridge in that format; `moechat chat --expert-format` holds for that model this session."""

from __future__ import annotations

import pytest
from textual.widgets import Button, Label, Select

from moechat.app.tui.bridge import LoadOptions
from moechat.app.tui.livestats import fmt_bytes
from moechat.app.tui.screens.dialogs import FormatScreen
from moechat.app.tui.settings import Settings

pytestmark = pytest.mark.anyio
SIZE = (130, 44)
MODEL = "/models/fake-moe"


def recording_factory(engine, loads: list):
    """The fake engine's factory, recording the options of each load (the bridge's model-load path)."""

    def factory(model, options, progress):
        loads.append((model, options))
        progress("loading the fake model")
        return engine

    return factory


def _text(screen, selector: str) -> str:
    return str(screen.query_one(selector, Label).content)


async def test_changing_the_format_confirms_saves_and_reloads_in_it(build_app, fakes, app_env):
    engine = fakes.Engine(num_layers=4, num_experts=16)
    loads: list = []
    settings = Settings(path=app_env / "settings.toml")
    app, _ = build_app(engine, settings=settings)
    app.engine_factory = recording_factory(engine, loads)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        await fakes.wait_for(pilot, lambda: screen.info is not None, what="the model")
        assert [o.expert_format for _, o in loads] == ["native"]
        select = screen.query_one("#format", Select)
        assert select.value == "native" and _text(screen, "#format-of") == "64.0 MiB"
        int4_bytes = screen.info.format_bytes["int4"]

        # Cancel: nothing saved, nothing reloaded, the knob back on the loaded format
        select.value = "int4"
        await fakes.wait_for(pilot, lambda: isinstance(app.screen, FormatScreen) and app.screen.query("#cancel"),
                             what="the confirmation")
        dialog = app.screen
        body = str(dialog.query_one("#format-text", Label).content)
        assert body.startswith("This reloads fake-moe with int4 experts. The first start converts every expert once")
        assert "repacked file under $XDG_CACHE_HOME/moechat/repacked" in body and "reused on later starts" in body
        assert "Measured: perplexity +0.22% vs native" in str(list(dialog.query(Label))[1].content)
        dialog.query_one("#cancel", Button).press()
        await fakes.wait_for(pilot, lambda: app.screen is screen, what="the chat again")
        await fakes.wait_for(pilot, lambda: select.value == "native", what="the knob reset")
        assert len(loads) == 1 and settings.expert_formats == {}

        # Reload: saved for this model, a notice with the repacked file's size, loaded again in int4
        select.value = "int4"
        await fakes.wait_for(pilot, lambda: isinstance(app.screen, FormatScreen) and app.screen.query("#reload"),
                             what="the confirmation")
        app.screen.query_one("#reload", Button).press()
        await fakes.wait_for(pilot, lambda: len(loads) == 2 and screen.info is not None, what="the reload")
        assert loads[1] == (MODEL, LoadOptions(expert_format="int4"))
        assert Settings.load(app_env / "settings.toml").expert_formats == {MODEL: "int4"}
        notice = f"converts every expert once into a {fmt_bytes(int4_bytes)} repacked file"
        await fakes.wait_for(pilot, lambda: any(notice in n.message for n in app._notifications), what="the notice")


async def test_the_chat_flag_holds_for_its_model_and_a_saved_choice_for_the_next_start(build_app, fakes, app_env):
    engine = fakes.Engine()
    loads: list = []
    settings = Settings(path=app_env / "settings.toml")
    settings.set_expert_format(MODEL, "int8")
    app, _ = build_app(engine, settings=settings)
    app.engine_factory = recording_factory(engine, loads)
    async with app.run_test(size=SIZE) as pilot:
        await fakes.wait_for(pilot, lambda: app.screen.info is not None, what="the model")
    assert loads[0][1].expert_format == "int8"  # the saved choice
    loads.clear()
    app, _ = build_app(engine, settings=settings)
    app.engine_factory = recording_factory(engine, loads)
    app.load_options = LoadOptions(expert_format="int4")
    app.session_formats = {MODEL: "int4"}  # as make_app sets it from `moechat chat MODEL --expert-format int4`
    async with app.run_test(size=SIZE) as pilot:
        await fakes.wait_for(pilot, lambda: app.screen.info is not None, what="the model")
    assert loads[0][1].expert_format == "int4" and settings.expert_formats == {MODEL: "int8"}  # not saved


async def test_the_wizard_hands_its_recommended_format_to_the_chat(build_app, fakes, app_env):
    from types import SimpleNamespace

    from moechat.app.tui.screens.setup import HubOptions, SetupScreen
    from moechat.engine.plan.hardware import Hardware, HostMemory

    engine = fakes.Engine()
    loads: list = []
    settings = Settings(path=app_env / "settings.toml")
    settings.set_expert_format("/models/chosen-before", "int4")
    box = Hardware((), HostMemory(16 << 30, 16 << 30), None)
    app, _ = build_app(engine, settings=settings, hub=HubOptions(entries=(), hardware=box))
    app.engine_factory = recording_factory(engine, loads)
    async with app.run_test(size=SIZE) as pilot:
        await fakes.wait_for(pilot, lambda: app.screen.info is not None, what="the model")
        for model, want in (("/models/downloaded", "int8"), ("/models/chosen-before", "int4")):
            app.open_setup()
            await fakes.wait_for(pilot, lambda: isinstance(app.screen, SetupScreen) and app.screen.query("Footer"),
                                 what="the wizard")
            await pilot.pause(0.1)
            app.screen.verdict = SimpleNamespace(expert_format="int8")  # the plan recommended int8
            n = len(loads)
            app.screen._finish(model)  # as "Download and chat" / "Open in chat" end
            await fakes.wait_for(pilot, lambda n=n: len(loads) > n, what="the chat loading it")
            assert loads[-1] == (model, LoadOptions(expert_format=want))  # the user's own choice is kept
    assert Settings.load(app_env / "settings.toml").expert_formats == {"/models/downloaded": "int8",
                                                                       "/models/chosen-before": "int4"}
