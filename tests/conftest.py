"""Shared fixtures: tiny random MoE checkpoints written by transformers itself (the reference).

Each is built with a fixed seed and saved with `save_pretrained` (safetensors, per-expert names as on
the Hub), once per test session. initializer_range is large so logits and router scores are spread
out: greedy ties between implementations that differ by 1e-7 would make an oracle test flaky.
"""

from __future__ import annotations

import json

import huggingface_hub.constants  # noqa: F401  (see below)
import pytest
import torch

# huggingface_hub reads HF_HUB_OFFLINE once, at its import, into constants.HF_HUB_OFFLINE, and moechat's is_offline()
# falls back to that constant when the variable is unset. Imported here, before any test sets the variable with
# monkeypatch, it holds the real environment's value; imported first inside such a test, it would stay "offline"
# for every later test of the session (test_fit's offline case, then test_hub_gguf's listing, failed so).

TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=16,
            initializer_range=0.2, max_position_embeddings=512, rms_norm_eps=1e-6)

# name -> (model_type, config overrides). Covers GQA ratios 1, 2 and 4, top-k 1..3, norm_topk_prob
# true and false, a dense layer between MoE layers, sliding-window attention and clip_qkv.
TINY_MODELS = {
    "qwen3_moe": ("qwen3_moe", dict(num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True)),
    "qwen3_moe_dense_layer": ("qwen3_moe", dict(num_key_value_heads=1, num_experts=6, num_experts_per_tok=3,
                                                moe_intermediate_size=24, intermediate_size=80,
                                                norm_topk_prob=False, mlp_only_layers=[1])),
    "mixtral": ("mixtral", dict(num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                                intermediate_size=48, eos_token_id=None, bos_token_id=None)),
    "mixtral_window": ("mixtral", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=1,
                                       intermediate_size=48, sliding_window=7, eos_token_id=None)),
    "olmoe": ("olmoe", dict(num_key_value_heads=2, num_experts=6, num_experts_per_tok=3, intermediate_size=32,
                            norm_topk_prob=False, eos_token_id=None, pad_token_id=None)),
    "olmoe_clip": ("olmoe", dict(num_key_value_heads=4, num_experts=6, num_experts_per_tok=2,
                                 intermediate_size=32, norm_topk_prob=True, clip_qkv=0.5, eos_token_id=None,
                                 pad_token_id=None)),
}


@pytest.fixture(autouse=True)
def _unpin_native_threads():
    """`set_threads` (the CLI, the app's bridge, tests of it) pins native.c's pool at its count; after each test the
    pool follows torch's count again, so a test that varies torch.set_num_threads measures what it says."""
    yield
    import sys

    native = sys.modules.get("moechat.engine.quant.native")
    lib = native._STATE.get("lib") if native is not None else None
    if lib is not None and getattr(lib, "moechat_pinned", None) is not None:
        native.pin_threads(lib, None)


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path_factory, monkeypatch):
    """Routing profiles and other cache files go to a fresh directory per test, never to ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg_cache")))


def build_tiny_model(path, model_type: str, overrides: dict, seed: int = 0):
    """Save a random tiny model of this type with transformers; return the transformers model."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """name -> (directory, transformers model), built once per session."""
    out = {}
    for i, (name, (model_type, overrides)) in enumerate(TINY_MODELS.items()):
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, build_tiny_model(path, model_type, overrides, seed=i))
    return out


def pytest_generate_tests(metafunc):
    """A test taking `tiny_name` runs once per tiny architecture variant."""
    if "tiny_name" in metafunc.fixturenames:
        metafunc.parametrize("tiny_name", list(TINY_MODELS))


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    """A tiny qwen3_moe with a real byte-level BPE tokenizer and a ChatML template: a chat model's files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("chat_model")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["The quick brown fox jumps over the lazy dog. Hello world, how are you? Experts route tokens.",
            "Ünïcödé text, 漢字, emoji 🙂 and numbers 1234567890."] * 50
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML)
    fast.save_pretrained(path)
    overrides = dict(TINY_MODELS["qwen3_moe"][1], vocab_size=tok.get_vocab_size(),
                     eos_token_id=tok.token_to_id("<|im_end|>"))
    model = build_tiny_model(path, "qwen3_moe", overrides, seed=42)
    return path, model, fast


# A harmony template cut down to what the engine relies on (the real one is tested in test_shared_templates.py):
# reasoning_effort with its "medium" default, a final-channel history that refuses channel tags in content.
HARMONY_TEMPLATE = (
    '{{- "<|start|>system<|message|>Reasoning: " + (reasoning_effort if reasoning_effort is defined else "medium") '
    '+ "<|end|>" -}}{%- for m in messages -%}{%- if m.role == "assistant" -%}'
    '{%- if "<|channel|>" in m.content %}{{ raise_exception("channel tags in content") }}{% endif -%}'
    '{{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|end|>" -}}'
    '{%- else -%}{{- "<|start|>" + m.role + "<|message|>" + m.content + "<|end|>" -}}{%- endif -%}{%- endfor -%}'
    '{%- if add_generation_prompt %}<|start|>assistant{% endif -%}'
)
HARMONY_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                    "<|end|>", "<|message|>", "<|call|>", "<|channel>", "<channel|>"]  # the last two: Gemma 4's


