"""bench/vs_llamacpp.py's parts that need no llama.cpp: the tokenizer it gives the converter, how it reads a build's
flags (AMX on or off), the messages when llama.cpp is absent, and the per-child peak RSS.

The bench's model writers and llama.cpp runs take minutes and gigabytes; the bench run itself checks them.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

_spec = importlib.util.spec_from_file_location("vs_llamacpp", Path(__file__).parents[1] / "bench" / "vs_llamacpp.py")
vs = importlib.util.module_from_spec(_spec)
sys.modules["vs_llamacpp"] = vs  # dataclasses look their module up by name
_spec.loader.exec_module(vs)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    vs.write_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def test_tokenizer_is_bytes_merges_and_an_end_token(tokenizer):
    vocab = tokenizer.get_vocab()
    n = 256 + len(vs.MERGES)
    assert len(vocab) == n + 1 and vocab["<|endoftext|>"] == n and tokenizer.eos_token_id == n
    # one token per UTF-8 byte but for the merges (llama.cpp will not load a BPE vocabulary without any)
    assert len(tokenizer.encode("héllo", add_special_tokens=False)) == len("héllo".encode())
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode(" the", add_special_tokens=False)) == ["Ġt", "he"]
    # below both models' vocabularies, as the converter asserts before padding with unused tokens
    assert max(vocab.values()) < min(vs.QWEN3["vocab_size"], vs.GPT_OSS["vocab_size"])


@settings(max_examples=40, deadline=2000)
@given(st.text(max_size=40))
def test_tokenizer_round_trips_any_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def _build(tmp_path, **flags) -> Path:
    (tmp_path / "bin").mkdir()
    for tool in ("llama-bench", "llama-quantize"):
        (tmp_path / "bin" / tool).write_text("")
    lines = [f"CMAKE_HOME_DIRECTORY:INTERNAL={tmp_path / 'src'}", "CMAKE_BUILD_TYPE:STRING=Release"]
    lines += [f"{k}:BOOL={v}" for k, v in flags.items()]
    (tmp_path / "CMakeCache.txt").write_text("# comment\n" + "\n".join(lines) + "\n")
    return tmp_path


@pytest.mark.parametrize("has_amx", [True, False])
def test_native_build_has_amx_exactly_when_the_cpu_does(tmp_path, monkeypatch, has_amx):
    # -march=native turns AMX on whatever GGML_AMX_* say: the CPU decides, not the option
    monkeypatch.setattr(vs, "_cpu_has_amx", lambda: has_amx)
    src, how = vs.describe_build(_build(tmp_path, GGML_NATIVE="ON", GGML_AMX_INT8="OFF"), "--llama-cpp")
    assert src == tmp_path / "src"
    assert ("AMX on" if has_amx else "AMX off") in how and "GGML_NATIVE=ON" in how and "Release" in how


@pytest.mark.parametrize("amx_int8, word", [("ON", "AMX on"), ("OFF", "AMX off")])
def test_non_native_build_follows_the_amx_options(tmp_path, monkeypatch, amx_int8, word):
    monkeypatch.setattr(vs, "_cpu_has_amx", lambda: True)
    _, how = vs.describe_build(_build(tmp_path, GGML_NATIVE="OFF", GGML_AMX_INT8=amx_int8), "MOECHAT_LLAMA_CPP")
    assert word in how and f"GGML_AMX_INT8={amx_int8}" in how


def test_find_llama_cpp_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.delenv("MOECHAT_LLAMA_CPP", raising=False)
    llama, why = vs.find_llama_cpp(None, None)
    assert llama is None and "--build-llama-cpp" in why and "MOECHAT_LLAMA_CPP" in why
    monkeypatch.setenv("MOECHAT_LLAMA_CPP", str(tmp_path))
    llama, why = vs.find_llama_cpp(None, None)
    assert llama is None and str(tmp_path) in why and "llama-bench" in why
    _build(tmp_path, GGML_NATIVE="ON")
    llama, why = vs.find_llama_cpp(None, None)
    assert why == "" and llama.bin == tmp_path / "bin" and llama.src == tmp_path / "src"
    assert llama.how.startswith("MOECHAT_LLAMA_CPP: ")


def test_converter_check_names_the_missing_source(tmp_path):
    llama = vs.LlamaCpp(tmp_path / "bin", tmp_path / "src", "test")
    assert "--llama-src" in vs.check_converter(llama)


def test_peak_rss_is_the_childs_own(tmp_path):
    # 300 MB touched in the child; the parent's own size does not count (wait4 reports that child alone)
    code = "import numpy as np; a = np.ones(300_000_000 // 8); print(a.sum())"
    out, rss = vs.run_measured([sys.executable, "-c", code])
    assert out.strip() == str(float(300_000_000 // 8)) and 0.3 <= rss < 1.5
    _, small = vs.run_measured([sys.executable, "-c", "pass"])
    assert small < 0.1  # a plain interpreter, not the pytest process it was started from


def test_a_failing_child_is_one_line_naming_its_last_words():
    with pytest.raises(vs.BenchError, match=r"exited 3: boom$"):
        vs.run_measured([sys.executable, "-c", "import sys; sys.stderr.write('first\\nboom\\n'); sys.exit(3)"])


def test_tiny_qwen3_through_the_converter_and_llama_bench(tmp_path):
    """With a llama.cpp build named by MOECHAT_LLAMA_CPP: the patched pre-tokenizer check lets the converter take the
    bench's tokenizer, llama-bench's JSON parses, and the GGUF's bytes per token are the shapes' bf16 bytes."""
    llama, why = vs.find_llama_cpp(None, None)
    if llama is None or vs.check_converter(llama):
        pytest.skip(why or vs.check_converter(llama))
    import torch
    import transformers

    H, I, E, K, L, V = 64, 32, 8, 2, 2, 512
    config = transformers.AutoConfig.for_model(
        "qwen3_moe", vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, moe_intermediate_size=I, intermediate_size=128, num_experts=E, num_experts_per_tok=K,
        max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model_dir = tmp_path / "tiny"
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(model_dir)
    vs.write_tokenizer(model_dir)
    gguf = vs.convert(llama, model_dir, tmp_path / "tiny-bf16.gguf", "bf16")
    b = vs.gguf_token_bytes(llama, gguf, K, E)
    attention = L * (H * 64 + 2 * H * 32 + 64 * H) * 2  # q, k, v, o in bf16 (q/k norms left out)
    assert b == {"attention": attention, "lm_head": V * H * 2, "experts": L * 3 * E * I * H * 2 * K // E}
    rec = vs.llama_bench(llama, gguf, 1, 8, 2)
    assert rec["prefill"] > 0 and rec["decode"] > 0 and 0 < rec["rss_gb"] < 2 and "llama.cpp" in rec["info"]
