"""The Jinja environment, configured like transformers' (``utils/chat_template_utils.py``).

An ``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a
``{% generation %}`` tag that just renders its body, a ``json.dumps`` based ``tojson``, and the globals
``raise_exception``, ``strftime_now``, a dunder-proof ``namespace`` and a callable-only ``dict``. Its hooks (binary
operators, calls, attribute and item reads, ``~`` and every ``{{ value }}``) poll the render's budget and run the
checks of ``checks.py``; every filter is wrapped the same way. One deliberate difference from Jinja: reading an
unsafe attribute (``x.__class__``, ``list.append``) fails at once, where Jinja would hand back an Undefined that
renders as ''. Real templates never do this; an escape attempt should be loud.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from .checks import _bounded_filter, _check_binop, _check_call, _DictGlobal
from .limits import MAX_LIPSUM_WORDS, _budget, _LimitExceeded
from .measure import _length, _text


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
