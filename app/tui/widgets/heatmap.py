"""The cache heatmap: one row per layer, one cell per expert (or per group of experts).

A cell's glyph says how much of it is in a slot (█ all; for a group of experts a bar ▁..▇ as high as
the fraction in slots; · none) and its brightness how much it was used over the last tokens (hot,
warm, idle). An expert used lately but not in a slot is a red dot when it was loaded and evicted
again, and a ring when the host computed it in place from the RAM tier (`--on-miss host|auto`,
`--host-layers`): the map shows where each expert ran. Each row ends with that layer's hit rate.

Readable from 32 experts x 24 layers to 256 x 60: experts are grouped by a power of two so the row
fits the panel's width (256 experts in a 40-column panel: 1 cell = 8 experts), layers scroll
vertically, and `z` zooms to one cell per expert with horizontal scrolling. Drawn with the line API:
only visible rows are rendered, the [L, E] aggregation is done once per snapshot, not per frame, and a
snapshot repaints only the rows whose cells or hit rate changed.

When the panel is shorter than the layers, the title says which rows are shown and that the rest scroll
("L0-L2 of 6 layers × 16 experts ↕ scroll"); a 80x24 terminal showed three rows of the demo's six and no sign
of the others. The title is the longest of its forms that fits the width, and the placeholder wraps at word
boundaries over the rows there are, never cut in a word.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where used: 0.1-0.15 s the first frame does not need
    import numpy as np
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.binding import Binding
from textual.geometry import Region, Size
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widget import Widget

from .text import first_that_fits, fit_words, plural

HOT, WARM = 0.5, 0.1  # recent use (0..1, relative to the busiest expert) that counts as hot / warm
RATE_WIDTH = 5  # " 100%"
PARTIAL = "▁▂▃▄▅▆▇"  # a group of experts with 1/8 .. 7/8 of them in slots


def group_size(num_experts: int, columns: int) -> int:
    """The smallest power of two g with ceil(E / g) <= columns."""
    g = 1
    while math.ceil(num_experts / g) > max(columns, 1) and g < num_experts:
        g *= 2
    return g


def aggregate(resident: np.ndarray, recent: np.ndarray, g: int,
              hosted: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per cell of g experts: fraction in a slot, the hottest recent use, and the hottest recent use of an
    expert the host computed (0 without `hosted`). [L, E] -> [L, ceil(E/g)] x 3."""
    import numpy as np
    E = resident.shape[1]
    starts = np.arange(0, E, g)  # [N]
    sizes = np.diff(np.append(starts, E))  # [N]
    frac = np.add.reduceat(resident.astype(np.float64), starts, axis=1) / sizes  # [L, N]
    heat = np.maximum.reduceat(recent.astype(np.float64), starts, axis=1)  # [L, N]
    if hosted is None:
        return frac, heat, np.zeros_like(heat)
    host_heat = np.maximum.reduceat(np.where(hosted, recent, 0.0).astype(np.float64), starts, axis=1)  # [L, N]
    return frac, heat, host_heat


CLASSES = ("heatmap--hot", "heatmap--warm", "heatmap--cold", "heatmap--miss", "heatmap--absent", "heatmap--host")
GLYPHS = "█" + PARTIAL + "•·○"


