"""Render a model's Hugging Face chat template exactly as transformers does, without importing transformers.

Design:

* One Jinja environment configured like transformers' (``utils/chat_template_utils.py``): an
  ``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a
  ``{% generation %}`` tag that just renders its body, a ``json.dumps`` based ``tojson``, and the globals
  ``raise_exception``, ``strftime_now``, a dunder-proof ``namespace`` and a callable-only ``dict``.
* A ``ChatTemplate`` compiles its source once, when it is built, so a syntax error shows at load time.
* ``render`` rebuilds every input from plain JSON types and fills the reasoning aliases the way
  ``apply_chat_template`` does, then passes the same variables: ``messages``, ``tools``, ``documents``,
  ``add_generation_prompt``, the special tokens as strings, and any extra keyword (``enable_thinking``...).
* Every failure becomes a one-line ``ChatTemplateError`` (template) or ``ConfigError`` (files). One deliberate
  difference: reading an unsafe attribute (``x.__class__``, ``list.append``) fails at once, where Jinja would
  hand back an Undefined that renders as ''. Real templates never do this; an escape attempt should be loud.
* Rendering is bounded, because a template is code from the Hub, and every bound is checked *before* the value
  is built (one C call, such as str() of a list or a sort, cannot be interrupted): strings at ``max_chars``
  (``*``, ``+``, ``~``, ``%``/format fields and widths, each str method and filter by what it adds to its input),
  lists and dicts at 200,000 items (``*``, ``+``, every filter that consumes or builds a sequence; a generator is
  read into a capped list), the text of a list or dict (output, ``string``, ``tojson``, ``join``, ``~``) by a walk
  capped at 200,000 items (shared sub-lists count each time), integers at 65,536 bits, the filters that split text
  into words in Python (wordwrap, urlize, title, striptags, wordcount) at 1M characters, lipsum at 100k words,
  pprint at 20k items. So each call ends well under a second; work is bounded by template lines (a trace function
  on the template's frames only: ~0.3 us a line; a 400-message chat through GLM-4.6's template runs ~12k lines,
  the cap is 2M), and a watchdog thread flags the 10 s deadline, the memory cap and the caller's cancel event,
  checked at every template line and sandbox hook. Three nested ``range(100000)`` loops fail in about a second.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import json
import math
import os
import re
import sys
import threading
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.runtime
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError, UndefinedError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from markupsafe import Markup

from moechat.engine.errors import ChatTemplateError, ConfigError, GenerationCancelled
from moechat.engine.io.files import MAX_JSON_BYTES, read_json_file, read_regular
from moechat.engine.io.validate import check_tokenizer_config

__all__ = ["ChatTemplate"]

# Names a message's reasoning arrives under; transformers copies the first one set into all of the first two.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# transformers' marker for continue_final_message: appended to the last message, then cut off the rendered text.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_JINJA_FILE = "chat_template.jinja"
_EXTRA_TEMPLATES_DIR = "additional_chat_templates"
_LEGACY_JSON_FILE = "chat_template.json"
_TOKENIZER_CONFIG = "tokenizer_config.json"


# --------------------------------------------------------------------------------------------------------------
# The Jinja environment


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


# -- sizes of values, known before they are built ----------------------------------------------------------------


def _length(x: Any) -> int | None:
    return len(x) if isinstance(x, (str, list, tuple, dict, bytes)) else None


_CHUNK = 4096


def _chunked(s: str, measure) -> int:
    # The escaped length of a long string, a piece at a time, so measuring never builds the whole escaped copy.
    if len(s) <= _CHUNK:
        return measure(s)
    return sum(measure(s[i : i + _CHUNK]) for i in range(0, len(s), _CHUNK))


def _repr_len(s: str) -> int:
    """At least len(repr(s)): exact quickly for printable ASCII, else by pieces (plus one per quote, since the
    whole string may pick the other quote character and escape it)."""
    if s.isascii() and s.isprintable():
        return len(s) + 2 + s.count("\\") + s.count("'")
    return _chunked(s, lambda piece: len(repr(piece))) + s.count("'")


def _json_len(s: str, ensure_ascii: bool) -> int:
    if s.isascii() and s.isprintable():
        return len(s) + 2 + s.count("\\") + s.count('"')
    encode = json.encoder.encode_basestring_ascii if ensure_ascii else json.encoder.encode_basestring
    return _chunked(s, lambda piece: len(encode(piece)))


def _int_len(n: int) -> int:
    return n.bit_length() + 3  # covers decimal, hex and binary ('-0b...') forms


_Namespace_attrs = "_Namespace__attrs"


class _Shape:
    """An upper bound on the text a value turns into, found by walking it (iteratively, at most ``cap`` items,
    shared sub-lists counted each time they repeat): ``str(value)`` (mode "str"), ``json.dumps`` ("json"), or
    ``pprint.pformat`` ("pprint"). Without it ``[[x] * 1000] * 1000 | string`` builds 1M items inside one C call."""

    def __init__(self, b: _Budget, what: str, mode: str = "str", *, ensure_ascii: bool = False, indent: Any = None,
                 separators: Any = None, cap: int = MAX_ITEMS) -> None:
        self.b, self.what, self.mode, self.ensure_ascii, self.cap = b, what, mode, ensure_ascii, cap
        self.indent = 0 if indent is None else (len(indent) if isinstance(indent, str) else max(int(indent), 0))
        self.newlines = indent is not None
        if isinstance(separators, (list, tuple)) and len(separators) == 2 and all(isinstance(s, str) for s in
                                                                                   separators):
            self.item_sep, self.key_sep = len(separators[0]), len(separators[1])
        else:
            self.item_sep, self.key_sep = (1 if indent is not None else 2), 2
        self.depth = 0  # deepest nesting seen
        self.key = 0  # longest dict key seen, in repr (pprint indents a value by its key)

    def measure(self, value: Any) -> int:
        total, self.nodes = 0, 1
        stack = [(value, 0, True)]
        while stack:
            obj, depth, top = stack.pop()
            total += self._node(obj, depth, top, stack)
            if total > self.b.max_chars:
                self.b.size(total, self.what)
        if self.mode == "pprint":  # each character may start a line indented to its depth (plus key widths)
            total *= self.depth * (self.key + 3) + 6
        return total

    def _scalar(self, obj: Any, top: bool = False) -> int:
        if isinstance(obj, str):
            if self.mode == "json":
                return _json_len(obj, self.ensure_ascii)
            return len(obj) if top else _repr_len(obj) + (8 if isinstance(obj, Markup) else 0)  # Markup('...')
        if obj is None or isinstance(obj, bool):
            return 5
        if isinstance(obj, int):
            return _int_len(obj)
        return 24  # a float

    def _node(self, obj: Any, depth: int, top: bool, stack: list) -> int:
        if obj is None or isinstance(obj, (str, int, float)):
            return self._scalar(obj, top)
        children: Any
        overhead = 2
        if isinstance(obj, (list, tuple)):
            children = obj
            overhead += 1 + (type(obj) not in (list, tuple)) * 64  # a tuple's trailing comma; namedtuple names
        elif isinstance(obj, (set, frozenset)):
            children, overhead = list(obj), 13
        elif isinstance(obj, Mapping):
            children = [x for kv in obj.items() for x in kv]
        elif isinstance(obj, (type({}.items()), type({}.keys()), type({}.values()))):
            children, overhead = list(obj), 14
        elif isinstance(obj, Namespace):
            children, overhead = [x for kv in object.__getattribute__(obj, _Namespace_attrs).items() for x in kv], 14
        else:
            return 1000  # an object's default repr (a macro, a cycler, a generator, Undefined)
        n = len(children)
        self.nodes += n
        if self.nodes > self.cap:
            self.b.items(self.nodes, self.what, self.cap)
        self.depth = max(self.depth, depth + 1)
        mapping = isinstance(obj, (Mapping, Namespace))
        per_item = self.item_sep + self.key_sep if mapping else self.item_sep
        if self.newlines:
            per_item += 1 + self.indent * (depth + 1)
        if mapping and self.mode == "pprint":
            for k in children[::2]:
                self.key = max(self.key, _repr_len(k) if isinstance(k, str) else 24)
        size = overhead + per_item * n
        kinds = set(map(type, children))  # a list of one scalar type is measured at C speed, not item by item
        if kinds <= {int, bool}:
            return size + sum(map(int.bit_length, children)) + 3 * n
        if kinds <= {float}:
            return size + 24 * n
        if kinds <= {str}:
            return size + sum(map(self._scalar, children))
        stack.extend((child, depth + 1, False) for child in children)
        return size


def _text(b: _Budget, value: Any, what: str) -> int:
    """The length str(value) will have, checked against the bound before it is built."""
    if isinstance(value, str):
        return len(value)
    n = _Shape(b, what).measure(value)
    b.size(n, what)
    return n


def _take(value: Any, what: str) -> Any:
    """`value` with a known length of at most MAX_ITEMS: a generator (map, batch, select...) is read into a list, at
    C speed, one item past the cap at most."""
    if isinstance(value, (str, list, tuple, dict, set, frozenset, range)) or hasattr(value, "__len__"):
        _Budget.items(len(value), what)
        return value
    if not hasattr(value, "__iter__"):
        return value  # the filter raises its own TypeError
    items = list(itertools.islice(value, MAX_ITEMS + 1))
    _Budget.items(len(items), what)
    return items


def _ascii_or(s: Any, factor: int) -> int:
    # upper/lower/title/capitalize of non-ASCII text may grow: 'ß'.upper() == 'SS', up to 3 characters from 1
    return 1 if isinstance(s, str) and s.isascii() else factor


def _widths(b: _Budget, fmt: str) -> int:
    """Widths and precisions in a %- or {}-format string ("%1000000000d") would build huge strings; the sum of
    every number written in it bounds what they add."""
    total, digits = 0, 0
    for ch in fmt:
        if ch.isdigit():
            digits += 1
            if digits > 7:
                raise _LimitExceeded("a format string asks for a width of more than 9,999,999 characters")
        else:
            digits = 0
    if any(ch.isdigit() for ch in fmt):
        total = sum(int(run) for run in _DIGIT_RUNS.findall(fmt))
    return total


_DIGIT_RUNS = re.compile(r"\d+")
_NESTED_FIELD = re.compile(r"\{[^{}]+\{")


def _check_format(b: _Budget, fmt: str, values: list, style: str) -> None:
    """`fmt % values` or `fmt.format(*values)`: each field is at most the longest value's text (repr, for !r) plus
    the widths written in fmt; a width taken from the arguments (`%*d`, `{:{}}`) at most the largest integer."""
    fields = fmt.count("%") if style == "%" else fmt.count("{")
    if not fields:
        return
    widths = _widths(b, fmt)
    shape = _Shape(b, "a formatted string")
    longest = 0
    for v in values:
        longest = max(longest, 330 if isinstance(v, float) else shape.measure([v]) - 3)  # '%f' % 1e300: 309 digits
    star = ("*" in fmt) if style == "%" else bool(_NESTED_FIELD.search(fmt))
    if star:
        longest += max((abs(v) for v in values if isinstance(v, int) and not isinstance(v, bool)), default=0)
    b.size(len(fmt) + widths + fields * longest, "a formatted string")


def _percent_values(right: Any) -> list:
    if isinstance(right, tuple):
        return list(right)
    if isinstance(right, Mapping):
        return list(right.values())
    return [right]


def _check_binop(b: _Budget, operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(n, int) and not isinstance(n, bool):
                if isinstance(seq, (str, bytes)):
                    b.size(len(seq) * max(n, 0), "a repeated string")
                elif isinstance(seq, (list, tuple)):
                    b.items(len(seq) * max(n, 0), "a repeated list")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise _LimitExceeded(f"a product would be a number of more than {MAX_INT_BITS:,} bits")
    elif operator == "+":
        if isinstance(left, str) and isinstance(right, str):
            b.size(len(left) + len(right), "a concatenation")
        elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
            b.items(len(left) + len(right), "a concatenation")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * math.log2(abs(left)) > MAX_INT_BITS:
                raise _LimitExceeded(f"{left} ** {right} is a number of more than {MAX_INT_BITS:,} bits")
    elif operator == "%" and isinstance(left, str):
        _check_format(b, left, _percent_values(right), "%")


_JINJA_STATE = (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment)


def _check_str_method(b: _Budget, s: str, name: str, args: tuple, kwargs: dict) -> tuple | None:
    """A str method called from a template, before it runs; returns replacement arguments where a generator had
    to be read into a list first (join)."""
    a = list(args)
    if name == "join" and a:
        a[0] = items = _take(a[0], "a join")
        b.size(sum(len(x) for x in items if isinstance(x, str)) + len(s) * max(len(items) - 1, 0), "a join")
        return tuple(a)
    if name == "replace" and len(a) >= 2 and isinstance(a[0], str) and isinstance(a[1], str):
        old, new = a[0], a[1]
        count = s.count(old) if old else len(s) + 1
        if len(a) > 2 and isinstance(a[2], int) and a[2] >= 0:
            count = min(count, a[2])
        b.size(len(s) + count * max(len(new) - len(old), 0), "a replace()")
    elif name in ("format", "format_map"):
        values = [*a, *kwargs.values()]
        if name == "format_map" and a and isinstance(a[0], Mapping):
            values = list(a[0].values())
        _check_format(b, s, values, "{")
    elif name in ("split", "rsplit", "splitlines"):
        sep = a[0] if a and name != "splitlines" else kwargs.get("sep")
        maxsplit = a[1] if len(a) > 1 else kwargs.get("maxsplit", -1)
        if isinstance(maxsplit, int) and maxsplit >= 0:
            pieces = maxsplit + 1
        elif isinstance(sep, str) and sep:
            pieces = s.count(sep) + 1
        elif len(s) // 2 + 1 <= MAX_ITEMS and name != "splitlines":
            pieces = len(s) // 2 + 1
        elif len(s) + 1 <= MAX_ITEMS:
            pieces = len(s) + 1
        else:  # a long text: count its pieces a bit at a time (one too many at most where a piece is cut)
            pieces = _chunked(s, lambda piece: len(getattr(piece, name)()) + 1)
        b.items(pieces, f"a {name}()")
    elif name in ("upper", "lower", "title", "capitalize", "swapcase", "casefold"):
        b.size(len(s) * _ascii_or(s, 3), f"a {name}()")
    elif name == "expandtabs":
        size = a[0] if a else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            b.size(len(s) + s.count("\t") * max(size, 0), "an expandtabs()")
    elif name == "encode":
        b.size(len(s) * _ascii_or(s, 4), "an encode()")
    return None


def _too_big_argument(b: _Budget, name: str, value: int) -> None:
    # a width, a count or a length: past the output cap it can only build something too big
    raise _LimitExceeded(f"a call to {name} with {value:,} asks for more than the {b.max_chars:,} characters a "
                         "prompt may be")


def _check_call(b: _Budget, fn: Any, args: tuple, kwargs: dict) -> tuple | None:
    """Before a method or global runs: a width-like integer past the cap is refused, and a str method that would
    grow past the caps (replace, join, format, split...) is sized first. Returns replacement arguments or None."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and value > b.max_chars:
            _too_big_argument(b, getattr(fn, "__name__", "a function"), value)
    name = getattr(fn, "__name__", "")
    # a str method (the sandbox wraps str.format) is checked with the string it belongs to
    target = getattr(fn, "__self__", None)
    if target is None:
        target = getattr(getattr(fn, "__wrapped__", None), "__self__", None)
    if isinstance(target, str):
        return _check_str_method(b, target, name, args, kwargs)
    if isinstance(target, _DictGlobal) or isinstance(fn, _DictGlobal):
        if args:
            return (_take(args[0], "a dict"), *args[1:])
    return None


