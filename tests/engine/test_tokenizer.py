"""moechat.engine.text.tokenizer against transformers, on tokenizers trained here with `tokenizers`.

Four tokenizers, wrapped in transformers' PreTrainedTokenizerFast, saved with save_pretrained and given
real-looking tokenizer_config.json files:
- "bytelevel": GPT-2/Qwen style byte-level BPE, Qwen3-like config (no BOS, eos <|im_end|>, a
  non-special added token <think>);
- "llama": SentencePiece-like BPE (Metaspace pre-tokenizer, byte_fallback, <0xNN> tokens in the vocab,
  TemplateProcessing adding <s>) with Llama/Mixtral's decoder and a Mixtral-like config (add_bos_token,
  which transformers 5.24 ignores when tokenizer.json exists, AddedToken dicts);
- "mixtral": the same model with Mixtral's actual tokenizer.json pipeline (Prepend + Replace normalizer,
  no pre-tokenizer);
- "metaspace": the same model with a ByteFallback + Metaspace decoder (newer Mistral-style).
PreTrainedTokenizerFast.from_pretrained (tokenizer.json as is) is the oracle for encode/decode;
decode(all ids) is the oracle for streaming.
"""

from __future__ import annotations

import functools
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from moechat.engine.errors import TokenizerError
from moechat.engine.text.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

CORPUS = [
    "Hello world, héllo wörld! The quick brown fox jumps over the lazy dog.",
    "Ça va? Déjà vu, naïve café, smörgåsbord, façade, jalapeño, Übermensch.",
    "你好，世界。我们今天去公园散步，天气很好。中文分词很有趣。",
    "日本語のテキストも少し。こんにちは、元気ですか？",
    "Emoji time 😀🎉🚀 and more 👍🏽 family 👨‍👩‍👧 flags 🇫🇷.",
    "def main():\n    print('hi')  # code\n\treturn 42\n",
    "Numbers 12345 67890 3.14159 and symbols @#$%^&*()[]{}<>",
    "Привет, мир! Ελληνικά κείμενα. مرحبا بالعالم",
]
TEXTS = CORPUS + [
    "", " ", "  leading and trailing  ", "\n\n", "a", "☃ snowman not in training ☃",
    "mixed 你好 world 😀 café", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>",
    "<s>[INST] hello [/INST] answer</s>", "tabs\tand\nnewlines\r\n", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝟙𝟚𝟛",
    "\u00e9 vs e\u0301",
]
EXAMPLES = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache  # training is the slow part; transformers copies the object it wraps
def _train_bytelevel() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=700, min_frequency=1, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3, trainer)
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False)])  # Qwen3: not special
    return tok


@functools.cache
def _train_sentencepiece_like(decoder: str) -> HFTokenizer:
    # Train merges on a few characters only, so that the rest must go through byte fallback.
    base = HFTokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    base.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(vocab_size=500, limit_alphabet=60,
                                                             show_progress=False))
    trained = json.loads(base.to_str())["model"]
    # Llama's layout: <unk> <s> </s>, then the 256 byte tokens, then the learned pieces.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                                 fuse_unk=True))
    if decoder == "mixtral":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    if decoder in ("llama", "mixtral"):
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    else:
        tok.decoder = decoders.Sequence([decoders.ByteFallback(),
                                         decoders.Metaspace(replacement="▁", prepend_scheme="first")])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok


