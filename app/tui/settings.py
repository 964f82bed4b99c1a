"""User settings: one small TOML file under the XDG config dir, read with tomllib, written by `dumps`.

    $XDG_CONFIG_HOME/moechat/settings.toml   (default ~/.config/moechat/settings.toml)
    $XDG_DATA_HOME/moechat/                  (default ~/.local/share/moechat: chats.sqlite3, exports)

The file holds what a user would expect to be remembered between runs: recent models, the system
prompt, sampling overrides (absent keys mean "the model's generation_config.json default"), the
reasoning effort for models whose template reads one (absent: the template's default), the expert
format chosen per model (`[expert_format]`, model path -> int8 | int4; absent: native), the cache tuning
set in the panel per model (`[tuning."<model path>"]`: slots, policy, ram_cache_mb, prefetch; applied
when that model loads unless the command line sets them), whether the dashboard is shown. A writer of
~40 lines covers the types used here (str, int, float, bool, lists of str, two levels of tables), so
there is no TOML-writing dependency. A file that does not parse is
not fatal: the defaults are used and `Settings.problem` says why, for a notice.
"""

from __future__ import annotations

import math
import os
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from moechat.engine.errors import MoechatError  # pure Python, no torch
from moechat.engine.io.files import atomic_write, read_regular
from moechat.engine.text.reasoning import REASONING_EFFORTS

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: settings are written, and read back from 3.11 on
    tomllib = None

