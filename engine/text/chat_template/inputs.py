"""The template's inputs, rebuilt the way ``apply_chat_template`` rebuilds them.

Every input is copied into plain JSON types (nothing else reaches the sandbox), None-valued message keys are dropped,
and a message's reasoning is filled under the names templates read (``reasoning_content``, ``thinking``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

from moechat.engine.errors import ChatTemplateError

# Names a message's reasoning arrives under; transformers copies the first one set into all of the first two.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


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