def _save(tmp_path_factory, kind: str):
    """Save with transformers, then make tokenizer_config.json look like the real model's."""
    path = tmp_path_factory.mktemp(kind)
    if kind == "bytelevel":
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=_train_bytelevel(), eos_token="<|im_end|>",
                                                  pad_token="<|endoftext|>")
    else:
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=_train_sentencepiece_like(kind),
                                                  bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.save_pretrained(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    if kind == "bytelevel":  # Qwen3-like
        config.update(add_bos_token=False, bos_token=None, errors="replace", split_special_tokens=False,
                      additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    else:  # Mixtral-like: AddedToken dicts, add_bos_token (ignored by transformers 5.24 with tokenizer.json)
        config.update(add_bos_token=True, add_eos_token=False, legacy=True, pad_token=None,
                      bos_token={"__type": "AddedToken", "content": "<s>", "lstrip": False,
                                 "normalized": False, "rstrip": False, "single_word": False})
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module", params=["bytelevel", "llama", "mixtral", "metaspace"])
def pair(request, tmp_path_factory):
    """(moechat Tokenizer, transformers tokenizer) loaded from the same folder."""
    path = _save(tmp_path_factory, request.param)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    return Tokenizer.from_model_dir(path), hf


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return Tokenizer.from_model_dir(_save(tmp_path_factory, "llama"))


def _stream(tok: Tokenizer, ids, **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


texts = st.one_of(st.sampled_from(TEXTS), st.text(max_size=40),
                  st.lists(st.sampled_from(TEXTS + ["😀", "é", "中", " ", "<s>", "</s>", "<|im_end|>"]),
                           max_size=8).map("".join))


# --- encode / decode / attributes against transformers ---------------------------------------------------

@EXAMPLES
@given(text=texts)
def test_encode_matches_transformers(pair, text):
    ours, hf = pair
    assert ours.encode(text) == hf.encode(text, add_special_tokens=True)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@EXAMPLES
@given(data=st.data())
def test_decode_matches_transformers(pair, data):
    ours, hf = pair
    ids = data.draw(st.lists(st.integers(0, ours.vocab_size - 1), max_size=30))
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_real_texts_round_trip(pair):
    ours, hf = pair
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text)
        assert ours.decode(ids) == hf.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_attributes_match_transformers(pair):
    ours, hf = pair
    assert ours.vocab_size == len(hf)
    assert (ours.bos_token, ours.bos_token_id) == (hf.bos_token, hf.bos_token_id)
    assert (ours.eos_token, ours.eos_token_id) == (hf.eos_token, hf.eos_token_id)
    assert set(hf.all_special_ids) <= ours.all_special_ids
    for name, value in ours.special_tokens.items():
        assert getattr(hf, name) == value
    vocab = hf.get_vocab()
    for token in ("<think>", "<|im_end|>", "<s>", "<0x41>", "▁the", "Ġthe"):
        assert ours.token_to_id(token) == vocab.get(token)
    for token_id in (0, 1, 2, ours.vocab_size - 1):
        assert ours.id_to_token(token_id) == hf.convert_ids_to_tokens(token_id)
    assert ours.token_to_id("definitely-not-a-token") is None
    assert ours.id_to_token(10**9) is None


def test_special_tokens_of_each_config(tmp_path_factory):
    qwen = Tokenizer.from_model_dir(_save(tmp_path_factory, "bytelevel"))
    assert qwen.bos_token is None and qwen.bos_token_id is None
    assert qwen.eos_token == "<|im_end|>" and qwen.special_tokens["pad_token"] == "<|endoftext|>"
    assert qwen.encode("hi", add_special_tokens=True) == qwen.encode("hi", add_special_tokens=False)
    think = qwen.token_to_id("<think>")
    assert think not in qwen.all_special_ids and qwen.decode([think], skip_special_tokens=True) == "<think>"
    mixtral = Tokenizer.from_model_dir(_save(tmp_path_factory, "llama"))
    assert mixtral.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert (mixtral.bos_token_id, mixtral.eos_token_id) == (1, 2)
    assert mixtral.encode("hi")[0] == 1 and mixtral.encode("hi", add_special_tokens=False)[0] != 1


@pytest.mark.parametrize("flags", [{"add_bos_token": False}, {"add_eos_token": True},
                                   {"add_bos_token": True, "add_eos_token": True}])
def test_add_bos_eos_flags_like_transformers(tmp_path_factory, flags):
    # transformers 5.24 drops these flags when tokenizer.json exists: its post-processor decides.
    path = _save(tmp_path_factory, "llama")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(flags)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = Tokenizer.from_model_dir(path), transformers.PreTrainedTokenizerFast.from_pretrained(path)
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text)


def test_special_token_missing_from_vocab_is_added_like_transformers(tmp_path_factory):
    path = _save(tmp_path_factory, "metaspace")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(pad_token="<pad>", extra_special_tokens=["<extra_0>"])
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = Tokenizer.from_model_dir(path), transformers.PreTrainedTokenizerFast.from_pretrained(path)
    assert ours.vocab_size == len(hf)
    assert ours.token_to_id("<pad>") == hf.pad_token_id is not None
    assert ours.token_to_id("<extra_0>") in ours.all_special_ids
    text = "a<pad>b <extra_0> c"
    assert ours.encode(text) == hf.encode(text)
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_legacy_special_tokens_map(tmp_path_factory):
    # Without added_tokens_decoder in tokenizer_config.json, transformers reads special_tokens_map.json too.
    path = _save(tmp_path_factory, "bytelevel")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("added_tokens_decoder", None)
    config.pop("eos_token", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": {"content": "<|endoftext|>", "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False}, "pad_token": "<|im_end|>"}))
    ours, hf = Tokenizer.from_model_dir(path), transformers.PreTrainedTokenizerFast.from_pretrained(path)
    assert (ours.eos_token, ours.eos_token_id) == (hf.eos_token, hf.eos_token_id) == ("<|endoftext|>", 0)
    assert ours.special_tokens["pad_token"] == hf.pad_token == "<|im_end|>"


