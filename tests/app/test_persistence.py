"""What the app keeps between runs (issue 18): the last chat, prompt history, the cache tuning per model; the
saved chats' search, rename and delete; a message sent while the model loads."""

from __future__ import annotations

import threading

import pytest

from moechat.app.tui.settings import Settings
from moechat.app.tui.store import ChatStore
from moechat.app.tui.widgets.prompt import PromptInput
from moechat.app.tui.widgets.transcript import AssistantMessage, UserMessage

pytestmark = pytest.mark.anyio
SIZE = (120, 36)


async def _ready(pilot, fakes):
    screen = pilot.app.screen
    await fakes.wait_for(pilot, lambda: screen.info is not None, what="the model")
    return screen


async def _say(pilot, fakes, screen, text: str) -> None:
    n = len(screen.session.turns)
    screen.query_one(PromptInput).focus()
    await pilot.press(*text, "enter")
    await fakes.wait_for(pilot, lambda: len(screen.session.turns) == n + 2
                         and screen.session.turns[-1].status == "done", what=f"the reply to {text!r}")


async def test_reopening_the_app_reopens_the_last_chat_with_its_prompt_history(build_app, fakes, app_env):
    engine = fakes.Engine(replies=[fakes.Reply(["one"]), fakes.Reply(["two"]), fakes.Reply(["three"])])
    app, store = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot, fakes)
        await _say(pilot, fakes, screen, "first question")
        await _say(pilot, fakes, screen, "second question")
        cid = screen.session.conversation_id
    app, _ = build_app(engine, store=ChatStore(app_env / "chats.sqlite3"),
                       settings=Settings.load(app_env / "settings.toml"))
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot, fakes)
        await fakes.wait_for(pilot, lambda: len(screen.query(AssistantMessage)) == 2, what="the last chat")
        assert screen.session.conversation_id == cid
        assert [m.text for m in screen.query(UserMessage)] == ["first question", "second question"]
        prompt = screen.query_one(PromptInput)
        await pilot.press("up")
        assert prompt.text == "second question"
        await pilot.press("up")
        assert prompt.text == "first question"
        await pilot.press("down", "down")
        assert prompt.text == ""
        await _say(pilot, fakes, screen, "third")  # the chat goes on where it was
        assert engine.sends[-1].history[-1] == {"role": "assistant", "content": "two"}


async def test_the_tuning_is_saved_per_model_and_restored_at_its_next_load(build_app, fakes, app_env):
    engine = fakes.Engine(slots=24)
    app, _ = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot, fakes)
        screen.query_one("#policy").value = "lfu"
        await fakes.wait_for(pilot, lambda: engine.policy == "lfu", what="the policy")
        knob = screen.query_one("#slots")
        knob.focus()
        await fakes.wait_for(pilot, lambda: knob.has_focus, what="the slots knob to take the focus")  # not the prompt's
        knob.value = "8"
        await pilot.press("enter")
        await fakes.wait_for(pilot, lambda: app.settings.tuning("/models/fake-moe").get("slots") == 8,
                             what="the effective slots to be saved")
    saved = Settings.load(app_env / "settings.toml")
    assert saved.problem is None
    assert saved.tuning("/models/fake-moe") == {"slots": 8, "policy": "lfu"}  # what was set; the rest the planner's
    fresh = fakes.Engine(slots=24)
    app, _ = build_app(fresh, settings=saved)
    async with app.run_test(size=SIZE) as pilot:
        await _ready(pilot, fakes)
        await fakes.wait_for(pilot, lambda: fresh.retunes, what="the saved tuning")
        assert fresh.retunes[0][2] == {"expert_slots": 8, "policy": "lfu"}


async def test_the_command_line_wins_over_saved_tuning(build_app, fakes, app_env):
    from moechat.app.tui.bridge import LoadOptions

    settings = Settings(path=app_env / "settings.toml")
    settings.set_tuning("/models/fake-moe", slots=8, policy="lfu")
    engine = fakes.Engine(slots=24)
    app, _ = build_app(engine, settings=settings)
    app.load_options = LoadOptions(expert_slots=24)  # `moechat chat MODEL --expert-slots 24`
    async with app.run_test(size=SIZE) as pilot:
        await _ready(pilot, fakes)
        await fakes.wait_for(pilot, lambda: engine.retunes, what="the saved policy")
        assert engine.retunes[0][2] == {"policy": "lfu"}


