"""A reasoning model in the app: thinking in a fold above the answer, saved beside it; the reasoning effort."""

from __future__ import annotations

import pytest
from textual.widgets import Collapsible, Markdown, Select
from textual.widgets._collapsible import CollapsibleTitle

from moechat.app.tui.screens.chat import ChatScreen
from moechat.app.tui.settings import Settings
from moechat.app.tui.widgets.prompt import PromptInput
from moechat.app.tui.widgets.transcript import AssistantMessage, ThinkingBlock

pytestmark = pytest.mark.anyio
SIZE = (120, 36)


async def _ready(pilot) -> ChatScreen:
    screen = pilot.app.screen
    for _ in range(500):
        if isinstance(screen, ChatScreen) and screen.info is not None:
            return screen
        await pilot.pause(0.02)
    raise AssertionError("the model did not load")


async def _send(pilot, text: str) -> None:
    prompt = pilot.app.screen.query_one(PromptInput)
    prompt.focus()
    prompt.load_text(text)
    await pilot.press("enter")


def _done(screen: ChatScreen) -> bool:
    """The reply ended: in the session and on screen (the message widget finishes after the session, awaited)."""
    messages = screen.transcript.assistant_messages
    return (screen.gen_id is None and bool(screen.session.turns) and screen.session.turns[-1].status != "streaming"
            and bool(messages) and messages[-1].status != "streaming")


def _markdown_text(markdown: Markdown) -> str:
    return markdown.source


async def test_thinking_streams_open_then_folds_when_the_answer_starts(build_app, fakes):
    reply = fakes.Reply(["The ", "answer."], thinking=["Let me ", "think it over."])
    engine = fakes.Engine(gated=True, replies=[reply])
    app, store = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        await _send(pilot, "question")
        engine.release(1)
        await fakes.wait_for(pilot, lambda: screen.reply is not None and screen.reply.thinking == "Let me ")
        message = screen.reply
        block = message.thinking_block
        assert isinstance(block, ThinkingBlock)
        assert not block.collapsed and block.title == "Thinking…" and message.text == ""
        # The fold sits above the answer.
        children = list(message.children)
        assert children.index(block) < children.index(message.markdown)
        engine.release(1)
        await fakes.wait_for(pilot, lambda: message.thinking == "Let me think it over.")
        assert not block.collapsed
        # Committed as it streams, like the answer.
        saved = store.load(screen.session.conversation_id).messages[-1]
        assert (saved.thinking, saved.content) == ("Let me think it over.", "")
        engine.release(1)
        await fakes.wait_for(pilot, lambda: message.text == "The ")
        assert block.collapsed  # the answer started: the thinking folds away
        engine.release(1)
        await fakes.wait_for(pilot, lambda: _done(screen))
        assert (message.text, message.thinking, message.status) == ("The answer.", "Let me think it over.", "done")
        assert block.title == "Thinking · 5 words"
        assert _markdown_text(block.markdown) == "Let me think it over."
        assert _markdown_text(message.markdown) == "The answer."
        saved = store.load(screen.session.conversation_id).messages[-1]
        assert (saved.content, saved.thinking, saved.status) == ("The answer.", "Let me think it over.", "done")
        contents = block.query_one(Collapsible.Contents)
        assert contents.styles.display == "none"
        # A click on its title opens it again (once the finished reply's layout has settled: a click aimed at the
        # title's old place can miss it).
        await pilot.pause()
        await pilot.click(block.query_one(CollapsibleTitle))
        await fakes.wait_for(pilot, lambda: not block.collapsed)
        assert contents.styles.display == "block"


async def test_a_reply_without_thinking_has_no_fold(build_app, fakes):
    app, _ = build_app(fakes.Engine(replies=[fakes.Reply(["Just ", "this."])]))
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        await _send(pilot, "hi")
        await fakes.wait_for(pilot, lambda: _done(screen))
        (message,) = screen.query(AssistantMessage)
        assert message.thinking_block is None and not screen.query(ThinkingBlock)


async def test_thinking_goes_back_with_the_history_and_a_reopened_chat_shows_it_folded(build_app, fakes):
    engine = fakes.Engine(replies=[fakes.Reply(["Four."], thinking=["2+2."]), fakes.Reply(["Twelve."])])
    app, store = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        await _send(pilot, "2+2?")
        await fakes.wait_for(pilot, lambda: _done(screen))
        await _send(pilot, "times 3?")
        await fakes.wait_for(pilot, lambda: _done(screen) and len(screen.session.turns) == 4)
        assert engine.sends[1].history == [{"role": "user", "content": "2+2?"},
                                           {"role": "assistant", "content": "Four.", "thinking": "2+2."}]
        conversation = screen.session.conversation_id
        await pilot.press("ctrl+n")
        await pilot.pause()
        await screen.open_conversation(conversation)
        await pilot.pause()
        first, second = screen.query(AssistantMessage)
        assert first.thinking_block is not None and first.thinking_block.collapsed
        assert _markdown_text(first.thinking_block.markdown) == "2+2." and first.text == "Four."
        assert first.thinking_block.title == "Thinking · 1 word"
        assert second.thinking_block is None
        assert store.export_markdown(conversation).count("<details><summary>Thinking</summary>") == 1


