"""The chat transcript: user turns as plain text, assistant turns as streaming Markdown.

An assistant reply streams through `Markdown.get_stream` and gets one full `update` at the end, so
the final document is parsed once as a whole. The chat screen hands it text in batches (see
ChatScreen.flush_reply), not per token. A reasoning model's thinking streams the same way into a
`ThinkingBlock` (a Collapsible) above the answer: mounted with the first thinking text, open while the
model thinks, folded when the answer starts, reopened with a click. The scroll view is anchored: it
follows new output while the user is at the bottom and stays put when they scroll up to read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.containers import Vertical, VerticalScroll
from textual.widgets import Collapsible, Label, Static

if TYPE_CHECKING:
    from textual.widgets import Markdown
    from textual.widgets.markdown import MarkdownStream


def _markdown():
    """Textual's Markdown widget, imported on the first reply shown: it brings markdown-it (~0.1 s), which the
    first frame of an empty chat does not need."""
    from textual.widgets import Markdown

    return Markdown

STATUS_TEXT = {"stopped": "stopped", "error": "error", "interrupted": "interrupted (the app was closed)",
               "streaming": "generating…"}


class UserMessage(Static):
    def __init__(self, text: str, **kwargs):
        super().__init__(text, markup=False, classes="message user", **kwargs)
        self.border_title = "You"
        self.text = text


class ThinkingBlock(Collapsible):
    """A reply's thinking, above its answer; the title says how long it is once the model stops thinking."""

    def __init__(self, text: str = "", collapsed: bool = True):
        super().__init__(_markdown()(text, classes="thinking-text"), title="Thinking…", collapsed=collapsed,
                         classes="thinking")

    @property
    def markdown(self) -> Markdown:
        return self.query_one(".thinking-text", _markdown())

    def done(self, text: str) -> None:
        words = len(text.split())
        self.title = f"Thinking · {words} word{'s' if words != 1 else ''}"


class AssistantMessage(Vertical):
    """One reply; `status` is "streaming" until `finish`. `thinking`: a reasoning model's, shown above."""

    def __init__(self, text: str = "", status: str = "streaming", footer: str = "", thinking: str = "",
                 **kwargs):
        super().__init__(classes="message assistant", **kwargs)
        self.border_title = "Assistant"
        self.text = text
        self.thinking = thinking
        self.status = status
        self._footer = footer
        self._stream: MarkdownStream | None = None
        self._thinking_stream: MarkdownStream | None = None

    def compose(self):
        if self.thinking:  # a saved reply: folded
            block = ThinkingBlock(self.thinking, collapsed=True)
            block.done(self.thinking)
            yield block
        yield _markdown()(self.text, classes="reply")
        yield Label("", classes="reply-status")

    def on_mount(self) -> None:
        self._show_status(self.status, self._footer)

    @property
    def markdown(self) -> Markdown:
        return self.query_one(".reply", _markdown())

    @property
    def thinking_block(self) -> ThinkingBlock | None:
        blocks = self.query_children(ThinkingBlock)
        return blocks.first() if blocks else None

    def _show_status(self, status: str, footer: str) -> None:
        for s in STATUS_TEXT:
            self.set_class(status == s, f"-{s}")
        parts = [STATUS_TEXT.get(status, "")] if status != "done" else []
        if footer:
            parts.append(footer)
        label = self.query_one(".reply-status", Label)
        label.update(" · ".join(p for p in parts if p))
        label.display = bool(parts)

    async def write(self, text: str, thinking: str = "") -> None:
        if thinking:
            await self._write_thinking(thinking)
        if not text:
            return
        if not self.text:
            await self._end_thinking()  # the answer starts: fold the thinking away
        self.text += text
        if self._stream is None:
            self._stream = _markdown().get_stream(self.markdown)
        await self._stream.write(text)

    async def _write_thinking(self, thinking: str) -> None:
        self.thinking += thinking
        block = self.thinking_block
        if block is None:
            block = ThinkingBlock(collapsed=bool(self.text))
            await self.mount(block, before=self.markdown)
        if self._thinking_stream is None:
            self._thinking_stream = _markdown().get_stream(block.markdown)
        await self._thinking_stream.write(thinking)

    async def _end_thinking(self, fold: bool = True) -> None:
        block = self.thinking_block
        if block is None:
            return
        if self._thinking_stream is not None:
            await self._thinking_stream.stop()
            self._thinking_stream = None
            await block.markdown.update(self.thinking)
        if fold:
            block.collapsed = True
        block.done(self.thinking)

    async def finish(self, status: str, footer: str = "", error: str = "") -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        # A reply that ends while thinking (stopped, or out of tokens) keeps what it thought on show.
        await self._end_thinking(fold=bool(self.text))
        self.status = status
        if error and not self.text:
            self.text = f"*{error}*"
        await self.markdown.update(self.text)
        self._show_status(status, footer)


class Transcript(VerticalScroll):
    """Holds the messages; `clear_messages` for a new chat."""

    def on_mount(self) -> None:
        self.anchor()

    async def add_user(self, text: str) -> UserMessage:
        widget = UserMessage(text)
        await self.mount(widget)
        return widget

    async def add_assistant(self, text: str = "", status: str = "streaming", footer: str = "",
                            thinking: str = "") -> AssistantMessage:
        widget = AssistantMessage(text, status, footer, thinking)
        await self.mount(widget)
        return widget

    async def clear_messages(self) -> None:
        await self.query(".message").remove()

    @property
    def assistant_messages(self) -> list[AssistantMessage]:
        return list(self.query(AssistantMessage))
