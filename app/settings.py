"""User settings: one small TOML file under the XDG config dir, read with tomllib, written by `dumps`.

    $XDG_CONFIG_HOME/moechat/settings.toml   (default ~/.config/moechat/settings.toml)
    $XDG_DATA_HOME/moechat/                  (default ~/.local/share/moechat: chats.sqlite3, exports)

The file holds what a user would expect to be remembered between runs: recent models, the system
prompt, sampling overrides (absent keys mean "the model's generation_config.json default"), the
reasoning effort for models whose template reads one (absent: the template's default), the expert
format chosen per model (`[expert_format]`, model path -> int8 | int4; absent: native), whether the
dashboard is shown. A writer of ~40 lines covers the types used here (str, int, float, bool, lists
of str, one level of tables), so there is no TOML-writing dependency. A file that does not parse is
not fatal: the defaults are used and `Settings.problem` says why, for a notice.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from moechat.engine.reasoning import REASONING_EFFORTS  # pure Python, no torch

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: settings are written, and read back from 3.11 on
    tomllib = None

APP_NAME = "moechat"
MAX_RECENT_MODELS = 10
# The sampling overrides a user may set, with their types (the names of SamplingParams' fields).
EXPERT_FORMATS = ("native", "int8", "int4")  # moechat run --expert-format
SAMPLING_KEYS: dict[str, type] = {"temperature": float, "top_k": int, "top_p": float, "min_p": float,
                                  "repetition_penalty": float, "seed": int}


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / APP_NAME


def data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / APP_NAME


# -- a small TOML writer ------------------------------------------------------------------------------
def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _string(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _key(k: str) -> str:
    bare = k and all(c.isascii() and (c.isalnum() or c in "-_") for c in k)
    return k if bare else _string(k)


def dumps(data: dict) -> str:
    """TOML for a dict of scalars, lists and one level of tables (None values are left out)."""
    lines = [f"{_key(k)} = {_value(v)}" for k, v in data.items() if v is not None and not isinstance(v, dict)]
    for name, table in data.items():
        if isinstance(table, dict):
            lines.append("")
            lines.append(f"[{_key(name)}]")
            lines.extend(f"{_key(k)} = {_value(v)}" for k, v in table.items() if v is not None)
    return "\n".join(lines).lstrip("\n") + "\n"


# -- the settings ---------------------------------------------------------------------------------------
@dataclass
class Settings:
    path: Path | None = None  # None: never written (tests, or a read-only home)
    recent_models: list[str] = field(default_factory=list)  # most recent first
    system_prompt: str = ""
    sampling: dict[str, float | int] = field(default_factory=dict)  # overrides of the model's defaults
    max_tokens: int | None = None  # None: the model's max_new_tokens, else 512
    reasoning_effort: str | None = None  # "low" | "medium" | "high"; None: the chat template's default
    show_dashboard: bool = True
    theme: str = "textual-dark"
    expert_formats: dict[str, str] = field(default_factory=dict)  # model -> int8 | int4 chosen for it (else native)
    problem: str | None = None  # why the file could not be read, for a notice

    @classmethod
    def load(cls, path: Path | None = None) -> Settings:
        path = config_dir() / "settings.toml" if path is None else Path(path)
        settings = cls(path=path)
        if tomllib is None:
            if path.exists():
                settings.problem = f"{path}: reading settings needs Python 3.11 (tomllib); using the defaults"
            return settings
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return settings
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            settings.problem = f"{path}: cannot read the settings ({e}); using the defaults"
            return settings
        models = data.get("models", {})
        chat = data.get("chat", {})
        ui = data.get("ui", {})
        settings.recent_models = [m for m in models.get("recent", []) if isinstance(m, str)][:MAX_RECENT_MODELS]
        if isinstance(chat.get("system_prompt"), str):
            settings.system_prompt = chat["system_prompt"]
        if isinstance(chat.get("max_tokens"), int) and chat["max_tokens"] > 0:
            settings.max_tokens = chat["max_tokens"]
        if chat.get("reasoning_effort") in REASONING_EFFORTS:
            settings.reasoning_effort = chat["reasoning_effort"]
        for key, kind in SAMPLING_KEYS.items():
            value = data.get("sampling", {}).get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                settings.sampling[key] = kind(value)
        formats = data.get("expert_format", {})
        if isinstance(formats, dict):
            settings.expert_formats = {m: f for m, f in formats.items() if f in EXPERT_FORMATS[1:]}
        if isinstance(ui.get("show_dashboard"), bool):
            settings.show_dashboard = ui["show_dashboard"]
        if isinstance(ui.get("theme"), str):
            settings.theme = ui["theme"]
        return settings

    @property
    def last_model(self) -> str | None:
        return self.recent_models[0] if self.recent_models else None

    def expert_format(self, model: str) -> str:
        """The --expert-format chosen for `model` in the app ("native" unless int8/int4 was chosen)."""
        return self.expert_formats.get(model, "native")

    def set_expert_format(self, model: str, fmt: str) -> None:
        if fmt not in EXPERT_FORMATS:
            raise ValueError(f"expert format {fmt!r}: use one of {', '.join(EXPERT_FORMATS)}")
        if fmt == "native":
            self.expert_formats.pop(model, None)
        else:
            self.expert_formats[model] = fmt

    def remember_model(self, model: str) -> None:
        self.recent_models = [model, *[m for m in self.recent_models if m != model]][:MAX_RECENT_MODELS]

    def to_dict(self) -> dict:
        return {
            "models": {"recent": self.recent_models},
            "chat": {"system_prompt": self.system_prompt, "max_tokens": self.max_tokens,
                     "reasoning_effort": self.reasoning_effort},
            "sampling": dict(self.sampling),
            "ui": {"show_dashboard": self.show_dashboard, "theme": self.theme},
            "expert_format": dict(self.expert_formats),
        }

    def save(self) -> str | None:
        """Write the file atomically; returns a problem to show, or None."""
        if self.path is None:
            return None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".toml.tmp")
            tmp.write_text(dumps(self.to_dict()), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as e:
            return f"cannot save the settings to {self.path}: {e.strerror or e}"
        return None
