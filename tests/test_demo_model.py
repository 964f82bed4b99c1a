"""The bundled demo model: loads fast, matches transformers, answers in the chat format."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from moechat.engine.generate import Engine
from moechat.engine.sampling import SamplingParams

DEMO = Path(__file__).resolve().parents[1] / "assets" / "demo-moe"
GREEDY = SamplingParams(temperature=0.0, do_sample=False)
QUESTIONS = ["What does json.dumps do?", "What is 12 + 7?", "What does os.path.join do?"]


def test_demo_model_is_small_and_loads_fast():
    total = sum(f.stat().st_size for f in DEMO.iterdir() if f.is_file())
    assert total < 30_000_000, f"assets/demo-moe is {total / 1e6:.1f} MB"
    t0 = time.perf_counter()
    engine = Engine.load(DEMO)
    assert time.perf_counter() - t0 < 2.0 * 3  # 2 s on a quiet machine; CI shares its cores
    assert engine.loaded.args.model_type == "qwen3_moe" and engine.chat_template is not None


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(DEMO))


def test_demo_model_matches_transformers(reference):
    model, tok = reference
    engine = Engine.load(DEMO, dtype="float32")
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        ids = engine.encode_chat(messages)
        assert ids == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
        ours = [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=24) for t in c.token_ids]
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24,
                                 eos_token_id=sorted(engine.eos_token_ids), repetition_penalty=1.0)
        assert ours == out[0, len(ids):].tolist(), question


def test_demo_model_answers_in_chat_format():
    engine = Engine.load(DEMO, dtype="float32")
    chunks = list(engine.conversation().send("What is 12 + 7?", sampling=GREEDY, max_tokens=40))
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop" and "12 + 7" in text and "<|im_end|>" not in text
