"""GGUF tokenizer metadata -> tokenizer: HF tokenizers of each kind written into GGUF metadata the way llama.cpp's
converter writes them, read back with gguf.GGUFReader, and compared id for id with the original on text with
Unicode, whitespace runs, digits and special tokens."""

from __future__ import annotations

import json
import random

import gguf
import pytest
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers

from moechat.engine.errors import TokenizerError
from moechat.engine.text.gguf_tokenizer import tokenizer_from_gguf

CORPUS = [
    "The quick brown fox jumps over the lazy dog. I've been told he's there; we'll see, they'd say.",
    "Numbers: 3 33 333 3333 33333 1234567 3.14159 and 1,000,000 items cost $42.50!",
    "def main(argv):\n    for i in range(10):\n        print(f'{i:>4}')\n\treturn 0\n",
    "我想在apple工作1314151天，然后去東京。日本語のテキストもあります。カタカナ、ひらがな。",
    "нещо на Български и русский текст, Ελληνικά γράμματα, Ünïcödé àçcénts café naïve.",
    "emoji 🚀🦙🦙 ✅ (normal) 😶\u200d🌫️ ------======= '''''' ``````` \"\"\"\" ......!!!!!!??????",
    "   leading spaces, trailing spaces   \n\n\n  newline runs \r\n windows lines \t tabs\t\t end",
    "Hello world hello World HELLO WORLD it's IT'S We'Ve a'lL 'RE you sure? 'M not sure",
]
TEXTS = [
    *CORPUS,
    "unseen words: zyxwvut qwerty, 9876543210, 丁丂七, ⅫⅣ ½",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n  hi  there\t<|im_end|>",
    "<think>\nreasoning\n</think>\n\nanswer<|endoftext|>",
    "",
    " ",
    "\n\n\n",
    "e\u0301 cafe\u0301",  # NFD input: Qwen's NFC normalizer changes it
    "a  b   c    d     e",
]

# Each pre-tokenizer as the HF tokenizer.json of that family spells it.
_CONTR = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
HF_PRE = {
    "qwen2": ([_CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
              "NFC", False),
    "llama-bpe": ([_CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
                   r"|\s+"], None, True),
    "glm4": ([_CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
             None, True),
    "gpt-4o": ([r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
                r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+"], None, False),
    "deepseek-v3": ([r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                     r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                     r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""], None, False),
    "gpt-2": ([], None, False),
}


def _byte_level_hf(pre: str) -> tokenizers.Tokenizer:
    """A small HF byte-level BPE tokenizer of one family, trained on CORPUS, with Qwen-style added tokens."""
    regexes, norm, ignore_merges = HF_PRE[pre]
    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=ignore_merges))
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not regexes))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    if norm:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    return tok


def _write_gguf(path, kv: dict) -> gguf.GGUFReader:
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, (kind, value) in kv.items():
        if kind == "str":
            writer.add_string(key, value)
        elif kind == "u32":
            writer.add_uint32(key, value)
        elif kind == "bool":
            writer.add_bool(key, value)
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path))


def _bpe_kv(tok: tokenizers.Tokenizer, pre: str) -> dict:
    """What convert_hf_to_gguf.py's _set_vocab_gpt2 writes for `tok` (plus the template a model ships)."""
    data = json.loads(tok.to_str())
    vocab = tok.get_vocab(with_added_tokens=True)
    added = {a["content"]: a for a in data["added_tokens"]}
    n = max(vocab.values()) + 3  # two padding rows past the tokenizer, as real embeddings have
    reverse = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(n):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            text = reverse[i]
            tokens.append(text)
            if text in added:
                types.append(gguf.TokenType.CONTROL if added[text]["special"] else gguf.TokenType.USER_DEFINED)
            else:
                types.append(gguf.TokenType.NORMAL)
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    return {
        "tokenizer.ggml.model": ("str", "gpt2"),
        "tokenizer.ggml.pre": ("str", pre),
        "tokenizer.ggml.tokens": ("arr", tokens),
        "tokenizer.ggml.token_type": ("arr", [int(t) for t in types]),
        "tokenizer.ggml.merges": ("arr", merges),
        "tokenizer.ggml.eos_token_id": ("u32", vocab["<|im_end|>"]),
        "tokenizer.ggml.padding_token_id": ("u32", vocab["<|endoftext|>"]),
        "tokenizer.ggml.bos_token_id": ("u32", vocab["<|endoftext|>"]),
        "tokenizer.ggml.add_bos_token": ("bool", False),
        "tokenizer.chat_template": ("str", "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>"
                                           "{% endfor %}"),
    }


