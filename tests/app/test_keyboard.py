"""Keyboard-first chat (issue 18): every control by a key in the footer, focus back to the prompt after a change,
knobs that step like sliders, dialogs that save with Enter or Ctrl+S, and a small terminal's collapsed panel."""

from __future__ import annotations

import pytest
from textual.widgets import Label, Select

from moechat.app.tui.screens.chat import ChatScreen
from moechat.app.tui.widgets.prompt import PromptInput
from moechat.app.tui.widgets.tuning import StepInput

pytestmark = pytest.mark.anyio
SIZE = (120, 36)


async def _ready(pilot, fakes) -> ChatScreen:
    screen = pilot.app.screen
    await fakes.wait_for(pilot, lambda: screen.info is not None, what="the model")
    return screen


def _footer_keys(screen) -> dict[str, str]:
    """key -> description of every binding the footer shows now."""
    return {key: b.description for key, (_, b, enabled, _) in screen.active_bindings.items() if b.show and enabled}


async def test_a_policy_picked_by_keyboard_then_typing_goes_to_the_prompt(build_app, fakes):
    """The report: after changing the policy focus stayed in the dropdown, and the next message + Enter was lost."""
    engine = fakes.Engine(replies=[fakes.Reply(["ok"])])
    app, store = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot, fakes)
        await pilot.press("f6")
        await fakes.wait_for(pilot, lambda: app.focused is screen.query_one("#slots"), what="F6 to focus the knobs")
        await pilot.press("tab", "tab")  # slots -> RAM MiB -> policy
        assert app.focused is screen.query_one("#policy", Select)
        await pilot.press("enter", "down", "enter")  # open, next policy, pick
        await fakes.wait_for(pilot, lambda: engine.retunes, what="the retune")
        assert engine.retunes[0][2] == {"policy": "lfu"}  # the one after lru in the list
        assert isinstance(app.focused, PromptInput)
        await pilot.press(*"hello", "enter")
        await fakes.wait_for(pilot, lambda: len(screen.session.turns) == 2 and screen.gen_id is None,
                             what="the message to be sent")
        assert engine.sends[0].text == "hello" and len(engine.retunes) == 1


async def test_knobs_step_without_applying_and_enter_applies(build_app, fakes):
    engine = fakes.Engine(num_layers=4, num_experts=16, slots=24)  # 64 experts: Up/Down step by 63 // 16 = 3
    app, _ = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot, fakes)
        await pilot.press("f6")
        knob = screen.query_one("#slots", StepInput)
        await fakes.wait_for(pilot, lambda: app.focused is knob, what="the slots knob")
        await pilot.press("up", "up", "minus", "plus", "plus")  # +3 +3 -1 +1 +1
        assert knob.value == "31"
        await pilot.press("down")
        assert knob.value == "28" and engine.retunes == []
        await pilot.press("enter")
        await fakes.wait_for(pilot, lambda: engine.retunes, what="the retune")
        assert engine.retunes[0][2] == {"expert_slots": 28}
        assert isinstance(app.focused, PromptInput)
        await fakes.wait_for(pilot, lambda: "28/64 slots" in str(screen.query_one("#effective", Label).content))
        await pilot.pause(0.2)
        assert len(engine.retunes) == 1  # leaving the knob after Enter does not apply it twice
        for _ in range(30):  # clamped to the range
            knob.step(+1)
        assert knob.value == "64"


async def test_escape_returns_to_the_prompt_and_the_footer_names_every_control(build_app, fakes):
    engine = fakes.Engine(gated=True, replies=[fakes.Reply(["a ", "b"])])
    app, _ = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot, fakes)
        keys = _footer_keys(screen)
        for key, what in {"escape": "Prompt", "ctrl+q": "Quit", "f6": "Tune", "f2": "System", "f3": "Sampling",
                          "f4": "Panel", "f5": "Models", "ctrl+o": "Chats", "ctrl+s": "Export", "ctrl+n": "New",
                          "ctrl+r": "Redo"}.items():
            assert keys.get(key) == what, key
        await pilot.press("f6")
        await fakes.wait_for(pilot, lambda: isinstance(app.focused, StepInput), what="a knob")
        await pilot.press("escape")
        assert isinstance(app.focused, PromptInput)
        await pilot.press(*"go", "enter")
        await fakes.wait_for(pilot, lambda: screen.gen_id is not None, what="the reply to start")
        await pilot.pause()
        assert _footer_keys(screen).get("escape") == "Stop"  # while a reply streams Escape stops it
        await pilot.press("escape")
        await fakes.wait_for(pilot, lambda: screen.gen_id is None, what="the stop")
        engine.release(5)
        assert _footer_keys(screen).get("escape") == "Prompt"


async def test_sampling_saves_with_enter_and_ctrl_s(build_app, fakes):
    app, _ = build_app(fakes.Engine())
    async with app.run_test(size=SIZE) as pilot:
        await _ready(pilot, fakes)
        await pilot.press("f3")
        await pilot.pause()
        field = app.screen.query_one("#param-temperature")
        field.focus()
        field.value = "0.3"
        await pilot.press("enter")
        await pilot.pause()
        assert app.settings.sampling == {"temperature": 0.3} and isinstance(app.screen, ChatScreen)
        await pilot.press("f3")
        await pilot.pause()
        app.screen.query_one("#param-top_k").value = "5"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.settings.sampling == {"temperature": 0.3, "top_k": 5} and isinstance(app.screen, ChatScreen)


async def test_80x24_collapses_the_panel_to_a_line_and_f4_opens_it(build_app, fakes):
    engine = fakes.Engine(replies=[fakes.Reply(["a ", "b ", "c ", "d"])])  # a decode after the first token
    app, _ = build_app(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await _ready(pilot, fakes)
        summary = screen.query_one("#summary", Label)
        assert summary.display and not screen.dashboard.display
        await pilot.press(*"hi", "enter")
        await fakes.wait_for(pilot, lambda: screen.gen_id is None and len(screen.session.turns) == 2)
        await fakes.wait_for(pilot, lambda: "% turn" in str(summary.content) and "tok/s" in str(summary.content),
                             what="the summary line")
        assert "24/64 slots lru" in str(summary.content)
        await pilot.press("f4")
        await pilot.pause()
        assert screen.dashboard.display and not screen.query_one("#transcript").display
        assert screen.query_one(PromptInput).display  # the prompt stays
        await pilot.press("escape")
        await pilot.pause()
        assert not screen.dashboard.display and screen.query_one("#transcript").display
        assert isinstance(app.focused, PromptInput)
        assert app.settings.show_dashboard  # opening it in a small terminal is not hiding it in a big one
