"""Typed errors a user can meet. Each message says what went wrong and what to do.

The CLI and the app print ``str(err)`` as one line and never a traceback, so every message here is
written for a person: the file, the tensor, the number, and the fix.
"""

from __future__ import annotations


class MoechatError(Exception):
    """Base class of every error moechat raises on purpose."""


class ConfigError(MoechatError):
    """config.json / generation_config.json / tokenizer files missing or malformed."""


class UnsupportedModelError(MoechatError):
    """A model_type moechat does not implement, a dense model, or a trust_remote_code architecture."""


class CheckpointError(MoechatError):
    """A weights file that is missing, truncated, malformed, or does not match the config.

    ``path`` names the file and ``tensor`` the tensor when the error is about one.
    """

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None):
        super().__init__(message)
        self.path = path
        self.tensor = tensor


class TokenizerError(MoechatError):
    """tokenizer.json missing or unreadable."""


class ChatTemplateError(MoechatError):
    """A chat template that fails to parse, raises, or tries to leave the sandbox."""


class PromptTooLongError(MoechatError):
    """The prompt (plus what is already in the conversation) does not fit the context."""


class GenerationCancelled(MoechatError):
    """Raised inside the engine when the caller cancels; never escapes the public API."""