@pytest.mark.parametrize("pre", sorted(HF_PRE))
def test_byte_level_bpe_matches_hf(tmp_path, pre):
    hf = _byte_level_hf(pre)
    reader = _write_gguf(tmp_path / "m.gguf", _bpe_kv(hf, pre))
    text = tokenizer_from_gguf(reader)
    tok = text.tokenizer
    for sample in TEXTS:
        want = hf.encode(sample).ids
        assert tok.encode(sample) == want, (pre, sample)
        assert tok.decode(want) == hf.decode(want, skip_special_tokens=False)
    assert tok.vocab_size == hf.get_vocab_size(with_added_tokens=True)
    vocab = hf.get_vocab(with_added_tokens=True)
    assert text.eos_token_ids[0] == vocab["<|im_end|>"]
    assert set(text.eos_token_ids) == {vocab["<|im_end|>"], vocab["<|endoftext|>"]}
    assert text.chat_template.startswith("{% for m in messages %}")
    # control tokens are special (dropped by skip_special_tokens), user-defined ones are not
    ids = tok.encode("<|im_start|>hi<think>x</think><|im_end|>")
    assert ids[0] == vocab["<|im_start|>"] and vocab["<think>"] in ids
    assert tok.decode(ids, skip_special_tokens=True) == "hi<think>x</think>"
    assert tok.eos_token == "<|im_end|>"


def test_nfc_matters_for_qwen(tmp_path):
    """The normalizer is part of the family's entry: Qwen's NFC makes 'e' + combining acute one character."""
    hf = _byte_level_hf("qwen2")
    tok = tokenizer_from_gguf(_write_gguf(tmp_path / "m.gguf", _bpe_kv(hf, "qwen2"))).tokenizer
    assert tok.encode("cafe\u0301") == tok.encode("caf\u00e9")


def test_llama3_adds_bos(tmp_path):
    hf = _byte_level_hf("llama-bpe")
    kv = _bpe_kv(hf, "llama-bpe")
    kv["tokenizer.ggml.add_bos_token"] = ("bool", True)
    tok = tokenizer_from_gguf(_write_gguf(tmp_path / "m.gguf", kv)).tokenizer
    bos = hf.token_to_id("<|endoftext|>")
    assert tok.encode("hello world") == [bos, *hf.encode("hello world").ids]
    assert tok.encode("hello world", add_special_tokens=False) == hf.encode("hello world").ids


def test_fields_mapping_and_plain_values(tmp_path):
    """The fields of a reader, or a dict of plain values (a header read some other way), give the same ids."""
    hf = _byte_level_hf("qwen2")
    kv = _bpe_kv(hf, "qwen2")
    reader = _write_gguf(tmp_path / "m.gguf", kv)
    plain = {key: value for key, (_, value) in kv.items()}
    a = tokenizer_from_gguf(reader.fields).tokenizer
    b = tokenizer_from_gguf(plain).tokenizer
    for sample in TEXTS:
        assert a.encode(sample) == b.encode(sample) == hf.encode(sample).ids


@pytest.mark.parametrize("pre", [None, "default", "kimi-k2", "no-such-pre"])
def test_unknown_pre_is_one_typed_line(tmp_path, pre):
    hf = _byte_level_hf("gpt-2")
    kv = _bpe_kv(hf, "gpt-2")
    if pre is None:
        del kv["tokenizer.ggml.pre"]
    else:
        kv["tokenizer.ggml.pre"] = ("str", pre)
    with pytest.raises(TokenizerError) as info:
        tokenizer_from_gguf(_write_gguf(tmp_path / "m.gguf", kv), where="m.gguf")
    message = str(info.value)
    assert "\n" not in message and "m.gguf" in message and "tokenizer.json" in message
    if pre is not None:
        assert repr(pre) in message


