"""The small things a new user trips on in the terminal app (issue 26): rows out of view said, no text cut in a
word, Escape in a knob applies nothing, Ctrl+L in the footer when the notice names it, no knobs against a remote
server, and counts with their noun in the right number."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.cells import cell_len
from textual.widgets import Label, Static

from moechat.app.tui.livestats import DashboardStats
from moechat.app.tui.screens.chats import describe as describe_chat
from moechat.app.tui.widgets.heatmap import CacheHeatmap
from moechat.app.tui.widgets.prompt import PromptInput
from moechat.app.tui.widgets.text import ELLIPSIS, FitLabel, first_that_fits, fit_words, plural
from moechat.app.tui.widgets.tuning import StepInput, TuningPanel, describe_prediction

pytestmark = pytest.mark.anyio


async def _ready(pilot, fakes):
    screen = pilot.app.screen
    await fakes.wait_for(pilot, lambda: screen.info is not None, what="the model")
    return screen


async def _reply(pilot, fakes, screen, text: str = "hi") -> None:
    await pilot.press(*text, "enter")
    await fakes.wait_for(pilot, lambda: screen.gen_id is None and len(screen.session.turns) >= 2, what="the reply")


def _footer_keys(screen) -> dict[str, str]:
    return {key: b.description for key, (_, b, enabled, _) in screen.active_bindings.items() if b.show and enabled}


def cut_labels(screen) -> list[tuple[str | None, str]]:
    """Every shown Label/Static whose text does not fit the room it has on screen (a wrapped line hidden by a
    one-row parent, or a line wider than the label): (id, text)."""
    cut = []
    for widget in screen.query(Static):
        if not widget.display or not widget.visible or widget.region.area == 0:
            continue
        room = widget.content_region
        parent = widget.parent
        if parent is not None and not parent.allow_vertical_scroll:
            room = room.intersection(parent.content_region)
        if room.width <= 0:
            continue
        need = widget.get_content_height(room.size, screen.size, room.width)
        if need > room.height:
            cut.append((widget.id, str(widget.render())))
    return cut


# -- text fitted at a word boundary ---------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet="abcdé0123456789,;", min_size=1, max_size=9), min_size=1, max_size=8),
       st.integers(min_value=1, max_value=40))
def test_fit_words_fits_and_ends_at_a_word_boundary(words, width):
    text = " ".join(words)
    out = fit_words(text, width)
    assert cell_len(out) <= width
    if cell_len(text) <= width:
        assert out == text
        return
    assert out.endswith(ELLIPSIS)
    kept = out[:-1].split(" ")
    if len(words[0]) + 1 > width:  # the first word alone does not fit: the only cut there is
        assert len(kept) == 1 and words[0].startswith(kept[0])
        return
    n = len(kept)
    assert kept[:-1] == words[:n - 1] and kept[-1] in (words[n - 1], words[n - 1].rstrip(",;:"))  # whole words


def test_fit_words_leaves_no_separator_before_the_ellipsis():
    assert fit_words("12.0 GiB used · 20.0 GiB free", 18) == "12.0 GiB used…"
    assert fit_words("a b", 1) == ELLIPSIS


def test_first_that_fits_prefers_the_longest_and_may_show_nothing():
    assert first_that_fits(("· app 306.2 MiB", ""), 9) == ""  # never "· app 306" without its unit
    assert first_that_fits(("· app 306.2 MiB", ""), 15) == "· app 306.2 MiB"
    assert first_that_fits(("stall 0.00 ms/tok", "stall 0.00ms"), 12) == "stall 0.00ms"
    assert fit_words("no expert cache: every expert is resident; set slots below", 46) == \
        "no expert cache: every expert is resident…"


def test_plural():
    assert plural(1, "token") == "1 token" and plural(0, "token") == "0 tokens" and plural(2, "token") == "2 tokens"
    assert plural(1, "miss", "misses") == "1 miss" and plural(1204, "hit") == "1,204 hits"


# -- 1. the heatmap says which rows it shows ----------------------------------------------------------------

async def test_80x24_heatmap_title_says_which_layers_show_and_that_the_rest_scroll(build_app, fakes):
    """The report: '6 layers x 16 experts' over L0-L2 and no sign of the rest."""
    app, _ = build_app(fakes.Engine(num_layers=6, num_experts=16, slots=48))
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await _ready(pilot, fakes)
        await _reply(pilot, fakes, screen)
        await pilot.press("f4")
        heatmap = screen.query_one(CacheHeatmap)
        await fakes.wait_for(pilot, lambda: heatmap._rows and heatmap.scrollable_content_region.height,
                             what="the heatmap drawn")
        await pilot.pause(0.2)
        height = heatmap.scrollable_content_region.height
        assert height < 6  # the premise: 80x24 shows fewer rows than the model has layers
        assert str(heatmap.border_title) == f"L0-L{height - 1} of 6 layers × 16 experts ↕ scroll"
        heatmap.scroll_to(y=6 - height, animate=False)
        await pilot.pause(0.1)
        assert str(heatmap.border_title) == f"L{6 - height}-L5 of 6 layers × 16 experts ↕ scroll"
        assert cell_len(str(heatmap.border_title)) <= heatmap.size.width - 2


async def test_a_tall_panel_titles_the_heatmap_without_a_scroll_hint_and_in_the_singular(build_app, fakes):
    app, _ = build_app(fakes.Engine(num_layers=1, num_experts=16, slots=8))
    async with app.run_test(size=(130, 40)) as pilot:
        screen = await _ready(pilot, fakes)
        await _reply(pilot, fakes, screen)
        heatmap = screen.query_one(CacheHeatmap)
        await fakes.wait_for(pilot, lambda: heatmap.border_title is not None, what="the title")
        assert str(heatmap.border_title) == "1 layer × 16 experts"


# -- 2. no label cut in a word ---------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [(80, 24), (105, 30), (130, 40)])
async def test_no_panel_label_is_cut(build_app, fakes, size):
    """The report: 'app 306' without its unit (a 50-column panel), 'stall 0.00' (42 columns)."""
    app, _ = build_app(fakes.Engine(num_layers=6, num_experts=16, slots=48))
    async with app.run_test(size=size) as pilot:
        screen = await _ready(pilot, fakes)
        await _reply(pilot, fakes, screen)
        if screen.collapsed:
            await pilot.press("f4")
        await pilot.pause(0.6)  # the panel's clock draws the stats; the memory probe has run
        assert cut_labels(screen) == []
        app_rss = screen.query_one("#ram-app", FitLabel)
        assert app_rss.shown in ("", "· app 1.50 GiB", "· app 1.5 GiB")  # whole or nothing


async def test_the_heatmap_placeholder_wraps_at_words(build_app, fakes):
    """The report: the remote panel's line ended at 'set' (cut at the panel's width)."""
    app, _ = build_app(fakes.Engine(num_layers=6, num_experts=16, slots=48))
    async with app.run_test(size=(130, 40)) as pilot:
        screen = await _ready(pilot, fakes)
        heatmap = screen.query_one(CacheHeatmap)
        heatmap.set_data(None, None)  # read at once: the panel's clock would draw the stats' cells again
        text = "no expert cache: every expert is resident; set slots below to cache"
        heatmap.set_placeholder(text)
        width = heatmap.scrollable_content_region.width
        assert width < len(text)  # the premise: one line cannot hold it
        lines = [heatmap.render_line(y).text.rstrip() for y in range(3)]
        assert " ".join(x for x in lines if x) == text


async def test_the_wizard_at_80x24_shows_whole_columns_and_a_whole_title(app_env, fakes):
    """The report: 'Downl', '~12.8' at the right edge, and the header cut in the Hub's URL."""
    from textual.widgets import DataTable

    from moechat.app.tui.app import make_app
    from moechat.app.tui.bridge import LoadOptions
    from moechat.app.tui.screens.setup import HubOptions, SetupScreen
    from moechat.app.tui.settings import Settings
    from moechat.app.tui.store import ChatStore
    from moechat.engine.plan.hardware import probe

    hardware = probe(app_env, nvml=None, cuda=None).with_overrides(vram_gb=8, ram_gb=32, disk_gb=100)
    options = HubOptions(endpoint="http://127.0.0.1:9", cache_dir=app_env / "hf", hardware=hardware)
    app = make_app(None, options=LoadOptions(device="cpu"), settings=Settings(path=app_env / "settings.toml"),
                   store=ChatStore(app_env / "chats.sqlite3"), memory_probe=fakes.Memory(),
                   export_dir=app_env / "exports", hub=options)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("f5")
        await fakes.wait_for(pilot, lambda: isinstance(app.screen, SetupScreen), what="the wizard")
        setup = app.screen
        await fakes.wait_for(pilot, lambda: setup.rows and all(r.status is not None for r in setup.rows.values()),
                             what="the estimates")
        await pilot.pause(0.3)
        table = setup.query_one("#setup-models", DataTable)
        widths = [c.get_render_width(table) for c in table.columns.values()]
        assert sum(widths) <= table.scrollable_content_region.width  # every shown column whole, none at the edge
        assert [c.label.plain for c in table.columns.values()][:4] == ["Model", "Verdict", "tok/s", "Download"]
        olmoe = "allenai/OLMoE-1B-7B-0125-Instruct"
        assert setup.cell(olmoe, "model") == "OLMoE-1B-7B-0125-Instruct" and setup.cell(olmoe, "speed") == "? offline"
        assert setup.cell(olmoe, "download").endswith(" GiB")
        assert setup.cell(olmoe, "note").startswith("estimate from")  # a hidden column still answers
        assert setup.sub_title == "model setup · offline"
        # the machine's box is three lines under 30 rows by design (the what-if line, a test's, below them)
        assert [c for c in cut_labels(setup) if c[0] != "setup-hardware"] == []


