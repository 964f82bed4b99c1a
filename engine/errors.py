"""Typed errors a user can meet. Each message says what went wrong and what to do.

The CLI and the app print ``str(err)`` as one line and never a traceback, so every message here is
written for a person: the file, the tensor, the number, and the fix.
"""

from __future__ import annotations

import functools
import inspect
import sys


class MoechatError(Exception):
    """Base class of every error moechat raises on purpose."""


class UnexpectedError(MoechatError):
    """An exception moechat did not type (a bug, or a library's own error), caught at an engine entry point:
    the message says what was being done and what was raised, in one line; `__cause__` keeps the original
    and its traceback (the CLI prints it with --debug)."""


def typed_errors(what: str):
    """Decorate an engine entry point (a function or a generator): an untyped exception becomes an UnexpectedError
    saying `what` failed. MoechatErrors pass through, and so does running out of memory (callers say what to
    lower) and anything that is not an Exception (Ctrl+C, a generator being closed)."""
    def passes(e: Exception) -> bool:
        torch = sys.modules.get("torch")
        oom = (MemoryError,) if torch is None else (MemoryError, torch.OutOfMemoryError)
        return isinstance(e, (MoechatError, *oom))

    def wrap(e: Exception) -> UnexpectedError:
        text = " ".join(str(e).split()) or "(no message)"
        return UnexpectedError(f"{what} failed: unexpected {type(e).__name__}: {text}")

    def decorate(fn):
        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def generator(*args, **kwargs):
                try:
                    return (yield from fn(*args, **kwargs))
                except Exception as e:
                    if passes(e):
                        raise
                    raise wrap(e) from e
            return generator

        @functools.wraps(fn)
        def function(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if passes(e):
                    raise
                raise wrap(e) from e
        return function

    return decorate


class ConfigError(MoechatError):
    """config.json / generation_config.json / tokenizer files missing or malformed.

    A value that breaks a rule (engine/io/validate.py) carries `path` (the file) and `key` (``rope_scaling.factor``).
    """

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None):
        super().__init__(message)
        self.path = path
        self.key = key


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


class NonFiniteLogitsError(MoechatError):
    """The model produced NaN or Inf logits: the generation ends with this, never with a made-up "stop"."""


class GenerationCancelled(MoechatError):
    """Raised inside the engine when the caller cancels; never escapes the public API."""


# -- the Hugging Face Hub (engine/plan/hub/) -----------------------------------------------------------------

class HubError(MoechatError):
    """Talking to the Hugging Face Hub, or downloading from it, failed. `repo_id` names the repo."""

    def __init__(self, message: str, *, repo_id: str | None = None):
        super().__init__(message)
        self.repo_id = repo_id


class RepoNotFoundError(HubError):
    """404: no such repo or revision (or a private repo the token cannot see)."""


class UnsafeHubResponseError(HubError):
    """The server sent a name or size that cannot be used safely (a blob id that is a path, a 10 GB "JSON"):
    refused before anything touches the file system."""


class RepoGatedError(HubError):
    """401/403 on a gated repo: the licence must be accepted, with the account whose token is used."""


class HubAuthError(HubError):
    """The token was rejected (401 invalid credentials) or lacks the permission (403)."""


class HubOfflineError(HubError):
    """HF_HUB_OFFLINE is set (or the Hub is unreachable) and what was asked for is not in the local cache."""


class NetworkError(HubError):
    """The connection failed or dropped and retries did not help; the bytes received so far are kept."""


class DownloadIntegrityError(HubError):
    """A downloaded file's size or checksum differs from the Hub's listing; the bad bytes were discarded."""


class DiskSpaceError(HubError):
    """Not enough free disk for the download (checked before the first byte, with a margin)."""


class DownloadCancelled(HubError):
    """The caller cancelled the download; partial files are kept so the next pull resumes."""


class DownloadBusyError(HubError):
    """Another process (or thread) is already downloading this repo."""


class NotDownloadedError(HubError):
    """A repo id that is not (completely) in the local Hugging Face cache."""


class QuantChoiceError(HubError):
    """A GGUF repo offers several quants and none (or one it lacks) was named; `quants` lists (name, bytes)."""

    def __init__(self, message: str, *, repo_id: str | None = None, quants: tuple[tuple[str, int], ...] = ()):
        super().__init__(message, repo_id=repo_id)
        self.quants = quants