def test_damaged_metadata_is_typed(tmp_path):
    hf = _byte_level_hf("gpt-2")
    kv = _bpe_kv(hf, "gpt-2")
    kv["tokenizer.ggml.token_type"] = ("arr", [1, 1, 1])
    with pytest.raises(TokenizerError, match="token_type has 3 entries"):
        tokenizer_from_gguf(_write_gguf(tmp_path / "a.gguf", kv))
    kv = _bpe_kv(hf, "gpt-2")
    kv["tokenizer.ggml.eos_token_id"] = ("u32", 10**6)
    with pytest.raises(TokenizerError, match="eos_token_id = 1000000 is not a token id"):
        tokenizer_from_gguf(_write_gguf(tmp_path / "b.gguf", kv))
    kv = _bpe_kv(hf, "gpt-2")
    kv["tokenizer.ggml.model"] = ("str", "rwkv")
    with pytest.raises(TokenizerError, match="'rwkv' is not one moechat can rebuild"):
        tokenizer_from_gguf(_write_gguf(tmp_path / "c.gguf", kv))
    with pytest.raises(TokenizerError, match="no tokenizer in the file"):
        tokenizer_from_gguf({"general.architecture": "qwen3moe"})


def test_harmony_turn_ends(tmp_path):
    """gpt-oss: <|return|> and <|call|> end generation, <|end|> (the end of one message) does not."""
    hf = _byte_level_hf("gpt-4o")
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|return|>", "<|call|>",
                                                                                   "<|end|>")])
    kv = _bpe_kv(hf, "gpt-4o")
    kv["tokenizer.ggml.eos_token_id"] = ("u32", hf.token_to_id("<|return|>"))
    text = tokenizer_from_gguf(_write_gguf(tmp_path / "m.gguf", kv))
    ids = set(text.eos_token_ids)
    assert {hf.token_to_id("<|return|>"), hf.token_to_id("<|call|>")} <= ids
    assert hf.token_to_id("<|end|>") not in ids


# ---- SentencePiece (tokenizer.ggml.model = "llama") ----

def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """An SPM-BPE vocabulary as llama.cpp's _create_vocab_sentencepiece writes one: <unk>, <s>, </s>, the 256
    byte pieces, then pieces in merge order with score = -rank (SentencePiece BPE's scores), the characters last."""
    trainer_tok = tokenizers.Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    trainer_tok.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(vocab_size=500, show_progress=False,
                                                                    limit_alphabet=150))
    data = json.loads(trainer_tok.to_str())
    merged = ["".join(m) if isinstance(m, list) else m.replace(" ", "") for m in data["model"]["merges"]]
    chars = [t for t in data["model"]["vocab"] if len(t) == 1]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    pieces = [(piece, -float(rank)) for rank, piece in enumerate(dict.fromkeys(merged + chars))]
    random.Random(0).shuffle(pieces)  # ids in another order than scores: the merge ranks must come from the scores
    for piece, score in pieces:
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
        scores.append(score)
    tokens.append("[PAD0]")
    types.append(gguf.TokenType.UNUSED)
    scores.append(-10000.0)
    return tokens, scores, [int(t) for t in types]