# -- 3. Escape in a knob applies nothing ---------------------------------------------------------------------------

async def test_escape_in_a_knob_restores_it_and_applies_nothing(build_app, fakes):
    """The report: Escape applied the change (leaving the knob applied it); the hint says Enter applies."""
    engine = fakes.Engine(num_layers=4, num_experts=16, slots=24)
    app, _ = build_app(engine)
    async with app.run_test(size=(120, 36)) as pilot:
        screen = await _ready(pilot, fakes)
        await pilot.press("f6")
        knob = screen.query_one("#slots", StepInput)
        await fakes.wait_for(pilot, lambda: app.focused is knob, what="the slots knob")
        await pilot.press("up", "up")
        assert knob.value == "30"
        assert _footer_keys(screen).get("escape") == "Prompt"  # the footer still says what Escape does
        await pilot.press("escape")
        await pilot.pause(0.3)
        assert isinstance(app.focused, PromptInput)
        assert knob.value == "24" and engine.retunes == []
        ram = screen.query_one("#ram-mb", StepInput)
        ram.focus()
        await pilot.press(*"12", "escape")
        await pilot.pause(0.3)
        assert ram.value == "" and engine.retunes == [] and isinstance(app.focused, PromptInput)
        await pilot.press("f6")  # Enter still applies
        await fakes.wait_for(pilot, lambda: app.focused is knob, what="the slots knob again")
        await pilot.press("down", "enter")
        await fakes.wait_for(pilot, lambda: engine.retunes, what="the retune")
        assert engine.retunes[0][2] == {"expert_slots": 21}


