"""Shared fixtures: tiny random MoE checkpoints written by transformers itself (the reference).

Each is built with a fixed seed and saved with `save_pretrained` (safetensors, per-expert names as on
the Hub), once per test session. initializer_range is large so logits and router scores are spread
out: greedy ties between implementations that differ by 1e-7 would make an oracle test flaky.
"""

from __future__ import annotations

import pytest
import torch

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


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA; bench/gpu_check.sh runs them on a machine that has it."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run bench/gpu_check.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