# -- every filter, bounded before it runs ------------------------------------------------------------------------
#
# Each check gets the filter's arguments by name (inspect's BoundArguments, defaults applied) and may replace the
# input (a generator read into a capped list). Filters left out build nothing bigger than their input or return a
# number: abs, attr, count, d, default, filesizeformat, first, float, int, last, length, random, round, items
# (lazy), and the lazy map/select/reject/selectattr/rejectattr, whose items pass through the bounded filters and
# list/join/... that consume them. `range` is Jinja's sandboxed one (at most 100,000 items).


def _value_name(fn) -> str:
    params = list(inspect.signature(fn).parameters)
    return params[1] if getattr(fn, "jinja_pass_arg", None) is not None else params[0]


def _sized_input(what: str):
    def check(b: _Budget, a: dict, value: str, name: str) -> None:
        a[value] = _take(a[value], what)
    return check


def _check_batch(b: _Budget, a: dict, value: str, name: str) -> None:
    a[value] = _take(a[value], "a batch")
    if a.get("fill_with") is not None and isinstance(a["linecount"], int):
        b.items(a["linecount"], "a batch with fill_with")


def _check_slice(b: _Budget, a: dict, value: str, name: str) -> None:
    a[value] = _take(a[value], "a slice")
    if isinstance(a["slices"], int):
        b.items(a["slices"], "a slice")


