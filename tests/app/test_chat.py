"""Pilot tests of the chat flows over the fake engine (tests/app/conftest.py)."""

from __future__ import annotations

import threading

import pytest
from textual.widgets import Label, Select

from moechat.app.tui.screens.chat import ChatScreen
from moechat.app.tui.store import ChatStore
from moechat.app.tui.widgets.loading import LoadingPanel
from moechat.app.tui.widgets.prompt import PromptInput
from moechat.app.tui.widgets.transcript import AssistantMessage, UserMessage
from moechat.app.tui.widgets.tuning import StepInput, TuningPanel
from moechat.engine.errors import CheckpointError

pytestmark = pytest.mark.anyio
SIZE = (120, 36)


async def _ready(pilot) -> ChatScreen:
    screen = pilot.app.screen
    assert isinstance(screen, ChatScreen)
    for _ in range(500):
        if screen.info is not None:
            return screen
        await pilot.pause(0.02)
    raise AssertionError("the model did not load")


async def _send(pilot, text: str) -> None:
    prompt = pilot.app.screen.query_one(PromptInput)
    prompt.focus()
    prompt.load_text(text)
    await pilot.press("enter")


def _done(screen: ChatScreen) -> bool:
    return screen.gen_id is None and bool(screen.session.turns) and screen.session.turns[-1].status != "streaming"


def _notices(app) -> list[str]:
    return [n.message for n in app._notifications]


async def test_send_streams_the_reply_and_saves_every_turn(build_app, fakes):
    engine = fakes.Engine(replies=[fakes.Reply(["Hello", ", ", "**world**", "!"])])
    app, store = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        await _send(pilot, "Hi there")
        await fakes.wait_for(pilot, lambda: _done(screen), what="the reply")
        assert [w.text for w in screen.query(UserMessage)] == ["Hi there"]
        (reply,) = screen.query(AssistantMessage)
        assert reply.text == "Hello, **world**!" and reply.status == "done"
        assert str(reply.query_one(".reply-status", Label).content) == "4 tokens · 43.0 tok/s"
        assert screen.query_one(PromptInput).text == ""
        assert engine.sends[0].history == [] and engine.sends[0].text == "Hi there"
        assert engine.sends[0].sampling.temperature == 0.7  # the model's default: no override set
        saved = store.load(screen.session.conversation_id)
        assert [(m.role, m.content, m.status) for m in saved.messages] == [
            ("user", "Hi there", "done"), ("assistant", "Hello, **world**!", "done")]
        assert saved.title == "Hi there"


async def test_tokens_are_committed_while_streaming(build_app, app_env, fakes):
    engine = fakes.Engine(gated=True, replies=[fakes.Reply(["one ", "two ", "three"])])
    app, store = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        await _send(pilot, "count")
        engine.release(2)
        await fakes.wait_for(pilot, lambda: screen.reply is not None and screen.reply.text == "one two ")
        # Another connection (as after a kill) sees the partial reply, committed, still marked streaming.
        other = ChatStore(app_env / "chats.sqlite3")
        saved = other.load(screen.session.conversation_id)
        assert (saved.messages[-1].content, saved.messages[-1].status) == ("one two ", "interrupted")
        other.close()
        engine.release(1)
        await fakes.wait_for(pilot, lambda: _done(screen))


