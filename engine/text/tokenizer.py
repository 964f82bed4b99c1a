"""Text <-> token ids with the `tokenizers` library, and streaming detokenization.

Design:
- ``tokenizer.json`` is the single source of truth (no sentencepiece/tiktoken fallback). It is loaded as
  is, post-processor included, which is what transformers 5.24 does: when ``tokenizer.json`` exists,
  ``from_pretrained`` drops ``add_bos_token``/``add_eos_token`` from ``tokenizer_config.json``, so the
  post-processor alone decides whether BOS/EOS are added (also for Llama-style tokenizers).
- ``tokenizer_config.json`` (optional) supplies the named special tokens. Like transformers, each one
  (and each extra special token) is registered as a special added token, so that ``encode`` never splits
  it and ``decode(skip_special_tokens=True)`` drops it.
- Truncation and padding stored in ``tokenizer.json`` are turned off: a chat engine must never cut a
  prompt silently.
- `IncrementalDetokenizer` streams text with the prefix-offset / read-offset technique (vLLM, TGI):
  decode a small window of ids, emit what lies past the previously decoded prefix, and hold back while
  the text could still change (trailing U+FFFD, or a trailing byte-fallback token).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken

from ..errors import TokenizerError
from ..io.files import read_json_object, read_regular
from ..io.validate import check_tokenizer_config

_TOKENIZER_JSON = "tokenizer.json"
_TOKENIZER_CONFIG = "tokenizer_config.json"
_SPECIAL_TOKENS_MAP = "special_tokens_map.json"
MAX_TOKENIZER_BYTES = 512 * 2**20  # the largest tokenizer.json files (250k-token vocabularies) are ~35 MB

# transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order (the order matters when tokens must be added).
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Files of tokenizers moechat cannot read, named in the error so the user knows what is missing.
_OTHER_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "tekken.json",
                          "tokenizer.tiktoken", "qwen.tiktoken")
_REPLACEMENT = "\ufffd"
# Trailing prompt tokens used as context by IncrementalDetokenizer (vLLM uses 5 as well): enough for the
# first generated token to get its leading space the way the full decode gives it.
_PROMPT_CONTEXT = 5


def _token_content(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: "<s>", {"content": "<s>", ...}, or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _added_token(value: Any) -> AddedToken | None:
    """The AddedToken transformers would build from a config entry (dict entries keep their flags)."""
    content = _token_content(value)
    if content is None:
        return None
    if isinstance(value, dict):
        flags = {k: bool(value[k]) for k in ("single_word", "lstrip", "rstrip", "normalized") if k in value}
        flags.setdefault("normalized", False)
        return AddedToken(content, special=True, **flags)
    return AddedToken(content, special=True, normalized=False)


def _read_json(path: Path) -> dict:
    """A tokenizer-side JSON file as a dict; its special tokens and template checked by their rules
    (engine/io/validate.py: a wrong type is a ConfigError naming the key)."""
    data = read_json_object(path, path.name, error=lambda m: TokenizerError(m + "; re-download the model's "
                                                                               "tokenizer files"))
    return check_tokenizer_config(data, str(path))


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens of ``tokenizer_config.json``.

    ``encode``/``decode`` give the same ids and text as transformers' ``PreTrainedTokenizerFast`` loaded
    from the same folder (decode never applies ``clean_up_tokenization_spaces``: transformers 5.24 skips
    it for BPE models too, and every MoE model moechat runs is BPE).
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, special_tokens: dict[str, Any] | None = None,
                 extra_special_tokens: Iterable[Any] = ()):
        """Wrap (and take over) ``backend``; ``special_tokens`` maps names (bos_token, ...) to "<s>" or
        {"content": "<s>", ...}; both they and ``extra_special_tokens`` become special added tokens."""
        self._backend = backend
        # Never truncate or pad a prompt behind the caller's back.
        self._backend.no_truncation()
        self._backend.no_padding()

        named: dict[str, str] = {}
        to_register: list[AddedToken] = []
        for name, value in (special_tokens or {}).items():
            token = _added_token(value)
            if token is not None:
                named[name] = token.content
                to_register.append(token)
        for value in extra_special_tokens:
            token = _added_token(value)
            if token is not None:
                to_register.append(token)

        added = {tok.content: tok_id for tok_id, tok in backend.get_added_tokens_decoder().items()}
        skip_ids = {tok_id for tok_id, tok in backend.get_added_tokens_decoder().items() if tok.special}
        for token in to_register:
            if token.content in added:
                # Already an added token: transformers' _post_init re-adds it as special, which leaves its
                # flags alone but makes decode(skip_special_tokens=True) drop it. Do the same.
                token = AddedToken(token.content, special=True, normalized=False)
            self._backend.add_special_tokens([token])
            token_id = self._backend.token_to_id(token.content)
            if token_id is not None:
                skip_ids.add(token_id)
                added[token.content] = token_id

        self.special_tokens: dict[str, str] = named
        self.all_special_ids: set[int] = skip_ids
        self.bos_token: str | None = named.get("bos_token")
        self.eos_token: str | None = named.get("eos_token")
        self.bos_token_id: int | None = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id: int | None = self.token_to_id(self.eos_token) if self.eos_token else None
        self._byte_ids = self._find_byte_fallback_ids()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (required) and ``tokenizer_config.json`` (optional) from a model folder."""
        root = Path(model_dir)
        if not root.is_dir():
            raise TokenizerError(f"{root} is not a directory; pass the folder holding the model's "
                                 "tokenizer files")
        path = root / _TOKENIZER_JSON
        if os.path.exists(path):  # a FIFO or a device is refused before it is read; the size is capped
            text = read_regular(path, _TOKENIZER_JSON, max_bytes=MAX_TOKENIZER_BYTES,
                                error=lambda m: TokenizerError(m + "; re-download it"))
        else:
            others = [name for name in _OTHER_TOKENIZER_FILES if (root / name).is_file()]
            if others:
                raise TokenizerError(
                    f"{root}: has {', '.join(others)} but no tokenizer.json; moechat needs tokenizer.json "
                    "(the `tokenizers` format). Convert it once with transformers: "
                    "AutoTokenizer.from_pretrained(dir).save_pretrained(dir)")
            raise TokenizerError(f"{root}: no tokenizer.json; moechat needs the model's tokenizer.json "
                                 "(download it with the weights)")
        try:
            backend = tokenizers.Tokenizer.from_str(text.decode("utf-8"))
        except Exception as err:  # tokenizers raises a bare Exception for malformed files
            raise TokenizerError(f"{path}: unreadable tokenizer.json ({err}); re-download it") from err

        config: dict = {}
        if os.path.lexists(root / _TOKENIZER_CONFIG):  # present but not a regular file: refused, not skipped
            config = _read_json(root / _TOKENIZER_CONFIG)
        # Like transformers: special_tokens_map.json is a legacy file, read only when tokenizer_config.json
        # does not carry added_tokens_decoder, and then its entries win.
        if "added_tokens_decoder" not in config and os.path.lexists(root / _SPECIAL_TOKENS_MAP):
            config = {**config, **_read_json(root / _SPECIAL_TOKENS_MAP)}

        special: dict[str, Any] = {name: config[name] for name in _NAMED_SPECIAL if name in config}
        # Model-specific named tokens (image_token, ...): any other *_token key holding a token.
        for key, value in config.items():
            if key.endswith("_token") and key not in special and _token_content(value) is not None:
                special[key] = value
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if isinstance(extra, dict):  # v5 also allows {"image_token": "<image>"}
            for key, value in extra.items():
                if _token_content(value) is not None:
                    special.setdefault(key, value)
            extra = []
        if not isinstance(extra, list):
            extra = []
        return cls(backend, special_tokens=special, extra_special_tokens=extra)

    def _find_byte_fallback_ids(self) -> frozenset[int]:
        """Ids of <0xNN> tokens, when the decoder turns them into raw bytes (ByteFallback)."""
        decoder = self._backend.decoder
        if decoder is None or b'"ByteFallback"' not in decoder.__getstate__():
            return frozenset()
        ids = set()
        for byte in range(256):
            for spelling in (f"<0x{byte:02X}>", f"<0x{byte:02x}>"):
                token_id = self._backend.token_to_id(spelling)
                if token_id is not None:
                    ids.add(token_id)
        return frozenset(ids)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (its longest vocabulary entry, added tokens included), so
        a text longer than N x this cannot be N tokens: known without tokenizing it."""
        return max((len(token) for token in self._backend.get_vocab(with_added_tokens=True)), default=1)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_id(self) -> int:
        """The largest id encode() can produce (ids may have gaps, so not always vocab_size - 1)."""
        return max(self._backend.get_vocab(with_added_tokens=True).values(), default=-1)

    def check_fits(self, model_vocab_size: int, where: str) -> str | None:
        """Refuse a tokenizer whose ids the model's embedding does not have (TokenizerError); return a notice when
        it is much smaller than the embedding, else None.

        Real models pad the embedding past the tokenizer (Qwen3 151,669 tokens in 151,936 rows, gpt-oss 200,019 in
        201,088), so only a tokenizer under half the rows is worth a word: most likely another model's.
        """
        if self.max_id >= model_vocab_size:
            raise TokenizerError(
                f"{where}: the tokenizer has {self.vocab_size:,} tokens (ids up to {self.max_id:,}) but the model's "
                f"vocab_size is {model_vocab_size:,}, so some ids have no embedding row: this tokenizer.json belongs "
                "to another model; put the model's own tokenizer files beside its weights"
            )
        if self.vocab_size * 2 < model_vocab_size:
            return (f"the tokenizer has {self.vocab_size:,} tokens but the model has {model_vocab_size:,} embedding "
                    "rows: it may be another model's tokenizer, and the output garbage; check tokenizer.json")
        return None

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, not {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        if hasattr(ids, "tolist"):  # a tensor or an array
            ids = ids.tolist()
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r})"


class IncrementalDetokenizer:
    """Streams text for generated ids: never emits a broken UTF-8 sequence (U+FFFD from an incomplete
    byte-level/byte-fallback token) mid-stream, handles SentencePiece-style leading-space (Metaspace) and
    byte-fallback tokens correctly, and is O(window) per token, not O(total).

    The concatenation of every ``add`` delta and ``flush`` equals ``tokenizer.decode(ids,
    skip_special_tokens=...)`` of the same ids. Two rules make that exact:
    - hold back while the window's text ends in U+FFFD: a byte-level token may end mid-character;
    - hold back while the last token is a byte-fallback token (<0xE4>): the ByteFallback decoder turns a
      whole run of byte tokens into U+FFFD if any of it is invalid, so a character that looks complete
      can still change until a non-byte token ends the run. Text spelled in byte tokens therefore arrives
      when its run ends, and the window spans that run (real text has short runs; byte-level BPE models
      such as Qwen, DeepSeek and OLMoE have no byte-fallback tokens at all).
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 prompt_ids: list[int] | None = None, keep: Iterable[str] = ()):
        """``prompt_ids`` (optional): its last tokens serve as context, so that the first generated token
        decodes with the spacing it has after the prompt (Metaspace decoders strip the first space).

        ``keep``: special tokens to show even when the others are skipped, spelled as in the vocabulary
        (harmony's ``<|channel|>``...: a reasoning parser must see them). The text then equals
        ``decode`` of the ids with only the other special ids removed."""
        self._tok = tokenizer
        kept = {tokenizer.token_to_id(token) for token in keep}
        self._skip = frozenset(tokenizer.all_special_ids - kept) if skip_special_tokens else frozenset()
        context = [int(t) for t in (prompt_ids or []) if int(t) not in self._skip][-_PROMPT_CONTEXT:]
        # Only ids[prefix:] are kept; ids[prefix:read] were already emitted and only serve as context.
        self._ids: list[int] = context
        self._read = len(context)
        self._prefix_text = self._decode(context)
        self._chunks: list[str] = []
        self._text: str | None = ""

    def _decode(self, ids: list[int]) -> str:
        # Special ids are filtered out on the way in, so a plain decode equals decode(skip=True) here.
        return self._tok._backend.decode(ids, skip_special_tokens=False)

    def _emit(self, delta: str) -> str:
        # Slide the window: what was read becomes the new prefix, and older ids are dropped, which keeps
        # every call O(window) however long the generation gets.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        if delta:
            self._chunks.append(delta)
            self._text = None
        return delta

    def add(self, token_id: int) -> str:
        """Feed one generated id; returns the new text (possibly "")."""
        token_id = int(token_id)
        if token_id in self._skip:
            return ""
        self._ids.append(token_id)
        if token_id in self._tok._byte_ids:
            return ""
        new_text = self._decode(self._ids)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        return self._emit(new_text[len(self._prefix_text):])

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end decodes to U+FFFD, as in decode)."""
        if self._read == len(self._ids):
            return ""
        new_text = self._decode(self._ids)
        return self._emit(new_text[len(self._prefix_text):])

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text is None:
            self._text = "".join(self._chunks)
            self._chunks = [self._text]
        return self._text