def _check_reverse(b: _Budget, a: dict, value: str, name: str) -> None:
    if not isinstance(a[value], str):
        a[value] = _take(a[value], "a reverse")


def _check_join(b: _Budget, a: dict, value: str, name: str) -> None:
    a[value] = items = _take(a[value], "a join")
    sep = a.get("d", "")
    n = len(items) if hasattr(items, "__len__") else 0
    # str of each item is within the repr of the whole sequence (an attribute's text is within its item's)
    body = _Shape(b, "a join").measure(list(items) if isinstance(items, (set, frozenset, dict)) else items)
    b.size(body + len(str(sep)) * max(n - 1, 0), "a join")


def _sum_linear(b: _Budget, a: dict, value: str, name: str):
    """sum(lists, start=[]) copies the growing list once per item: quadratic in C. Lists and tuples are summed by
    one chain instead (same result), after their total is checked."""
    a[value] = items = _take(a[value], "a sum")
    start = a.get("start")
    if isinstance(start, (list, tuple)) and hasattr(items, "__iter__") and a.get("attribute") is None:
        if all(type(x) is type(start) for x in items):
            b.items(len(start) + sum(len(x) for x in items), "a sum of lists")
            return _Result(type(start)(itertools.chain(start, *items)))
    return None


def _check_string(b: _Budget, a: dict, value: str, name: str) -> None:
    _text(b, a[value], "the text of a value")


