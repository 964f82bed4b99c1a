"""The setup wizard on a GGUF repo: one line per quant with its verdict and predicted tok/s (each from the quant's
header alone), the recommended quant marked, [ and ] to mark another, D fetching the marked quant only. And the
recommendation rule itself (engine/plan/hub/gguf.py `recommend_quant`), without Textual."""

from __future__ import annotations

import re

import pytest

from moechat.app.tui.screens.chat import ChatScreen
from moechat.app.tui.screens.setup.listing import _size
from moechat.engine.plan.catalog import CatalogEntry
from moechat.engine.plan.hub.gguf import GGUFQuant, LocalFile, QuantFit, recommend_quant

from ..engine.test_gguf_load import tiny_qwen3moe, write_gguf
from .test_wizard import SIZE, _app, _notices, _open_wizard, _text

REPO = "gguf-org/tiny-qwen3moe-wizard-GGUF"


def _fit(name, size, *, full=False, fits=None, tok_s=None, checked=True) -> QuantFit:
    fits = full if fits is None else fits
    word = "runs" if full else ("runs with 2/4 experts in RAM (disk only)" if fits else "does not fit")
    return QuantFit(name, size, word, fits, full, tok_s, checked)


def test_the_largest_quant_that_runs_fully_is_recommended():
    fits = [_fit("Q2_K", 10, full=True, tok_s=(30, 40)), _fit("Q4_K_M", 20, full=True, tok_s=(20, 25)),
            _fit("Q6_K", 30, fits=True, tok_s=(25, 30)), _fit("Q8_0", 40)]
    assert recommend_quant(fits).name == "Q4_K_M"  # not the fastest (Q2_K), nor the partly cached Q6_K
    # an unread quant never counts, even when it is the largest
    assert recommend_quant(fits + [_fit("BF16", 80, full=True, checked=False)]).name == "Q4_K_M"


def test_without_a_full_fit_the_fastest_that_fits_then_none():
    fits = [_fit("Q4_K_M", 20, fits=True, tok_s=(5, 6)), _fit("Q6_K", 30, fits=True, tok_s=(3, 4)),
            _fit("Q8_0", 40)]
    assert recommend_quant(fits).name == "Q4_K_M"
    tie = [_fit("Q4_0", 18, fits=True, tok_s=(5, 7)), _fit("Q4_K_M", 20, fits=True, tok_s=(5, 6))]
    assert recommend_quant(tie).name == "Q4_K_M"  # same low end: the larger
    assert recommend_quant([_fit("Q8_0", 40), _fit("BF16", 80)]) is None
    assert recommend_quant([]) is None


def test_a_quant_not_read_yet_or_failed_is_a_line_without_a_verdict():
    q = GGUFQuant("Q4_K_M", (LocalFile("m-Q4_K_M.gguf", 123),), 1)
    pending, failed = QuantFit.of(q), QuantFit.of(q, error="GGUF header truncated")
    assert (pending.word, pending.checked, pending.size) == ("checking…", False, 123)
    assert (failed.word, failed.checked, failed.fits) == ("GGUF header truncated", True, False)
    assert recommend_quant([pending, failed]) is None


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf_wizard")
    model = tiny_qwen3moe(hidden_size=256, moe_intermediate_size=256, num_experts=4)
    out = {}
    for name, types in {"Q8_0": ("Q8_0", "Q8_0", "Q8_0"), "Q4_K_M": ("Q4_K", "Q4_K", "Q6_K")}.items():
        path = folder / f"tiny-qwen3moe-{name}.gguf"
        write_gguf(path, model, types, "Q8_0", "Q8_0")
        out[name] = path
    return out


@pytest.fixture
def gguf_repo(hub, gguf_files):
    content = {"README.md": b"# tiny\n", **{p.name: p.read_bytes() for p in gguf_files.values()}}
    hub.server.add(hub.module.Repo(REPO, content, "d" * 40))
    return REPO


