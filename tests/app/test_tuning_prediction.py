"""The tuning panel's predicted hit rate: from the session's recorded routing, following the slots knob."""

from __future__ import annotations

import re

import pytest
from textual.widgets import Label

from moechat.app.widgets.tuning import StepInput
from moechat.engine.cache.mrc import lru_hit_curve
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
        assert "LRU on this session's routing, 40 tokens" in str(label.content)
        curve = lru_hit_curve(engine.provider.recorder.to_trace())
        assert _predicted(screen) == (24, round(100 * curve.hit_rate(24)))

        knob = screen.query_one("#slots", StepInput)
        knob.focus()
        seen = {}
        for key in ["down"] * 9 + ["up"] * 24:  # steps of (64 - 1) // 16 = 3 slots, down to 1 and up to 64
            await pilot.press(key)
            await fakes.wait_for(pilot, lambda: _predicted(screen) is not None
                                 and _predicted(screen)[0] == int(knob.value), what="the label to follow")
            slots, pct = _predicted(screen)
            assert pct == round(100 * curve.hit_rate(slots))
            seen[slots] = pct
        assert min(seen) == 1 and max(seen) == 64
        rates = [seen[s] for s in sorted(seen)]
        assert rates == sorted(rates)  # monotone non-decreasing in slots
        assert rates[0] < rates[-1]  # and the knob does move it


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
        await fakes.wait_for(pilot, lambda: _predicted(screen) is not None, timeout=120, what="the prediction")
        label = str(screen.query_one("#predicted", Label).content)
        assert "LRU on the model's bundled routing trace" in label
        curve = lru_hit_curve(RoutingTrace.load(demo / "routing_trace.npz"))
        assert _predicted(screen) == (24, round(100 * curve.hit_rate(24)))