def _check_tojson(b: _Budget, a: dict, value: str, name: str) -> None:
    shape = _Shape(b, "a tojson", "json", ensure_ascii=bool(a.get("ensure_ascii")), indent=a.get("indent"),
                   separators=a.get("separators"))
    b.size(shape.measure(a[value]), "a tojson")


def _check_pprint(b: _Budget, a: dict, value: str, name: str) -> None:
    b.size(_Shape(b, "a pprint", "pprint", cap=MAX_PPRINT_ITEMS).measure(a[value]), "a pprint")


def _text_check(grow):
    """A filter of text: the input's text is sized first, then what the filter adds to it (``grow``)."""
    def check(b: _Budget, a: dict, value: str, name: str) -> None:
        n = _text(b, a[value], f"the text given to the {name} filter")
        b.size(grow(b, a, a[value], n), f"the result of the {name} filter")
    return check


def _words(n: int) -> None:
    if n > MAX_WORDY_CHARS:
        raise _LimitExceeded(f"a text of {n:,} characters is more than the {MAX_WORDY_CHARS:,} the filters that split "
                             "text into words (wordwrap, urlize, title, striptags, wordcount) take")


def _wordy(factor: int = 1):
    def grow(b: _Budget, a: dict, s: Any, n: int) -> int:
        _words(n)
        return n * factor
    return grow


def _indent_grow(b: _Budget, a: dict, s: Any, n: int) -> int:
    width = a.get("width", 4)
    width = len(width) if isinstance(width, str) else max(width, 0) if isinstance(width, int) else 0
    lines = (s.count("\n") + s.count("\r") if isinstance(s, str) else n) + 2
    return n + lines * width


def _replace_grow(b: _Budget, a: dict, s: Any, n: int) -> int:
    old, new, count = str(a.get("old", "")), str(a.get("new", "")), a.get("count")
    hits = (s.count(old) if old else len(s) + 1) if isinstance(s, str) else n + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return n + hits * max(len(new) - len(old), 0)


def _escape_grow(b: _Budget, a: dict, s: Any, n: int) -> int:
    if not isinstance(s, str):
        return 5 * n
    return n + 4 * sum(s.count(c) for c in "&<>'\"")  # '&#34;' for '"'


def _wordwrap_grow(b: _Budget, a: dict, s: Any, n: int) -> int:
    _words(n)
    wrap = a.get("wrapstring")
    return n * (1 + (len(wrap) if isinstance(wrap, str) else 1))  # a line break after every character at most


def _urlize_grow(b: _Budget, a: dict, s: Any, n: int) -> int:
    _words(n)
    extra = sum(len(str(a.get(k) or "")) for k in ("target", "rel"))
    return n * (53 + 6 * extra)  # every character a link: '<a href="..." rel="noopener">...</a>', escaped twice


def _check_format_filter(b: _Budget, a: dict, value: str, name: str) -> None:
    fmt = a[value]
    if isinstance(fmt, str):
        values = list(a.get("args", ())) + list(a.get("kwargs", {}).values())
        _check_format(b, fmt, values, "%")


def _check_xmlattr(b: _Budget, a: dict, value: str, name: str) -> None:
    b.size(6 * _Shape(b, "an xmlattr").measure(a[value]), "an xmlattr")


def _check_urlencode(b: _Budget, a: dict, value: str, name: str) -> None:
    b.size(12 * _Shape(b, "a urlencode").measure(a[value]), "a urlencode")  # '%F0%9F%98%80' for one character