async def test_escape_stops_at_once_and_keeps_the_partial_reply(build_app, fakes):
    engine = fakes.Engine(gated=True, replies=[fakes.Reply(["a", "b", "c", "d", "e", "f"])])
    app, store = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        await _send(pilot, "letters")
        engine.release(3)
        await fakes.wait_for(pilot, lambda: screen.reply is not None and screen.reply.text == "abc")
        reply = screen.reply
        await pilot.press("escape")
        # Stopped on screen before the engine produced another token.
        assert reply.status == "stopped" and reply.has_class("-stopped") and screen.gen_id is None
        assert engine.sends[0].cancel.is_set()
        engine.release(3)  # the engine sees the cancel after its next token; that token is not shown
        await fakes.wait_for(pilot, lambda: engine.yielded == 4, what="the engine to stop")
        await pilot.pause(0.1)
        assert reply.text == "abc"
        saved = store.load(screen.session.conversation_id)
        assert (saved.messages[-1].content, saved.messages[-1].status) == ("abc", "stopped")
        # The next turn continues from what the user saw.
        engine.replies.append(fakes.Reply(["ok"]))
        await _send(pilot, "go on")
        await fakes.wait_for(pilot, lambda: _done(screen) and len(screen.session.turns) == 4)
        assert engine.sends[1].history == [{"role": "user", "content": "letters"},
                                           {"role": "assistant", "content": "abc"}]


async def test_regenerate_replaces_the_last_reply(build_app, fakes):
    engine = fakes.Engine(replies=[fakes.Reply(["first"]), fakes.Reply(["second"])])
    app, store = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        await _send(pilot, "question")
        await fakes.wait_for(pilot, lambda: _done(screen))
        await pilot.press("ctrl+r")
        await fakes.wait_for(pilot, lambda: len(engine.sends) == 2 and _done(screen))
        assert engine.sends[1].history == engine.sends[0].history and engine.sends[1].text == "question"
        assert [w.text for w in screen.query(AssistantMessage)] == ["second"]
        saved = store.load(screen.session.conversation_id)
        assert [(m.role, m.content) for m in saved.messages] == [("user", "question"), ("assistant", "second")]


async def test_new_chat_starts_empty_and_keeps_the_old_one(build_app, fakes):
    engine = fakes.Engine(replies=[fakes.Reply(["one"]), fakes.Reply(["two"])])
    app, store = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        await _send(pilot, "first chat")
        await fakes.wait_for(pilot, lambda: _done(screen))
        first = screen.session.conversation_id
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert not screen.query(".message") and screen.session.turns == []
        await _send(pilot, "second chat")
        await fakes.wait_for(pilot, lambda: _done(screen))
        assert engine.sends[1].history == []  # nothing of the first chat reaches the model
        assert screen.session.conversation_id != first
        assert [c.title for c in store.list_conversations()] == ["second chat", "first chat"]


async def test_reopen_a_saved_chat_and_continue_it(build_app, fakes):
    engine = fakes.Engine(replies=[fakes.Reply(["sure"])])
    app, store = build_app(engine)
    cid = store.new_conversation("/models/fake-moe", system="Be brief.")
    store.add_message(cid, "user", "What is an expert?")
    store.add_message(cid, "assistant", "A small MLP.", "done")
    store.add_message(cid, "user", "And a slot?")
    store.add_message(cid, "assistant", "A place on the", "streaming")  # the app was killed here
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        await pilot.press("ctrl+o")
        await pilot.pause()
        await pilot.press("enter")  # the first (most recent) chat
        await fakes.wait_for(pilot, lambda: len(screen.query(AssistantMessage)) == 2, what="the chat to open")
        replies = list(screen.query(AssistantMessage))
        assert [r.text for r in replies] == ["A small MLP.", "A place on the"]
        assert replies[1].has_class("-interrupted")
        assert screen.session.system == "Be brief."
        await _send(pilot, "Go on")
        await fakes.wait_for(pilot, lambda: _done(screen) and len(screen.session.turns) == 6)
        assert engine.sends[0].history == [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is an expert?"},
            {"role": "assistant", "content": "A small MLP."}, {"role": "user", "content": "And a slot?"},
            {"role": "assistant", "content": "A place on the"}]
        assert len(store.load(cid).messages) == 6


