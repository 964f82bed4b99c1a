"""``ChatTemplate``: a model's Hugging Face chat template, rendered exactly as transformers does.

A ``ChatTemplate`` compiles its source once, when it is built, so a syntax error shows at load time. ``render``
rebuilds every input from plain JSON types and fills the reasoning aliases the way ``apply_chat_template`` does
(``inputs.py``), then passes the same variables: ``messages``, ``tools``, ``documents``, ``add_generation_prompt``,
the special tokens as strings, and any extra keyword (``enable_thinking``...). It runs under a fresh budget
(``limits.py``) and turns every failure into a one-line ``ChatTemplateError`` (template) or ``ConfigError``
(files); ``continue_final_message`` is transformers' marker trick (tag the last message, render, cut at the tag).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from typing import Any

import jinja2.meta
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError, UndefinedError

from moechat.engine.errors import ChatTemplateError, GenerationCancelled

from .inputs import _REASONING_FIELDS, _plain, _prepare_documents, _prepare_messages, _prepare_tools
from .limits import _RENDERING, _WATCHDOG, MAX_OUTPUT_CHARS, _Budget, _Cancelled, _LimitExceeded, _new_budget
from .model_dir import _find_template
from .sandbox import _ENV, _TemplateRaised

__all__ = ["ChatTemplate"]

# transformers' marker for continue_final_message: appended to the last message, then cut off the rendered text.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


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
        found = _find_template(model_dir, name)
        if found is None:
            return None
        source, special_tokens, origin = found
        return cls(source, special_tokens, origin=origin)

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

        Bounded (limits.py, checks.py): past ``max_chars`` characters of output (or of any string the template
        builds), 2M template lines or 10 s it stops with a ChatTemplateError; ``cancel`` set stops it with
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

        budget = _new_budget(max_chars, cancel)
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
