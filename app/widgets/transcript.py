"""The chat transcript: user turns as plain text, assistant turns as streaming Markdown.

An assistant reply streams through `Markdown.get_stream` and gets one full `update` at the end, so
the final document is parsed once as a whole. The chat screen hands it text in batches (see
ChatScreen.flush_reply), not per token. The scroll view is anchored: it follows new output while the user is at the
bottom and stays put when they scroll up to read.
"""

from __future__ import annotations

from textual.containers import Vertical, VerticalScroll
from textual.widgets import Label, Markdown, Static
from textual.widgets.markdown import MarkdownStream

STATUS_TEXT = {"stopped": "stopped", "error": "error", "interrupted": "interrupted (the app was closed)",
               "streaming": "generating…"}


class UserMessage(Static):
    def __init__(self, text: str, **kwargs):
        super().__init__(text, markup=False, classes="message user", **kwargs)
        self.border_title = "You"
        self.text = text


class AssistantMessage(Vertical):
    """One reply; `status` is "streaming" until `finish`."""

    def __init__(self, text: str = "", status: str = "streaming", footer: str = "", **kwargs):
        super().__init__(classes="message assistant", **kwargs)
        self.border_title = "Assistant"
        self.text = text
        self.status = status
        self._footer = footer
        self._stream: MarkdownStream | None = None

    def compose(self):
        yield Markdown(self.text, classes="reply")
        yield Label("", classes="reply-status")

    def on_mount(self) -> None:
        self._show_status(self.status, self._footer)

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    def _show_status(self, status: str, footer: str) -> None:
        for s in STATUS_TEXT:
            self.set_class(status == s, f"-{s}")
        parts = [STATUS_TEXT.get(status, "")] if status != "done" else []
        if footer:
            parts.append(footer)
        label = self.query_one(".reply-status", Label)
        label.update(" · ".join(p for p in parts if p))
        label.display = bool(parts)

    async def write(self, text: str) -> None:
        if not text:
            return
        self.text += text
        if self._stream is None:
            self._stream = Markdown.get_stream(self.markdown)
        await self._stream.write(text)

    async def finish(self, status: str, footer: str = "", error: str = "") -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
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

    async def add_assistant(self, text: str = "", status: str = "streaming", footer: str = "") -> AssistantMessage:
        widget = AssistantMessage(text, status, footer)
        await self.mount(widget)
        return widget

    async def clear_messages(self) -> None:
        await self.query(".message").remove()

    @property
    def assistant_messages(self) -> list[AssistantMessage]:
        return list(self.query(AssistantMessage))
