"""The tuning panel's predicted hit rate: from the session's recorded routing, following the slots knob, for the
chosen policy (replayed) beside LRU's (the stack-distance curve), both for a warm cache."""

from __future__ import annotations

import re

import pytest
from textual.widgets import Label

from moechat.app.widgets.tuning import StepInput, lru_warm_rate
from moechat.engine.cache.mrc import lru_hit_curve
from moechat.engine.cache.replay import replay_policy
from moechat.engine.cache.trace import DECODE, TraceRecorder

pytestmark = pytest.mark.anyio
SIZE = (120, 40)


def tracing_engine(fakes, **kwargs):
    """The fake engine, recording its routing the way CachedProvider does (engine.provider.recorder)."""

    class TracingEngine(fakes.Engine):
        def __post_init__(self):
            super().__post_init__()
            self.provider.recorder = TraceRecorder(self.num_layers, self.num_experts, self.top_k)

        def route(self, step: int):
            super().route(step)
            for layer in range(self.num_layers):
                ids = [(layer * 3) % self.num_experts, (step * 5 + layer) % self.num_experts]
                self.provider.recorder.record(layer, [ids], DECODE)

    return TracingEngine(**kwargs)


def _predicted(screen) -> tuple[int, int] | None:
    """(slots, percent) from the label, or None when it shows no number."""
    text = str(screen.query_one("#predicted", Label).content)
    m = re.search(r"~(\d+)% at (\d+) slots", text)
    return (int(m[2]), int(m[1])) if m else None


async def test_moving_the_slots_knob_moves_the_predicted_hit_rate(build_app, fakes):
    # 4 layers x 16 experts, top-2: each token uses a hot expert per layer (reused every token) and a rotating
    # one (reused 16 tokens later), so LRU's curve rises in steps between 1 and 64 slots.
    engine = tracing_engine(fakes, num_layers=4, num_experts=16, slots=24,
                            replies=[fakes.Reply([f"t{i} " for i in range(40)])])
    app, _ = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        await fakes.wait_for(pilot, lambda: screen.info is not None, what="the model")
        label = screen.query_one("#predicted", Label)
        assert not label.display  # no routing seen yet, and the fake model has no bundled trace
        screen.query_one("#prompt").load_text("go")
        await pilot.press("enter")
        await fakes.wait_for(pilot, lambda: label.display and _predicted(screen) is not None,
                             what="the curve from the session's routing")
        assert "(lru)" in str(label.content) and "on this session's routing, 40 tokens" in str(label.content)
        curve = lru_hit_curve(engine.provider.recorder.to_trace())
        assert _predicted(screen) == (24, round(100 * lru_warm_rate(curve, 24)))

        knob = screen.query_one("#slots", StepInput)
        knob.focus()
        seen = {}
        for key in ["down"] * 9 + ["up"] * 24:  # steps of (64 - 1) // 16 = 3 slots, down to 1 and up to 64
            await pilot.press(key)
            await fakes.wait_for(pilot, lambda: _predicted(screen) is not None
                                 and _predicted(screen)[0] == int(knob.value), what="the label to follow")
            slots, pct = _predicted(screen)
            assert pct == round(100 * lru_warm_rate(curve, slots))
            seen[slots] = pct
        assert min(seen) == 1 and max(seen) == 64
        rates = [seen[s] for s in sorted(seen)]
        assert rates == sorted(rates)  # monotone non-decreasing in slots
        assert rates[0] < rates[-1] == 100  # the knob moves it; with every expert in a slot a warm cache always hits
        assert engine.retunes == []  # stepping only moves the value: Enter applies it

        # another policy: replayed through its class at the knob's slot count, LRU's curve beside it
        knob.value = "10"
        screen.query_one("#policy").value = "lfu"
        want = replay_policy(engine.provider.recorder.to_trace(), "lfu", 10).warm_rate
        await fakes.wait_for(pilot, lambda: "(lfu)" in str(label.content), what="the replay")
        assert _predicted(screen) == (10, round(100 * want))
        assert f"LRU ~{lru_warm_rate(curve, 10):.0%}" in str(label.content)


async def test_the_demo_model_predicts_from_its_bundled_trace_before_any_reply(app_env, fakes):
    from pathlib import Path

    from moechat.app.app import make_app
    from moechat.app.bridge import LoadOptions
    from moechat.app.settings import Settings
    from moechat.app.store import ChatStore
    from moechat.engine.cache.trace import RoutingTrace

    demo = Path(__file__).resolve().parents[2] / "assets" / "demo-moe"
    app = make_app(demo, options=LoadOptions(dtype="float32", expert_slots=24, device="cpu"),
                   settings=Settings(path=app_env / "settings.toml"), store=ChatStore(":memory:"),
                   memory_probe=fakes.Memory(), export_dir=app_env)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        await fakes.wait_for(pilot, lambda: _predicted(screen) is not None and "lrfu-layered)" in str(
            screen.query_one("#predicted", Label).content), timeout=120, what="the prediction")
        label = str(screen.query_one("#predicted", Label).content)
        assert "on the model's bundled routing trace" in label and "(lrfu-layered)" in label  # the default policy
        trace = RoutingTrace.load(demo / "routing_trace.npz")
        assert _predicted(screen) == (24, round(100 * replay_policy(trace, "lrfu-layered", 24).warm_rate))
        assert f"LRU ~{lru_warm_rate(lru_hit_curve(trace), 24):.0%}" in label
