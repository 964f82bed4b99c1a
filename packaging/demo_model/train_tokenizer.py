"""Train a byte-level BPE tokenizer on the demo corpus (train split only).

Writes tokenizer.json + tokenizer_config.json (with the ChatML chat template)
+ special_tokens_map.json into --out, then checks that
`apply_chat_template` matches chatml.render and that token counts per domain
are recorded in OUT/token_stats.json.
"""

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chatml import CHAT_TEMPLATE, EOT, IM_END, IM_START, SPECIAL_TOKENS, render  # noqa: E402


def iter_texts(path):
    with open(path) as f:
        for line in f:
            yield json.loads(line)["text"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default="/work/demo_build/corpus")
    ap.add_argument("--out", default="/work/demo_build/tokenizer")
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_texts(Path(args.corpus) / "train.jsonl"), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))

    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 2048,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": EOT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "additional_special_tokens": [IM_START, IM_END],
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                      "rstrip": False, "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": IM_END, "pad_token": EOT, "additional_special_tokens": [IM_START, IM_END]},
        indent=2) + "\n")

    # --- checks with transformers
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(out))
    msgs = [{"role": "user", "content": "What does json.dumps do?"},
            {"role": "assistant", "content": "Serialize obj to a JSON formatted str."}]
    a = hf.apply_chat_template(msgs, tokenize=False)
    assert a == render(msgs), (a, render(msgs))
    g = hf.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert g == render(msgs[:1], add_generation_prompt=True)
    assert g.endswith("<|im_start|>assistant\n")
    for t in SPECIAL_TOKENS:
        ids = hf(t, add_special_tokens=False)["input_ids"]
        assert ids == [hf.convert_tokens_to_ids(t)], (t, ids)
    assert hf.eos_token == IM_END and hf.pad_token == EOT
    print("chat template OK; ids:", {t: hf.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS})

    # --- token counts per domain / source
    stats = Counter()
    for split in ("train", "heldout"):
        with open(Path(args.corpus) / f"{split}.jsonl") as f:
            batch = []
            for line in f:
                batch.append(json.loads(line))
                if len(batch) == 512:
                    enc = tok.encode_batch([d["text"] for d in batch])
                    for d, e in zip(batch, enc, strict=True):
                        stats[f"{split}:{d['domain']}:{d['source']}"] += len(e.ids) + 1
                    batch = []
            enc = tok.encode_batch([d["text"] for d in batch]) if batch else []
            for d, e in zip(batch, enc, strict=True):
                stats[f"{split}:{d['domain']}:{d['source']}"] += len(e.ids) + 1
    (Path(args.corpus) / "token_stats.json").write_text(json.dumps(dict(sorted(stats.items())), indent=1))
    tot = sum(v for k, v in stats.items() if k.startswith("train:"))
    for k, v in sorted(stats.items()):
        print(f"{k:45s} {v:10d} {100 * v / tot:6.2f}%" if k.startswith("train:") else f"{k:45s} {v:10d}")


if __name__ == "__main__":
    main()
