"""The tokenizer, chat template and end-of-generation ids of a GGUF file, from its ``tokenizer.*`` metadata.

Design:
- A GGUF file keeps the vocabulary, not the ``tokenizer.json`` pipeline: ``tokenizer.ggml.model`` names the
  algorithm (``gpt2``: byte-level BPE with ``merges``; ``llama``: SentencePiece with ``scores``; ``gemma4``:
  Gemma's BPE over raw UTF-8 with ``merges``, ``▁`` for spaces and ``<0xXX>`` byte fallback),
  ``tokenizer.ggml.pre`` names the pre-tokenizer (one name per HF regex family, chosen by llama.cpp's converter
  from a hash of the tokens of a test text), and ``token_type`` says which ids are control/user-defined/byte.
  This module rebuilds the HF pipeline those stand for as a ``tokenizers.Tokenizer`` and wraps it in the engine's
  `Tokenizer` (the class a safetensors folder gets), so ``encode`` gives the ids transformers gives on the
  original ``tokenizer.json``. A file that embeds ``tokenizer.huggingface.json`` is loaded from it, exactly.
- Each pre name maps to the *original* regexes of the HF file (``(?i:'s|...)``, possessive-free), not to
  llama.cpp's rewritten ones (llama.cpp's regex engine lacks ``(?i:``); the normalizer a family ships (Qwen's
  NFC) is part of the entry, since GGUF does not record it. A name not in the table is one typed line naming it:
  guessing a pre-tokenizer silently gives other ids (llama.cpp's own "default" fallback degrades output).
- SentencePiece vocabularies become HF's converted Llama/Mixtral pipeline: a BPE model whose merges are rebuilt
  from the scores the way transformers' SentencePieceExtractor does (every split of a piece into two pieces,
  ranked by the merged piece's score; SentencePiece BPE's score is minus its merge rank, so this is exact), byte
  fallback, ``▁`` for spaces (prepended unless ``add_space_prefix`` is false). Cost: ~0.2 s for a 32k vocabulary.
- End-of-generation ids: ``eos``/``eot``/``eom`` from the metadata plus the control tokens that end a turn in
  the families moechat runs (``<|im_end|>``, ``<|return|>``/``<|call|>``, ...), because the HF
  ``generation_config.json`` that lists them is not in the file (Qwen3: 151645 and 151643).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors

from ..errors import TokenizerError
from .tokenizer import Tokenizer

# llama.cpp's token types (gguf.TokenType); a CONTROL token is a special added token, USER_DEFINED a plain one.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
)
_DEEPSEEK_LLM = (
    "[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}+",
)


@dataclass(frozen=True)
class PreTokenizer:
    """What one ``tokenizer.ggml.pre`` name stands for in the HF file: Split regexes (Isolated, in order) before
    a ByteLevel step (``regexes=()``: ByteLevel's own GPT-2 regex), the normalizer, and BPE's ignore_merges."""

    regexes: tuple[str, ...] = ()
    nfc: bool = False
    ignore_merges: bool = False
    digits: bool = False  # StarCoder-style: every digit its own piece before the GPT-2 regex


_GPT2 = PreTokenizer()
_PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan"),
                    PreTokenizer((_QWEN2,), nfc=True)),
    "qwen35": PreTokenizer((_QWEN35,), nfc=True),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"),
                    PreTokenizer((_LLAMA3,), ignore_merges=True)),
    "chatglm-bpe": PreTokenizer((_LLAMA3,)),
    **dict.fromkeys(("glm4", "glm5"), PreTokenizer((_LLAMA3,), ignore_merges=True)),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), PreTokenizer((_O200K,))),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense"), PreTokenizer(_DEEPSEEK_V3)),
    "deepseek-llm": PreTokenizer(_DEEPSEEK_LLM),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "jais"), _GPT2),
    "olmo": PreTokenizer(nfc=True),  # OLMo's tokenizer is GPT-NeoX's, which normalizes to NFC
    **dict.fromkeys(("starcoder", "refact", "smollm", "codeshell"), PreTokenizer(digits=True)),
}
KNOWN_PRE_TOKENIZERS = frozenset(_PRE_TOKENIZERS)

# Control tokens that end a turn in the families moechat runs: HF lists them in generation_config.json, which a
# GGUF file lacks (llama.cpp keeps a similar list for the same reason).
_TURN_ENDS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|return|>",
              "<|call|>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_turn>", "<|end|>")
# Named special tokens, from metadata key to the Tokenizer's name (transformers' attribute names).
_SPECIAL_KEYS = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token", "padding": "pad_token",
                 "seperator": "sep_token", "cls": "cls_token", "mask": "mask_token"}


@dataclass(frozen=True)
class GGUFText:
    """What a GGUF file says about text: the tokenizer, the chat template(s), and the ids that end generation."""

    tokenizer: Tokenizer
    chat_template: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    named_chat_templates: dict[str, str] = field(default_factory=dict)  # tokenizer.chat_template.<name>


def _value(fields: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """A metadata value as Python (str, int, float, bool, list): from a gguf ReaderField or a plain value."""
    item = fields.get(key)
    if item is None:
        return default
    if not hasattr(item, "contents"):
        return item
    types = getattr(item, "types", None) or []
    if len(types) > 1 and int(types[-1]) != 8 and item.data:  # a numeric array: one vectorised read, not 150k
        return np.concatenate([item.parts[i] for i in item.data]).tolist()
    try:
        return item.contents()
    except UnicodeDecodeError as err:
        raise TokenizerError(f"{key} holds bytes that are not UTF-8 (at byte {err.start} of one entry); the file's "
                             "tokenizer metadata is damaged: re-download or re-convert it") from None


def _typed_list(fields: Mapping[str, Any], key: str, kind: type, n: int | None, where: str) -> list:
    values = _value(fields, key)
    if not isinstance(values, list) or (values and not isinstance(values[0], kind)):
        raise TokenizerError(f"{where}: {key} is missing or not a list of {kind.__name__}; the file's tokenizer "
                             "metadata is damaged: re-download or re-convert it")
    if n is not None and len(values) != n:
        raise TokenizerError(f"{where}: {key} has {len(values):,} entries for {n:,} tokens; the file's tokenizer "
                             "metadata is damaged: re-download or re-convert it")
    return values


def _token_id(fields: Mapping[str, Any], name: str, n: int, where: str) -> int | None:
    value = _value(fields, f"tokenizer.ggml.{name}_token_id")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TokenizerError(f"{where}: tokenizer.ggml.{name}_token_id is not an integer; re-convert the file")
    if not 0 <= value < n:
        if value in (-1, 0xFFFFFFFF):  # llama.cpp's "none"
            return None
        raise TokenizerError(f"{where}: tokenizer.ggml.{name}_token_id = {value} is not a token id (the file has "
                             f"{n:,} tokens); re-convert the file")
    return value


def _byte_level_pipeline(backend: tokenizers.Tokenizer, pre: PreTokenizer) -> None:
    steps: list = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    if pre.digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not pre.regexes))
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    if pre.nfc:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()


def _spm_merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """SentencePiece scores -> BPE merges, as transformers' SentencePieceExtractor builds them: every split of a
    piece into two vocabulary pieces, ranked by the merged piece's score (higher first), ties by the ids of the
    halves, then by the merged piece's id."""
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for token_id, piece in enumerate(tokens):
        if vocab.get(piece) != token_id:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            left_id, right_id = vocab.get(left), vocab.get(right)
            if left_id is not None and right_id is not None:
                ranked.append((-scores[token_id], token_id, left_id, right_id, left, right))
    ranked.sort(key=lambda m: (m[0], m[1], m[2], m[3]))
    return [(m[4], m[5]) for m in ranked]


def _add_bos_eos(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None, bos_id: int | None,
                 eos_id: int | None) -> None:
    """The TemplateProcessing HF files carry when BOS (or EOS) is added to every encoding (Llama's
    ``<s>:0 $A:0``, pair ``<s>:0 $A:0 <s>:1 $B:1``)."""
    if bos is None and eos is None:
        return
    def sequence(name: str, type_id: int) -> list[str]:
        return [f"{t}:{type_id}" for t in (bos, name, eos) if t is not None]
    specials = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None]
    backend.post_processor = processors.TemplateProcessing(
        single=sequence("$A", 0), pair=sequence("$A", 0) + sequence("$B", 1), special_tokens=specials)