_FILTER_CHECKS = {
    "batch": _check_batch, "slice": _check_slice, "reverse": _check_reverse, "join": _check_join,
    "sum": _sum_linear, "string": _check_string, "tojson": _check_tojson, "pprint": _check_pprint,
    "format": _check_format_filter, "xmlattr": _check_xmlattr, "urlencode": _check_urlencode,
    **{name: _sized_input(f"a {name}") for name in ("sort", "dictsort", "groupby", "unique", "list", "min", "max",
                                                    "map", "select", "reject", "selectattr", "rejectattr")},
    **{name: _text_check(lambda b, a, s, n: n * _ascii_or(s, 3)) for name in ("upper", "lower", "capitalize")},
    "title": _text_check(_wordy(3)),
    "striptags": _text_check(_wordy()),
    "wordcount": _text_check(_wordy()),
    "trim": _text_check(lambda b, a, s, n: n),
    "safe": _text_check(lambda b, a, s, n: n),
    "truncate": _text_check(lambda b, a, s, n: n + len(str(a.get("end", "")))),
    "center": _text_check(lambda b, a, s, n: max(n, a["width"] if isinstance(a.get("width"), int) else 0)),
    "indent": _text_check(_indent_grow),
    "replace": _text_check(_replace_grow),
    **{name: _text_check(_escape_grow) for name in ("e", "escape", "forceescape")},
    "wordwrap": _text_check(_wordwrap_grow),
    "urlize": _text_check(_urlize_grow),
}


@dataclasses.dataclass(frozen=True)
class _Result:
    """A check that computed the filter's result itself (sum of lists)."""

    value: Any


def _bounded_filter(name: str, fn):
    check = _FILTER_CHECKS.get(name)
    # Filters take Jinja's state first (pass_context...); an async-variant filter (list, sum, join...) reports its
    # sync twin's signature, so the arguments are bound to that twin's, past its own state parameter.
    core = inspect.unwrap(fn)
    params = list(inspect.signature(core, follow_wrapped=False).parameters.values())
    if getattr(core, "jinja_pass_arg", None) is not None:
        params = params[1:]
    signature = inspect.Signature(params)
    n_state = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0
    value = params[0].name if params else ""

    @functools.wraps(fn)  # keeps jinja's pass_context/pass_eval_context marks
    def bounded(*args, **kwargs):
        b = _budget()
        b.poll()
        for v in (*args, *kwargs.values()):
            if isinstance(v, int) and not isinstance(v, bool) and v > b.max_chars:
                _too_big_argument(b, fn.__name__, v)
        if check is not None:
            try:
                bound = signature.bind(*args[n_state:], **kwargs)
            except TypeError:
                pass  # wrong arguments: the filter raises its own error
            else:
                bound.apply_defaults()
                arguments = bound.arguments
                done = check(b, arguments, value, name)
                if isinstance(done, _Result):
                    return done.value
                args, kwargs = (*args[:n_state], *bound.args), bound.kwargs
        result = fn(*args, **kwargs)
        if isinstance(result, str):
            b.size(len(result), f"the result of the {name} filter")
        elif _length(result) is not None:
            b.items(len(result), f"the result of the {name} filter")
        return result

    return bounded


class _BoundedCodeGenerator(CodeGenerator):
    """`a ~ b` compiles to environment.bounded_concat((a, b)) instead of str_join: the one string-building
    operator Jinja gives no hook for (autoescape is off here, so markup_join is never needed)."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _TemplateRaised(TemplateError):
    """raise_exception() called by the template; a subclass so render() can tell it from Jinja's own errors."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in transformers.

    Rendering only needs the body, so the block is a call that returns what it wraps: same text, no tracking.
    """

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _Sandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _budget()
        b.poll()
        _check_binop(b, operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja's form
        b = _budget()
        b.poll()
        replaced = _check_call(b, __obj, args, kwargs)
        if replaced is not None:
            args = replaced
        result = ImmutableSandboxedEnvironment.call(__self, __context, __obj, *args, **kwargs)
        if isinstance(result, str):
            b.size(len(result), f"the result of {getattr(__obj, '__name__', 'a call')}()")
        elif _length(result) is not None:
            b.items(len(result), f"the result of {getattr(__obj, '__name__', 'a call')}()")
        return result

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().poll()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget().poll()
        return super().getitem(obj, argument)

    def bounded_concat(self, values: tuple) -> str:
        b = _budget()
        b.size(sum(_text(b, v, "a ~ concatenation") for v in values), "a ~ concatenation")
        return "".join(map(str, values))

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # Jinja returns an Undefined that only raises when used, so `{{ ''.__class__ }}` renders ''. Templates
        # from the Hub are untrusted code: refuse the access itself, so a probe fails instead of passing quietly.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")


def _finalize(value: Any) -> Any:
    """Every `{{ value }}` passes here before str(): a list or dict is sized before its text is built."""
    if not isinstance(value, str):
        _text(_budget(), value, "the text of an output value")
    return value


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ' and always escapes non-ASCII; transformers replaces it with
    # plain json.dumps (non-ASCII kept), and prompts must match it byte for byte.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # `format`: the keyword name a template may pass
    if isinstance(format, str):
        _budget().size(len(format) * 16, "a strftime_now()")  # '%c' is 24 characters
    return datetime.now().strftime(format)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 - Jinja's names
    """Jinja's lipsum, whose paragraphs of up to ``max`` words are made one random word at a time in Python."""
    if isinstance(n, int) and isinstance(max, int) and n > 0 and max > 0 and n * max > MAX_LIPSUM_WORDS:
        raise _LimitExceeded(f"lipsum({n:,}, max={max:,}) would make up to {n * max:,} words, more than the "
                             f"{MAX_LIPSUM_WORDS:,} a template may ask for")
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


