"""The prefetch control: the tuning panel's mode select reaches Engine.retune_cache, the panel shows its counters."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from textual.widgets import Label, Select

from moechat.engine.cache.prefetch import PREFETCH_MODES

pytestmark = pytest.mark.anyio
SIZE = (120, 40)
STALL_S_PER_TOKEN = 0.0015


def prefetching_engine(fakes, **kwargs):
    """The fake engine with the prefetch half of the engine's cache API (modes, counters, stall time)."""

    class PrefetchingEngine(fakes.Engine):
        def __post_init__(self):
            super().__post_init__()
            self.prefetch = "next-layer"
            self.prefetch_calls: list[tuple[str, int]] = []  # (mode, thread)
            self.tokens_routed = 0

        def route(self, step: int):
            super().route(step)
            self.tokens_routed += 1

        def retune_cache(self, *, prefetch=None, **changes):
            if prefetch is not None:
                if prefetch not in PREFETCH_MODES:
                    raise ValueError(f"unknown prefetch mode {prefetch!r}")
                self.prefetch = prefetch
                self.prefetch_calls.append((prefetch, threading.get_ident()))
            return super().retune_cache(**changes)

        def cache_snapshot(self):
            n, L = self.tokens_routed, self.num_layers
            return dataclasses.replace(super().cache_snapshot(), prefetch=self.prefetch, prefetch_depth=1,
                                       prefetch_issued=(2 * n,) * L, prefetch_used=(n,) * L, prefetch_wasted=(0,) * L,
                                       stall_seconds=STALL_S_PER_TOKEN * n)

    return PrefetchingEngine(**kwargs)


async def test_prefetch_select_retunes_the_engine_and_the_panel_shows_its_counters(build_app, fakes):
    engine = prefetching_engine(fakes, replies=[fakes.Reply([f"t{i} " for i in range(8)])])
    app, _ = build_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        await fakes.wait_for(pilot, lambda: screen.info is not None, what="the model")
        select = screen.query_one("#prefetch", Select)
        assert select.value == "next-layer"  # the engine's mode, as loaded
        effective = screen.query_one("#effective", Label)
        assert "prefetch next-layer" in str(effective.content)

        select.value = "previous-token"
        await fakes.wait_for(pilot, lambda: engine.prefetch_calls, what="the retune")
        assert engine.prefetch_calls[0][0] == "previous-token"
        assert engine.prefetch_calls[0][1] != threading.get_ident()  # on the engine's thread, not the UI's
        await fakes.wait_for(pilot, lambda: "prefetch previous-token" in str(effective.content))

        screen.query_one("#prompt").load_text("go")
        await pilot.press("enter")
        await fakes.wait_for(pilot, lambda: screen.gen_id is None and len(screen.session.turns) == 2)

        def value(id_: str) -> str:
            return str(screen.query_one(id_, Label).content)

        # 8 tokens routed: 16 prefetches issued per layer x 4 layers, 8 x 4 used; 1.5 ms of stall a token.
        await fakes.wait_for(pilot, lambda: value("#prefetch-used") == "32/64 used", what="the counters")
        await fakes.wait_for(pilot, lambda: value("#stall") == "stall 1.50 ms/tok", what="the stall per token")