def _fields_of(source: Any) -> Mapping[str, Any]:
    fields = getattr(source, "fields", source)
    if not isinstance(fields, Mapping):
        raise TypeError(f"tokenizer_from_gguf takes a gguf.GGUFReader or its fields, not {type(source).__name__}")
    return fields


def tokenizer_from_gguf(source: Any, *, where: str = "the GGUF file") -> GGUFText:
    """The engine's tokenizer, chat template and EOS ids from a `gguf.GGUFReader` (or its ``fields`` mapping, whose
    values may also be plain Python values). ``where`` names the file in errors. Raises TokenizerError."""
    fields = _fields_of(source)
    model = _value(fields, "tokenizer.ggml.model")
    hf_json = _value(fields, "tokenizer.huggingface.json")
    if model is None and hf_json is None:
        raise TokenizerError(f"{where}: no tokenizer in the file (no tokenizer.ggml.model); put the model's "
                             "tokenizer.json beside it or use a GGUF converted with its vocabulary")
    tokens = _typed_list(fields, "tokenizer.ggml.tokens", str, None, where) if model is not None else []
    n = len(tokens)
    types = (_typed_list(fields, "tokenizer.ggml.token_type", int, n, where)
             if "tokenizer.ggml.token_type" in fields else [NORMAL] * n)
    ids = {name: _token_id(fields, name, n, where) for name in ("bos", "eos", "unknown", "padding", "seperator",
                                                                "cls", "mask", "eot", "eom")}
    if isinstance(hf_json, str) and hf_json:
        try:
            backend = tokenizers.Tokenizer.from_str(hf_json)
        except Exception as err:  # tokenizers raises a bare Exception for malformed JSON
            raise TokenizerError(f"{where}: unreadable tokenizer.huggingface.json ({err}); re-convert the file") \
                from err
        if not tokens:
            vocab = backend.get_vocab(with_added_tokens=True)
            tokens = [""] * (max(vocab.values(), default=-1) + 1)
            for text, token_id in vocab.items():
                tokens[token_id] = text
            n, types = len(tokens), [NORMAL] * len(tokens)
    elif model == "gpt2":
        backend = _build_bpe(fields, tokens, types, ids, where)
    elif model == "llama":
        backend = _build_spm(fields, tokens, types, ids, where)
    elif model == "gemma4":
        backend = _build_gemma(fields, tokens, types, ids, where)
    else:
        raise TokenizerError(f"{where}: tokenizer.ggml.model {model!r} is not one moechat can rebuild (it reads "
                             "'gpt2' byte-level BPE, 'llama' SentencePiece and 'gemma4'); put the model's "
                             "tokenizer.json beside the file")

    special: dict[str, Any] = {}
    for key, name in _SPECIAL_KEYS.items():
        token_id = ids[key]
        if token_id is not None and tokens[token_id]:
            special[name] = tokens[token_id]
    # Every control token is special (encode keeps it whole, decode(skip_special_tokens=True) drops it).
    extra = [tokens[i] for i in range(n) if types[i] == CONTROL and tokens[i]]
    tokenizer = Tokenizer(backend, special_tokens=special, extra_special_tokens=extra)

    eos: list[int] = [i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None]
    control = {tokens[i]: i for i in range(n) if types[i] == CONTROL}
    turn_ends = [t for t in _TURN_ENDS if t in control]
    if "<|return|>" in control and "<|call|>" in control:  # harmony: <|end|> ends a message, not the turn
        turn_ends = [t for t in turn_ends if t != "<|end|>"]
    eos.extend(control[t] for t in turn_ends)

    template = _value(fields, "tokenizer.chat_template")
    named = {}
    for key in fields:
        if key.startswith("tokenizer.chat_template.") and isinstance(_value(fields, key), str):
            named[key.removeprefix("tokenizer.chat_template.")] = _value(fields, key)
    return GGUFText(tokenizer=tokenizer, chat_template=template if isinstance(template, str) and template else None,
                    eos_token_ids=tuple(dict.fromkeys(eos)), bos_token_id=ids["bos"], named_chat_templates=named)