async def test_escape_in_a_knob_while_replying_still_stops_the_reply(build_app, fakes):
    engine = fakes.Engine(gated=True, replies=[fakes.Reply(["a ", "b ", "c"])])
    app, _ = build_app(engine)
    async with app.run_test(size=(120, 36)) as pilot:
        screen = await _ready(pilot, fakes)
        await pilot.press(*"hi", "enter")
        await fakes.wait_for(pilot, lambda: screen.gen_id is not None, what="the reply to start")
        engine.release(1)
        await pilot.press("f6")
        knob = screen.query_one("#slots", StepInput)
        await fakes.wait_for(pilot, lambda: app.focused is knob, what="the slots knob")
        await pilot.press("up", "escape")
        await fakes.wait_for(pilot, lambda: screen.gen_id is None, what="the stop")
        engine.release(5)
        assert knob.value == "24" and screen.session.turns[-1].status == "stopped"
        await pilot.pause(0.2)
        assert engine.retunes == []


# -- 5. the key the failed load's notice names is in the footer -------------------------------------------------

async def test_after_a_failed_load_the_footer_shows_ctrl_l(build_app, fakes):
    from moechat.engine.errors import ConfigError

    app, _ = build_app(ConfigError("config.json: num_experts = 0 is invalid; it must be >= 1"))
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.screen
        await fakes.wait_for(pilot, lambda: screen.load_failed, what="the failed load")
        await pilot.pause(0.1)
        notice = str(screen.query_one("#loading-stage", Label).content)
        assert "Ctrl+L" in notice
        assert _footer_keys(screen).get("ctrl+l") == "Open model"
        await pilot.press("ctrl+l")
        await fakes.wait_for(pilot, lambda: type(app.screen).__name__ == "OpenModelScreen", what="Open model")