# --- errors ---------------------------------------------------------------------------------------------

def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match=str(tmp_path)):
        Tokenizer.from_model_dir(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\x00sentencepiece")
    with pytest.raises(TokenizerError, match="needs tokenizer.json") as err:
        Tokenizer.from_model_dir(tmp_path)
    assert "tokenizer.model" in str(err.value) and str(tmp_path) in str(err.value)
    with pytest.raises(TokenizerError, match="not a directory"):
        Tokenizer.from_model_dir(tmp_path / "nope")


def test_unreadable_files(tmp_path, llama):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text(llama.backend.to_str())
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_model_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    assert Tokenizer.from_model_dir(tmp_path).encode("hello") == llama.encode("hello")  # config optional


# --- streaming --------------------------------------------------------------------------------------------

def _check_stream(tok: Tokenizer, ids: list[int], skip: bool = True) -> None:
    deltas = _stream(tok, ids, skip_special_tokens=skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


@EXAMPLES
@given(data=st.data())
def test_stream_random_ids_equals_decode(pair, data):
    tok, _ = pair
    # Bias toward the interesting ids: specials, byte tokens (3..258 in "llama") and multi-byte pieces.
    ids = data.draw(st.lists(st.one_of(st.integers(0, tok.vocab_size - 1), st.integers(0, 300)), max_size=40))
    _check_stream(tok, ids, skip=True)
    _check_stream(tok, ids, skip=False)


@EXAMPLES
@given(text=texts)
def test_stream_real_text_equals_decode(pair, text):
    tok, _ = pair
    ids = tok.encode(text)
    _check_stream(tok, ids, skip=True)
    _check_stream(tok, ids, skip=False)
    plain = tok.encode(text, add_special_tokens=False)
    assert "".join(_stream(tok, plain)) == tok.decode(plain, skip_special_tokens=True)


def test_stream_never_splits_a_character(pair):
    tok, _ = pair
    for text in ["中文 😀👨‍👩‍👧 café", "☃☃☃ snow", "🇫🇷🇫🇷 flags", "x😀"]:
        deltas = _stream(tok, tok.encode(text))
        assert "".join(deltas) == tok.decode(tok.encode(text), skip_special_tokens=True)
        assert all("\ufffd" not in d for d in deltas)


def test_stream_skips_special_tokens(pair):
    tok, _ = pair
    special = sorted(tok.all_special_ids)
    ids = [special[0]] + tok.encode("hello world", add_special_tokens=False) + [special[-1]]
    assert "".join(_stream(tok, ids)) == tok.decode(ids, skip_special_tokens=True)
    assert not any(tok.id_to_token(s) in "".join(_stream(tok, ids)) for s in special)
    with_specials = "".join(_stream(tok, ids, skip_special_tokens=False))
    assert with_specials == tok.decode(ids) and tok.id_to_token(special[0]) in with_specials



def test_stream_keeps_the_named_special_tokens(pair):
    # A reasoning parser needs some special tokens (harmony's <|channel|>...) in the text; the rest stay out.
    tok, _ = pair
    special = sorted(tok.all_special_ids)
    kept, dropped = special[0], special[-1]
    words = tok.encode("hello world", add_special_tokens=False)
    ids = [kept, *words, dropped, kept, *words, kept]
    text = "".join(_stream(tok, ids, keep=[tok.id_to_token(kept), "<|not-in-vocab|>"]))
    assert text == tok.decode([i for i in ids if i != dropped])
    assert text.count(tok.id_to_token(kept)) == 3 and tok.id_to_token(dropped) not in text
    # Kept tokens in the prompt are context like any other token.
    after = "".join(_stream(tok, words, prompt_ids=[kept], keep=[tok.id_to_token(kept)]))
    assert tok.decode([kept]) + after == tok.decode([kept, *words])

def test_stream_after_prompt_keeps_leading_space(pair):
    tok, _ = pair
    rng = random.Random(0)
    for _ in range(30):
        prompt, answer = rng.choice(TEXTS[:8]), rng.choice(TEXTS[:8])
        full = prompt + " " + answer
        ids = tok.encode(full)
        cut = len(tok.encode(prompt))
        # Only where the prompt's tokens are a prefix of the whole (tokenization is not always additive).
        if ids[:cut] != tok.encode(prompt):
            continue
        prompt_ids, generated = ids[:cut], ids[cut:]
        deltas = _stream(tok, generated, prompt_ids=prompt_ids)
        head = tok.decode(prompt_ids, skip_special_tokens=True)
        whole = tok.decode(ids, skip_special_tokens=True)
        assert whole.startswith(head)
        assert "".join(deltas) == whole[len(head):]


def test_stream_first_token_after_prompt_metaspace(llama):
    prompt = llama.encode("[INST] hi [/INST]")
    answer = llama.encode("Hello there", add_special_tokens=False)  # "▁Hello" piece after the prompt
    assert "".join(_stream(llama, answer, prompt_ids=prompt)) == " Hello there"
    assert "".join(_stream(llama, answer)) == "Hello there"  # no context: like decode(answer)


def test_byte_fallback_character_is_emitted_whole(llama):
    ids = llama.encode("a☃b", add_special_tokens=False)
    assert any(llama.id_to_token(i).startswith("<0x") for i in ids)
    detok = IncrementalDetokenizer(llama)
    deltas = [detok.add(i) for i in ids]
    assert "☃" in deltas or "☃b" in deltas or any("☃" in d for d in deltas)
    assert all("\ufffd" not in d for d in deltas)
    assert detok.text + detok.flush() == "a☃b"


def test_stream_window_stays_small(pair, monkeypatch):
    tok, _ = pair
    # Text spelled with the trained pieces: a run of byte-fallback tokens is held (and so decoded) whole.
    ids = tok.encode(" ".join([CORPUS[0], CORPUS[5], CORPUS[6]]) * 30, add_special_tokens=False)
    assert len(ids) > 1000
    sizes = []
    original = IncrementalDetokenizer._decode

    def spy(self, window):
        sizes.append(len(window))
        return original(self, window)

    monkeypatch.setattr(IncrementalDetokenizer, "_decode", spy)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert max(sizes) <= 16  # a window of a few tokens, not the whole text


# -- a tokenizer that does not fit the model (issue 25) --------------------------------------------------------

def _model_with_vocab(tmp_path_factory, tiny_chat_model, vocab_size: int):
    """A tiny qwen3_moe with `vocab_size` embedding rows beside tiny_chat_model's tokenizer (~400 tokens)."""
    import shutil

    from tests.conftest import TINY_MODELS, build_tiny_model

    source = tiny_chat_model[0]
    path = tmp_path_factory.mktemp(f"vocab_{vocab_size}")
    build_tiny_model(path, "qwen3_moe", dict(TINY_MODELS["qwen3_moe"][1], vocab_size=vocab_size), seed=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path


def test_a_tokenizer_with_ids_past_the_embedding_is_refused(tmp_path_factory, tiny_chat_model):
    """Old: ids past the embedding reached the model (an index error mid-prefill, or garbage on a GPU)."""
    from moechat.engine.runtime.generate import Engine

    tok = Tokenizer.from_model_dir(tiny_chat_model[0])
    path = _model_with_vocab(tmp_path_factory, tiny_chat_model, 300)
    with pytest.raises(TokenizerError) as e:
        Engine.load(path, dtype="float32", context=64)
    message = str(e.value)
    assert f"{tok.vocab_size:,} tokens (ids up to {tok.max_id:,})" in message and "vocab_size is 300" in message
    assert "\n" not in message


def test_a_tokenizer_far_smaller_than_the_embedding_gets_a_notice(tmp_path_factory, tiny_chat_model):
    """Old: a 400-token tokenizer on a 4,096-row model ran and printed garbage, silently."""
    from moechat.engine.runtime.generate import Engine

    tok = Tokenizer.from_model_dir(tiny_chat_model[0])
    engine = Engine.load(_model_with_vocab(tmp_path_factory, tiny_chat_model, 4096), dtype="float32", context=64)
    assert len(engine.notices) == 1
    assert f"{tok.vocab_size:,} tokens but the model has 4,096 embedding rows" in engine.notices[0]


def test_a_padded_embedding_is_normal(tmp_path_factory, tiny_chat_model):
    """Real models pad their rows past the tokenizer (Qwen3: 151,669 tokens, 151,936 rows): no notice."""
    from moechat.engine.runtime.generate import Engine

    tok = Tokenizer.from_model_dir(tiny_chat_model[0])
    assert Engine.load(tiny_chat_model[0], dtype="float32", context=64).notices == []
    padded = _model_with_vocab(tmp_path_factory, tiny_chat_model, tok.max_id + 1 + 256)
    assert Engine.load(padded, dtype="float32", context=64).notices == []
    assert tok.check_fits(tok.max_id + 1, "m") is None
    with pytest.raises(TokenizerError):
        tok.check_fits(tok.max_id, "m")
    assert tok.check_fits(2 * tok.vocab_size + 1, "m") is not None and tok.check_fits(2 * tok.vocab_size, "m") is None