class _DictGlobal:
    """The ``dict`` global: callable and ``fromkeys`` only, so the real type never reaches the template."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a chat template may not store the underscore-prefixed name {name!r} on a namespace")


class _Namespace(Namespace):
    """Jinja's namespace, minus underscore names: `ns.__class__ = ...` style writes are a CPython-internals probe."""

    # No named `self`: Jinja's own trick, so that namespace(self=1) stays a valid template call.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        Namespace.__setitem__(self, name, value)


def _build_environment() -> jinja2.Environment:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        finalize=_finalize,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictGlobal()
    env.globals["namespace"] = _Namespace
    env.globals["lipsum"] = _lipsum
    env.filters = {name: _bounded_filter(name, fn) for name, fn in env.filters.items()}
    return env


# Shared by every template: the environment holds configuration only, and compiled templates are thread-safe.
_ENV = _build_environment()


# --------------------------------------------------------------------------------------------------------------
# Inputs, rebuilt the way apply_chat_template rebuilds them


def _plain(value: Any) -> Any:
    """A copy of ``value`` made of plain JSON types (transformers' ``_plain_template_data``).

    Rich objects (arrays, images, enums, pydantic models) carry methods the sandbox does not know are dangerous,
    so nothing but str/int/float/bool/None/list/tuple/dict reaches the template; anything else becomes "<Type>".
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    numpy = sys.modules.get("numpy")  # a numpy scalar can only exist if numpy is already imported
    if numpy is not None and isinstance(value, numpy.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: Any) -> list[dict]:
    if isinstance(messages, (str, bytes, Mapping)) or not hasattr(messages, "__iter__"):
        raise ChatTemplateError(
            f"messages must be a list of message dicts, got {type(messages).__name__}; wrap a single message in a list"
        )
    prepared = []
    for message in _plain(list(messages)):
        if not isinstance(message, dict):
            raise ChatTemplateError(
                f"each message must be a dict like {{'role': 'user', 'content': '...'}}, got {message!r}"
            )
        # Keys set to None are dropped: OpenAI-style `content=None` would render as "None" or crash many templates,
        # which all handle a missing key.
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            # Templates read `reasoning_content` (Qwen, DeepSeek) or `thinking` (gpt-oss); fill both, keeping the
            # key order transformers produces, since `message|tojson` or `message.items()` would show it.
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    if not prepared:
        raise ChatTemplateError("cannot render an empty conversation; pass at least one message")
    return prepared


def _prepare_tools(tools: Any) -> list | None:
    if tools is None:
        return None
    for tool in tools:
        if not isinstance(tool, Mapping):
            raise ChatTemplateError(
                f"each tool must be a JSON-schema dict, got {type(tool).__name__}; moechat does not turn Python "
                "functions into schemas, so pass the schema dict"
            )
    return _plain(list(tools))


def _prepare_documents(documents: Any) -> list | None:
    if documents is None:
        return None
    for document in documents:
        if not isinstance(document, Mapping):
            raise ChatTemplateError(
                f"each document must be a dict with 'title' and 'text' keys, got {type(document).__name__}"
            )
    return _plain(list(documents))


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def _template_line(exc: BaseException) -> int | None:
    # Jinja rewrites tracebacks so frames of the compiled template carry the template's own line numbers.
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


# --------------------------------------------------------------------------------------------------------------
# Files


def _read_text(path: Path) -> str:
    try:  # a FIFO or a device is refused before it is read, and the size is capped
        raw = read_regular(path, "chat template file", max_bytes=MAX_JSON_BYTES)
    except FileNotFoundError:
        raise ConfigError(f"cannot read {path}: not found") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not valid UTF-8 ({exc.reason}); re-download the model files") from exc


def _read_json(path: Path) -> Any:
    data = read_json_file(path, path.name, error=lambda m: ConfigError(m + "; re-download the model files or fix "
                                                                          "the file"))
    if path.name in (_TOKENIZER_CONFIG, "special_tokens_map.json", _LEGACY_JSON_FILE) and isinstance(data, dict):
        data = check_tokenizer_config(data, str(path))  # the special tokens and templates by their rules
    return data


def _token_text(value: Any) -> str | None:
    """A special token as the string templates see: a plain string, or the content of an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_tokens(config: Mapping, legacy_map: Mapping | None) -> dict[str, str]:
    # Like transformers 5: every top-level "*_token" string or AddedToken dict - the named ones (bos_token,
    # eos_token, unk_token, sep_token, pad_token, cls_token, mask_token) and model-specific ones such as
    # "image_token" - plus the entries of a dict-valued "extra_special_tokens".
    tokens: dict[str, str] = {}
    for key, value in config.items():
        if key.endswith("_token"):  # "add_bos_token" and friends are booleans and drop out here
            text = _token_text(value)
            if text is not None:
                tokens[key] = text
    extra = config.get("extra_special_tokens")
    if isinstance(extra, Mapping):
        for key, value in extra.items():
            text = _token_text(value)
            if text is not None:
                tokens[str(key)] = text
    # Old checkpoints keep their tokens in special_tokens_map.json; transformers lets it override the config
    # only when the config has no "added_tokens_decoder" (the legacy layout).
    if legacy_map is not None:
        for key, value in legacy_map.items():
            text = _token_text(value) if key.endswith("_token") else None
            if text is not None:
                tokens[key] = text
    return tokens


def _templates_from_config(value: Any, path: Path) -> dict[str, str]:
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        templates = {}
        for entry in value:
            if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ConfigError(
                    f'{path}: "chat_template" list entries must be {{"name": ..., "template": ...}} '
                    "with string values; fix or re-download the file"
                )
            templates[entry["name"]] = entry["template"]
        return templates
    raise ConfigError(
        f'{path}: "chat_template" must be a string or a list of named templates, got {type(value).__name__}; '
        "fix or re-download the file"
    )