async def test_a_loaded_model_keeps_ctrl_l_working_but_off_the_footer(build_app, fakes):
    app, _ = build_app(fakes.Engine())
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await _ready(pilot, fakes)
        assert "ctrl+l" not in _footer_keys(screen)
        await pilot.press("ctrl+l")
        await fakes.wait_for(pilot, lambda: type(app.screen).__name__ == "OpenModelScreen", what="Open model")


# -- 6. no knobs against a remote server ---------------------------------------------------------------------

async def test_remote_server_hides_the_knobs_and_says_why(build_app, fakes):
    """The report: with --remote the knobs showed and did nothing (the server has no API to retune)."""
    from moechat.app.tui.remote import RemoteEngine

    note = RemoteEngine.tuning_note.fget(SimpleNamespace(is_moechat=True))
    engine = fakes.Engine(num_layers=6, num_experts=16, slots=32)
    app, _ = build_app(engine)
    app.tuning_note = note
    async with app.run_test(size=(120, 36)) as pilot:
        screen = await _ready(pilot, fakes)
        tuning = screen.query_one(TuningPanel)
        await pilot.pause(0.1)
        assert tuning.unavailable == note and "moechat serve" in note
        off = screen.query_one("#tuning-off", Label)
        assert off.display and str(off.content) == note
        shown = [c.id for c in tuning.children if c.display]
        assert shown == ["effective", "tuning-off"]  # what the server runs with, then why there is no knob
        await pilot.press("f6")
        await pilot.pause(0.2)
        assert isinstance(app.focused, PromptInput) and any(n.message == note for n in app._notifications)
        assert engine.retunes == []
        assert cut_labels(screen) == []


def test_run_remote_chat_gives_the_app_the_servers_tuning_note(monkeypatch):
    from moechat.app.tui import remote
    from moechat.app.tui.app import MoechatApp

    engine = SimpleNamespace(label="http://gpu:8000/v1/m", panel_note="panel", tuning_note="tuned on the server")
    monkeypatch.setattr(remote.RemoteEngine, "connect", classmethod(lambda cls, *a, **k: engine))
    seen = []
    monkeypatch.setattr(MoechatApp, "run", lambda self: seen.append(self))
    args = SimpleNamespace(model=None, api_key="k", remote="http://gpu:8000", remote_model=None,
                           reasoning_effort=None, temperature=None, top_p=None, top_k=None, min_p=None,
                           repetition_penalty=None, seed=None, max_tokens=None)
    monkeypatch.setenv("XDG_CONFIG_HOME", "/nonexistent-moechat-test")
    assert remote.run_remote_chat(args) == 0
    (app,) = seen
    assert app.tuning_note == "tuned on the server" and MoechatApp.tuning_note is None


# -- 7. counts in the right number -------------------------------------------------------------------------

async def test_a_one_token_reply_says_1_token(build_app, fakes):
    app, _ = build_app(fakes.Engine(replies=[fakes.Reply(["ok"])]))
    async with app.run_test(size=(120, 36)) as pilot:
        screen = await _ready(pilot, fakes)
        await _reply(pilot, fakes, screen)
        (reply,) = screen.transcript.assistant_messages
        status = str(reply.query_one(".reply-status", Label).content)
        assert status.startswith("1 token · ") and "tokens" not in status


def test_predictions_at_one_slot_and_a_one_message_chat_are_singular():
    from moechat.engine.cache.mrc import lru_hit_curve
    from moechat.engine.cache.trace import RoutingTrace

    one = np.zeros(1, dtype=np.int32)  # [N=1]: one token's row of one layer
    curve = lru_hit_curve(RoutingTrace(1, 4, 1, one, one, one.astype(np.uint8), one.reshape(1, 1)))
    assert curve.tokens == 1
    text = describe_prediction(curve, 1)
    assert "at 1 slot " in text and "1 token" in text and "1 slots" not in text and "1 tokens" not in text
    summary = SimpleNamespace(title="t", model="m", num_messages=1, updated=time.time())
    assert re.search(r"\b1 message\b", describe_chat(summary).plain)


def test_hit_counts_are_singular_at_one():
    from moechat.app.tui.widgets.dashboard import hit_counts_text

    s = DashboardStats(hits=1, misses=1, num_slots=4, resident=np.zeros((1, 4), dtype=bool))
    assert hit_counts_text(s).startswith("1 hit · 1 miss")
