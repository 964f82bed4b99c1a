"""The tuning panel's predicted hit rate: from the session's recorded routing, following the slots knob, for the
chosen policy (replayed) beside LRU's (the stack-distance curve), both for a warm cache."""

from __future__ import annotations

import re

import pytest
from textual.widgets import Label

from moechat.app.tui.widgets.tuning import StepInput, lru_warm_rate
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
    m = re.search(r"~(\d+)% at (\d+) slots?\b", text)
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

    from moechat.app.tui.app import make_app
    from moechat.app.tui.bridge import LoadOptions
    from moechat.app.tui.settings import Settings
    from moechat.app.tui.store import ChatStore
    from moechat.engine.cache.trace import RoutingTrace

    demo = Path(__file__).resolve().parents[2] / "assets" / "demo-moe"
    # on-miss load: the slots fill from misses even on a CPU (with auto the RAM tier is the cache: see below)
    app = make_app(demo, options=LoadOptions(dtype="float32", expert_slots=24, device="cpu", on_miss="load"),
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


def _ram_predicted(screen) -> tuple[int, int] | None:
    """(experts, percent) from the RAM knob's prediction, or None when it shows no number."""
    text = str(screen.query_one("#ram-predicted", Label).content)
    m = re.search(r"~(\d+)% from RAM \(([\d,]+) of", text)
    return (int(m[2].replace(",", "")), int(m[1])) if m else None


async def _demo_on_a_cpu(app_env, fakes, **options):
    from pathlib import Path

    from moechat.app.tui.app import make_app
    from moechat.app.tui.bridge import LoadOptions
    from moechat.app.tui.settings import Settings
    from moechat.app.tui.store import ChatStore

    demo = Path(__file__).resolve().parents[2] / "assets" / "demo-moe"
    return demo, make_app(demo, options=LoadOptions(dtype="bfloat16", device="cpu", warm_start=False, **options),
                          settings=Settings(path=app_env / "settings.toml"), store=ChatStore(":memory:"),
                          memory_probe=fakes.Memory(), export_dir=app_env)


async def test_on_a_cpu_the_panel_shows_the_ram_tier_and_the_ram_knob_predicts(app_env, fakes):
    """A CPU computing misses in place (on-miss auto): no slot knob (it changes nothing there), the hit figures are
    the RAM tier's over the disk, and they move with the RAM budget as the prediction under the RAM knob says."""
    from moechat.engine.cache.trace import RoutingTrace

    demo, app = await _demo_on_a_cpu(app_env, fakes, ram_cache_mb=1)  # 1 MiB: 6 of the 96 experts of 168 KiB
    trace = RoutingTrace.load(demo / "routing_trace.npz")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        await fakes.wait_for(pilot, lambda: _ram_predicted(screen) is not None and "lrfu-layered" in str(
            screen.query_one("#ram-predicted", Label).content), timeout=120, what="the RAM tier's prediction")
        assert not screen.query_one("#slots-knob").display and not screen.query_one("#predicted", Label).display
        assert _ram_predicted(screen) == (6, round(100 * replay_policy(trace, "lrfu-layered", 6).warm_rate))
        effective = str(screen.query_one("#effective", Label).content)
        assert "RAM tier" in effective and "6 of 96 experts" in effective
        knob = screen.query_one("#ram-mb", StepInput)
        knob.value = "8"  # 48 experts
        await fakes.wait_for(pilot, lambda: _ram_predicted(screen) is not None and _ram_predicted(screen)[0] == 48,
                             timeout=60, what="the prediction to follow the RAM knob")
        assert _ram_predicted(screen)[1] == round(100 * replay_policy(trace, "lrfu-layered", 48).warm_rate)
        knob.value = ""
        await fakes.wait_for(pilot, lambda: "100% from RAM" in str(screen.query_one("#ram-predicted", Label).content),
                             what="every expert in RAM")

        rates = {}
        for mb in (1, 8):
            screen.bridge.retune(ram_cache_bytes=mb << 20)
            await fakes.wait_for(pilot, lambda: f"/{mb}.0 MiB" in str(screen.query_one("#effective", Label)
                                                                     .content), timeout=60, what="the retune")
            screen.query_one("#prompt").load_text("What does os.listdir do?")
            await pilot.press("enter")
            await fakes.wait_for(pilot, lambda: screen.gen_id is None and "from disk" in str(
                screen.query_one("#hit-counts", Label).content), timeout=120, what="a reply")
            await pilot.pause(0.5)
            counts = str(screen.query_one("#hit-counts", Label).content)
            assert re.fullmatch(r"[\d,]+ from RAM · [\d,]+ from disk \([\d,]+ run on the host\)", counts), counts
            tier = str(screen.query_one("#slots-used", Label).content)
            assert tier.startswith("RAM ") and f"/{(mb << 20) // (168 * 1024)} experts" in tier, tier
            rates[mb] = screen.dashboard.stats.turn_hit_rate
        assert rates[1] < rates[8], rates  # a bigger RAM tier: more of this reply's requests served from RAM


async def test_on_a_cpu_with_every_expert_in_ram_nothing_is_a_miss(app_env, fakes):
    _, app = await _demo_on_a_cpu(app_env, fakes, expert_slots=96)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        await fakes.wait_for(pilot, lambda: screen.info is not None, timeout=120, what="the model")
        screen.query_one("#prompt").load_text("What does os.listdir do?")
        await pilot.press("enter")
        await fakes.wait_for(pilot, lambda: screen.gen_id is None and "from RAM" in str(
            screen.query_one("#hit-counts", Label).content), timeout=120, what="a reply")
        await pilot.pause(0.5)
        assert re.search(r" from RAM · 0 from disk \([\d,]+ run on the host\)$",
                         str(screen.query_one("#hit-counts", Label).content))
        assert screen.dashboard.stats.turn_hit_rate == 1.0
        assert str(screen.query_one("#slots-used", Label).content) == "RAM: all 96 experts, none from disk"
        assert "every expert in RAM, none read from disk" in str(screen.query_one("#effective", Label).content)