async def test_stopped_while_thinking_keeps_the_thinking_open(build_app, fakes):
    engine = fakes.Engine(gated=True, replies=[fakes.Reply(["never"], thinking=["Hmm, ", "let me see", "..."])])
    app, store = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        await _send(pilot, "hard one")
        engine.release(2)
        await fakes.wait_for(pilot, lambda: screen.reply is not None and screen.reply.thinking == "Hmm, let me see")
        message = screen.reply
        await pilot.press("escape")
        assert message.status == "stopped" and not message.thinking_block.collapsed
        engine.release(2)
        saved = store.load(screen.session.conversation_id).messages[-1]
        assert (saved.content, saved.thinking, saved.status) == ("", "Hmm, let me see", "stopped")
        # A reply with no answer is not sent back as a turn.
        engine.replies.append(fakes.Reply(["ok"]))
        await _send(pilot, "try again")
        await fakes.wait_for(pilot, lambda: len(engine.sends) == 2 and _done(screen))
        assert engine.sends[1].history == [{"role": "user", "content": "hard one"}]


# (make_app keyword, its value, the template variable, the dialog's Select id, its shown value, the value picked there,
#  the variable's value so picked, the settings field)
CHOICES = {
    "effort": ("reasoning_effort", "high", "reasoning_effort", "#param-reasoning_effort", "high", "low", "low",
               "reasoning_effort"),
    "thinking": ("thinking", False, "enable_thinking", "#param-thinking", "off", "on", True, "thinking"),
}


@pytest.mark.parametrize("choice", sorted(CHOICES))
async def test_a_template_choice_from_the_command_line_then_the_dialog(build_app, fakes, app_env, choice):
    # --reasoning-effort (gpt-oss) and --thinking (the enable_thinking switch): this session only, then a pick in the
    # sampling dialog replaces it and is saved; "Model defaults" clears it, and nothing is passed any more
    arg, cli, variable, select_id, shown, picked, sent, field = CHOICES[choice]
    engine = fakes.Engine(template_variables=frozenset({variable}),
                          replies=[fakes.Reply(["a"]), fakes.Reply(["b"]), fakes.Reply(["c"])])
    app, _ = build_app(engine, **{arg: cli})
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        assert screen.info.reads_reasoning_effort == (choice == "effort")
        assert screen.info.thinking_switch == (choice == "thinking")
        await _send(pilot, "one")
        await fakes.wait_for(pilot, lambda: _done(screen))
        assert engine.sends[0].template_kwargs == {variable: cli}
        assert getattr(app.settings, field) is None  # the command line's is for this session only
        await pilot.press("f3")
        await pilot.pause()
        select = app.screen.query_one(select_id, Select)
        assert select.value == shown
        select.value = picked
        await pilot.click("#save")
        await pilot.pause()
        assert getattr(app.settings, field) == sent and getattr(app, arg) is None
        assert getattr(Settings.load(app_env / "settings.toml"), field) == sent
        await _send(pilot, "two")
        await fakes.wait_for(pilot, lambda: len(engine.sends) == 2 and _done(screen))
        assert engine.sends[1].template_kwargs == {variable: sent}
        await pilot.press("f3")
        await pilot.pause()
        await pilot.click("#reset")
        await pilot.click("#save")
        await pilot.pause()
        assert getattr(app.settings, field) is None
        await _send(pilot, "three")
        await fakes.wait_for(pilot, lambda: len(engine.sends) == 3 and _done(screen))
        assert engine.sends[2].template_kwargs == {}


@pytest.mark.parametrize("choice", sorted(CHOICES))
async def test_a_template_choice_is_not_offered_or_sent_to_a_template_without_it(build_app, fakes, app_env, choice):
    _, _, _, select_id, _, _, saved, field = CHOICES[choice]
    settings = Settings(path=app_env / "settings.toml", **{field: saved})
    engine = fakes.Engine(replies=[fakes.Reply(["a"])])
    app, _ = build_app(engine, settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        screen = await _ready(pilot)
        assert not screen.info.reads_reasoning_effort and not screen.info.thinking_switch
        await _send(pilot, "one")
        await fakes.wait_for(pilot, lambda: _done(screen))
        assert engine.sends[0].template_kwargs == {}
        await pilot.press("f3")
        await pilot.pause()
        assert not app.screen.query(select_id)
        await pilot.click("#save")
        await pilot.pause()
        assert getattr(app.settings, field) == saved  # kept for the models that read it