async def test_tuning_mid_generation_applies_at_the_next_token(build_app, fakes):
    engine = fakes.Engine(gated=True, replies=[fakes.Reply(["t1 ", "t2 ", "t3 ", "t4 ", "t5"])])
    app, store = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        panel = screen.query_one(TuningPanel)
        assert panel.query_one("#slots", StepInput).value == "24"
        await _send(pilot, "go")
        engine.release(2)
        await fakes.wait_for(pilot, lambda: screen.reply is not None and screen.reply.text == "t1 t2 ")
        panel.query_one("#policy", Select).value = "lfu"
        slots = panel.query_one("#slots", StepInput)
        slots.focus()
        slots.value = "8"
        await pilot.press("enter")
        await fakes.wait_for(pilot, lambda: screen.bridge._pending == {"policy": "lfu", "expert_slots": 8},
                       what="the change to be queued")
        assert engine.retunes == []  # not while the engine is inside a token
        engine.release(1)
        await fakes.wait_for(pilot, lambda: engine.retunes, what="the retune")
        yielded, thread, changes = engine.retunes[0]
        assert yielded == 3 and changes == {"policy": "lfu", "expert_slots": 8}
        assert thread == engine.sends[0].thread  # on the generating thread, between two tokens
        await fakes.wait_for(pilot, lambda: "8/64 slots" in str(panel.query_one("#effective", Label).content))
        assert "lfu" in str(panel.query_one("#effective", Label).content)
        assert "applied at token 3" in str(panel.query_one("#effective", Label).content)  # said there, no toast
        assert isinstance(app.focused, PromptInput)  # Enter in a knob applies it and returns to the prompt
        engine.release(2)
        await fakes.wait_for(pilot, lambda: _done(screen))
        assert len(engine.retunes) == 1
        await fakes.wait_for(pilot, lambda: screen.dashboard.stats.num_slots == 8,
                             what="the panel's next (throttled) redraw")
        assert screen.dashboard.stats.policy == "lfu"


async def test_tuning_while_idle_applies_at_once(build_app, fakes):
    engine = fakes.Engine()
    app, _ = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        ram = screen.query_one("#ram-mb", StepInput)
        ram.focus()
        ram.value = "10"
        await pilot.press("enter")
        await fakes.wait_for(pilot, lambda: engine.retunes, what="the retune")
        assert engine.retunes[0][2] == {"ram_cache_bytes": 10 << 20}
        assert engine.retunes[0][1] != threading.get_ident()  # off the UI thread
        await fakes.wait_for(pilot, lambda: "RAM tier" in str(screen.query_one("#effective", Label).content))


async def test_engine_error_is_a_notice_and_the_app_stays_usable(build_app, fakes):
    engine = fakes.Engine(replies=[fakes.Reply(["partial ", "reply", "never"], fail_at=2), fakes.Reply(["fine"])])
    app, store = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        await _send(pilot, "break")
        await fakes.wait_for(pilot, lambda: _done(screen))
        assert any("the KV cache is full" in n for n in _notices(app))
        reply = screen.query(AssistantMessage).last()
        assert reply.has_class("-error") and reply.text == "partial reply"
        await _send(pilot, "again")
        await fakes.wait_for(pilot, lambda: _done(screen) and len(screen.session.turns) == 4)
        assert screen.query(AssistantMessage).last().text == "fine"
        assert [m.status for m in store.load(screen.session.conversation_id).messages] == [
            "done", "error", "done", "done"]


async def test_bad_sampling_value_is_a_notice(build_app, fakes):
    engine = fakes.Engine()
    app, _ = build_app(engine)
    app.settings.sampling = {"temperature": -1.0}
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        await _send(pilot, "hi")
        await fakes.wait_for(pilot, lambda: _done(screen))
        assert any("temperature must be >= 0" in n for n in _notices(app))


