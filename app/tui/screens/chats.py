"""The saved conversations: search them, reopen one, export, rename or delete it.

Typing goes to the search field (titles and message text, as you type); Up/Down move in the list
from there, Enter reopens the highlighted chat. Ctrl+E exports it, F2 renames it (Enter keeps the new
title, Escape leaves it), Ctrl+D deletes it after a second Ctrl+D (the chat on screen then starts anew).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.text import Text
from textual import on
from textual.binding import Binding
from textual.containers import Vertical
from textual.events import Key
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from ..store import ChatStore, ConversationSummary
from ..widgets.text import plural

KEYS = "Enter reopen · Ctrl+E export · F2 rename · Ctrl+D delete · Escape close"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def describe(c: ConversationSummary) -> Text:
    return Text.assemble(c.title, (f"  {c.model} · {plural(c.num_messages, 'message')} · {_when(c.updated)}", "dim"))


class ChatsScreen(ModalScreen[tuple[str, int] | None]):
    """Dismisses with ("open", id) or ("export", id), or None. `on_delete(id)` is told of each deleted chat."""

    # priority: before the search field's own Ctrl+E (end of line) and Ctrl+D (delete right)
    BINDINGS = [Binding("escape", "cancel", "Close"), Binding("ctrl+e", "export", "Export to Markdown", priority=True),
                Binding("f2", "rename", "Rename", priority=True), Binding("ctrl+d", "delete", "Delete", priority=True)]

    def __init__(self, store: ChatStore, on_delete: Callable[[int], None] | None = None):
        super().__init__(classes="dialog-screen")
        self.store = store
        self.on_delete = on_delete
        self.conversations = store.list_conversations()
        self._confirm: int | None = None  # the chat a first Ctrl+D asked about
        self._renaming: int | None = None

    def compose(self):
        with Vertical(classes="dialog wide") as box:
            box.border_title = "Saved chats"
            yield Input(placeholder="search titles and messages", id="chat-search")
            yield Input(id="chat-rename", placeholder="new title")
            yield Label(KEYS if self.conversations else "No saved chats yet: they are kept as you talk.",
                        classes="hint", id="chats-hint", markup=False)
            yield OptionList(*(Option(describe(c), id=str(c.id)) for c in self.conversations), id="chat-list")

    def on_mount(self) -> None:
        self.query_one("#chat-rename", Input).display = False
        self.query_one("#chat-search", Input).focus()
        self._highlight_first()

    # -- the list ---------------------------------------------------------------------------------------
    @property
    def options(self) -> OptionList:
        return self.query_one("#chat-list", OptionList)

    def _highlight_first(self) -> None:
        if self.options.option_count:
            self.options.highlighted = 0

    def _show(self, conversations: list[ConversationSummary], keep: int | None = None) -> None:
        self.conversations = conversations
        options = self.options
        options.clear_options()
        options.add_options([Option(describe(c), id=str(c.id)) for c in conversations])
        ids = [c.id for c in conversations]
        if keep in ids:
            options.highlighted = ids.index(keep)
        else:
            self._highlight_first()

    def _selected(self) -> int | None:
        options = self.options
        if options.highlighted is None or not options.option_count:
            return None
        return int(options.get_option_at_index(options.highlighted).id)

    def _say(self, text: str) -> None:
        self.query_one("#chats-hint", Label).update(text)

    @on(Input.Changed, "#chat-search")
    def _search(self, event: Input.Changed) -> None:
        self._confirm = None
        found = self.store.search_conversations(event.value)
        self._show(found)
        self._say(KEYS if found else f"No chat contains {event.value.strip()!r}.")

    def on_key(self, event: Key) -> None:
        """Up/Down in the search field move in the list; any key but Ctrl+D keeps a chat a first Ctrl+D asked about."""
        if event.key != "ctrl+d" and self._confirm is not None:
            self._confirm = None
            self._say(KEYS)
        if self.focused is self.query_one("#chat-search", Input) and event.key in ("up", "down"):
            event.stop()
            event.prevent_default()
            if event.key == "up":
                self.options.action_cursor_up()
            else:
                self.options.action_cursor_down()

    @on(Input.Submitted, "#chat-search")
    def _open_highlighted(self) -> None:
        selected = self._selected()
        if selected is not None:
            self.dismiss(("open", selected))

    @on(OptionList.OptionSelected, "#chat-list")
    def _open(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(("open", int(event.option.id)))

    # -- actions ----------------------------------------------------------------------------------------
    def action_export(self) -> None:
        selected = self._selected()
        if selected is not None:
            self.dismiss(("export", selected))

    def action_delete(self) -> None:
        selected = self._selected()
        if selected is None:
            return
        title = next((c.title for c in self.conversations if c.id == selected), "")
        if self._confirm != selected:
            self._confirm = selected
            self._say(f"Delete {title!r} and its messages? Ctrl+D again deletes it; any other key keeps it.")
            return
        self._confirm = None
        self.store.delete_conversation(selected)
        if self.on_delete is not None:
            self.on_delete(selected)
        self._show(self.store.search_conversations(self.query_one("#chat-search", Input).value))
        self._say(f"Deleted {title!r}. " + KEYS)

    def action_rename(self) -> None:
        selected = self._selected()
        if selected is None:
            return
        self._renaming = selected
        field = self.query_one("#chat-rename", Input)
        field.value = next((c.title for c in self.conversations if c.id == selected), "")
        field.display = True
        field.focus()
        self._say("Type the new title · Enter keeps it · Escape leaves it as it was")

    @on(Input.Submitted, "#chat-rename")
    def _renamed(self, event: Input.Submitted) -> None:
        event.stop()
        title = event.value.strip()
        if self._renaming is not None and title:
            self.store.rename_conversation(self._renaming, title)
        self._end_rename(keep=self._renaming)

    def _end_rename(self, keep: int | None = None) -> None:
        self._renaming = None
        field = self.query_one("#chat-rename", Input)
        field.display = False
        self._show(self.store.search_conversations(self.query_one("#chat-search", Input).value), keep=keep)
        self._say(KEYS)
        self.query_one("#chat-search", Input).focus()

    def action_cancel(self) -> None:
        if self._renaming is not None:
            self._end_rename(keep=self._renaming)
            return
        self.dismiss(None)
