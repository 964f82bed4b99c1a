"""Every architecture against transformers: fp32 logits to 1e-4, greedy tokens identical."""

from __future__ import annotations

import torch

from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, do_sample=False)
PROMPT_LENGTHS = [1, 5, 23, 70]


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def test_last_logits_match_transformers(tiny_models, tiny_name):
    name = tiny_name
    path, ref = tiny_models[name]
    engine = Engine.load(path, dtype="float32", prefill_chunk=16)  # 70 tokens = 5 chunks
    for n in PROMPT_LENGTHS:
        ids = _prompt(n, seed=n)
        seq = engine.new_sequence()
        with torch.inference_mode():
            ours = engine._forward(seq, ids)
            theirs = ref(torch.tensor([ids])).logits[0, -1].float()
        assert seq.kv.length == n
        err = (ours - theirs).abs().max().item()
        assert err < 1e-4, f"{name}, {n} tokens: max |logit diff| {err:.2e}"


def test_greedy_tokens_match_transformers_generate(tiny_models, tiny_name):
    name = tiny_name
    path, ref = tiny_models[name]
    engine = Engine.load(path, dtype="float32", prefill_chunk=16)
    for n in (4, 37):
        ids = _prompt(n, seed=100 + n)
        ours = [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=32) for t in c.token_ids]
        with torch.inference_mode():
            out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32, min_new_tokens=0,
                               pad_token_id=0)
        theirs = out[0, n:].tolist()
        assert ours == theirs, f"{name}, {n}-token prompt"
        assert len(ours) == 32 or ours[-1] in engine.eos_token_ids


def test_decode_logits_track_transformers_step_by_step(tiny_models):
    """Each decode step's logits (not just the argmax) stay within 1e-4 of a full re-forward."""
    path, ref = tiny_models["mixtral_window"]  # sliding window 7: decode must drop old positions
    engine = Engine.load(path, dtype="float32")
    ids = _prompt(5, seed=7)
    seq = engine.new_sequence()
    with torch.inference_mode():
        logits = engine._forward(seq, ids)
        for step in range(12):
            theirs = ref(torch.tensor([seq.tokens])).logits[0, -1]
            assert (logits - theirs).abs().max().item() < 1e-4, f"step {step}"
            logits = engine._forward(seq, [int(logits.argmax())])


def test_bfloat16_runs_close_to_float32(tiny_models):
    path, _ = tiny_models["qwen3_moe"]
    ids = _prompt(12, seed=3)
    f32 = Engine.load(path, dtype="float32")
    bf16 = Engine.load(path, dtype="bfloat16")
    assert bf16.loaded.provider.prepare(0, torch.zeros(1, 2, dtype=torch.long)).tensors["w13"].dtype == torch.bfloat16
    with torch.inference_mode():
        a = f32._forward(f32.new_sequence(), ids)
        b = bf16._forward(bf16.new_sequence(), ids)
    assert torch.softmax(a, -1).sub(torch.softmax(b, -1)).abs().max().item() < 0.05