async def test_model_load_failure_is_a_notice(build_app, fakes):
    error = CheckpointError("model-00001.safetensors: truncated: header says 4096 bytes, file has 100; download "
                            "it again")
    app, _ = build_app(error)
    async with app.run_test(size=SIZE) as pilot:
        screen = pilot.app.screen
        await fakes.wait_for(pilot, lambda: screen.query_one(LoadingPanel).has_class("-error"))
        await fakes.wait_for(pilot, lambda: any("truncated" in n for n in _notices(app)), what="the notice")
        assert "truncated" in str(screen.query_one("#loading-stage", Label).content)
        await _send(pilot, "hello?")
        await pilot.pause()
        assert any("not loaded" in n for n in _notices(app))
        assert screen.query_one(PromptInput).text == "hello?"  # kept for later
        await pilot.press("ctrl+o")  # saved chats still open
        await pilot.pause()
        assert pilot.app.screen.__class__.__name__ == "ChatsScreen"


async def test_prompt_keys_newline_and_history(build_app, fakes):
    engine = fakes.Engine(replies=[fakes.Reply(["a"]), fakes.Reply(["b"])])
    app, _ = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        prompt = screen.query_one(PromptInput)
        prompt.focus()
        await pilot.press("l", "1", "shift+enter", "l", "2")
        assert prompt.text == "l1\nl2"
        await pilot.press("enter")
        await fakes.wait_for(pilot, lambda: _done(screen))
        await pilot.press("o", "k", "ctrl+j", "x")
        assert prompt.text == "ok\nx"
        prompt.load_text("draft")
        await pilot.press("up")
        assert prompt.text == "l1\nl2"
        await pilot.press("down")  # first through the recalled prompt's lines
        assert prompt.text == "l1\nl2" and prompt.cursor_location[0] == 1
        await pilot.press("down")
        assert prompt.text == "draft"


async def test_welcome_screen_opens_a_typed_model(build_app, fakes):
    engine = fakes.Engine()
    app, _ = build_app(engine, model=None)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert app.screen.__class__.__name__ == "WelcomeScreen"
        await pilot.press(*"/models/fake-moe", "enter")
        screen = await _ready(pilot)
        assert screen.model == "/models/fake-moe" and app.settings.recent_models == ["/models/fake-moe"]


async def test_export_writes_markdown(build_app, fakes, app_env):
    app, _ = build_app(fakes.Engine(replies=[fakes.Reply(["A ", "reply."])]))
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        await _send(pilot, "Export me")
        await fakes.wait_for(pilot, lambda: _done(screen))
        await pilot.press("ctrl+s")  # asks where, the export folder offered; Enter writes there
        await pilot.pause()
        assert app.screen.query_one("#export-dir").value == str(app_env / "exports")
        assert not (app_env / "exports").exists()  # nothing written before the answer
        await pilot.press("enter")
        await pilot.pause()
        (path,) = (app_env / "exports").glob("*.md")
        assert "## You\n\nExport me" in path.read_text() and "## Assistant\n\nA reply." in path.read_text()
        assert any(str(path) in n for n in _notices(app))


async def test_system_prompt_and_sampling_dialogs_reach_the_engine(build_app, fakes):
    engine = fakes.Engine(replies=[fakes.Reply(["a"]), fakes.Reply(["b"])])
    app, store = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        await pilot.press("f2")
        await pilot.pause()
        app.screen.query_one("#system-text").load_text("You are terse.")
        await pilot.click("#save")
        await pilot.press("f3")
        await pilot.pause()
        dialog = app.screen
        assert "0.7" in str(dialog.query_one("#param-temperature").placeholder)  # the model's default, shown
        dialog.query_one("#param-temperature").value = "0.2"
        dialog.query_one("#param-max_tokens").value = "5"
        await pilot.click("#save")
        await pilot.pause()
        assert app.settings.sampling == {"temperature": 0.2} and app.settings.max_tokens == 5
        await _send(pilot, "hi")
        await fakes.wait_for(pilot, lambda: _done(screen))
        call = engine.sends[0]
        assert call.history == [{"role": "system", "content": "You are terse."}]
        assert call.sampling.temperature == 0.2 and call.sampling.top_p == 0.8 and call.max_tokens == 5
        assert store.load(screen.session.conversation_id).system == "You are terse."
        assert app.settings.system_prompt == "You are terse."