def _spm_reference(text: str, tokens: list[str], scores: list[float], types: list[int],
                   add_bos: bool = True, prefix: bool = True) -> list[int]:
    """The SentencePiece BPE algorithm, slowly: ' ' -> '▁' with one prepended, then repeatedly merge the
    adjacent pair whose concatenation is a piece with the highest score (leftmost on ties); characters that
    are no piece become their UTF-8 byte pieces."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    symbols = list(("▁" if prefix and text else "") + text.replace(" ", "▁"))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            piece = symbols[i] + symbols[i + 1]
            if piece in ids and (best is None or scores[ids[piece]] > scores[ids[best[1]]]):
                best = (i, piece)
        if best is None:
            break
        i, piece = best
        symbols[i:i + 2] = [piece]
    out = [1] if add_bos else []
    for s in symbols:
        if s in ids:
            out.append(ids[s])
        else:
            out.extend(tokens.index(f"<0x{b:02X}>") for b in s.encode("utf-8"))
    return out


def _spm_kv(tokens, scores, types) -> dict:
    return {
        "tokenizer.ggml.model": ("str", "llama"),
        "tokenizer.ggml.pre": ("str", "default"),
        "tokenizer.ggml.tokens": ("arr", tokens),
        "tokenizer.ggml.scores": ("arr", scores),
        "tokenizer.ggml.token_type": ("arr", types),
        "tokenizer.ggml.bos_token_id": ("u32", 1),
        "tokenizer.ggml.eos_token_id": ("u32", 2),
        "tokenizer.ggml.unknown_token_id": ("u32", 0),
        "tokenizer.ggml.add_bos_token": ("bool", True),
        "tokenizer.ggml.add_eos_token": ("bool", False),
    }


SPM_TEXTS = [t for t in TEXTS if "<|" not in t and "<think>" not in t and "\u0301" not in t] + [
    "ØÞß unknown chars 🦒 get byte pieces", "x",
]


def test_sentencepiece_matches_the_spm_algorithm(tmp_path):
    tokens, scores, types = _spm_vocab()
    text = tokenizer_from_gguf(_write_gguf(tmp_path / "m.gguf", _spm_kv(tokens, scores, types)))
    tok = text.tokenizer
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>" and text.eos_token_ids == (2,)
    for sample in SPM_TEXTS:
        ids = tok.encode(sample)
        assert ids == _spm_reference(sample, tokens, scores, types), sample
        assert tok.decode(ids, skip_special_tokens=True) == sample
    assert tok.encode("</s>", add_special_tokens=False) == [2]


def test_sentencepiece_without_space_prefix(tmp_path):
    tokens, scores, types = _spm_vocab()
    kv = _spm_kv(tokens, scores, types)
    kv["tokenizer.ggml.add_space_prefix"] = ("bool", False)
    kv["tokenizer.ggml.add_bos_token"] = ("bool", False)
    tok = tokenizer_from_gguf(_write_gguf(tmp_path / "m.gguf", kv)).tokenizer
    for sample in ("hello world", " the fox", "x"):
        ids = tok.encode(sample)
        assert ids == _spm_reference(sample, tokens, scores, types, add_bos=False, prefix=False)
        assert tok.decode(ids) == sample
    assert not tok.id_to_token(tok.encode("hello")[0]).startswith("▁")


def test_embedded_hf_json_wins(tmp_path):
    hf = _byte_level_hf("qwen2")
    kv = _bpe_kv(hf, "no-such-pre")
    kv["tokenizer.huggingface.json"] = ("str", hf.to_str())
    tok = tokenizer_from_gguf(_write_gguf(tmp_path / "m.gguf", kv)).tokenizer
    for sample in TEXTS:
        assert tok.encode(sample) == hf.encode(sample).ids


def test_the_demo_models_tokenizer_through_the_converters_steps(tmp_path):
    """The bundled demo model's tokenizer written as convert_hf_to_gguf.py's get_vocab_base writes it (vocab by
    id, added tokens pre-normalized, CONTROL when special or looking special), read back: the ids equal those of
    the safetensors folder's tokenizer (engine/text/tokenizer.py, itself tested equal to transformers')."""
    from pathlib import Path

    from moechat.engine.text.tokenizer import Tokenizer

    demo = Path(__file__).resolve().parents[2] / "assets" / "demo-moe"
    ref = Tokenizer.from_model_dir(demo)
    backend = ref.backend
    vocab = backend.get_vocab(with_added_tokens=True)
    reverse = {i: t for t, i in vocab.items()}
    decoder = backend.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(max(reverse) + 1):
        token = reverse.get(i, f"[PAD{i}]")
        kind = gguf.TokenType.UNUSED if i not in reverse else gguf.TokenType.NORMAL
        if i in decoder:
            if not decoder[i].normalized:
                token = backend.decode(backend.encode(token, add_special_tokens=False).ids, skip_special_tokens=False)
            looks = token.startswith("<|") and token.endswith("|>")
            kind = gguf.TokenType.CONTROL if decoder[i].special or looks else gguf.TokenType.USER_DEFINED
        tokens.append(token)
        types.append(int(kind))
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(backend.to_str())["model"]["merges"]]
    kv = {"tokenizer.ggml.model": ("str", "gpt2"), "tokenizer.ggml.pre": ("str", "gpt-2"),
          "tokenizer.ggml.tokens": ("arr", tokens), "tokenizer.ggml.token_type": ("arr", types),
          "tokenizer.ggml.merges": ("arr", merges), "tokenizer.ggml.eos_token_id": ("u32", ref.eos_token_id)}
    text = tokenizer_from_gguf(_write_gguf(tmp_path / "demo.gguf", kv))
    for sample in TEXTS + ["def f(x):\n    return x ** 2  # squares", "What does len() return?"]:
        ids = ref.encode(sample)
        assert text.tokenizer.encode(sample) == ids, sample
        assert text.tokenizer.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert ref.eos_token_id in text.eos_token_ids and text.tokenizer.eos_token == ref.eos_token


def test_tokens_that_are_not_utf8_are_typed(tmp_path):
    hf = _byte_level_hf("gpt-2")
    kv = _bpe_kv(hf, "gpt-2")
    _write_gguf(tmp_path / "m.gguf", kv)
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "m.gguf").write_bytes(data.replace(b"<|im_start|>", b"<|im_st\xffrt|>"))  # same length
    with pytest.raises(TokenizerError, match="tokenizer.ggml.tokens holds bytes that are not UTF-8"):
        tokenizer_from_gguf(gguf.GGUFReader(str(tmp_path / "m.gguf")))


# ---- Gemma 4 (tokenizer.ggml.model = "gemma4") ----

GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
GEMMA_CONTROL = ("<|turn>", "<turn|>")  # special in HF, CONTROL in the file
GEMMA_VISIBLE = ("<|channel>", "<channel|>")  # llama.cpp's converter writes these USER_DEFINED, always rendered


def _gemma_hf():
    """transformers' GemmaTokenizer (the class Gemma 4 ships with) over a small vocabulary trained on CORPUS: the
    five specials, the 256 byte pieces, the trained pieces; the turn and channel markers as added tokens."""
    from transformers import GemmaTokenizer

    trainer_tok = tokenizers.Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Replace(" ", "▁")
    trainer_tok.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(vocab_size=450, show_progress=False,
                                                                    limit_alphabet=120))
    data = json.loads(trainer_tok.to_str())
    vocab = {t: i for i, t in enumerate(GEMMA_SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in sorted(data["model"]["vocab"], key=data["model"]["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    hf = GemmaTokenizer(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges])
    hf.add_special_tokens({"additional_special_tokens": list(GEMMA_CONTROL + GEMMA_VISIBLE)})
    return hf, merges


def _gemma_kv(hf, merges) -> dict:
    """What conversion/gemma.py's Gemma4Model.set_vocab writes for `hf`."""
    vocab = hf.get_vocab()
    reverse = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(max(vocab.values()) + 1):
        text = reverse[i]
        tokens.append(text)
        if text in GEMMA_VISIBLE:
            types.append(gguf.TokenType.USER_DEFINED)
        elif text == "<unk>":
            types.append(gguf.TokenType.UNKNOWN)
        elif text in GEMMA_SPECIALS or text in GEMMA_CONTROL:
            types.append(gguf.TokenType.CONTROL)
        elif text.startswith("<0x") and len(text) == 6:
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    return {
        "tokenizer.ggml.model": ("str", "gemma4"),
        "tokenizer.ggml.tokens": ("arr", tokens),
        "tokenizer.ggml.scores": ("arr", [0.0] * len(tokens)),
        "tokenizer.ggml.token_type": ("arr", [int(t) for t in types]),
        "tokenizer.ggml.merges": ("arr", merges),
        "tokenizer.ggml.bos_token_id": ("u32", vocab["<bos>"]),
        "tokenizer.ggml.eos_token_id": ("u32", vocab["<eos>"]),
        "tokenizer.ggml.unknown_token_id": ("u32", vocab["<unk>"]),
        "tokenizer.ggml.padding_token_id": ("u32", vocab["<pad>"]),
        "tokenizer.ggml.add_space_prefix": ("bool", False),
        "tokenizer.ggml.add_bos_token": ("bool", True),
    }