# --------------------------------------------------------------------------------------------------------------
# Public API


class ChatTemplate:
    """A compiled chat template plus the special tokens it may read (``bos_token``, ``eos_token``, ...)."""

    source: str
    special_tokens: dict[str, str]

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, *, origin: str | None = None):
        if not isinstance(source, str):
            raise ChatTemplateError(f"a chat template must be a string, got {type(source).__name__}")
        self.source = source
        self.special_tokens = {str(k): str(v) for k, v in (special_tokens or {}).items()}
        self._origin = origin or "the chat template"
        try:
            self._compiled = _ENV.from_string(source)
        except TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"{self._origin} has a syntax error at line {exc.lineno}: {_one_line(exc.message)}; "
                "fix the template or use another one"
            ) from exc
        except TemplateError as exc:
            raise ChatTemplateError(
                f"{self._origin} cannot be compiled: {_one_line(exc)}; fix the template or use another one"
            ) from exc

    def __repr__(self) -> str:
        return f"ChatTemplate({self._origin!r}, {len(self.source)} chars, special_tokens={self.special_tokens!r})"

    @functools.cached_property
    def variables(self) -> frozenset[str]:
        """Names the template reads without setting them first: what a caller's keyword can change.

        A superset (a name set in one branch and read in another counts), so "not in variables" is certain:
        e.g. ``reasoning_effort`` only changes gpt-oss's prompt, and a CLI can say it is ignored elsewhere.
        """
        return frozenset(jinja2.meta.find_undeclared_variables(_ENV.parse(self.source)))

    @classmethod
    def from_string(cls, source: str, special_tokens: dict[str, str] | None = None) -> ChatTemplate:
        return cls(source, special_tokens)

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike, name: str | None = None) -> ChatTemplate | None:
        """Load the template the way ``AutoTokenizer.from_pretrained(model_dir)`` finds it.

        ``chat_template.jinja`` (plus ``additional_chat_templates/*.jinja`` for named ones) wins; else
        ``chat_template.json``; else ``tokenizer_config.json``'s ``chat_template``. ``name`` picks a named
        template (e.g. "tool_use"), else "default". Returns None when the model ships no template.
        """
        root = Path(model_dir)
        if not root.is_dir():
            raise ConfigError(f"{root} is not a directory; pass the folder holding the model's tokenizer files")

        config: Any = {}
        config_path = root / _TOKENIZER_CONFIG
        if os.path.lexists(config_path):  # present but not a regular file (a FIFO): refused, not skipped
            config = _read_json(config_path)
            if not isinstance(config, dict):
                raise ConfigError(f"{config_path} must hold a JSON object; re-download the model files")

        templates: dict[str, str] = {}
        origins: dict[str, Path] = {}
        if os.path.lexists(root / _JINJA_FILE):
            templates["default"] = _read_text(root / _JINJA_FILE)
            origins["default"] = root / _JINJA_FILE
        extra_dir = root / _EXTRA_TEMPLATES_DIR
        if extra_dir.is_dir():
            for path in sorted(extra_dir.glob("*.jinja")):
                templates[path.name.removesuffix(".jinja")] = _read_text(path)
                origins[path.name.removesuffix(".jinja")] = path
        # Template files replace whatever the config holds (transformers does the same), so only fall back to
        # the JSON sources when there are none.
        if not templates and os.path.lexists(root / _LEGACY_JSON_FILE):
            legacy = _read_json(root / _LEGACY_JSON_FILE)
            if not isinstance(legacy, dict) or "chat_template" not in legacy:
                raise ConfigError(
                    f'{root / _LEGACY_JSON_FILE} must be a JSON object with a "chat_template" key; '
                    "re-download the model files"
                )
            templates = _templates_from_config(legacy["chat_template"], root / _LEGACY_JSON_FILE)
            origins = dict.fromkeys(templates, root / _LEGACY_JSON_FILE)
        if not templates and config.get("chat_template") is not None:
            templates = _templates_from_config(config["chat_template"], config_path)
            origins = dict.fromkeys(templates, config_path)
        if not templates:
            return None

        wanted = name if name is not None else "default"
        if wanted not in templates:
            available = ", ".join(sorted(templates))
            if name is None:
                raise ConfigError(
                    f"{root} has no default chat template, only named ones ({available}); pass name= to pick one"
                )
            raise ConfigError(f"{root} has no chat template named {name!r}; available: {available}")

        legacy_map = None
        map_path = root / "special_tokens_map.json"
        if "added_tokens_decoder" not in config and os.path.lexists(map_path):
            legacy_map = _read_json(map_path)
            if not isinstance(legacy_map, dict):
                raise ConfigError(f"{map_path} must hold a JSON object; re-download the model files")
        origin = f"the chat template in {origins[wanted]}" + ("" if wanted == "default" else f" ({wanted!r})")
        return cls(templates[wanted], _special_tokens(config, legacy_map), origin=origin)

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list | None = None,
        documents: list | None = None,
        continue_final_message: bool | str = False,
        cancel: threading.Event | None = None,
        max_chars: int = MAX_OUTPUT_CHARS,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for ``messages``, identical to ``apply_chat_template(..., tokenize=False)``.

        Unlike transformers, ``add_generation_prompt`` defaults to True: moechat renders prompts to generate from.

        Extra keywords (``enable_thinking=False``, ``date_string=...``) become template variables and override
        special tokens of the same name. ``continue_final_message`` (True, or the field name to continue) leaves
        the last message open for the model to continue; it implies no generation prompt.

        Bounded (module docstring): past ``max_chars`` characters of output (or of any string the template builds),
        2M template lines or 10 s it stops with a ChatTemplateError; ``cancel`` set stops it with
        GenerationCancelled within ~20 ms (the watchdog's period).
        """
        chat = _prepare_messages(messages)
        tool_schemas = _prepare_tools(tools)
        docs = _prepare_documents(documents)
        variables = _plain({**self.special_tokens, **template_kwargs})
        if continue_final_message:
            # Opening a new assistant turn and continuing the last message contradict each other.
            add_generation_prompt = False
            final_text = self._tag_final_message(chat, continue_final_message)

        budget = _Budget(max_chars, time.monotonic() + MAX_RENDER_SECONDS, cancel)
        start_rss = _rss()
        if start_rss is not None:  # what a template may hold alive at once: many times its output, at least 1 GiB
            budget.rss_limit = start_rss + max(2**30, 16 * max_chars)
        try:
            rendered = self._run(budget, dict(
                messages=chat,
                tools=tool_schemas,
                documents=docs,
                add_generation_prompt=add_generation_prompt,
                **variables,
            ))
        except _Cancelled:
            raise GenerationCancelled("rendering the chat template was cancelled") from None
        except _LimitExceeded as exc:
            raise ChatTemplateError(
                f"{self._origin} was stopped: {exc}; the template (or the conversation) is too big or never "
                "finishes: use another template, or shorten the conversation"
            ) from None
        except RecursionError:
            raise ChatTemplateError(
                f"{self._origin} was stopped: it recursed too deeply (a macro that calls itself without end)"
            ) from None
        except _TemplateRaised as exc:
            raise ChatTemplateError(
                f"the model's chat template refused the conversation: {_one_line(exc)}"
            ) from exc
        except SecurityError as exc:
            raise ChatTemplateError(
                f"{self._origin} tried to leave the sandbox{self._at(exc)} ({_one_line(exc)}); "
                "this template is unsafe: do not use it"
            ) from exc
        except UndefinedError as exc:
            raise ChatTemplateError(
                f"{self._origin} used a value that is not set{self._at(exc)} ({_one_line(exc)}); check that the "
                "messages have the fields this template expects, or pass the missing template variable"
            ) from exc
        except Exception as exc:  # anything else raised by template code (TypeError, ZeroDivisionError, ...)
            raise ChatTemplateError(
                f"{self._origin} failed{self._at(exc)}: {type(exc).__name__}: {_one_line(exc)}; check the "
                "messages' shape against what the template expects"
            ) from exc

        if continue_final_message:
            rendered = self._cut_at_tag(rendered, final_text)
        return rendered

    # -- helpers --------------------------------------------------------------------------------------------

    def _run(self, budget: _Budget, variables: dict) -> str:
        """Render with the budget in force: sizes through the sandbox's hooks, template lines through a trace
        function that only template frames get (other code runs untraced), the output stream counted."""
        previous, outer = sys.gettrace(), getattr(_RENDERING, "budget", None)

        def trace(frame, event, arg):
            if frame.f_code.co_filename == "<template>":
                return budget.line
            return previous(frame, event, arg) if previous is not None else None  # a debugger or coverage

        _RENDERING.budget = budget
        _WATCHDOG.add(budget)
        sys.settrace(trace)
        try:
            out, n = [], 0
            for chunk in self._compiled.generate(**variables):
                n += len(chunk)
                budget.size(n, "the rendered prompt")
                out.append(chunk)
            return "".join(out)
        finally:
            sys.settrace(previous)
            _WATCHDOG.remove(budget)
            _RENDERING.budget = outer

    @staticmethod
    def _at(exc: BaseException) -> str:
        line = _template_line(exc)
        return "" if line is None else f" at template line {line}"

    def _tag_final_message(self, chat: list[dict], continue_final_message: bool | str) -> str:
        # Same trick as transformers: append a marker to the text being continued, render, then cut the prompt
        # just before the marker so whatever the template writes after the message (end-of-turn token) is gone.
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        last = chat[-1]
        final = last.get(field)
        if final is None:
            raise ChatTemplateError(f"continue_final_message: the final message has no {field!r} to continue")
        fields = [field]
        if field in _REASONING_FIELDS:
            # The reasoning was copied under several names; tag each copy, whichever the template reads.
            fields = [name for name in _REASONING_FIELDS if last.get(name) == final]
        if not any(name in self.source for name in fields):
            raise ChatTemplateError(
                f"continue_final_message: this chat template never reads {field!r}, so it cannot be continued"
            )
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if isinstance(block, dict) and isinstance(block.get("text"), str):
                    text = block["text"]
                    block["text"] = text + _CONTINUE_TAG
                    return text
            raise ChatTemplateError("continue_final_message: the final message has no text block to continue")
        if not isinstance(final, str):
            raise ChatTemplateError(
                f"continue_final_message: the final message's {field!r} is a {type(final).__name__}, not text"
            )
        for name in fields:
            last[name] = last[name] + _CONTINUE_TAG
        return final

    @staticmethod
    def _cut_at_tag(rendered: str, final_text: str) -> str:
        marker = _CONTINUE_TAG.strip()
        if final_text.strip() not in rendered or marker not in rendered:
            raise ChatTemplateError(
                "continue_final_message: the chat template dropped or changed the final message, so there is "
                "nothing to continue; render without continue_final_message"
            )
        at = rendered.rindex(marker)
        if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return rendered[:at]
        # The template trimmed the message, and the space after the marker with it: trim the same way.
        return rendered[:at].rstrip()