async def _pick_gguf(pilot, fakes, setup, repo_id):
    table = setup.table
    table.focus()
    table.move_cursor(row=table.get_row_index(repo_id))
    await pilot.press("enter")
    await fakes.wait_for(pilot, lambda: setup.quants_done and setup.chosen == repo_id, timeout=30,
                         what=f"the quants of {repo_id}")


@pytest.mark.anyio
async def test_the_wizard_lists_a_gguf_repos_quants_recommends_one_and_downloads_the_marked_one(
        hub, gguf_repo, gguf_files, app_env, fakes):
    entries = (CatalogEntry(REPO, "qwen3_moe", 0.001, 0.0005, "GGUF"),)
    app, _ = _app(hub, app_env, fakes, entries=entries)
    async with app.run_test(size=SIZE) as pilot:
        setup = await _open_wizard(pilot, fakes)
        # the row, before Enter: no config.json to plan from, but what the repo offers (from its listing alone)
        assert setup.cell(REPO, "verdict") == "GGUF" and setup.cell(REPO, "note").startswith("2 GGUF quants: Enter")
        small, large = (_size(gguf_files[q].stat().st_size) for q in ("Q4_K_M", "Q8_0"))
        assert setup.cell(REPO, "download") == f"{small}-{large}"
        assert f"GGUF: 2 quants (Q4_K_M {small}, Q8_0 {large})" in _text(setup, "#setup-summary")
        assert not [r for r in hub.server.requests if r.file and r.file.endswith(".gguf")]  # no header read yet
        assert not setup.check_action("quant", (1,))  # [ and ] are not in the footer before the quants are listed
        await _pick_gguf(pilot, fakes, setup, REPO)
        assert setup.check_action("quant", (1,))
        assert [f.name for f in setup.quants] == ["Q4_K_M", "Q8_0"]  # smallest first
        assert all(f.verdict is not None and f.full and f.tok_s for f in setup.quants)
        summary = _text(setup, "#setup-summary").splitlines()
        assert summary[0] == f"{REPO}: GGUF, 2 quants"
        lines = {line[2:].split()[0]: line for line in summary[1:3]}
        for f in setup.quants:  # name, size, verdict and predicted tok/s on each line
            size = _size(gguf_files[f.name].stat().st_size)
            speed = re.search(r"  ([0-9.]+)(?:-([0-9.]+))? tok/s", lines[f.name])
            assert f"  {size}  runs  " in lines[f.name] and speed, lines[f.name]
            assert float(speed[1]) == pytest.approx(f.tok_s[0], rel=0.05, abs=0.1)
        # both run with every expert in RAM (no GPU): the larger one is recommended, and marked for D
        assert lines["Q8_0"].startswith("▶ Q8_0") and lines["Q8_0"].endswith("★ recommended")
        assert lines["Q4_K_M"].startswith("  Q4_K_M") and "★" not in lines["Q4_K_M"]
        assert "★ Q8_0: the largest quant that runs with every expert in RAM" in summary
        assert setup.verdict.spec.name == f"{REPO}:Q8_0" and setup.cell(REPO, "verdict") == "fits"
        assert "GGUF Q8_0/Q8_0/Q8_0" in _text(setup, "#setup-decisions")
        # each verdict came from its quant's header: ranged reads only, never a whole file
        for path in gguf_files.values():
            reads = hub.server.file_requests(path.name, "GET")
            assert reads and all(r.range for r in reads)

        await pilot.press("left_square_bracket")  # mark the other quant: D now fetches it
        assert setup.chosen_quant().name == "Q4_K_M" and setup.verdict.spec.name == f"{REPO}:Q4_K_M"
        assert setup.cell(REPO, "download") == small  # the row follows the marked quant
        summary = _text(setup, "#setup-summary")
        assert "▶ Q4_K_M" in summary and "★ recommended" in summary.split("Q8_0")[1]
        assert _text(setup, "#setup-download-plan").startswith("D downloads Q4_K_M only: ")
        await pilot.press("d")
        await fakes.wait_for(pilot, lambda: setup not in app.screen_stack, timeout=30, what="the download")
        assert ("Downloaded", f"{REPO} is ready: opening the chat on it.") in _notices(app)
        whole = {r.file for r in hub.server.requests if r.file and r.method == "GET" and r.range is None}
        assert gguf_files["Q4_K_M"].name in whole and gguf_files["Q8_0"].name not in whole
        first = hub.client.local_snapshot(REPO) / gguf_files["Q4_K_M"].name
        assert first.read_bytes() == gguf_files["Q4_K_M"].read_bytes()
        # the chat opens on the quant's first file and loads it
        await fakes.wait_for(pilot, lambda: isinstance(app.screen, ChatScreen), timeout=30, what="the chat")
        chat = app.screen
        await fakes.wait_for(pilot, lambda: chat.info is not None, timeout=60, what="the quant loaded")
        assert chat.info.path == str(first) and chat.info.model_type == "qwen3_moe"


