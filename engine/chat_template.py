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
* Rendering is bounded, because a template is code from the Hub: in output size (``'x' * 10**9``, ``~``
  concatenation, ``+``, ``%`` formatting, a filter's or method's width argument and result, and the output
  stream itself are checked against ``max_chars`` before or as they grow), in work (template lines executed,
  counted by a trace function on the template's own frames only: ~0.3 us a line; a 400-message chat
  through GLM-4.6's template runs ~12k lines, the cap is 2M) and in time (10 s), and it is cancellable (a
  ``threading.Event`` checked every 256 lines). Three nested ``range(100000)`` loops fail in about a second.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
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

from moechat.engine.errors import ChatTemplateError, ConfigError, GenerationCancelled
from moechat.engine.files import MAX_JSON_BYTES, read_json_file, read_regular
from moechat.engine.validate import check_tokenizer_config

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
MAX_RENDER_STEPS = 2_000_000  # template lines executed per render
MAX_RENDER_SECONDS = 10.0
_CHECK_EVERY = 256  # lines between two looks at the clock and the cancel event


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


@dataclasses.dataclass
class _Budget:
    max_chars: int
    deadline: float
    cancel: threading.Event | None
    steps: int = 0
    rss_limit: float = math.inf  # bytes of resident memory past which the render stops (strings kept in a list...)

    def size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise _LimitExceeded(f"{what} would be {n:,} characters, more than the {self.max_chars:,} a prompt may be")

    def line(self, frame, event, arg):  # the local trace function of template frames
        if event == "line":
            self.steps += 1
            if self.steps % _CHECK_EVERY == 0:
                if self.steps > MAX_RENDER_STEPS:
                    raise _LimitExceeded(f"it ran {MAX_RENDER_STEPS:,} template lines without finishing (a loop that "
                                         "does not end, or nested loops over huge ranges)")
                if time.monotonic() > self.deadline:
                    raise _LimitExceeded(f"it ran for more than {MAX_RENDER_SECONDS:g} s")
                if self.cancel is not None and self.cancel.is_set():
                    raise _Cancelled()
                rss = _rss() if self.rss_limit < math.inf else None
                if rss is not None and rss > self.rss_limit:
                    raise _LimitExceeded(f"it grew this process's memory past {self.rss_limit / 2**30:.1f} GiB")
        return self.line


_RENDERING = threading.local()  # .budget: the bounds of the render running on this thread


_DEFAULT_BUDGET = _Budget(MAX_OUTPUT_CHARS, math.inf, None)  # sizes only: constants Jinja folds while compiling


def _budget() -> _Budget:
    return getattr(_RENDERING, "budget", None) or _DEFAULT_BUDGET


def _length(x: Any) -> int | None:
    return len(x) if isinstance(x, (str, list, tuple, dict, bytes)) else None


def _check_binop(b: _Budget, operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if _length(seq) is not None and isinstance(n, int):
                b.size(_length(seq) * max(n, 0), "a repeated string or list")
    elif operator == "+":
        if _length(left) is not None and _length(right) is not None:
            b.size(_length(left) + _length(right), "a concatenation")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * math.log2(abs(left)) > 65536:
                raise _LimitExceeded(f"{left} ** {right} is a number of more than 65,536 bits")
    elif operator == "%" and isinstance(left, str):
        _check_widths(b, left)


def _check_widths(b: _Budget, fmt: str) -> None:
    """Widths and precisions in a %- or {}-format string ("%1000000000d") would build huge strings."""
    digits = 0
    for ch in fmt:
        digits = digits + 1 if ch.isdigit() else 0
        if digits > 7:
            raise _LimitExceeded("a format string asks for a width of more than 9,999,999 characters")


_JINJA_STATE = (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment)


def _check_call(b: _Budget, fn: Any, args: tuple, kwargs: dict) -> None:
    """Before a filter or method runs: a width-like integer past the cap, or a replace/join/format that would grow
    past it, is refused before it allocates (the result is checked after, too)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and value > b.max_chars:
            b.size(value, f"a call to {getattr(fn, '__name__', 'a function')} with {value:,}")
    name = getattr(fn, "__name__", "")
    # a str method (the sandbox wraps str.format), as the function with the string first, like the filters
    target = getattr(fn, "__self__", None) or getattr(getattr(fn, "__wrapped__", None), "__self__", None)
    args = tuple(a for a in args if not isinstance(a, _JINJA_STATE))  # pass_context / pass_eval_context filters
    if isinstance(target, str):
        args = (target, *args)
    if name in ("replace", "do_replace") and len(args) >= 3 and all(isinstance(a, str) for a in args[:3]):
        text, old, new = args[0], args[1], args[2]
        count = text.count(old) if old else len(text) + 1
        b.size(len(text) + count * max(len(new) - len(old), 0), "a replace()")
    elif name == "join" and isinstance(target, str) and len(args) >= 2 and _length(args[1]) is not None:
        b.size(len(target) * max(len(args[1]) - 1, 0), "a join")
    elif name == "do_join" and args and _length(args[0]) is not None:
        sep = args[1] if len(args) > 1 else kwargs.get("d", "")
        if isinstance(sep, str):
            b.size(len(sep) * max(len(args[0]) - 1, 0), "a join")
    elif name in ("format", "format_map", "do_format") and args and isinstance(args[0], str):
        _check_widths(b, args[0])


def _bounded_filter(fn):
    @functools.wraps(fn)  # keeps jinja's pass_context/pass_eval_context marks
    def bounded(*args, **kwargs):
        b = _budget()
        _check_call(b, fn, args, kwargs)
        result = fn(*args, **kwargs)
        if _length(result) is not None:
            b.size(_length(result), f"the result of the {fn.__name__} filter")
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
        _check_binop(_budget(), operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja's form
        b = _budget()
        _check_call(b, __obj, args, kwargs)
        result = ImmutableSandboxedEnvironment.call(__self, __context, __obj, *args, **kwargs)
        if _length(result) is not None:
            b.size(_length(result), f"the result of {getattr(__obj, '__name__', 'a call')}()")
        return result

    def bounded_concat(self, values: tuple) -> str:
        parts = [str(v) for v in values]
        _budget().size(sum(map(len, parts)), "a ~ concatenation")
        return "".join(parts)

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # Jinja returns an Undefined that only raises when used, so `{{ ''.__class__ }}` renders ''. Templates
        # from the Hub are untrusted code: refuse the access itself, so a probe fails instead of passing quietly.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ' and always escapes non-ASCII; transformers replaces it with
    # plain json.dumps (non-ASCII kept), and prompts must match it byte for byte.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # `format`: the keyword name a template may pass
    return datetime.now().strftime(format)


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
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictGlobal()
    env.globals["namespace"] = _Namespace
    env.filters = {name: _bounded_filter(fn) for name, fn in env.filters.items()}
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
        GenerationCancelled within 256 template lines.
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