def test_gemma4_matches_transformers_gemma_tokenizer(tmp_path):
    hf, merges = _gemma_hf()
    text = tokenizer_from_gguf(_write_gguf(tmp_path / "m.gguf", _gemma_kv(hf, merges)))
    tok = text.tokenizer
    bos = hf.convert_tokens_to_ids("<bos>")
    samples = [*TEXTS, "<|turn>user\n丂 hi  there<turn|>\n<|turn>model\n<|channel>thought\nok<channel|>Hi",
               "tabs\tand\u00a0nbsp and \U0001f999 llamas"]
    byte_fallback = False
    for sample in samples:
        want = hf.encode(sample, add_special_tokens=False)
        assert tok.encode(sample, add_special_tokens=False) == want, sample
        assert tok.encode(sample) == [bos, *want]  # add_bos_token, as Gemma's files set it
        assert tok.decode(want) == hf.decode(want)
        byte_fallback |= any(hf.convert_ids_to_tokens(i).startswith("<0x") for i in want)
    assert byte_fallback  # the unseen characters went through the byte pieces, not <unk>
    assert text.eos_token_ids[0] == hf.convert_tokens_to_ids("<eos>") and text.bos_token_id == bos
    # The channel markers are kept whole and shown (USER_DEFINED), the turn markers are special.
    ids = tok.encode("<|channel>thought\nx<channel|><turn|>", add_special_tokens=False)
    assert ids[0] == hf.convert_tokens_to_ids("<|channel>")
    assert tok.decode(ids, skip_special_tokens=True) == "<|channel>thought\nx<channel|>"
