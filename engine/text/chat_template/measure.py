"""Sizes of values, known before they are built.

An upper bound on the text a value turns into (``str``, ``json.dumps``, ``pprint``), found by a walk capped at
MAX_ITEMS items (shared sub-lists count each time), and the lengths of escaped strings, integers and format results,
measured a piece at a time so measuring never builds the big value it guards against.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Mapping
from typing import Any

from jinja2.utils import Namespace
from markupsafe import Markup

from .limits import MAX_ITEMS, _Budget, _LimitExceeded


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
