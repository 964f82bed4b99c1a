"""Does the live panel slow generation? Decode tok/s in the app with the panel shown vs hidden, same run.

    python bench/tui_overhead.py MODEL_DIR [--tokens 64] [--rounds 3] [--expert-slots N]

Runs the real app headless (Textual still lays out and renders every frame, it only skips the
terminal write), loads the model once, then alternates replies to the same prompt with the panel
shown and hidden (F4), greedy, the same number of tokens each, and prints decode tok/s side by side
with the engine alone (no app) as the ceiling. The panel's work is bounded by design: stats are
snapshotted 4 times a second, so its share shrinks as a decode step gets slower.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from moechat.app.app import make_app
from moechat.app.bridge import LoadOptions
from moechat.app.settings import Settings
from moechat.app.store import ChatStore

PROMPT = "Tell me about the history of computing in a few paragraphs."


async def _wait(pilot, predicate, timeout=600.0):
    # asyncio.sleep, not pilot.pause: a pause waits for every widget's queue to drain, which is UI work
    # the real app never does and would be measured as the panel's cost.
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError
        await asyncio.sleep(0.05)


async def app_rates(model: str, tokens: int, rounds: int, options: LoadOptions) -> dict[str, list[float]]:
    settings = Settings(path=None, max_tokens=tokens, sampling={"temperature": 0.0})
    app = make_app(model, options=options, settings=settings, store=ChatStore(":memory:"),
                   export_dir=tempfile.gettempdir())
    rates: dict[str, list[float]] = {"panel shown": [], "panel hidden": []}
    async with app.run_test(size=(160, 48)) as pilot:
        screen = app.screen
        await _wait(pilot, lambda: screen.info is not None)
        screen.query_one("#prompt").load_text(PROMPT)
        await pilot.press("enter")
        await _wait(pilot, lambda: screen.gen_id is None and len(screen.session.turns) == 2)  # warm-up
        for r in range(rounds):
            for shown in ((True, False) if r % 2 == 0 else (False, True)):
                if screen.dashboard.display != shown:
                    await pilot.press("f4")
                await pilot.press("ctrl+r")
                await pilot.pause(0.05)
                await _wait(pilot, lambda: screen.gen_id is None and screen.session.turns[-1].status == "done")
                stats = screen.session.turns[-1].stats
                rates["panel shown" if shown else "panel hidden"].append(stats["decode_tps"])
    return rates


def engine_rates(model: str, tokens: int, rounds: int, options: LoadOptions) -> list[float]:
    from moechat.app.bridge import load_engine

    engine = load_engine(model, options, lambda stage: None)
    out = []
    for _ in range(rounds + 1):
        conversation = engine.conversation()
        chunks = list(conversation.send(PROMPT, sampling=engine.sampling(temperature=0.0), max_tokens=tokens))
        out.append(chunks[-1].decode_tokens_per_s)
    return out[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--expert-slots", type=int)
    args = parser.parse_args()
    options = LoadOptions(expert_slots=args.expert_slots)
    rates = asyncio.run(app_rates(str(Path(args.model)), args.tokens, args.rounds, options))
    rates["engine alone"] = engine_rates(str(Path(args.model)), args.tokens, args.rounds, options)
    base = statistics.median(rates["panel hidden"])
    print(f"{'':14} {'median tok/s':>12} {'vs hidden':>10}   runs")
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"{name:14} {med:12.1f} {med / base:10.3f}   {', '.join(f'{v:.1f}' for v in values)}")


if __name__ == "__main__":
    main()