APP_NAME = "moechat"
MAX_RECENT_MODELS = 10
MAX_SETTINGS_BYTES = 4 * 2**20  # a settings file is a few hundred bytes; a 1 GB one is not read
# The sampling overrides a user may set, with their types (the names of SamplingParams' fields).
EXPERT_FORMATS = ("native", "int8", "int4")  # moechat run --expert-format
# The tuning panel's values saved per model: key -> (check, what is allowed).
TUNING_KEYS = {"slots": (lambda v: type(v) is int and v > 0, "a whole number > 0"),
               "policy": (lambda v: isinstance(v, str) and 0 < len(v) < 64, "a policy name"),
               "ram_cache_mb": (lambda v: type(v) is int and v >= 0, "a whole number >= 0 (0: every expert in RAM)"),
               "prefetch": (lambda v: isinstance(v, str) and 0 < len(v) < 64, "a prefetch mode")}
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
    """TOML for a dict of scalars, lists and two levels of tables (None values are left out)."""
    lines = [f"{_key(k)} = {_value(v)}" for k, v in data.items() if v is not None and not isinstance(v, dict)]
    for name, table in data.items():
        if isinstance(table, dict):
            lines.append("")
            lines.append(f"[{_key(name)}]")
            lines.extend(f"{_key(k)} = {_value(v)}" for k, v in table.items()
                         if v is not None and not isinstance(v, dict))
            for sub, values in table.items():
                if isinstance(values, dict):
                    lines.append("")
                    lines.append(f"[{_key(name)}.{_key(sub)}]")
                    lines.extend(f"{_key(k)} = {_value(v)}" for k, v in values.items() if v is not None)
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
    thinking: bool | None = None  # a reasoning model's thinking on or off; None: the chat template's default
    show_dashboard: bool = True
    theme: str = "textual-dark"
    expert_formats: dict[str, str] = field(default_factory=dict)  # model -> int8 | int4 chosen for it (else native)
    tunings: dict[str, dict] = field(default_factory=dict)  # model -> the panel's slots, policy, ram_cache_mb, prefetch
    problem: str | None = None  # why the file could not be read, for a notice
    keep_file: bool = field(default=False, repr=False, compare=False)  # a bad file that could not be set aside

    @classmethod
    def load(cls, path: Path | None = None) -> Settings:
        path = config_dir() / "settings.toml" if path is None else Path(path)
        settings = cls(path=path)
        if tomllib is None:
            if path.exists():
                settings.problem = f"{path}: reading settings needs Python 3.11 (tomllib); using the defaults"
            return settings
        try:
            data = tomllib.loads(read_regular(path, "settings file", max_bytes=MAX_SETTINGS_BYTES).decode("utf-8"))
        except FileNotFoundError:
            return settings
        except (MoechatError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            settings._set_aside(f"cannot read the settings ({e})", kept_any=False)
            return settings
        problems = settings._apply(data)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            settings._set_aside(problems[0] + more, kept_any=True)
        return settings

    def _apply(self, data: dict) -> list[str]:
        """Take every valid value of a parsed file; the problems with the others (a wrong type, an unknown key)."""
        problems: list[str] = []

        def table(name: str) -> dict:
            value = data.get(name, {})
            if isinstance(value, dict):
                return value
            problems.append(f"{name} must be a table ([{name}]), found {type(value).__name__}")
            return {}

        def bad(key: str, value, allowed: str) -> None:
            problems.append(f"{key} = {value!r} is not allowed: {allowed}")

        models, chat, sampling, ui, formats, tunings = (
            table(n) for n in ("models", "chat", "sampling", "ui", "expert_format", "tuning"))
        recent = models.get("recent", [])
        if isinstance(recent, list) and all(isinstance(m, str) for m in recent):
            self.recent_models = recent[:MAX_RECENT_MODELS]
        else:
            bad("models.recent", recent, "a list of model paths (strings)")
        checks = [("chat", chat, "system_prompt", lambda v: isinstance(v, str), "a string"),
                  ("chat", chat, "max_tokens", lambda v: type(v) is int and v > 0, "a whole number > 0"),
                  ("chat", chat, "reasoning_effort", lambda v: v in REASONING_EFFORTS,
                   "one of " + ", ".join(REASONING_EFFORTS)),
                  ("chat", chat, "thinking", lambda v: isinstance(v, bool), "true or false"),
                  ("ui", ui, "show_dashboard", lambda v: isinstance(v, bool), "true or false"),
                  ("ui", ui, "theme", lambda v: isinstance(v, str), "a string")]
        checks += [("sampling", sampling, key, lambda v: type(v) in (int, float) and math.isfinite(v), "a number")
                   for key in SAMPLING_KEYS]
        for where, values, key, ok, allowed in checks:
            if key not in values:
                continue
            if not ok(values[key]):
                bad(f"{where}.{key}", values[key], allowed)
            elif where == "sampling":
                self.sampling[key] = SAMPLING_KEYS[key](values[key])
            else:
                setattr(self, key, values[key])  # the field has the key's name
        for model, fmt in formats.items():
            if fmt in EXPERT_FORMATS[1:]:
                self.expert_formats[model] = fmt
            else:
                bad(f"expert_format.{model!r}", fmt, "int8 or int4")
        for model, tuning in tunings.items():
            if not isinstance(tuning, dict):
                bad(f"tuning.{model!r}", tuning, "a table of slots, policy, ram_cache_mb, prefetch")
                continue
            kept = {}
            for key, value in tuning.items():
                ok = TUNING_KEYS.get(key)
                if ok is None:
                    problems.append(f"unknown setting tuning.{model!r}.{key} (a typo?)")
                elif not ok[0](value):
                    bad(f"tuning.{model!r}.{key}", value, ok[1])
                else:
                    kept[key] = value
            if kept:
                self.tunings[model] = kept
        known = {"models": {"recent"}, "chat": {"system_prompt", "max_tokens", "reasoning_effort", "thinking"},
                 "sampling": set(SAMPLING_KEYS), "ui": {"show_dashboard", "theme"}}
        for name in data:
            if name not in known and name not in ("expert_format", "tuning"):
                problems.append(f"unknown setting {name!r} (a typo?)")
        for name, keys in known.items():
            for key in (data.get(name) if isinstance(data.get(name), dict) else {}):
                if key not in keys:
                    problems.append(f"unknown setting {name}.{key} (a typo?)")
        return problems

    def _set_aside(self, reason: str, *, kept_any: bool) -> None:
        """A file with problems is renamed settings.toml.bad-<time>, never overwritten: what the user typed is kept
        there. When it cannot be renamed, it is left alone and this session does not save over it. A symlinked file
        (dotfiles) is set aside beside its target, so the link stays and the next save writes through it."""
        path = Path(os.path.realpath(self.path))
        aside = path.with_name(f"{path.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}")
        n = 1
        while aside.exists():
            n += 1
            aside = path.with_name(f"{path.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
        loaded = "its valid settings were loaded" if kept_any else "using the defaults"
        try:
            os.rename(path, aside)
        except OSError as e:
            self.keep_file = True
            self.problem = (f"{self.path}: {reason}; {loaded}; the file could not be set aside ({e.strerror or e}) and "
                            "is not overwritten this session")
            return
        kept = aside.name if aside.parent == Path(self.path).absolute().parent else str(aside)
        self.problem = f"{self.path}: {reason}; the file was kept as {kept} and {loaded}"

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

    def tuning(self, model: str) -> dict:
        """The expert cache tuning saved for `model` (slots, policy, ram_cache_mb, prefetch); {} when none."""
        return dict(self.tunings.get(model, {}))

    def set_tuning(self, model: str, **values) -> None:
        self.tunings[model] = {k: v for k, v in values.items() if k in TUNING_KEYS and v is not None}

    def remember_model(self, model: str) -> None:
        self.recent_models = [model, *[m for m in self.recent_models if m != model]][:MAX_RECENT_MODELS]

    def to_dict(self) -> dict:
        return {
            "models": {"recent": self.recent_models},
            "chat": {"system_prompt": self.system_prompt, "max_tokens": self.max_tokens,
                     "reasoning_effort": self.reasoning_effort, "thinking": self.thinking},
            "sampling": dict(self.sampling),
            "ui": {"show_dashboard": self.show_dashboard, "theme": self.theme},
            "expert_format": dict(self.expert_formats),
            "tuning": {model: dict(values) for model, values in self.tunings.items()},
        }

    def save(self) -> str | None:
        """Write the file atomically (through a symlink: a dotfiles link stays a link); returns a problem to show,
        or None."""
        if self.path is None:
            return None
        if self.keep_file:
            return f"not saving the settings: {self.path} could not be read and is kept as it is"
        try:
            # a full disk or a kill leaves the old file whole; a directory or a FIFO there is refused, not replaced
            atomic_write(self.path, dumps(self.to_dict()), what="settings file")
        except OSError as e:
            return f"cannot save the settings to {self.path}: {e.strerror or e}"
        return None
