"""The app on the real engine and a tiny random chat model: load, send, tokens arrive, the panel fills."""

from __future__ import annotations

import re

import pytest
from textual.widgets import Label

from moechat.app.tui.bridge import LoadOptions
from moechat.app.tui.settings import Settings
from moechat.app.tui.widgets.transcript import AssistantMessage

pytestmark = pytest.mark.anyio


async def test_real_engine_streams_and_fills_the_panel(tiny_chat_model, app_env, fakes):
    from moechat.app.tui.app import make_app
    from moechat.app.tui.store import ChatStore

    path = tiny_chat_model[0]
    settings = Settings(path=app_env / "settings.toml", max_tokens=12, sampling={"temperature": 0.0})
    store = ChatStore(app_env / "chats.sqlite3")
    app = make_app(path, options=LoadOptions(dtype="float32", expert_slots=6, on_miss="load"), settings=settings,
                   store=store, memory_probe=fakes.Memory(), export_dir=app_env)
    async with app.run_test(size=(120, 36)) as pilot:
        screen = app.screen
        await fakes.wait_for(pilot, lambda: screen.info is not None, timeout=120, what="the model to load")
        info = screen.info
        assert (info.model_type, info.num_layers, info.num_experts, info.top_k) == ("qwen3_moe", 3, 8, 2)
        assert info.cache.slots == 6 and info.cache.max_slots == 24
        assert str(screen.query_one("#hit-rate", Label).content) == "–"  # nothing routed yet
        screen.query_one("#prompt").load_text("Hello world")
        await pilot.press("enter")
        await fakes.wait_for(pilot, lambda: screen.gen_id is None and len(screen.session.turns) == 2, timeout=60,
                             what="the reply")
        reply = screen.session.turns[-1]
        assert reply.status == "done" and reply.content
        assert 1 <= reply.stats["generated_tokens"] <= 12
        assert screen.query_one(AssistantMessage).text == reply.content
        assert store.load(screen.session.conversation_id).messages[-1].content == reply.content

        def value(id_: str) -> str:
            return str(screen.query_one(id_, Label).content)

        await fakes.wait_for(pilot, lambda: re.fullmatch(r"\d+\.\d%", value("#hit-rate")), what="a hit rate")
        # The panel redraws on its own clock (a few times a second): wait for each field, don't sample once.
        for field, pattern in (("#prefill-tps", r"prefill \d+(\.\d)?"), ("#decode-tps", r"decode \d+(\.\d)?"),
                               ("#slots-used", r"6/6 used · \S+")):
            await fakes.wait_for(pilot, lambda f=field, p=pattern: re.fullmatch(p, value(f)),
                                 what=f"{field} to become a number")
        heatmap = screen.query_one("#heatmap")
        assert heatmap.resident.shape == (3, 8) and heatmap.resident.sum() == 6
        # The engine recorded this reply's routing; the tuning panel predicts the policy's hit rate from it.
        await fakes.wait_for(pilot, lambda: "this session's routing" in value("#predicted")
                             and re.match(r"predicted ~\d+% at 6 slots \(\S+\)", value("#predicted")),
                             what="a prediction")


async def test_panel_shows_where_experts_ran(tiny_chat_model, app_env, fakes):
    """--on-miss host in the app on a CPU: every miss runs on the host from the RAM tier, so the slots never fill and
    the panel shows the cache that exists there (the RAM tier over the disk) and where the experts ran: requests
    served from RAM and from disk, how many ran on the host, the heatmap of what RAM holds, no slot knob."""
    from moechat.app.tui.app import make_app
    from moechat.app.tui.store import ChatStore
    from moechat.app.tui.widgets.heatmap import HeatmapLegend

    path = tiny_chat_model[0]
    settings = Settings(path=app_env / "settings.toml", max_tokens=12, sampling={"temperature": 0.0})
    store = ChatStore(app_env / "chats.sqlite3")
    app = make_app(path, options=LoadOptions(dtype="float32", expert_slots=3, on_miss="host", warm_start=False),
                   settings=settings, store=store, memory_probe=fakes.Memory(), export_dir=app_env)
    async with app.run_test(size=(120, 36)) as pilot:
        screen = app.screen
        await fakes.wait_for(pilot, lambda: screen.info is not None, timeout=120, what="the model to load")
        screen.query_one("#prompt").load_text("Hello world")
        await pilot.press("enter")
        await fakes.wait_for(pilot, lambda: screen.gen_id is None and len(screen.session.turns) == 2, timeout=60,
                             what="the reply")
        counts = lambda: str(screen.query_one("#hit-counts", Label).content)  # noqa: E731
        await fakes.wait_for(pilot, lambda: re.search(r"([1-9][\d,]*) from RAM · 0 from disk \(([1-9][\d,]*) run "
                                                      r"on the host\)", counts()),
                             what="RAM-tier requests and host-run experts in the panel")
        stats = screen.dashboard.stats
        assert stats.fast_tier == "ram" and stats.hit_rate == 1.0  # every expert is in RAM: none from disk
        heatmap = screen.query_one("#heatmap")
        assert heatmap.resident.all()  # the heatmap draws what the RAM tier holds: all of it
        assert not screen.query_one(HeatmapLegend).hosting  # no host ring: on a CPU every expert runs there
        assert not screen.query_one("#slots-knob").display  # slots change nothing here


async def test_a_chat_longer_than_the_context_goes_on_and_says_so(tiny_chat_model, app_env, fakes):
    """Issue 19: once a chat outgrows the context, the next message ("hi") is answered with the oldest turns
    left out of the prompt, the transcript keeps them, and a notice says what happened, once."""
    from moechat.app.tui.app import make_app
    from moechat.app.tui.store import ChatStore

    path = tiny_chat_model[0]
    settings = Settings(path=app_env / "settings.toml", max_tokens=400, sampling={"temperature": 0.0})
    store = ChatStore(app_env / "chats.sqlite3")
    app = make_app(path, options=LoadOptions(dtype="float32", context=128), settings=settings, store=store,
                   memory_probe=fakes.Memory(), export_dir=app_env)
    async with app.run_test(size=(120, 36)) as pilot:
        screen = app.screen
        await fakes.wait_for(pilot, lambda: screen.info is not None, timeout=120, what="the model to load")
        notices = lambda: [n.message for n in app._notifications if "longer than the model's context" in n.message]  # noqa: E731
        for i, text in enumerate(["Tell me a long story about experts " * 3, "hi", "hi again"]):
            screen.query_one("#prompt").load_text(text)
            await pilot.press("enter")
            await fakes.wait_for(pilot, lambda n=i: screen.gen_id is None and len(screen.session.turns) == 2 * n + 2,
                                 timeout=60, what=f"reply {i}")
            assert screen.session.turns[-1].status == "done", i
        assert len(screen.session.turns) == 6  # nothing lost from the transcript
        # told when it starts, and again only when more turns are left out (not on every message)
        assert 1 <= len(notices()) <= 2 and "its oldest turn was left out" in notices()[0]
