"""The bounds of one render and the budget that enforces them.

Rendering is bounded, because a template is code from the Hub. Every size bound (the caps below) is checked
*before* the value is built (``measure.py``, ``checks.py``), since one C call, such as str() of a list or a sort,
cannot be interrupted. Work is bounded by template lines: a trace function on the template's frames only (~0.3 us a
line, ~3.6 us where the line calls a filter with the trace on, on a Zen 2 core; a 400-message chat through GLM-4.6's
template runs ~12k lines, the cap is 2M) counts them into the render's ``_Budget``, and one watchdog thread flags
the 10 s deadline, the memory cap and the caller's cancel event, checked at every template line and sandbox hook.
Three nested ``range(100000)`` loops that print fail in ~7 s on a Zen 2 core (the line cap), or at the deadline on a
busy one.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time

MAX_OUTPUT_CHARS = 32 * 2**20  # a rendered prompt (or any string a template builds) of at most this many characters
MAX_ITEMS = 200_000  # items in one list/dict a template builds, or walked to turn a value into text: a sort over it
#                      with Jinja's Python key function takes ~0.15 s; a 500-message chat holds ~3k
MAX_WORDY_CHARS = 1_000_000  # input of the filters that split text into words in Python (wordwrap, urlize,
#                              title, striptags, wordcount): 1 MB wraps in ~0.2 s
MAX_PPRINT_ITEMS = 20_000  # pprint is pure Python, ~10 us an item
MAX_LIPSUM_WORDS = 100_000
MAX_INT_BITS = 65_536  # an integer a product or a power may make
MAX_RENDER_STEPS = 2_000_000  # template lines executed per render
MAX_RENDER_SECONDS = 10.0
_WATCH_SECONDS = 0.02  # how often the watchdog looks at the clock, the cancel event and the memory


class _LimitExceeded(Exception):
    """A render went past one of its bounds; render() turns it into a ChatTemplateError."""


class _Cancelled(Exception):
    """The caller's cancel event was set while rendering."""


def _rss() -> int | None:
    """This process's resident memory in bytes (Linux), read in ~5 us; None elsewhere."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_CANCEL = "cancelled"  # Budget.stop's value when the caller's event was set


@dataclasses.dataclass(eq=False)
class _Budget:
    max_chars: int
    deadline: float
    cancel: threading.Event | None
    steps: int = 0
    rss_limit: float = math.inf  # bytes of resident memory past which the render stops (strings kept in a list...)
    stop: str | None = None  # set by the watchdog thread: why the render must stop, checked at every line and hook

    def size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise _LimitExceeded(f"{what} would be {n:,} characters, more than the {self.max_chars:,} a prompt may be")

    @staticmethod
    def items(n: int, what: str, cap: int = MAX_ITEMS) -> None:
        if n > cap:
            raise _LimitExceeded(f"{what} would hold {n:,} items, more than the {cap:,} a template may build")

    def poll(self) -> None:
        if self.stop is not None:
            raise _Cancelled() if self.stop is _CANCEL else _LimitExceeded(self.stop)

    def watch(self, now: float, rss: int | None) -> None:  # on the watchdog thread
        if self.cancel is not None and self.cancel.is_set():
            self.stop = _CANCEL
        elif now > self.deadline:
            self.stop = f"it ran for more than {MAX_RENDER_SECONDS:g} s"
        elif rss is not None and rss > self.rss_limit:
            self.stop = f"it grew this process's memory past {self.rss_limit / 2**30:.1f} GiB"

    def line(self, frame, event, arg):  # the local trace function of template frames
        if event == "line":
            self.steps += 1
            if self.stop is not None:
                self.poll()
            if self.steps > MAX_RENDER_STEPS:
                raise _LimitExceeded(f"it ran {MAX_RENDER_STEPS:,} template lines without finishing (a loop that "
                                     "does not end, or nested loops over huge ranges)")
        return self.line


class _Watchdog:
    """One daemon thread that flags renders past their deadline, memory or cancel event. It cannot interrupt a C
    call, so every filter and operator is bounded before it allocates (each runs well under a second); the flag
    then stops the render at its next template line or sandbox hook."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._budgets: set[_Budget] = set()
        self._thread: threading.Thread | None = None

    def add(self, budget: _Budget) -> None:
        with self._cond:
            self._budgets.add(budget)
            if self._thread is None or not self._thread.is_alive():  # first use, or after a fork
                self._thread = threading.Thread(target=self._loop, name="moechat-template-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()

    def remove(self, budget: _Budget) -> None:
        with self._cond:
            self._budgets.discard(budget)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._budgets:
                    self._cond.wait()
                budgets = list(self._budgets)
            rss = _rss() if any(b.rss_limit < math.inf for b in budgets) else None
            now = time.monotonic()
            for b in budgets:
                b.watch(now, rss)
            time.sleep(_WATCH_SECONDS)


_WATCHDOG = _Watchdog()
_RENDERING = threading.local()  # .budget: the bounds of the render running on this thread


_DEFAULT_BUDGET = _Budget(MAX_OUTPUT_CHARS, math.inf, None)  # sizes only: constants Jinja folds while compiling


def _budget() -> _Budget:
    return getattr(_RENDERING, "budget", None) or _DEFAULT_BUDGET


def _new_budget(max_chars: int, cancel: threading.Event | None) -> _Budget:
    """The bounds of one render starting now: MAX_RENDER_SECONDS from now, and a memory cap above today's RSS."""
    budget = _Budget(max_chars, time.monotonic() + MAX_RENDER_SECONDS, cancel)
    start_rss = _rss()
    if start_rss is not None:  # what a template may hold alive at once: many times its output, at least 1 GiB
        budget.rss_limit = start_rss + max(2**30, 16 * max_chars)
    return budget
