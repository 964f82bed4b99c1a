"""Operators, calls and filters of a template, each bounded before it runs.

Strings at ``max_chars`` (``*``, ``+``, ``%``/format fields and widths, each str method and filter by what it adds to
its input), lists and dicts at MAX_ITEMS (``*``, ``+``, every filter that consumes or builds a sequence; a generator
is read into a capped list), integers at MAX_INT_BITS, the filters that split text into words in Python (wordwrap,
urlize, title, striptags, wordcount) at MAX_WORDY_CHARS, lipsum at MAX_LIPSUM_WORDS (``sandbox.py``), pprint at
MAX_PPRINT_ITEMS. So each call ends well under a second. ``sandbox.py`` calls these from its hooks.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math
from collections.abc import Mapping
from typing import Any

import jinja2
import jinja2.nodes
import jinja2.runtime

from .limits import MAX_INT_BITS, MAX_ITEMS, MAX_PPRINT_ITEMS, MAX_WORDY_CHARS, _Budget, _budget, _LimitExceeded
from .measure import _ascii_or, _check_format, _chunked, _length, _percent_values, _Shape, _take, _text


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


class _DictGlobal:
    """The ``dict`` global: callable and ``fromkeys`` only, so the real type never reaches the template."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


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
