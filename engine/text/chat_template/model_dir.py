"""A model folder's chat template and special tokens, found the way ``AutoTokenizer.from_pretrained`` finds them.

Every failure is a one-line ``ConfigError`` naming the file and what to do.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moechat.engine.errors import ConfigError
from moechat.engine.io.files import MAX_JSON_BYTES, read_json_file, read_regular
from moechat.engine.io.validate import check_tokenizer_config

_JINJA_FILE = "chat_template.jinja"
_EXTRA_TEMPLATES_DIR = "additional_chat_templates"
_LEGACY_JSON_FILE = "chat_template.json"
_TOKENIZER_CONFIG = "tokenizer_config.json"


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


def _find_template(model_dir: str | os.PathLike, name: str | None) -> tuple[str, dict[str, str], str] | None:
    """(source, special tokens, origin) of the template ``ChatTemplate.from_model_dir`` loads; None if there is none."""
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
    return templates[wanted], _special_tokens(config, legacy_map), origin
