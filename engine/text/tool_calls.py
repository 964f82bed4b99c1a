"""Tool calls in a model's generated text, for the families whose chat templates define them.

Three formats, told apart by the chat template (as `reasoning_format` tells reasoning formats apart):

* hermes (Qwen2.5, Qwen3 and the templates that copy them): the answer holds
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks, one per call. The same blocks may hold
  XML instead of JSON: ``<function=NAME><parameter=KEY>\\nVALUE\\n</parameter></function>`` (Qwen3-Coder,
  Qwen3.5/3.6, Nemotron 3) or ``NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`` (GLM-4.5 to 4.7).
* MiniMax-M2: ``<minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE</parameter></invoke>
  </minimax:tool_call>``, one or more invokes a block.
  In the XML forms a value is text: the tool's JSON schema (the request's `tools`) says which are strings; the
  others are read as JSON where they parse (Qwen's template writes Python's True/False for booleans).
* harmony (gpt-oss): a call is a message on the ``commentary`` channel addressed to a function,
  ``<|start|>assistant to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>{...}<|call|>``
  (the recipient may also follow the channel name); ``<|call|>`` is a stop token, so a call ends the reply.
* Gemma 4: ``<|tool_call>call:NAME{key:value,...}<tool_call|>``, the arguments in Gemma's own notation (keys bare,
  strings between ``<|"|>`` marks, numbers, true/false, lists, nested dicts), read into JSON; the reply then stops
  at ``<|tool_response>`` (the template opens the response there).

The parsers are reasoning parsers (engine/text/reasoning.py) that also collect calls: the engine feeds
them the generated text as it streams, the thinking and the answer come out as before minus the
call blocks, and `take_calls()` returns the calls completed since it was last asked. A hermes block
that is not valid JSON stays in the answer as the model wrote it: nothing the model said is lost.

Pure Python: no torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .reasoning import (
    HARMONY,
    HarmonyParser,
    ReasoningDelta,
    ReasoningParser,
    _partial_marker_len,
    make_parser,
    reasoning_format,
)

__all__ = ["GEMMA", "HERMES", "HARMONY", "MINIMAX", "GemmaToolParser", "HarmonyToolParser", "HermesToolParser",
           "MiniMaxToolParser", "ToolCall", "make_tool_parser",
           "tool_call_format"]

HERMES = "hermes"
GEMMA = "gemma"
MINIMAX = "minimax"
_MINIMAX_OPEN, _MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
_XML_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*?)(?:</function>\s*)?$", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>]+)>\n?(.*?)\n?</parameter>", re.S)
_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_MINIMAX_INVOKE = re.compile(r'<invoke name="([^"]+)">(.*?)</invoke>', re.S)
_MINIMAX_PARAMETER = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.S)
_GEMMA_OPEN, _GEMMA_CLOSE, _GEMMA_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it


def tool_call_format(template_source: str | None) -> str | None:
    """HARMONY, HERMES, GEMMA, MINIMAX, or None when the template defines no tool-call format."""
    if not template_source:
        return None
    if reasoning_format(template_source) == HARMONY:
        return HARMONY
    if _MINIMAX_OPEN in template_source:
        return MINIMAX
    if _CALL_OPEN in template_source:
        return HERMES
    if _GEMMA_OPEN in template_source and _GEMMA_CLOSE in template_source:
        return GEMMA
    return None


class HermesToolParser(ReasoningParser):
    """``<tool_call>{json}</tool_call>`` blocks cut out of the answer; `inner` (e.g. a ThinkTagParser) splits the
    thinking first, so a block inside the thinking is left there."""

    _open, _close = _CALL_OPEN, _CALL_CLOSE

    def __init__(self, inner: ReasoningParser | None = None, tools: list | None = None):
        super().__init__()
        self.inner = inner
        self._schemas = _parameter_types(tools)
        self.markers = (inner.markers if inner is not None else ()) + (self._open, self._close)
        self._in_call = False
        self._pending = ""
        self.calls: list[ToolCall] = []
        self._taken = 0

    def feed(self, text: str) -> ReasoningDelta:
        delta = self.inner.feed(text) if self.inner is not None else ReasoningDelta("", text)
        return self._split(delta, final=False)

    def flush(self) -> ReasoningDelta:
        delta = self.inner.flush() if self.inner is not None else ReasoningDelta()
        return self._split(delta, final=True)

    def take_calls(self) -> list[ToolCall]:
        new, self._taken = self.calls[self._taken:], len(self.calls)
        return new

    def _split(self, delta: ReasoningDelta, final: bool) -> ReasoningDelta:
        buf, out = self._pending + delta.answer, []
        while True:
            marker = self._close if self._in_call else self._open
            at = buf.find(marker)
            if at != -1:
                if self._in_call:
                    out.append(self._finish(buf[:at]))
                else:
                    out.append(buf[:at])
                self._in_call = not self._in_call
                buf = buf[at + len(marker):]
                continue
            if self._in_call:
                if final:  # an unterminated block at the end: parse what is there
                    out.append(self._finish(buf))
                    self._in_call, buf = False, ""
                break
            keep = 0 if final else _partial_marker_len(buf, (self._open,))
            out.append(buf[: len(buf) - keep])
            buf = buf[len(buf) - keep:]
            break
        self._pending = buf
        answer = "".join(out)
        self._answer.append(answer)
        if delta.thinking:
            self._thinking.append(delta.thinking)
        return ReasoningDelta(delta.thinking, answer)

    def _finish(self, body: str) -> str:
        """Record the call in `body`; returns the text to show instead ("" for a call, the block if not one)."""
        calls = self._parse(body)
        if not calls:
            return self._open + body + self._close
        self.calls.extend(calls)
        return ""

    def _parse(self, body: str) -> list[ToolCall] | None:
        """The calls in one block's `body`, or None when it is not a call (the block is then kept as text)."""
        try:
            data = json.loads(body)
            name = data["name"]
            arguments = data.get("arguments", data.get("parameters", {}))
            if not isinstance(name, str) or not name:
                raise ValueError(name)
        except (ValueError, KeyError, TypeError, AttributeError):
            return self._parse_xml(body)
        return [ToolCall(name, arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))]

    def _parse_xml(self, body: str) -> list[ToolCall] | None:
        """Qwen3-Coder's ``<function=NAME>`` with ``<parameter=KEY>`` blocks, or GLM's ``NAME<arg_key>..``."""
        match = _XML_FUNCTION.match(body)
        if match:
            name, inner = match.group(1), match.group(2)
            pairs = _XML_PARAMETER.findall(inner)
            if _XML_PARAMETER.sub("", inner).strip():
                return None  # text between the parameters: not this format
        else:
            name, _, rest = body.strip().partition("<arg_key>")
            name = name.strip()
            pairs = _GLM_PAIR.findall("<arg_key>" + rest) if rest else []
            leftover = _GLM_PAIR.sub("", "<arg_key>" + rest).strip() if rest else ""
            if not name or any(c in name for c in " <>{}\n") or leftover:
                return None
        if self._schemas and name not in self._schemas:
            return None  # not one of the request's tools: the model's text, kept
        return [self._typed(name, pairs)]

    def _typed(self, name: str, pairs) -> ToolCall:
        types = self._schemas.get(name, {})
        arguments = {key.strip(): _typed_value(value, types.get(key.strip())) for key, value in pairs}
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