async def test_chats_are_searched_renamed_and_deleted(build_app, fakes):
    app, store = build_app(fakes.Engine(replies=[fakes.Reply(["ok"])] * 3))
    for title, text in (("Cooking", "how long to boil an egg"), ("Routing", "what does top-k mean"),
                        ("Caches", "what is an LRU cache")):
        cid = store.new_conversation("/models/fake-moe")
        store.add_message(cid, "user", text)
        store.rename_conversation(cid, title)
    app.reopen_last_chat = False
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot, fakes)
        await pilot.press("ctrl+o")
        await pilot.pause()
        chats = app.screen
        assert [c.title for c in chats.conversations] == ["Caches", "Routing", "Cooking"]
        await pilot.press(*"top-k")  # message text, not only titles
        await pilot.pause()
        assert [c.title for c in chats.conversations] == ["Routing"]
        await pilot.press("f2")
        await pilot.pause()
        rename = chats.query_one("#chat-rename")
        assert app.focused is rename and rename.value == "Routing"
        rename.value = "Top-k routing"
        await pilot.press("enter")
        await pilot.pause()
        assert [c.title for c in chats.conversations] == ["Top-k routing"]
        for _ in range(5):
            await pilot.press("backspace")
        await pilot.pause()
        assert len(chats.conversations) == 3
        await pilot.press("down")  # the list's second row: "Top-k routing"
        await pilot.press("ctrl+d")
        assert len(store.list_conversations()) == 3  # a first Ctrl+D only asks
        await pilot.press("ctrl+d")
        await pilot.pause()
        assert [c.title for c in store.list_conversations()] == ["Caches", "Cooking"]
        await pilot.press("enter")  # reopens the highlighted one
        await fakes.wait_for(pilot, lambda: screen.session.conversation_id is not None, what="a chat to open")
        assert store.load(screen.session.conversation_id).title in ("Caches", "Cooking")


async def test_a_message_sent_while_the_model_loads_is_answered_when_it_is_ready(build_app, fakes, app_env):
    from moechat.app.tui.app import make_app
    from moechat.app.tui.bridge import LoadOptions

    engine = fakes.Engine(replies=[fakes.Reply(["ready now"])])
    loaded = threading.Event()

    def slow_factory(model, options, progress):
        progress("reading the weights")
        assert loaded.wait(20)
        return engine

    app = make_app("/models/fake-moe", engine_factory=slow_factory, options=LoadOptions(),
                   settings=Settings(path=app_env / "settings.toml"), store=ChatStore(app_env / "chats.sqlite3"),
                   memory_probe=fakes.Memory(), export_dir=app_env / "exports")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        await pilot.pause(0.2)
        await pilot.press(*"hello early", "enter")
        await pilot.pause(0.2)
        assert screen.info is None and screen.queued == "hello early"
        assert not screen.loading  # Textual's own spinner over the whole screen stays off: the prompt is usable
        assert [m.text for m in screen.query(UserMessage)] == ["hello early"]  # on screen and saved, not lost
        assert screen.query_one(PromptInput).text == ""
        await pilot.press(*"and more", "enter")  # a second one waits in the prompt
        await pilot.pause()
        assert screen.query_one(PromptInput).text == "and more"
        loaded.set()
        await fakes.wait_for(pilot, lambda: len(screen.session.turns) == 2
                             and screen.session.turns[1].status == "done", what="the queued message's reply")
        assert engine.sends[0].text == "hello early"
        assert screen.query(AssistantMessage).last().text == "ready now"


async def test_only_a_chat_with_this_model_reopens(build_app, fakes):
    app, store = build_app(fakes.Engine())
    mine = store.new_conversation("/models/fake-moe")
    store.add_message(mine, "user", "about the fake model")
    other = store.new_conversation("/models/another-moe")  # the latest chat, with another model
    store.add_message(other, "user", "about another model")
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot, fakes)
        await fakes.wait_for(pilot, lambda: screen.session.conversation_id == mine, what="this model's last chat")
        assert [m.text for m in screen.query(UserMessage)] == ["about the fake model"]


async def test_quitting_while_the_model_loads_does_not_wait_for_it(app_env, fakes):
    """The exit used to hold the UI for the load (up to 5 s on the engine lock); the load now closes what it loaded."""
    import time

    from moechat.app.tui.app import make_app
    from moechat.app.tui.bridge import LoadOptions

    closed = threading.Event()
    release = threading.Event()

    class Closing(fakes.Engine):
        def close(self):
            closed.set()

    def slow_factory(model, options, progress):
        assert release.wait(20)
        return Closing()

    app = make_app("/models/fake-moe", engine_factory=slow_factory, options=LoadOptions(),
                   settings=Settings(path=app_env / "settings.toml"), store=ChatStore(app_env / "chats.sqlite3"),
                   memory_probe=fakes.Memory(), export_dir=app_env / "exports")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.2)
        bridge = app.screen.bridge
        start = time.monotonic()
        bridge.on_unmount()  # what the exit runs, on the UI thread
        waited = time.monotonic() - start
        release.set()
        assert closed.wait(10)  # the load that ended after the exit closed its engine
        assert bridge._engine is None
        assert waited < 5  # not the whole load (it never ended before the release)