@pytest.mark.anyio
async def test_no_quant_runs_here_none_is_recommended_and_d_says_how_to_take_one_anyway(hub, gguf_repo, app_env,
                                                                                        fakes):
    entries = (CatalogEntry(REPO, "qwen3_moe", 0.001, 0.0005, "GGUF"),)
    app, _ = _app(hub, app_env, fakes, entries=entries, ram_gb=0.5)  # under the planner's working room
    async with app.run_test(size=SIZE) as pilot:
        setup = await _open_wizard(pilot, fakes)
        await _pick_gguf(pilot, fakes, setup, REPO)
        assert [f.word for f in setup.quants] == ["does not fit", "does not fit"]
        summary = _text(setup, "#setup-summary")
        assert "★" not in summary and "none of them runs on this machine: no quant recommended" in summary
        assert setup.chosen_quant() is None and setup.verdict is None
        await pilot.press("d")
        assert ("No quant", f"No quant of {REPO} runs on this machine: [ and ] mark one to download anyway") in \
            _notices(app)
        assert setup.downloading is None
        await pilot.press("right_square_bracket")  # the first quant with a verdict, marked by hand
        assert setup.chosen_quant().name == "Q4_K_M" and "▶ Q4_K_M" in _text(setup, "#setup-summary")


@pytest.mark.anyio
async def test_on_a_gpu_that_holds_only_the_smaller_quant_whole_the_smaller_one_is_recommended(hub, gguf_repo, app_env,
                                                                                              fakes):
    from moechat.engine.plan.hardware import probe

    def plan(vram_gb, quant):
        hw = probe(app_env, nvml=None, cuda=None).with_overrides(vram_gb=vram_gb, ram_gb=16, disk_gb=100)
        return hub.client.fit(REPO, hw, quant=quant).best_plan

    # the VRAM whose budget lies half-way between what each quant needs with every expert resident (the budget is
    # linear in the what-if's VRAM: two points give it)
    need = {q: plan(8, q).device_used_bytes for q in ("Q4_K_M", "Q8_0")}
    b8, b4 = plan(8, "Q8_0").device_budget_bytes, plan(4, "Q8_0").device_budget_bytes
    vram_gb = 4 + ((need["Q4_K_M"] + need["Q8_0"]) / 2 - b4) * 4 / (b8 - b4)
    entries = (CatalogEntry(REPO, "qwen3_moe", 0.001, 0.0005, "GGUF"),)
    app, _ = _app(hub, app_env, fakes, entries=entries, vram_gb=vram_gb)
    async with app.run_test(size=SIZE) as pilot:
        setup = await _open_wizard(pilot, fakes)
        await _pick_gguf(pilot, fakes, setup, REPO)
        small, large = setup.quants
        assert small.full and small.word == "runs"
        assert large.fits and not large.full and re.fullmatch(r"runs with \d/8 experts in VRAM \(.+\)", large.word)
        summary = _text(setup, "#setup-summary")
        assert "★ Q4_K_M: the largest quant that runs with every expert in VRAM" in summary
        assert setup.chosen_quant().name == "Q4_K_M" and setup.verdict.best_plan.resident