class MiniMaxToolParser(HermesToolParser):
    """MiniMax-M2's ``<minimax:tool_call>`` blocks of ``<invoke name=..>`` calls."""

    _open, _close = _MINIMAX_OPEN, _MINIMAX_CLOSE

    def _parse(self, body: str) -> list[ToolCall] | None:
        invokes = _MINIMAX_INVOKE.findall(body)
        if not invokes or _MINIMAX_INVOKE.sub("", body).strip():
            return None
        return [self._typed(name, _MINIMAX_PARAMETER.findall(inner)) for name, inner in invokes]


def _parameter_types(tools: list | None) -> dict[str, dict[str, str | None]]:
    """{function name: {parameter: its JSON schema type (None: not given)}} of an OpenAI `tools` list."""
    out: dict[str, dict[str, str | None]] = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        properties = (function.get("parameters") or {}).get("properties") if isinstance(
            function.get("parameters"), dict) else None
        out[function["name"]] = {k: (v.get("type") if isinstance(v, dict) and isinstance(v.get("type"), str)
                                     else None) for k, v in (properties or {}).items()}
    return out


def _typed_value(text: str, kind: str | None):
    """An XML call's parameter text as its JSON value: a string parameter as written, a boolean from JSON's or
    Python's spelling, anything else as JSON where it parses, else the text."""
    if kind == "string":
        return text
    if kind == "boolean" and text.strip() in ("True", "False", "true", "false"):
        return text.strip() in ("True", "true")
    try:
        return json.loads(text)
    except ValueError:
        return text


class GemmaToolParser(HermesToolParser):
    """Gemma 4's ``<|tool_call>call:NAME{...}<tool_call|>`` blocks: HermesToolParser's streaming with these markers,
    the body read by `gemma_arguments`."""

    _open, _close = _GEMMA_OPEN, _GEMMA_CLOSE

    def _parse(self, body: str) -> list[ToolCall] | None:
        head, brace, _ = body.partition("{")
        name = head.strip().removeprefix("call:")
        if not head.strip().startswith("call:") or not brace or not name or any(c in name for c in " :,<>"):
            return None
        try:
            arguments = gemma_arguments(body[len(head):])
        except ValueError:
            return None
        return [ToolCall(name, json.dumps(arguments, ensure_ascii=False))]