def classify(frac: np.ndarray, heat: np.ndarray, host_heat: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per cell: an index into GLYPHS and one into CLASSES (vectorised: 15k cells in microseconds)."""
    import numpy as np
    level = np.where(heat >= HOT, 0, np.where(heat >= WARM, 1, 2))  # hot, warm, cold
    bar = np.clip(np.ceil(frac * 8) - 1, 0, 6).astype(np.int64)  # PARTIAL index for a part-resident group
    glyph = np.where(frac >= 1, 0, 1 + bar)
    absent = frac <= 0
    missed = absent & (heat >= WARM)
    hosted = missed & (host_heat >= WARM) if host_heat is not None else np.zeros_like(missed)
    glyph = np.where(absent, np.where(hosted, 10, np.where(missed, 8, 9)), glyph)
    cls = np.where(absent, np.where(hosted, 5, np.where(missed, 3, 4)), level)
    return glyph, cls


def cell_kind(frac: float, heat: float, host_heat: float = 0.0) -> tuple[str, str]:
    """(glyph, component class) of one cell."""
    import numpy as np
    glyph, cls = classify(np.array([frac]), np.array([heat]), np.array([host_heat]))
    return GLYPHS[int(glyph[0])], CLASSES[int(cls[0])]


class CacheHeatmap(ScrollView, can_focus=True):
    COMPONENT_CLASSES = {"heatmap--label", "heatmap--rate", "heatmap--hot", "heatmap--warm", "heatmap--cold",
                         "heatmap--miss", "heatmap--absent", "heatmap--host", "heatmap--empty"}
    BINDINGS = [Binding("z", "toggle_zoom", "Zoom heatmap")]

    zoomed = reactive(False)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.resident: np.ndarray | None = None  # [L, E] bool
        self.recent: np.ndarray | None = None  # [L, E] in [0, 1]
        self.hosted: np.ndarray | None = None  # [L, E] bool: computed on the host this session
        self.rates: tuple[float, ...] = ()
        self.placeholder = "waiting for the model…"
        self.group = 1
        self._grouped_shown = False
        self._style_cache: dict[str, Style] = {}
        self._rows: list[tuple[str, list[int], str]] = []  # per layer: cells' glyphs, class per cell, rate

    # -- data -----------------------------------------------------------------------------------------
    def set_data(self, resident: np.ndarray | None, recent: np.ndarray | None, rates=(),
                 hosted: np.ndarray | None = None) -> None:
        import numpy as np
        self.resident = None if resident is None else np.asarray(resident, dtype=bool)
        if self.resident is not None and (recent is None or np.shape(recent) != self.resident.shape):
            recent = np.zeros(self.resident.shape)
        self.recent = recent
        self.hosted = None if hosted is None or self.resident is None or np.shape(hosted) != self.resident.shape \
            else np.asarray(hosted, dtype=bool)
        self.rates = tuple(rates)
        self._rebuild()

    def set_placeholder(self, text: str) -> None:
        self.placeholder = text
        self.refresh()

    def _placeholder_lines(self, width: int) -> list[str]:
        """The placeholder wrapped to `width`; its last visible line ends with '…' when it does not all fit."""
        lines = [line.plain.rstrip() for line in Text(self.placeholder).wrap(self.app.console, max(width, 1))]
        height = max(self.scrollable_content_region.height, 1)
        if len(lines) > height:
            lines = lines[:height - 1] + [fit_words(" ".join(lines[height - 1:]), width)]
        return lines

    @property
    def label_width(self) -> int:
        L = 0 if self.resident is None else self.resident.shape[0]
        return len(str(max(L - 1, 0))) + 2  # "L7 " / "L59 "

    def _cell_columns(self) -> int:
        return max(self.scrollable_content_region.width - self.label_width - RATE_WIDTH, 1)

    def _rebuild(self) -> None:
        if self.resident is None:
            self._rows = []
            self.virtual_size = Size(0, 1)
            self.border_title = None
            self.refresh()
            return
        L, E = self.resident.shape
        group = 1 if self.zoomed else group_size(E, self._cell_columns())
        frac, heat, host_heat = aggregate(self.resident, self.recent, group, self.hosted)
        glyph, cls = classify(frac, heat, host_heat)  # [L, N] x 2
        rates = [self.rates[i] if i < len(self.rates) else math.nan for i in range(L)]
        rows = [("".join(GLYPHS[g] for g in grow), crow, "   –" if math.isnan(rate) else f"{rate:4.0%}")
                for grow, crow, rate in zip(glyph.tolist(), cls.tolist(), rates, strict=True)]
        n = frac.shape[1]
        size = Size(self.label_width + n + RATE_WIDTH, L)
        old, self._rows = self._rows, rows
        if size != self.virtual_size or group != self.group:
            self.group = group
            self.virtual_size = size
            self.refresh()
        else:
            # Repaint only the rows whose cells or rate changed: between two snapshots of a decode most rows
            # of a big model are unchanged, and a row is one line of the widget.
            top, width = self.scroll_offset.y, self.scrollable_content_region.width
            height = self.scrollable_content_region.height
            changed = [y for y in range(L) if y >= len(old) or old[y] != rows[y]]
            regions = [Region(0, y - top, width, 1) for y in changed if 0 <= y - top < height]
            if regions:
                self.refresh(*regions)
        self._show_title()

    def title_text(self) -> str:
        """'6 layers × 16 experts', or with rows out of view 'L0-L2 of 6 layers × 16 experts ↕ scroll': the
        longest form that fits the width."""
        if self.resident is None:
            return ""
        L, E = self.resident.shape
        size = f"{plural(L, 'layer')} × {plural(E, 'expert')}"
        scale = "" if self.group == 1 else f", {self.group} per cell"
        height = self.scrollable_content_region.height
        width = max(self.size.width - 2, 1)  # the border's corner and one cell of the line before the title
        if not height or height >= L:
            return first_that_fits((size + scale, size), width)
        top = min(self.scroll_offset.y, max(L - height, 0))
        rows = f"L{top}-L{min(top + height, L) - 1} of {L}"
        experts = plural(E, "expert")  # L > height >= 1: "layers"
        return first_that_fits((f"{rows} layers × {experts}{scale} ↕ scroll", f"{rows} layers{scale} ↕ scroll",
                                f"{rows} layers ↕ scroll", f"{rows} ↕"), width)

    def _show_title(self) -> None:
        title = self.title_text() or None
        if self.border_title != title:
            self.border_title = title
        grouped = self.group > 1
        if grouped != self._grouped_shown:  # the legend's "part" glyph; a DOM query only when it changes
            self._grouped_shown = grouped
            for legend in self.screen.query(HeatmapLegend):
                legend.grouped = grouped

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if self.resident is not None and round(old_value) != round(new_value):
            self._show_title()

    def on_resize(self) -> None:
        if self.resident is not None and not self.zoomed:
            self._rebuild()
        elif self.resident is not None:
            self._show_title()
        else:
            self.refresh()  # the placeholder wraps to the new width

    def watch_zoomed(self) -> None:
        self.scroll_to(x=0, animate=False)
        self._rebuild()

    def action_toggle_zoom(self) -> None:
        self.zoomed = not self.zoomed

    # -- drawing --------------------------------------------------------------------------------------
    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._style_cache = {}

    def _style(self, name: str) -> Style:
        # Looked up once per theme, not ~7 times per drawn row (each lookup resolves CSS: ~20 us).
        style = self._style_cache.get(name)
        if style is None:
            style = self._style_cache[name] = self.get_component_rich_style(name)
        return style

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        style = self._style
        if not self._rows:  # the placeholder, wrapped at word boundaries (never cut in a word)
            lines = self._placeholder_lines(width)
            text = lines[y] if y < len(lines) else ""
            return Strip([Segment(text.ljust(width), style("heatmap--empty"))], width)
        row = self.scroll_offset.y + y
        if row >= len(self._rows):
            return Strip.blank(width, self.rich_style)
        lw = self.label_width
        label = Segment(f"L{row}".ljust(lw), style("heatmap--label"))
        cols = max(width - lw - RATE_WIDTH, 0)
        x0 = self.scroll_offset.x
        glyphs, classes, rate_text = self._rows[row]
        glyphs, classes = glyphs[x0 : x0 + cols], classes[x0 : x0 + cols]
        styles = [style(name) for name in CLASSES]
        segments = [label]
        start = 0
        for i in range(1, len(classes) + 1):  # one segment per run of equal class
            if i == len(classes) or classes[i] != classes[start]:
                segments.append(Segment(glyphs[start:i], styles[classes[start]]))
                start = i
        cells = glyphs
        segments.append(Segment(" " + rate_text.rjust(RATE_WIDTH - 1), style("heatmap--rate")))
        pad = cols - len(cells)  # the rate follows the cells; blank after it
        if pad > 0:
            segments.append(Segment(" " * pad, self.rich_style))
        return Strip(segments, width).crop(0, width)


class HeatmapLegend(Widget):
    """One line under the heatmap, drawn with the heatmap's own cell styles."""

    COMPONENT_CLASSES = {"heatmap--hot", "heatmap--warm", "heatmap--cold", "heatmap--miss", "heatmap--absent",
                         "heatmap--host", "heatmap--label"}
    grouped = reactive(False)
    hosting = reactive(False)  # misses may run on the host (--on-miss host|auto, --host-layers)

    def render(self) -> Text:
        style = self.get_component_rich_style
        parts = [("█", "heatmap--hot"), ("hot ", "heatmap--label"), ("█", "heatmap--warm"),
                 ("warm ", "heatmap--label"), ("█", "heatmap--cold"), ("idle ", "heatmap--label"),
                 ("•", "heatmap--miss"), ("evicted ", "heatmap--label")]
        if self.hosting:
            parts += [("○", "heatmap--host"), ("host ", "heatmap--label")]
        parts += [("·", "heatmap--absent"), ("out", "heatmap--label")]
        if self.grouped:
            parts += [(" ▄", "heatmap--warm"), ("part", "heatmap--label")]
        return Text.assemble(*((text, style(cls)) for text, cls in parts))
