"""Textual's Footer, on two rows when its keys do not fit on one: no key is cut off at 80 columns.

Footer lays its keys out in one row (a grid of one column per key when the CSS asks for a grid); this
one counts the width its keys need and, when the terminal is narrower, gives the grid half as many
columns and two rows (moechat.tcss: `KeyFooter.-two-rows`). It recomposes when the terminal is resized
across that width.
"""

from __future__ import annotations

from textual.widgets import Footer


class KeyFooter(Footer):
    def compose(self):
        keys = list(super().compose())
        # compact: "key description" and one cell between keys
        need = sum(len(k.key_display) + 1 + len(k.description) + 1 for k in keys if hasattr(k, "key_display"))
        two_rows = need > self.app.size.width
        self.set_class(two_rows, "-two-rows")
        if two_rows:
            self.styles.grid_size_columns = -(-len(keys) // 2)
        self._need = need
        yield from keys

    def on_resize(self) -> None:
        need = getattr(self, "_need", 0)
        if (need > self.app.size.width) != self.has_class("-two-rows"):
            self.refresh(recompose=True)
