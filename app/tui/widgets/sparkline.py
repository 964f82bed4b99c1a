"""A sparkline that costs almost nothing to redraw.

Textual's `Sparkline` blends a colour and builds a style for every bar on every render: ~1.2 ms of the
UI thread per redraw of a 48-column line, a fifth of a whole panel redraw, every 0.25 s while the
engine decodes (and the UI thread's time is GIL the generating thread waits for). This one draws the
same bars (the same bucketing, `max` per bucket, 8 steps a line) with one style per bar height (blended
from the widget's min and max colours once per theme) and keeps the finished `Strip` until the data or the
size change.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget

BARS = "▁▂▃▄▅▆▇█"


def bar_levels(data: Sequence[float], width: int, height: int = 1) -> list[int]:
    """Per column, the bar height 0..8*height-1 of the max of its bucket of `data` (Textual's buckets)."""
    top = len(BARS) * height - 1
    if width <= 0 or not data:
        return []
    if len(data) == 1:
        return [top] * width
    n = len(data)
    buckets = [data[n * i // width : n * (i + 1) // width] for i in range(width)]
    buckets = [b for b in buckets if b]
    lo, hi = min(data), max(data)
    extent = hi - lo or 1
    per_column = len(buckets) / width
    return [min(int((max(buckets[int(i * per_column)]) - lo) / extent * top), top) for i in range(width)]


class FastSparkline(Widget):
    COMPONENT_CLASSES = {"sparkline--max-color", "sparkline--min-color"}
    DEFAULT_CSS = """
    FastSparkline { height: 1; }
    FastSparkline > .sparkline--max-color { color: $primary; }
    FastSparkline > .sparkline--min-color { color: $primary 30%; }
    """

    def __init__(self, data: Sequence[float] = (), **kwargs):
        super().__init__(**kwargs)
        self.data: tuple[float, ...] = tuple(data)
        self._strip: tuple[tuple[int, int], list[Strip]] | None = None  # ((width, height), the drawn lines)
        self._style_list: list[Style] | None = None

    def set_data(self, data: Sequence[float]) -> None:
        data = tuple(data)
        if data != self.data:
            self.data = data
            self._strip = None
            self.refresh()

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._strip = self._style_list = None  # a theme change: new colours

    def _styles(self) -> list[Style]:
        if self._style_list is None:
            self._style_list = self._blend_styles()
        return self._style_list

    def _blend_styles(self) -> list[Style]:
        """One style per bar height 0..8*height-1, blended from the min to the max colour."""
        _, base = self.background_colors
        low = base + self.get_component_styles("sparkline--min-color").color
        high = base + self.get_component_styles("sparkline--max-color").color
        top = len(BARS) * max(self.size.height, 1) - 1
        return [Style.from_color(low.blend(high, level / max(top, 1)).rich_color, bgcolor=base.rich_color)
                for level in range(top + 1)]

    def render_line(self, y: int) -> Strip:
        width, height = self.size
        if self._strip is None or self._strip[0] != (width, height):
            if self._style_list is not None and len(self._style_list) != len(BARS) * max(height, 1):
                self._style_list = None  # the height changed
            self._strip = ((width, height), self._draw(width, height))
        lines = self._strip[1]
        return lines[y] if 0 <= y < len(lines) else Strip.blank(width, self.rich_style)

    def _draw(self, width: int, height: int) -> list[Strip]:
        levels = bar_levels(self.data, width, height)
        styles = self._styles()
        if not levels:
            blank = [Strip.blank(width, self.rich_style) for _ in range(height - 1)]
            return [*blank, Strip([Segment(BARS[0] * width, styles[0])], width)]
        n = len(BARS)
        out = []
        for line in reversed(range(height)):  # top line first
            low, high = line * n, (line + 1) * n
            cells = [" " if lv < low else "█" if lv >= high else BARS[lv % n] for lv in levels]
            segments, start = [], 0
            for i in range(1, width + 1):  # one segment per run of equal bars
                if i == width or levels[i] != levels[start]:
                    lv = levels[start]
                    style = self.rich_style if lv < low else styles[lv]
                    segments.append(Segment("".join(cells[start:i]), style))
                    start = i
            out.append(Strip(segments, width))
        return out