def _vocab(tokens: list[str], types: list[int]) -> dict[str, int]:
    """Token text -> id, padding entries ([PAD151669], type UNUSED) left out as HF has no such tokens; the first
    id wins when a text repeats (a damaged or hand-made file)."""
    vocab: dict[str, int] = {}
    for token_id, (text, kind) in enumerate(zip(tokens, types)):
        if kind != UNUSED and text not in vocab:
            vocab[text] = token_id
    return vocab


def _register_added(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """User-defined tokens are plain added tokens (matched whole, kept by decode); control tokens are added as
    special by the Tokenizer wrapper. Both were written pre-normalized (raw text) by llama.cpp's converter."""
    user = [AddedToken(tokens[i], special=False, normalized=False) for i in range(len(tokens))
            if types[i] == USER_DEFINED and tokens[i]]
    if user:
        backend.add_tokens(user)
    control = [AddedToken(tokens[i], special=True, normalized=False) for i in range(len(tokens))
               if types[i] == CONTROL and tokens[i]]
    if control:
        backend.add_special_tokens(control)


def _build_bpe(fields: Mapping[str, Any], tokens: list[str], types: list[int], ids: dict[str, int | None],
               where: str) -> tokenizers.Tokenizer:
    pre_name = _value(fields, "tokenizer.ggml.pre")
    if pre_name is None or pre_name == "default":
        raise TokenizerError(f"{where}: the file names no BPE pre-tokenizer (tokenizer.ggml.pre is "
                             f"{pre_name!r}), so its ids cannot be reproduced; use a GGUF converted by a llama.cpp "
                             "from 2024-05 or later, or put the model's tokenizer.json beside the file")
    pre = _PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise TokenizerError(f"{where}: unknown pre-tokenizer tokenizer.ggml.pre = {pre_name!r}; moechat knows "
                             f"{', '.join(sorted(_PRE_TOKENIZERS))}: put the model's tokenizer.json beside the file")
    backend = tokenizers.Tokenizer(_bpe_model(fields, _vocab(tokens, types), where, ignore_merges=pre.ignore_merges))
    _byte_level_pipeline(backend, pre)
    _register_added(backend, tokens, types)
    _post_process(fields, backend, tokens, ids, default_bos=pre_name in ("llama3", "llama-v3", "llama-bpe"))
    return backend


def _bpe_model(fields: Mapping[str, Any], vocab: dict[str, int], where: str, **options) -> tokenizers.models.BPE:
    """A BPE model over `vocab` with the file's ``tokenizer.ggml.merges`` ("left right" each)."""
    merges = []
    for line in _typed_list(fields, "tokenizer.ggml.merges", str, None, where):
        left, sep, right = line.partition(" ")
        if not sep:
            raise TokenizerError(f"{where}: tokenizer.ggml.merges holds {line!r}, not 'left right'; re-convert "
                                 "the file")
        merges.append((left, right))
    try:
        return tokenizers.models.BPE(vocab, merges, **options)
    except Exception as err:  # a merge naming a token the vocabulary lacks
        raise TokenizerError(f"{where}: the BPE merges do not fit the vocabulary ({err}); re-convert the file") \
            from err


def _build_gemma(fields: Mapping[str, Any], tokens: list[str], types: list[int], ids: dict[str, int | None],
                 where: str) -> tokenizers.Tokenizer:
    """Gemma 4's pipeline as transformers' GemmaTokenizer builds it: spaces to ``▁`` (no prefix space), a split on
    spaces that the normalizer has left nothing to split, BPE with the file's merges over raw UTF-8 and ``<0xXX>``
    byte fallback; decoded back through ``▁`` -> space and the byte pieces."""
    unk = tokens[ids["unknown"]] if ids["unknown"] is not None else None
    backend = tokenizers.Tokenizer(_bpe_model(fields, _vocab(tokens, types), where, unk_token=unk, fuse_unk=True,
                                              byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    _register_added(backend, tokens, types)
    _post_process(fields, backend, tokens, ids, default_bos=True)
    return backend


def _post_process(fields: Mapping[str, Any], backend: tokenizers.Tokenizer, tokens: list[str],
                  ids: dict[str, int | None], *, default_bos: bool) -> None:
    add_bos = bool(_value(fields, "tokenizer.ggml.add_bos_token", default_bos)) and ids["bos"] is not None
    add_eos = bool(_value(fields, "tokenizer.ggml.add_eos_token", False)) and ids["eos"] is not None
    _add_bos_eos(backend, tokens[ids["bos"]] if add_bos else None, tokens[ids["eos"]] if add_eos else None,
                 ids["bos"], ids["eos"])


def _build_spm(fields: Mapping[str, Any], tokens: list[str], types: list[int], ids: dict[str, int | None],
               where: str) -> tokenizers.Tokenizer:
    scores = _typed_list(fields, "tokenizer.ggml.scores", float, len(tokens), where)
    if not all(math.isfinite(s) for s in scores):
        raise TokenizerError(f"{where}: tokenizer.ggml.scores holds NaN or infinity; re-convert the file")
    vocab = _vocab(tokens, types)
    merges = _spm_merges(tokens, scores, vocab)
    unk = tokens[ids["unknown"]] if ids["unknown"] is not None else None
    byte_fallback = any(kind == BYTE for kind in types)
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges, unk_token=unk, fuse_unk=True,
                                                         byte_fallback=byte_fallback))
    space_prefix = bool(_value(fields, "tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("\u2581")] if space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(dec)
    _register_added(backend, tokens, types)
    _post_process(fields, backend, tokens, ids, default_bos=True)
    return backend
