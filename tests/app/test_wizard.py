"""Pilot tests of the setup wizard against the local Hub (tests/hubserver.py) and the real engine: pick a model,
see its verdict (from headers alone), download it, cancel mid-way, resume, and land in the chat on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import DataTable, Label, Static

from moechat.app.tui.app import make_app
from moechat.app.tui.bridge import LoadOptions
from moechat.app.tui.screens.chat import ChatScreen
from moechat.app.tui.screens.setup import HubOptions, SetupScreen
from moechat.app.tui.screens.welcome import WelcomeScreen
from moechat.app.tui.settings import Settings
from moechat.app.tui.store import ChatStore
from moechat.engine.errors import NotDownloadedError
from moechat.engine.plan.catalog import CatalogEntry, find
from moechat.engine.plan.hardware import probe
from moechat.engine.plan.hub import INDEX_FILE, wanted_file

pytestmark = pytest.mark.anyio
SIZE = (150, 45)
DEMO = Path(__file__).resolve().parents[2] / "assets" / "demo-moe"
WEIGHTS = (".safetensors", ".bin")
MISSING = "nobody/nothing"
CONFIGS = Path(__file__).resolve().parents[3] / "shared" / "model-configs"


def _app(hub, app_env, fakes, model=None, entries=None, vram_gb=0, ram_gb=16, **hub_options):
    # A what-if machine (no GPU, 16 GiB RAM, 100 GiB disk), so the verdicts do not depend on the test machine.
    hardware = probe(app_env, nvml=None, cuda=None).with_overrides(vram_gb=vram_gb, ram_gb=ram_gb, disk_gb=100)
    entries = entries or (CatalogEntry(hub.repo, "qwen3_moe", 0.0003, 0.0001, "fp32", ("softmax top-k routing",)),
                          CatalogEntry(hub.gated, "qwen3_moe", 0.0003, 0.0001, "fp32", gated=True),
                          CatalogEntry(MISSING, "phimoe", 80.0, 3.0, "bf16"))
    options = HubOptions(endpoint=hub.server.url, cache_dir=hub.cache, entries=entries, hardware=hardware,
                         **hub_options)
    settings = Settings(path=app_env / "settings.toml")
    app = make_app(model, options=LoadOptions(device="cpu"), settings=settings,
                   store=ChatStore(app_env / "chats.sqlite3"), memory_probe=fakes.Memory(),
                   export_dir=app_env / "exports", hub=options)
    return app, settings


def _notices(app) -> list[tuple[str, str]]:
    return [(n.title, n.message) for n in app._notifications]


def _text(screen, selector: str) -> str:
    return str(screen.query_one(selector, Static).content)


def _weight_requests(hub) -> list:
    return [r for r in list(hub.server.requests) if r.file and r.file.endswith(WEIGHTS)]


async def _open_wizard(pilot, fakes) -> SetupScreen:
    await pilot.press("f5")
    await fakes.wait_for(pilot, lambda: isinstance(pilot.app.screen, SetupScreen), what="the wizard")
    setup = pilot.app.screen
    await fakes.wait_for(pilot, lambda: all(r.status is not None for r in setup.rows.values()), what="the verdicts")
    return setup


async def _pick(pilot, fakes, setup: SetupScreen, repo_id: str) -> None:
    table = setup.query_one("#setup-models", DataTable)
    table.focus()
    table.move_cursor(row=table.get_row_index(repo_id))
    await pilot.press("enter")
    await fakes.wait_for(pilot, lambda: setup.verdict is not None and setup.verdict.repo_id == repo_id,
                         what=f"the plan of {repo_id}")


async def test_from_the_chat_pick_see_the_verdict_download_and_chat_on_it(hub, app_env, fakes):
    app, settings = _app(hub, app_env, fakes, model=DEMO)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.screen
        assert isinstance(chat, ChatScreen)
        await fakes.wait_for(pilot, lambda: chat.info is not None, what="the demo model")
        hint = chat.query_one("#chat-hint", Label)  # a line above the prompt, not a toast over the panel's knobs
        assert hint.display and "F5: real MoE models" in str(hint.content)
        assert not any("F5" in m for _, m in _notices(app))
        setup = await _open_wizard(pilot, fakes)
        # this machine, then each catalog row's verdict and predicted speed
        hardware = _text(setup, "#setup-hardware")
        assert "GPU   none usable" in hardware and "RAM   16.00 GiB available" in hardware
        assert "disk  100.00 GiB free" in hardware and "what-if: no GPU" in hardware
        assert setup.cell(hub.repo, "verdict") == "fits"
        assert setup.cell(hub.repo, "speed").endswith(" tok/s")
        # what is left to fetch: every file moechat takes, less config.json and the index the verdict read
        files = hub.server.repos[hub.repo].files
        left = sum(len(b) for f, b in files.items() if wanted_file(f) and f not in ("config.json", INDEX_FILE))
        assert setup.cell(hub.repo, "download") == f"{left / 1024:.1f} KiB"
        assert setup.cell(hub.gated, "verdict") == "gated"
        assert setup.cell(hub.gated, "note").startswith("is gated (401): accept its conditions")
        assert setup.cell(MISSING, "verdict") == "unsupported" and "SparseMixer" in setup.cell(MISSING, "note")
        # the catalog's verdicts came from config.json and the index alone: not one weight file was requested
        assert hub.server.requests and not _weight_requests(hub)

        await _pick(pilot, fakes, setup, hub.repo)
        summary = _text(setup, "#setup-summary")
        assert f"{hub.repo} at {hub.server.repos[hub.repo].sha[:12]} (qwen3_moe): FITS on this machine" in summary
        assert "predicted decode" in summary and "sizes from Hub safetensors headers (exact)" in summary
        assert "\nexperts: f32, " in summary and "(bf16 would be " in summary and "; stored as f32" in summary
        decisions = _text(setup, "#setup-decisions").splitlines()  # each decision of the plan with its reason
        assert len(decisions) >= 3 and all(d.startswith("• ") and d.split(": ", 1)[1] for d in decisions)
        assert any(d.startswith("• dense weights ") for d in decisions)
        # the expert format it is planned in, and each format it can run in, the recommended one starred
        verdict = setup.verdict
        assert "\nexpert format: " in summary and setup.cell(hub.repo, "format") in ("native f32", "int8", "int4")
        formats = [line for line in summary.splitlines() if line.startswith(("  * ", "  - "))]
        assert [line[4:].split(":")[0] for line in formats] == ["native", "int8", "int4"]
        assert [line[2] for line in formats].count("*") == 1 and verdict.best_plan is verdict.formats.best.plan
        assert _text(setup, "#setup-download-plan").endswith("to download: 0.9 MiB")
        # the exact verdict read the safetensors headers: ranged reads of each shard's first 100 kB, no weight body
        weights = _weight_requests(hub)
        assert weights and all(r.method == "HEAD" or (r.range == "bytes=0-100000" and r.body_bytes <= 100_001)
                               for r in weights), weights
        assert not hub.server.file_requests("pytorch_model.bin")

        await pilot.press("d")
        await fakes.wait_for(pilot, lambda: app.screen is chat, timeout=30, what="back in the chat")
        snapshot = hub.client.resolve(hub.repo)  # complete and verified
        await fakes.wait_for(pilot, lambda: chat.info is not None and chat.info.path == str(snapshot), timeout=30,
                             what="the downloaded model loaded")
        assert chat.info.model_type == "qwen3_moe" and chat.info.num_experts == 8
        assert settings.recent_models[0] == str(snapshot)
        assert ("Downloaded", f"{hub.repo} is ready: opening the chat on it.") in _notices(app)
        full = [r for r in _weight_requests(hub) if r.method == "GET" and r.range is None]
        assert {r.file for r in full} == {p.name for p in snapshot.glob("*.safetensors")}


async def test_first_start_cancel_mid_way_then_resume_and_land_in_the_chat(hub, app_env, fakes):
    app, _ = _app(hub, app_env, fakes)
    async with app.run_test(size=SIZE) as pilot:
        assert isinstance(app.screen, WelcomeScreen)
        setup = await _open_wizard(pilot, fakes)
        await _pick(pilot, fakes, setup, hub.repo)
        hub.server.faults.slow_s = 0.05  # 16 KiB every 50 ms: the weights take seconds

        await pilot.press("d")
        await fakes.wait_for(pilot, lambda: setup.last_progress is not None and setup.last_progress.file
                             and setup.last_progress.file.endswith(".safetensors")
                             and setup.last_progress.file_done >= 32 * 1024, what="a weight file half-way")
        assert setup.query_one("#setup-cancel").display and "files" in str(
            setup.query_one("#setup-progress-label", Label).content)
        shard = setup.last_progress.file
        await pilot.press("escape")  # cancels the download; the wizard stays
        await fakes.wait_for(pilot, lambda: setup.downloading is None, what="the cancel")
        assert app.screen is setup
        (title, message), = [n for n in _notices(app) if n[0] == "Download cancelled"]
        assert message.startswith(f"download of {hub.repo} cancelled during {shard}") and "kept in the cache" in message
        assert str(setup.query_one("#setup-progress-label", Label).content).startswith("Cancelled: download of")
        assert not setup.query_one("#setup-cancel").display
        with pytest.raises(NotDownloadedError, match="only partly downloaded"):
            hub.client.resolve(hub.repo)
        kept = hub.client.plan_download(hub.repo).kept_bytes
        assert kept >= 32 * 1024

        hub.server.faults.slow_s = 0.0
        await pilot.press("d")  # again: it resumes where the cancel left it
        await fakes.wait_for(pilot, lambda: isinstance(app.screen, ChatScreen), timeout=30, what="the chat")
        chat = app.screen
        snapshot = hub.client.resolve(hub.repo)
        await fakes.wait_for(pilot, lambda: chat.info is not None, timeout=30, what="the model loaded")
        assert chat.info.path == str(snapshot)
        assert not any(isinstance(s, (WelcomeScreen, SetupScreen)) for s in app.screen_stack)
        resumed = [r for r in hub.server.file_requests(shard, "GET") if r.range and r.range != "bytes=0-100000"]
        assert resumed and resumed[-1].range.startswith("bytes=") and int(resumed[-1].range[6:-1]) >= kept


async def test_search_and_the_errors_say_what_to_do(hub, app_env, fakes, monkeypatch):
    planned = "other-org/phimoe-tiny"  # a family moechat does not run yet, for this test only
    monkeypatch.setitem(hub.server.repos, planned, hub.module.Repo(
        planned, {"config.json": b'{"model_type": "phimoe"}'}, "e" * 40, model_type="phimoe", downloads=5))
    app, _ = _app(hub, app_env, fakes, free_space=lambda path: 1 << 20)  # a disk with 1 MiB free
    async with app.run_test(size=SIZE) as pilot:
        setup = await _open_wizard(pilot, fakes)
        # search: supported families get verdicts, the others say why they do not run yet
        await pilot.press("slash")
        await pilot.press(*"tiny", "enter")
        expected = {hub.repo, hub.gated, "other-org/gpt-oss-tiny", "other-org/mixtral-moe-tiny", planned}
        await fakes.wait_for(pilot, lambda: set(setup.rows) == expected, what="the search hits")
        await fakes.wait_for(pilot, lambda: setup.cell(hub.repo, "verdict") == "fits", what="a hit's verdict")
        assert setup.cell(planned, "verdict") == "unsupported" and "SparseMixer" in setup.cell(planned, "note")
        for broken in ("other-org/mixtral-moe-tiny", "other-org/gpt-oss-tiny"):  # supported, but a config-only stub
            await fakes.wait_for(pilot, lambda b=broken: setup.cell(b, "verdict") == "unknown",
                                 what="a broken repo's row")

        # gated: the engine's message, with the action to take
        setup.query_one("#setup-models", DataTable).focus()
        table = setup.query_one("#setup-models", DataTable)
        table.move_cursor(row=table.get_row_index(hub.gated))
        await pilot.press("enter")
        await fakes.wait_for(pilot, lambda: any(t == "Gated model" for t, _ in _notices(app)), what="gated")
        (message,) = [m for t, m in _notices(app) if t == "Gated model"]
        assert message.startswith(f"{hub.gated} is gated (401): accept its conditions on the model page")
        assert "set HF_TOKEN" in message and _text(setup, "#setup-summary").startswith(f"{hub.gated}: ")
        assert setup.query_one("#setup-download").disabled

        # no space: refused before the first byte
        await _pick(pilot, fakes, setup, hub.repo)
        requests_before = len(hub.server.requests)
        await pilot.press("d")
        await fakes.wait_for(pilot, lambda: any(t == "Not enough disk" for t, _ in _notices(app)), what="no space")
        (message,) = [m for t, m in _notices(app) if t == "Not enough disk"]
        assert message.startswith(f"{hub.repo} needs 0.9 MiB more on disk")
        assert "set HF_HOME to a bigger disk" in message
        assert not [r for r in hub.server.requests[requests_before:] if r.method == "GET" and r.file
                    and r.file.endswith(".safetensors")]

        # offline: nothing downloaded, so no plan; the notice says how to get online
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        table.move_cursor(row=table.get_row_index(hub.gated))
        await pilot.pause()
        table.move_cursor(row=table.get_row_index(hub.repo))
        await pilot.press("enter")
        await fakes.wait_for(pilot, lambda: any(t == "Offline" for t, _ in _notices(app)), what="offline")
        (message,) = [m for t, m in _notices(app) if t == "Offline"]
        assert message == (f"{hub.repo}: its exact plan and its download need the Hub (offline: HF_HUB_OFFLINE is "
                           "set): unset HF_HUB_OFFLINE, or use a model that is already downloaded; the row shows the "
                           "catalog's estimate")
        await pilot.press("d")  # Enter then D: says why, not "pick a model first"
        await pilot.pause()
        assert [m for t, m in _notices(app) if t == "No plan"] == [f"Cannot download {hub.repo}: {message}"]
        monkeypatch.delenv("HF_HUB_OFFLINE")

        # not found, through search of a name that matches nothing; then back to the catalog and out
        await pilot.press("slash")
        search = setup.query_one("#setup-search")
        search.value = "no-such-model-anywhere"
        await pilot.press("enter")
        await fakes.wait_for(pilot, lambda: not setup.rows, what="an empty search")
        assert "No MoE model on the Hub matches 'no-such-model-anywhere'" in _text(setup, "#setup-summary")
        await pilot.press("slash")
        search.value = ""
        await pilot.press("enter")
        await fakes.wait_for(pilot, lambda: set(setup.rows) == {hub.repo, hub.gated, MISSING}, what="the catalog")
        assert setup.cell(MISSING, "verdict") == "unsupported" and "SparseMixer" in setup.cell(MISSING, "note")
        table.move_cursor(row=table.get_row_index(MISSING))  # its brief says the Hub does not know it
        await fakes.wait_for(pilot, lambda: f"no such model on {hub.server.url} (404)"
                             in _text(setup, "#setup-summary"), what="the brief of a missing repo")
        assert _text(setup, "#setup-summary").count(MISSING) == 1  # its first line names it; the error not again
        await pilot.press("escape")
        await fakes.wait_for(pilot, lambda: isinstance(app.screen, WelcomeScreen), what="back to the welcome screen")


def _gpt_oss_on_the_hub(hub, monkeypatch) -> dict[str, int]:
    """openai/gpt-oss-20b and -120b on the local Hub: their real config.json (the 20b's index and
    generation_config.json too) and placeholder shards listed at full size, since a catalog row reads config.json
    and the index only. The 20b's shards add up to its index's total_size; the 120b's 15 to ~65 GB, as the Hub
    lists them. Returns repo id -> the listed bytes of the files moechat downloads, less what a row reads."""
    left = {}
    for name, shards, shard_bytes in (("gpt-oss-20b", 3, 13_761_264_768 // 3), ("gpt-oss-120b", 15, 4_350_000_000)):
        folder = CONFIGS / f"openai--{name}"
        files = {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix == ".json"}
        for i in range(shards):
            files[f"model-{i:05d}-of-{shards - 1:05d}.safetensors"] = f"placeholder {i}".encode()
        repo = hub.module.Repo(f"openai/{name}", files, f"{shards:040x}", model_type="gpt_oss")
        monkeypatch.setitem(hub.server.repos, repo.repo_id, repo)
        for f in files:
            if f.endswith(".safetensors"):
                hub.server.faults.listing_patch[f] = {"size": shard_bytes, "lfs": {
                    "size": shard_bytes, "sha256": repo.sha256(f), "pointerSize": 134}}
        read = len(files["config.json"]) + len(files.get(INDEX_FILE, b""))
        left[repo.repo_id] = shards * shard_bytes + sum(len(b) for f, b in files.items() if f.endswith(".json")) - read
    return left


@pytest.mark.skipif(not (CONFIGS / "openai--gpt-oss-20b" / INDEX_FILE).exists()
                    or not (CONFIGS / "openai--gpt-oss-120b" / "config.json").exists(),
                    reason="../shared/model-configs has no gpt-oss configs")
async def test_gpt_oss_rows_are_runnable_with_verdict_speed_and_download(hub, app_env, fakes, monkeypatch):
    left = _gpt_oss_on_the_hub(hub, monkeypatch)
    entries = (find("openai/gpt-oss-20b"), find("openai/gpt-oss-120b"))
    app, _ = _app(hub, app_env, fakes, entries=entries, vram_gb=8, ram_gb=32)  # the vLLM RFC's 8 GB GPU
    async with app.run_test(size=SIZE) as pilot:
        setup = await _open_wizard(pilot, fakes)
        for repo_id in left:
            row = setup.rows[repo_id]
            assert row.entry.supported and row.status.error is None, row.status.error
            assert setup.cell(repo_id, "verdict") == "fits"
            assert setup.cell(repo_id, "speed").endswith(" tok/s") and setup.cell(repo_id, "family") == "gpt_oss"
            assert setup.cell(repo_id, "download") == f"{left[repo_id] / (1 << 30):.2f} GiB"
            assert setup.cell(repo_id, "note").startswith("MXFP4 experts")
            assert setup.cell(repo_id, "format") == "native MXFP4"  # int8/int4 would be larger, quality unmeasured
            plan = row.status.verdict.plan
            slots = next(d.reason for d in plan.decisions if d.item.startswith("expert slots"))
            assert slots.startswith("experts: MXFP4, 12.6 MiB each (bf16 would be 47.5 MiB: ")
        small, big = (setup.rows[r].status.verdict.plan for r in left)
        assert small.expert_slots >= 200 and small.host_tier == "all experts in RAM"  # 9.5 GiB of experts
        assert big.host_tier == "RAM cache" and big.decode.bound_by == "disk"  # 57 GiB of experts, 32 GiB of RAM
        low, high = small.decode.low, small.decode.high
        assert setup.cell("openai/gpt-oss-20b", "speed") == f"{low:.1f}-{high:.1f} tok/s"
        table = setup.query_one("#setup-models", DataTable)
        table.focus()
        table.move_cursor(row=table.get_row_index("openai/gpt-oss-20b"))
        await fakes.wait_for(pilot, lambda: "on this machine: fits" in _text(setup, "#setup-summary"),
                             what="the 20b's brief")
        brief = _text(setup, "#setup-summary")
        assert "experts in mxfp4" in brief and f"{low:.1f}-{high:.1f} tok/s predicted" in brief
        assert not _weight_requests(hub)  # the rows read config.json and the index, not one shard


async def test_hub_unreachable_rows_get_the_catalogs_estimate_and_search_says_offline_at_once(app_env, fakes):
    """Issue 18: offline, every verdict was "unknown", search spun 24 s, Enter then D said "Pick a model first"."""
    from moechat.app.tui.screens.setup import catalog_estimate
    from moechat.engine.plan.catalog import CATALOG

    hardware = probe(app_env, nvml=None, cuda=None).with_overrides(vram_gb=8, ram_gb=32, disk_gb=100)
    options = HubOptions(endpoint="http://127.0.0.1:9", cache_dir=app_env / "hf", hardware=hardware)  # refused
    app = make_app(None, options=LoadOptions(device="cpu"), settings=Settings(path=app_env / "settings.toml"),
                   store=ChatStore(app_env / "chats.sqlite3"), memory_probe=fakes.Memory(),
                   export_dir=app_env / "exports", hub=options)
    async with app.run_test(size=SIZE) as pilot:
        setup = await _open_wizard(pilot, fakes)
        assert setup.offline.startswith("offline: cannot reach http://127.0.0.1:9")
        verdicts = {e.repo_id: setup.cell(e.repo_id, "verdict") for e in CATALOG}
        for e in CATALOG:
            if e.supported:
                assert verdicts[e.repo_id] in ("fits (est.)", "too big (est.)", "disk short (est.)"), e.repo_id
                assert setup.cell(e.repo_id, "speed") == "? offline"  # not an empty column: it needs config.json
                assert setup.cell(e.repo_id, "download").startswith("~")
            else:
                assert verdicts[e.repo_id] == "unsupported"
        assert verdicts["allenai/OLMoE-1B-7B-0125-Instruct"] == "fits (est.)"  # ~13 GiB on a 100 GiB disk
        # ~657 GiB of FP8 on a 100 GiB disk, but a token's 37 B active parameters fit 32 GiB RAM + 8 GiB VRAM
        assert verdicts["deepseek-ai/DeepSeek-V3-0324"] == "disk short (est.)"
        word, note, size = catalog_estimate(find("Qwen/Qwen3-235B-A22B-Instruct-2507"), hardware)  # both short
        assert word == "too big (est.)" and "RAM + VRAM" in note and "100.00 GiB free on disk" in note
        assert size > 400 << 30
        small = probe(app_env, nvml=None, cuda=None).with_overrides(vram_gb=0, ram_gb=1, disk_gb=100)
        word, note, _ = catalog_estimate(find("allenai/OLMoE-1B-7B-0125-Instruct"), small)  # memory short only
        assert word == "too big (est.)" and "RAM + VRAM" in note and "disk" not in note
        note = setup.cell("allenai/OLMoE-1B-7B-0125-Instruct", "note")
        assert note == "estimate from the catalog's sizes; small: fits most machines"  # the whole note, not 10 chars
        brief = _text(setup, "#setup-summary")  # the first row's: its note once, not twice
        assert brief.count("small: fits most machines") == 1 and "the predicted speed needs config.json" in brief
        table = setup.query_one("#setup-models", DataTable)
        # whole columns only: the Note column, when it fits, is as wide as its widest note; else it is not shown
        columns = {c.label.plain: c.get_render_width(table) for c in table.columns.values()}
        assert columns.get("Note", len(note) + 1) > len(note)
        assert sum(columns.values()) <= table.scrollable_content_region.width

        await pilot.press("slash", *"qwen", "enter")
        await fakes.wait_for(pilot, lambda: any(t == "Offline" for t, _ in _notices(app)), timeout=5,
                             what="search to say it is offline at once")
        (message,) = [m for t, m in _notices(app) if t == "Offline"]
        assert message.startswith("Hub search needs the Hub (offline: cannot reach")
        assert "matching 'qwen'" in message
        qwen = {e.repo_id for e in CATALOG if "qwen" in e.repo_id.lower() or "qwen" in e.family.lower()}
        await fakes.wait_for(pilot, lambda: set(setup.rows) == qwen, what="the catalog filtered offline")
        await fakes.wait_for(pilot, lambda: all(r.status is not None for r in setup.rows.values()), what="estimates")
        assert setup.cell("Qwen/Qwen3-30B-A3B", "verdict") == "fits (est.)"
        await pilot.press("slash", *" 235b", "enter")  # every word must match: "qwen 235b"
        await fakes.wait_for(pilot, lambda: set(setup.rows) == {"Qwen/Qwen3-235B-A22B-Instruct-2507"}, what="two words")
        search = setup.query_one("#setup-search")
        search.value = ""
        search.focus()
        await pilot.press("enter")
        await fakes.wait_for(pilot, lambda: len(setup.rows) == len(CATALOG), what="the whole catalog again")

        table = setup.query_one("#setup-models", DataTable)
        table.focus()
        table.move_cursor(row=table.get_row_index("allenai/OLMoE-1B-7B-0125-Instruct"))
        await pilot.press("enter", "d")
        await fakes.wait_for(pilot, lambda: any(t == "No plan" for t, _ in _notices(app)), what="why no download")
        assert not any("Pick a model first" in m for _, m in _notices(app))
        (why,) = [m for t, m in _notices(app) if t == "No plan"]
        assert "need the Hub (offline: cannot reach" in why and "check the connection" in why


async def test_enter_then_d_at_once_downloads_when_the_plan_arrives(hub, app_env, fakes):
    app, _ = _app(hub, app_env, fakes)
    async with app.run_test(size=SIZE) as pilot:
        setup = await _open_wizard(pilot, fakes)
        table = setup.query_one("#setup-models", DataTable)
        table.focus()
        table.move_cursor(row=table.get_row_index(hub.repo))
        await pilot.press("enter", "d")  # before the plan has come back
        await fakes.wait_for(pilot, lambda: isinstance(app.screen, ChatScreen), timeout=30, what="the chat")
        assert not any("Pick a model first" in m for _, m in _notices(app))
        assert hub.client.resolve(hub.repo)


async def test_the_wizard_at_80x24_keeps_a_dozen_rows_and_the_footer(app_env, fakes):
    hardware = probe(app_env, nvml=None, cuda=None).with_overrides(vram_gb=8, ram_gb=32, disk_gb=100)
    options = HubOptions(endpoint="http://127.0.0.1:9", cache_dir=app_env / "hf", hardware=hardware)
    app = make_app(None, options=LoadOptions(device="cpu"), settings=Settings(path=app_env / "settings.toml"),
                   store=ChatStore(app_env / "chats.sqlite3"), memory_probe=fakes.Memory(),
                   export_dir=app_env / "exports", hub=options)
    async with app.run_test(size=(80, 24)) as pilot:
        setup = await _open_wizard(pilot, fakes)
        await pilot.pause(0.2)
        table = setup.query_one("#setup-models", DataTable)
        assert table.size.height >= 10  # header + 9 models or more
        assert setup.query_one("#setup-download").region.bottom <= 23  # the button above the footer
        keys = {key for key, (_, b, enabled, _) in setup.active_bindings.items() if b.show}
        assert {"escape", "slash", "d", "ctrl+q"} <= keys
