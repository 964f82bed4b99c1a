"""The screens' header: Textual's, with a title refresh that survives its screen being taken down."""

from __future__ import annotations

from textual.css.query import NoMatches
from textual.dom import NoScreen
from textual.events import Mount
from textual.widget import Widget
from textual.widgets import Header
from textual.widgets._header import HeaderTitle


class ScreenHeader(Header):
    """Textual's `Header`, except that a title change arriving while the screen is being removed is dropped.

    Textual's header refreshes its title from watchers on the app's and the screen's titles and looks its title
    widget up each time. When a screen is dismissed in the same moment its sub-title changes (Enter then `d` in the
    wizard, a catalog answer arriving as the chat opens), the title widget is already gone, the lookup raises
    `NoMatches` and the app exits with it. Here that case is a no-op: there is no title left to update.
    """

    def _on_mount(self, event: Mount) -> None:
        event.prevent_default()  # Header's own watchers are replaced by these
        Widget._on_mount(self, event)

        async def set_title() -> None:
            try:
                self.query_one(HeaderTitle).update(self.format_title())
            except (NoScreen, NoMatches):
                pass  # the header is being removed with its screen

        self.watch(self.app, "title", set_title)
        self.watch(self.app, "sub_title", set_title)
        self.watch(self.screen, "title", set_title)
        self.watch(self.screen, "sub_title", set_title)