@pytest.fixture(scope="session")
def tiny_harmony_model(tmp_path_factory):
    """A tiny qwen3_moe speaking gpt-oss's chat format: harmony markers are special tokens, <|return|> and
    <|call|> stop it. Random weights never write harmony, so tests script the sampled ids (see script_sampler)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("harmony_model")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=HARMONY_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["analysis final commentary assistant user system Reasoning: think answer"] * 50,
                            trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|return|>",
                                   pad_token="<|endoftext|>", chat_template=HARMONY_TEMPLATE)
    fast.save_pretrained(path)
    stops = [tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]
    overrides = dict(TINY_MODELS["qwen3_moe"][1], vocab_size=tok.get_vocab_size(), eos_token_id=stops)
    build_tiny_model(path, "qwen3_moe", overrides, seed=7)
    # After save_pretrained, which writes its own: gpt-oss stops on <|return|> and <|call|>.
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": stops, "do_sample": False}))
    return path, fast


@pytest.fixture
def script_sampler(monkeypatch):
    """script_sampler(ids): the engine samples exactly these ids, in order, whatever the logits say."""

    def install(ids):
        script = iter(list(ids))

        class Scripted:
            def __init__(self, *args, **kwargs):
                pass

            def __call__(self, logits, seen=None):
                return next(script)

        monkeypatch.setattr("moechat.engine.runtime.generate.Sampler", Scripted)

    return install

def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA; bench/gpu_check.sh runs them on a machine that has it."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run bench/gpu_check.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# -- a local Hugging Face Hub (tests/hubserver.py) serving a tiny sharded chat model -----------------------------

def _hubserver_module():
    """tests/hubserver.py, loaded by path (tests are not a package under --import-mode=importlib)."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "moechat_tests_hubserver"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("hubserver.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return sys.modules[name]


HUB_REPO = "tiny-org/chat-moe"
HUB_GATED = "tiny-org/gated-moe"
HUB_TOKEN = "hf_test_token_approved"


@pytest.fixture(scope="session")
def hub_repo_dir(tiny_chat_model, tmp_path_factory):
    """The tiny chat model as a Hub repo: 3+ safetensors shards with an index, tokenizer, chat template, plus
    files moechat must never fetch (pickle weights, a README)."""
    import shutil

    src, model, _ = tiny_chat_model
    path = tmp_path_factory.mktemp("hub_repo")
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, path / f.name)
    model.save_pretrained(path, max_shard_size="300KB")
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04pickle weights moechat must not download" * 64)
    (path / "README.md").write_text("# tiny chat moe\n")
    assert len(list(path.glob("*.safetensors"))) >= 3, "expected a sharded checkpoint"
    return path


@pytest.fixture(scope="session")
def hub_server_session(hub_repo_dir):
    mod = _hubserver_module()
    server = mod.HubServer()
    server.add(mod.Repo.from_folder(HUB_REPO, hub_repo_dir, downloads=100))
    server.add(mod.Repo.from_folder(HUB_GATED, hub_repo_dir, gated=True, approved_tokens={HUB_TOKEN}))
    server.tokens.add(HUB_TOKEN)
    server.tokens.add("hf_test_token_not_approved")
    for repo_id, model_type in (("other-org/dense-llama", "llama"), ("other-org/gpt-oss-tiny", "gpt_oss"),
                                ("other-org/mixtral-moe-tiny", "mixtral")):
        server.add(mod.Repo(repo_id, {"config.json": json.dumps({"model_type": model_type}).encode()},
                            "f" * 40, model_type=model_type, downloads=10))
    yield server
    server.close()


@pytest.fixture
def hub(hub_server_session, tmp_path, monkeypatch):
    """A clean local Hub for one test: faults off, request log empty, an empty HF_HOME in tmp_path, no token.

    `hub.client` is an engine Hub pointed at it; `hub.server` the server (faults, requests, repos)."""
    from types import SimpleNamespace

    from moechat.engine.plan.hub import Hub

    hub_server_session.reset()
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_ENDPOINT", hub_server_session.url)
    client = Hub(endpoint=hub_server_session.url, cache_dir=tmp_path / "hf_home" / "hub")
    repos = dict(hub_server_session.repos)  # a repo a test adds (server.add) is gone after it: searches see the same
    yield SimpleNamespace(server=hub_server_session, client=client, repo=HUB_REPO, gated=HUB_GATED,
                          token=HUB_TOKEN, cache=tmp_path / "hf_home" / "hub", module=_hubserver_module())
    hub_server_session.repos.clear()
    hub_server_session.repos.update(repos)
