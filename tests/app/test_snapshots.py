"""Screenshots of the chat screen with the live panel at fixed terminal sizes (80x24, 130x40, 200x50), fed fixed stats.

The fake engine streams a reply (code block included); then the panel is given deterministic
`DashboardStats` (a seeded pattern of residency and recent use), so every run draws the same frame.
Update after a deliberate change with `pytest tests/app/test_snapshots.py --snapshot-update` and look
at the SVGs in tests/app/__snapshots__/ before committing them.
"""

from __future__ import annotations

import math

import numpy as np

from moechat.app.tui.livestats import DashboardStats

REPLY = ["Each token is routed to **2 of 32 experts** per layer. ", "Only the hot ones stay in slots:\n\n",
         "```python\n", "for layer in range(L):\n", "    batch = provider.prepare(layer, topk_ids)\n", "```\n\n",
         "The rest wait in RAM or on disk."]


def fixed_stats(L: int, E: int, slots: int) -> DashboardStats:
    rng = np.random.default_rng(7)
    popularity = rng.zipf(1.6, size=(L, E)) + rng.random((L, E))  # [L, E] a few hub experts per layer
    resident = np.zeros(L * E, dtype=bool)
    resident[np.argsort(-popularity, axis=None)[:slots]] = True  # the `slots` most popular
    resident = resident.reshape(L, E)  # [L, E]
    recent = np.clip(popularity / 8.0, 0, 1) * (rng.random((L, E)) > 0.3)  # [L, E]
    recent[~resident] *= rng.random(((~resident).sum(),)) > 0.8  # a few evicted-after-use experts
    rates = tuple(0.55 + 0.4 * math.sin(i / 3.0) ** 2 for i in range(L))
    history = tuple(30 + 12 * math.sin(i / 4.0) + (i % 5) for i in range(40))
    return DashboardStats(
        prefill_tps=812.4, decode_tps=41.7, decode_history=history, prompt_tokens=37, generated_tokens=64,
        hit_rate=0.873, turn_hit_rate=0.281, turn_hits=281, turn_misses=719,
        layer_hit_rates=rates, hits=12_345, misses=1_796, bytes_per_token_ram=3.4 * 2**20,
        bytes_per_token_disk=0.6 * 2**20, bytes_from_ram=900 * 2**20, bytes_from_disk=120 * 2**20,
        num_slots=slots, slots_used=slots, policy="lru", ram_cache_bytes=0,
        resident=resident, recent=recent)


def _scenario(fakes, L: int, E: int, slots: int, keys: tuple[str, ...] = ()):
    async def run_before(pilot) -> None:
        screen = pilot.app.screen
        await fakes.wait_for(pilot, lambda: screen.info is not None)
        prompt = screen.query_one("#prompt")
        prompt.load_text("How does the expert cache work?")
        await pilot.press("enter")
        await fakes.wait_for(pilot, lambda: screen.gen_id is None and len(screen.session.turns) == 2)
        await fakes.wait_for(pilot, lambda: not screen._stats_pending)  # the engine's last stats are drawn
        screen.last_stats = fixed_stats(L, E, slots)
        screen._stats_pending = True  # drawn by the panel's clock, on the panel or its summary line
        await fakes.wait_for(pilot, lambda: not screen._stats_pending)
        prompt.cursor_blink = False
        for key in keys:
            await pilot.press(key)
        await pilot.pause(0.1)
        for knob in screen.query("StepInput"):
            knob.cursor_blink = False
        await pilot.pause(0.1)

    return run_before


def test_chat_with_dashboard_32_experts_24_layers(snap_compare, build_app, fakes):
    app, _ = build_app(fakes.Engine(num_layers=24, num_experts=32, slots=300, replies=[fakes.Reply(REPLY)]))
    assert snap_compare(app, terminal_size=(130, 40), run_before=_scenario(fakes, 24, 32, 300))


def test_chat_with_dashboard_256_experts_60_layers_200x50(snap_compare, build_app, fakes):
    app, _ = build_app(fakes.Engine(num_layers=60, num_experts=256, slots=4096, replies=[fakes.Reply(REPLY)]))
    assert snap_compare(app, terminal_size=(200, 50), run_before=_scenario(fakes, 60, 256, 4096))


def test_chat_80x24_panel_is_one_line(snap_compare, build_app, fakes):
    """80x24: the panel collapses to its summary line above the prompt; the footer's keys take two rows, none cut."""
    app, _ = build_app(fakes.Engine(num_layers=24, num_experts=32, slots=300, replies=[fakes.Reply(REPLY)]))
    assert snap_compare(app, terminal_size=(80, 24), run_before=_scenario(fakes, 24, 32, 300))


def test_chat_80x24_f6_opens_the_knobs(snap_compare, build_app, fakes):
    """80x24, F6: the panel over the transcript, scrolled to the focused slots knob, the prompt still above."""
    app, _ = build_app(fakes.Engine(num_layers=24, num_experts=32, slots=300, replies=[fakes.Reply(REPLY)]))
    assert snap_compare(app, terminal_size=(80, 24), run_before=_scenario(fakes, 24, 32, 300, keys=("f6",)))
