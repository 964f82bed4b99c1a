"""Words for the UI: a count with its noun in the right number, and text fitted to a width at a word boundary.

A label too narrow for its text used to lose the end wherever the width fell ("app 306" without its unit, a
notice ending at "set"); `fit_words` cuts at the last whole word that fits and says so with an ellipsis, and
`FitLabel` shows the first of its alternatives (longest first) that fits the width it has, at every repaint:
a few string lengths, no layout pass.
"""

from __future__ import annotations

from rich.cells import cell_len
from textual.widgets import Label

ELLIPSIS = "…"
SEPARATORS = {"·", "-", "—", "|", "/", ""}  # words that only join others: not left before the ellipsis


def plural(n: int, word: str, words: str | None = None) -> str:
    """'1 token', '2 tokens', '1,204 hits' (`words`: an irregular plural, e.g. 'misses')."""
    return f"{n:,} {word if n == 1 else (words or word + 's')}"


def fit_words(text: str, width: int) -> str:
    """`text` if it fits `width` cells, else its longest prefix of whole words that fits, with an ellipsis after
    it; a first word wider than `width` alone is cut with the ellipsis (nothing else fits)."""
    if cell_len(text) <= width:
        return text
    if width <= 1:
        return ELLIPSIS[:width]
    words = text.split(" ")
    out = ""
    for word in words:
        candidate = f"{out} {word}" if out else word
        if cell_len(candidate) + 1 > width:
            break
        out = candidate
    kept = out.split(" ")
    while kept and kept[-1] in SEPARATORS:  # "12.0 GiB used ·" -> "12.0 GiB used…"
        kept.pop()
    out = " ".join(kept)
    out = out.rstrip(",;:") or out  # punctuation after a whole word, not a part of it
    if not out:  # one word longer than the width: the only cut left
        out = text[: width - 1]
    return out + ELLIPSIS


def first_that_fits(alternatives: tuple[str, ...], width: int) -> str:
    """The first of `alternatives` (longest, most informative first) that fits `width`; else the last one fitted
    with `fit_words`. An empty last alternative means: show nothing rather than a part."""
    for text in alternatives:
        if cell_len(text) <= width:
            return text
    return fit_words(alternatives[-1], width) if alternatives and alternatives[-1] else ""


class FitLabel(Label):
    """A one-line label that never shows a part of a word: `alternatives` from the longest to the shortest; it
    shows the first that fits its width at each repaint (the last one cut at a word boundary with '…')."""

    DEFAULT_CSS = "FitLabel { width: 1fr; text-wrap: nowrap; }"

    def __init__(self, *alternatives: str, **kwargs):
        super().__init__(alternatives[0] if alternatives else "", markup=False, **kwargs)
        self.alternatives: tuple[str, ...] = tuple(alternatives) or ("",)

    def set_texts(self, *alternatives: str) -> None:
        """The full text first, then shorter forms; `content` keeps the full one."""
        alternatives = tuple(alternatives) or ("",)
        if alternatives != self.alternatives:
            self.alternatives = alternatives
            super().update(alternatives[0], layout=False)

    def update(self, content="", *, layout: bool = True) -> None:
        self.set_texts(str(content))

    @property
    def shown(self) -> str:
        """What the label shows at its width now (tests read it); before its first layout, the full text."""
        width = self.content_region.width
        return first_that_fits(self.alternatives, width) if width else self.alternatives[0]

    def render(self):
        return self.shown
