"""The multi-line prompt: Enter sends, Shift+Enter (or Ctrl+J) a newline, Up/Down walk the history.

Up recalls the previous prompt only when the cursor is on the first line (and Down the next only on
the last), so moving through a multi-line draft still works; the draft is kept and comes back after
the newest entry. Terminals that cannot tell Shift+Enter from Enter (no kitty keyboard protocol, e.g.
inside tmux) send Ctrl+J for it, hence both.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("shift+enter", "ctrl+j", "alt+enter")


class PromptInput(TextArea):
    @dataclass
    class Submitted(Message):
        prompt: PromptInput
        text: str

        @property
        def control(self) -> PromptInput:
            return self.prompt

    def __init__(self, history: list[str] | None = None, **kwargs):
        kwargs.setdefault("placeholder", "Message the model · Enter send · Shift+Enter newline · ↑ history")
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.prompt_history: list[str] = list(history or [])
        self._index: int | None = None  # position in history while browsing, None when editing a draft
        self._draft = ""

    def remember(self, text: str) -> None:
        if text and (not self.prompt_history or self.prompt_history[-1] != text):
            self.prompt_history.append(text)
        self._index = None

    def _show(self, text: str, at_end: bool) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end if at_end else (0, len(text.split("\n", 1)[0])))

    def history_previous(self) -> bool:
        if not self.prompt_history or self._index == 0:
            return False
        if self._index is None:
            self._draft = self.text
            self._index = len(self.prompt_history)
        self._index -= 1
        self._show(self.prompt_history[self._index], at_end=False)
        return True

    def history_next(self) -> bool:
        if self._index is None:
            return False
        self._index += 1
        if self._index >= len(self.prompt_history):
            self._index = None
            self._show(self._draft, at_end=True)
        else:
            self._show(self.prompt_history[self._index], at_end=True)
        return True

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text
            if text.strip():
                self.post_message(self.Submitted(self, text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self._replace_via_keyboard("\n", start, end)
            return
        if event.key == "up" and self.cursor_at_first_line and self.history_previous():
            event.stop()
            event.prevent_default()
            return
        if event.key == "down" and self.cursor_at_last_line and self.history_next():
            event.stop()
            event.prevent_default()
            return
        await super()._on_key(event)
