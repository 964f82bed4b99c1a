"""The saved conversations: pick one to reopen, or export it to Markdown."""

from __future__ import annotations

import time

from rich.text import Text
from textual import on
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from ..store import ChatStore, ConversationSummary


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def describe(c: ConversationSummary) -> Text:
    return Text.assemble(c.title, (f"  {c.model} · {c.num_messages} messages · {_when(c.updated)}", "dim"))


class ChatsScreen(ModalScreen[tuple[str, int] | None]):
    """Dismisses with ("open", id) or ("export", id), or None."""

    BINDINGS = [Binding("escape", "cancel", "Close"), Binding("e", "export", "Export to Markdown")]

    def __init__(self, store: ChatStore):
        super().__init__(classes="dialog-screen")
        self.store = store
        self.conversations = store.list_conversations()

    def compose(self):
        with Vertical(classes="dialog wide") as box:
            box.border_title = "Saved chats"
            if not self.conversations:
                yield Label("No saved chats yet: they are kept as you talk.", classes="hint")
            else:
                yield Label("Enter: reopen · e: export to Markdown · Escape: close", classes="hint")
            yield OptionList(*(Option(describe(c), id=str(c.id)) for c in self.conversations), id="chat-list")

    @on(OptionList.OptionSelected, "#chat-list")
    def _open(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(("open", int(event.option.id)))

    def action_export(self) -> None:
        options = self.query_one("#chat-list", OptionList)
        if options.highlighted is not None:
            self.dismiss(("export", int(options.get_option_at_index(options.highlighted).id)))

    def action_cancel(self) -> None:
        self.dismiss(None)
