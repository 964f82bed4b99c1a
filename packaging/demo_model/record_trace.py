"""Record a routing trace of the bundled demo model for the cache benchmarks (bench/replay.py).

    python packaging/demo_model/record_trace.py [--out assets/demo-moe/routing_trace.npz]

Four prompts from four domains (chat about the standard library, Python code, prose, arithmetic), each
a separate sequence: prefill, then 96 greedy decode tokens. Every expert stays resident (all slots), so
the trace is the model's routing, not a cache's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moechat.engine.cache.provider import CacheConfig
from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 96
PROMPTS = [
    ("chat", "What does json.dumps do?"),
    ("code", "def read_config(path):\n    with open(path) as f:\n"),
    ("docs", "The git rebase command reapplies commits on top of another base tip. "),
    ("arith", "12 + 7 = 19\n45 * 3 = 135\n81 - 17 = "),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "assets" / "demo-moe" / "routing_trace.npz"))
    parser.add_argument("--new", type=int, default=NEW_TOKENS)
    opts = parser.parse_args()
    engine = Engine.load(ROOT / "assets" / "demo-moe", dtype="float32", cache=CacheConfig(record_trace=True))
    recorder = engine.provider.recorder
    greedy = SamplingParams(temperature=0.0, do_sample=False)
    for i, (domain, text) in enumerate(PROMPTS):
        if i:
            recorder.new_sequence()
        ids = engine.encode_chat([{"role": "user", "content": text}]) if domain == "chat" else engine.encode(text)
        chunks = list(engine.generate(ids, sampling=greedy, max_tokens=opts.new, stop_on_eos=False))
        print(f"{domain}: {len(ids)} prompt + {len(chunks)} generated tokens")
    trace = recorder.to_trace()
    trace.save(opts.out)
    print(f"{opts.out}: {len(trace.layer)} rows, {trace.num_layers} layers x {trace.num_experts} experts, "
          f"top-{trace.top_k}")


if __name__ == "__main__":
    main()