_GEMMA_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_GEMMA_MAX_DEPTH = 64  # nested lists/dicts: a model's output, never deeper than a schema; past it, not a call


def gemma_arguments(text: str) -> dict:
    """Gemma 4's argument notation (what its template's format_argument writes: ``{city:<|"|>Paris<|"|>,days:2,
    tags:[<|"|>a<|"|>],opts:{deep:true}}``) -> the dict. Raises ValueError for anything else, trailing text included."""
    value, end = _gemma_value(text, 0, 0)
    if not isinstance(value, dict) or text[end:].strip():
        raise ValueError("not one dict")
    return value


def _gemma_value(t: str, i: int, depth: int):
    """(value, index after it) of the value starting at t[i] (leading whitespace skipped)."""
    if depth > _GEMMA_MAX_DEPTH:
        raise ValueError("nested too deep")
    while i < len(t) and t[i].isspace():
        i += 1
    if t.startswith(_GEMMA_QUOTE, i):
        end = t.find(_GEMMA_QUOTE, i + len(_GEMMA_QUOTE))
        if end == -1:
            raise ValueError("unterminated string")
        return t[i + len(_GEMMA_QUOTE):end], end + len(_GEMMA_QUOTE)
    if t.startswith("{", i) or t.startswith("[", i):
        is_dict, close = t[i] == "{", "}" if t[i] == "{" else "]"
        out: dict | list = {} if is_dict else []
        i += 1
        while True:
            while i < len(t) and t[i].isspace():
                i += 1
            if t.startswith(close, i) and not out:
                return out, i + 1
            if is_dict:
                if t.startswith(_GEMMA_QUOTE, i):
                    key, i = _gemma_value(t, i, depth + 1)
                else:
                    colon = t.find(":", i)
                    key = t[i:colon].strip() if colon != -1 else ""
                    if not key or any(c in key for c in "{}[],"):
                        raise ValueError("bad key")
                    i = colon
                while i < len(t) and t[i].isspace():
                    i += 1
                if not t.startswith(":", i):
                    raise ValueError("no colon")
                out[key], i = _gemma_value(t, i + 1, depth + 1)
            else:
                item, i = _gemma_value(t, i, depth + 1)
                out.append(item)
            while i < len(t) and t[i].isspace():
                i += 1
            if t.startswith(",", i):
                i += 1
                continue
            if t.startswith(close, i):
                return out, i + 1
            raise ValueError("expected , or " + close)
    for word, value in (("true", True), ("false", False), ("null", None), ("None", None)):
        if t.startswith(word, i):
            return value, i + len(word)
    match = _GEMMA_NUMBER.match(t, i)
    if match:
        number = match.group(0)
        return (float(number) if any(c in number for c in ".eE") else int(number)), match.end()
    raise ValueError(f"unexpected text at {i}")


class HarmonyToolParser(HarmonyParser):
    """gpt-oss: a message addressed ``to=functions.NAME`` is a call; its body (JSON) is the arguments, neither
    thinking nor answer."""

    def __init__(self, prompt_tail: str = "<|start|>assistant"):
        self.calls: list[ToolCall] = []
        self._taken = 0
        self._call: tuple[str, list[str]] | None = None
        super().__init__(prompt_tail)

    def take_calls(self) -> list[ToolCall]:
        new, self._taken = self.calls[self._taken:], len(self.calls)
        return new

    def _end_call(self) -> None:
        if self._call is not None:
            name, parts = self._call
            self._call = None
            self.calls.append(ToolCall(name, "".join(parts).strip()))

    def _open_body(self) -> None:
        self._end_call()
        match = _RECIPIENT.search(self._header)
        super()._open_body()
        if match:
            self._call = (match.group(1), [])

    def _scan(self, final: bool) -> None:
        before = self._state
        super()._scan(final)
        if self._call is not None and (final or (before == "body" and self._state != "body")):
            self._end_call()

    def _body_text(self, text: str) -> None:
        if self._call is not None:
            self._call[1].append(text)
        else:
            super()._body_text(text)


def make_tool_parser(template_source: str | None, prompt_tail: str = "",
                     tools: list | None = None) -> ReasoningParser | None:
    """A parser that splits thinking, answer and tool calls for a reply to a prompt ending in `prompt_tail`;
    None when the template has neither a reasoning nor a tool-call format. `tools`: the request's OpenAI tools,
    whose schemas type the XML forms' parameters."""
    calls = tool_call_format(template_source)
    reasoning = reasoning_format(template_source)
    if calls == HARMONY:
        return HarmonyToolParser(prompt_tail)
    inner = make_parser(reasoning, prompt_tail) if reasoning is not None else None
    if calls == HERMES:
        return HermesToolParser(inner, tools)
    if calls == MINIMAX:
        return MiniMaxToolParser(inner, tools)
    if calls == GEMMA:
        return GemmaToolParser(inner, tools)
    return inner
