"""Split a model's generated text into its reasoning ("thinking") and its answer, as the text streams.

Three formats cover the MoE models moechat runs:

* harmony (gpt-oss): every message is ``<|start|>{role}[ to=..]<|channel|>{channel}[ <|constrain|>..]<|message|>``
  then its body, ended by ``<|end|>`` (``<|return|>``/``<|call|>`` are stop tokens and never reach the text).
  The prompt ends in ``<|start|>assistant``, so generation starts inside a header. Channel ``final`` is
  the answer; ``analysis`` (the chain of thought) and ``commentary`` (tool calls and their preambles:
  moechat runs no tools) are thinking.
* think tags (Qwen3, DeepSeek-V3.1, GLM-4.5/4.6, MiniMax-M2, Nemotron-3): ``<think>...</think>`` before
  the answer. Templates that open the block in the prompt (it ends in ``<think>``) start inside it.
* channel tags (Gemma 4): ``<|channel>thought\n...<channel|>`` before the answer, both markers special tokens.
  With thinking off (its template's default) the prompt ends in an empty ``<|channel>thought\n<channel|>``,
  and the model answers at once.

Design: parsers read text, not token ids. The text is what every consumer already streams, and the
same code then serves both formats. Harmony's markers are special tokens that the detokenizer drops by
default, so the engine asks it to keep exactly the ids of ``parser.markers`` visible (Qwen3's ``<think>``
is not special and is there anyway). A marker split across deltas is held back until it is complete or
can no longer be one: a feed costs O(len(delta) + longest marker), and nothing is shown twice. The one
trade-off: a model that spells ``<|end|>`` out of ordinary tokens would be read as the marker; it never
does, and user text never goes through a parser.

Pure Python: no torch, so the app and the CLI can import it at start-up.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["CHANNEL_TAGS", "HARMONY", "REASONING_EFFORTS", "THINK_TAGS", "ChannelTagParser", "HarmonyParser",
           "ReasoningDelta", "ReasoningParser",
           "THINKING_SWITCHES", "ThinkTagParser", "make_parser", "reasoning_format", "thinking_switch"]

HARMONY = "harmony"
THINK_TAGS = "think"
CHANNEL_TAGS = "channel"
# gpt-oss's reasoning levels: what its template's `reasoning_effort` takes ("medium" when it is not set).
REASONING_EFFORTS = ("low", "medium", "high")
# The variables templates read to turn thinking on or off: Qwen3/3.5, GLM, Nemotron 3 and Gemma 4 read the first,
# DeepSeek-V3.1 the second. Each template has its own default (Qwen: on, Gemma 4 and DeepSeek-V3.1: off).
THINKING_SWITCHES = ("enable_thinking", "thinking")

_START, _END, _MESSAGE, _CHANNEL, _CONSTRAIN, _RETURN, _CALL = (
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
_HARMONY_MARKERS = (_START, _END, _MESSAGE, _CHANNEL, _CONSTRAIN, _RETURN, _CALL)
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_GEMMA_OPEN, _GEMMA_CLOSE = "<|channel>", "<channel|>"
# A real header is "assistant to=functions.lookup_weather<|channel|>commentary <|constrain|>json" (~70 chars);
# header text past this is a model ignoring the format, and is shown as the answer rather than swallowed.
_MAX_HEADER = 256
_CHANNEL_NAME = re.compile(r"\s*([^\s<]+)")


@dataclass(frozen=True)
class ReasoningDelta:
    """New text of each part since the previous feed."""

    thinking: str = ""
    answer: str = ""


def reasoning_format(template_source: str | None) -> str | None:
    """The reasoning format a chat template speaks: HARMONY, THINK_TAGS, CHANNEL_TAGS, or None (no reasoning to
    split)."""
    if not template_source:
        return None
    if _CHANNEL in template_source and _MESSAGE in template_source:
        return HARMONY
    if _GEMMA_OPEN in template_source and _GEMMA_CLOSE in template_source:
        return CHANNEL_TAGS
    if _THINK_OPEN in template_source or _THINK_CLOSE in template_source:
        return THINK_TAGS
    return None


def thinking_switch(variables) -> str | None:
    """Which of THINKING_SWITCHES a template with these top-level `variables` reads (None: it has no switch)."""
    return next((name for name in THINKING_SWITCHES if name in variables), None)


def make_parser(fmt: str, prompt_tail: str = "") -> ReasoningParser:
    """A parser for `fmt`, starting where the prompt leaves off (`prompt_tail`: its last few tokens as text)."""
    if fmt == HARMONY:
        return HarmonyParser(prompt_tail)
    if fmt == THINK_TAGS:
        return ThinkTagParser(starts_in_thinking=prompt_tail.rstrip().endswith(_THINK_OPEN))
    if fmt == CHANNEL_TAGS:
        return ChannelTagParser(starts_in_thinking=prompt_tail.endswith(_GEMMA_OPEN + "thought\n"))
    raise ValueError(f"unknown reasoning format {fmt!r}; expected {HARMONY!r}, {THINK_TAGS!r} or {CHANNEL_TAGS!r}")


def _partial_marker_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start of a marker (so it must wait for more text)."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class ReasoningParser:
    """Feed text deltas, get (thinking, answer) deltas; `flush` at the end. `thinking`/`answer`: all so far."""

    markers: tuple[str, ...] = ()  # marker strings that must reach the parser (special tokens kept visible)

    def __init__(self) -> None:
        self._buf = ""
        self._thinking: list[str] = []
        self._answer: list[str] = []
        self._out_thinking: list[str] = []
        self._out_answer: list[str] = []

    @property
    def thinking(self) -> str:
        return "".join(self._thinking)

    @property
    def answer(self) -> str:
        return "".join(self._answer)

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        self._scan(final=False)
        return self._take()

    def flush(self) -> ReasoningDelta:
        """The text still held back (a partial marker is text after all); call once, at the end."""
        self._scan(final=True)
        return self._take()

    # -- for subclasses ---------------------------------------------------------------------------------
    def _scan(self, final: bool) -> None:
        raise NotImplementedError

    def _next(self, markers: tuple[str, ...], final: bool) -> tuple[str, str | None]:
        """Consume the buffer up to the first of `markers`: (text before it, the marker), or (safe text, None)."""
        buf = self._buf
        first, found = len(buf), None
        for marker in markers:
            at = buf.find(marker, 0, first + len(marker))
            if at != -1 and at < first:
                first, found = at, marker
        if found is not None:
            self._buf = buf[first + len(found):]
            return buf[:first], found
        keep = 0 if final else _partial_marker_len(buf, markers)
        self._buf = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], None

    def _emit_thinking(self, text: str) -> None:
        if text:
            self._thinking.append(text)
            self._out_thinking.append(text)

    def _emit_answer(self, text: str) -> None:
        if text:
            self._answer.append(text)
            self._out_answer.append(text)

    def _take(self) -> ReasoningDelta:
        delta = ReasoningDelta("".join(self._out_thinking), "".join(self._out_answer))
        self._out_thinking.clear()
        self._out_answer.clear()
        return delta


class HarmonyParser(ReasoningParser):
    """gpt-oss's harmony messages: the ``final`` channel is the answer, every other channel is thinking.

    States: ``header`` (after ``<|start|>``, up to ``<|message|>``), ``body`` (up to ``<|end|>``) and
    ``between`` (after ``<|end|>``, waiting for the next ``<|start|>``). Messages of one part are joined with
    a blank line. A stream with no harmony at all (a model ignoring its format) becomes the answer.
    """

    markers = _HARMONY_MARKERS

    def __init__(self, prompt_tail: str = "<|start|>assistant"):
        super().__init__()
        self._state = "between"
        self._header = ""
        self._to_answer = False
        self._started = False  # the current message has shown text (a separator goes before the next one)
        self._has_thinking = self._has_answer = False
        self._prompt_header = 0  # leading characters of the header that came from the prompt
        tail = prompt_tail[prompt_tail.rfind(_START):] if _START in prompt_tail else ""
        if tail:  # replay the prompt's open message, if any, without showing it
            self.feed(tail)
            self._thinking.clear()
            self._answer.clear()
            self._prompt_header = len(self._header)

    def _scan(self, final: bool) -> None:
        while True:
            if self._state == "header":
                text, marker = self._next((_MESSAGE, _START, _END, _RETURN, _CALL), final)
                self._header += text
                if marker == _MESSAGE:
                    self._open_body()
                elif marker == _START:
                    self._header, self._prompt_header = "", 0
                elif marker is not None:
                    self._state, self._header, self._prompt_header = "between", "", 0
                elif len(self._header) > _MAX_HEADER or (final and _CHANNEL not in self._header):
                    # Not a header: a model writing plain text. Show it rather than lose it.
                    self._state, self._to_answer, self._started = "body", True, False
                    text, self._header = self._header[self._prompt_header:], ""
                    self._prompt_header = 0
                    self._body_text(text)
                    continue
                else:
                    return
            elif self._state == "body":
                text, marker = self._next((_END, _RETURN, _CALL, _START, _CHANNEL, _MESSAGE, _CONSTRAIN), final)
                self._body_text(text)
                if marker in (_END, _RETURN, _CALL):
                    self._state = "between"
                elif marker == _START:
                    self._state, self._header = "header", ""
                elif marker == _CHANNEL:  # a new message without <|end|><|start|>: read its header
                    self._state, self._header = "header", _CHANNEL
                elif marker is None:
                    return
            else:  # between messages: only whitespace belongs here
                text, marker = self._next((_START, _CHANNEL), final)
                if text.strip():
                    self._state, self._to_answer, self._started = "body", True, False
                    self._body_text(text)
                    continue
                if marker is None:
                    return
                self._state, self._header = "header", ("" if marker == _START else _CHANNEL)

    def _open_body(self) -> None:
        header, self._header, self._prompt_header = self._header, "", 0
        at = header.find(_CHANNEL)
        channel = None
        if at != -1:
            match = _CHANNEL_NAME.match(header, at + len(_CHANNEL))
            channel = match.group(1) if match else ""
        # A message with no channel is a plain assistant message: the answer.
        self._to_answer = channel is None or channel == "final"
        self._state, self._started = "body", False

    def _body_text(self, text: str) -> None:
        if not text:
            return
        if not self._started:
            self._started = True
            if self._to_answer:
                if self._has_answer:
                    text = "\n\n" + text
                self._has_answer = True
            else:
                if self._has_thinking:
                    text = "\n\n" + text
                self._has_thinking = True
        if self._to_answer:
            self._emit_answer(text)
        else:
            self._emit_thinking(text)


class ThinkTagParser(ReasoningParser):
    """``<think>...</think>`` then the answer (Qwen3 and most open reasoning models).

    ``<think>`` opens the block only before any answer text, and ``</think>`` closes it once: a model that
    writes about the tags in its answer is shown as it wrote. Whitespace around the block is dropped, as the
    templates drop it when they render the turn back (``reasoning_content.strip('\\n')``).
    """

    markers = (_THINK_OPEN, _THINK_CLOSE)
    _open, _close = _THINK_OPEN, _THINK_CLOSE

    def __init__(self, starts_in_thinking: bool = False):
        super().__init__()
        self._state = "thinking" if starts_in_thinking else "before"
        self._pending_space = ""  # whitespace inside the block, shown only if more thinking follows

    def _scan(self, final: bool) -> None:
        while True:
            if self._state == "before":  # nothing shown yet: leading whitespace, then maybe <think>
                stripped = self._buf.lstrip()
                if not stripped:
                    self._buf = "" if final else self._buf
                    return
                if stripped.startswith(self._open):
                    self._buf = stripped[len(self._open):]
                    self._state = self._opened()
                    continue
                if self._open.startswith(stripped) and not final:
                    return  # "<thi": wait
                self._buf = stripped
                self._state = "answer"
            elif self._state == "thinking":
                text, marker = self._next((self._close,), final)
                if marker is not None:
                    self._thinking_text(text)
                    self._pending_space = ""
                    self._state = "answer_start"
                    continue
                self._thinking_text(text)
                return
            elif self._state == "name":  # ChannelTagParser: the channel's name line, not shown
                if not self._channel_name(final):
                    return
            elif self._state == "answer_start":  # the whitespace after </think> is a separator, not text
                stripped = self._buf.lstrip()
                self._buf = stripped
                if not stripped:
                    return
                self._state = "answer"
            else:
                self._emit_answer(self._buf)
                self._buf = ""
                return

    def _opened(self) -> str:
        """The state after the opening marker."""
        return "thinking"

    def _channel_name(self, final: bool) -> bool:
        raise NotImplementedError

    def _thinking_text(self, text: str) -> None:
        if not self._thinking:
            text = text.lstrip()
        body = text.rstrip()
        if body:
            self._emit_thinking(self._pending_space + body)
            self._pending_space = text[len(body):]
        else:
            self._pending_space += text


class ChannelTagParser(ThinkTagParser):
    """Gemma 4's ``<|channel>thought\n...<channel|>`` then the answer: ThinkTagParser's rules with these markers,
    and the channel's name line (``thought``) dropped. A name that runs past a line, or a close before its
    newline, is thinking text after all: nothing the model wrote is lost."""

    markers = (_GEMMA_OPEN, _GEMMA_CLOSE)
    _open, _close = _GEMMA_OPEN, _GEMMA_CLOSE
    _MAX_NAME = 32

    def _opened(self) -> str:
        return "name"

    def _channel_name(self, final: bool) -> bool:
        """Drop the name line once it is whole; False while it may still be coming."""
        buf = self._buf
        end = buf.find("\n", 0, self._MAX_NAME + 1)
        close = buf.find(self._close, 0, self._MAX_NAME + len(self._close))
        if end != -1 and (close == -1 or end < close):
            self._buf = buf[end + 1:]
        elif close == -1 and len(buf) <= self._MAX_NAME and not final:
            return False
        self._state = "thinking"
        return True
