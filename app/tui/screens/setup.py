"""The setup wizard: pick a model from the Hub, know before the download whether and how fast it runs here,
download it with progress and cancel, and land in the chat on it.

    this machine   GPU, free VRAM, link, RAM, disk             engine.hardware.probe (a worker)
    catalog        engine/plan/catalog.py's MoE models, one row each; each row's verdict and predicted tok/s from
                   config.json and the index alone (Hub.catalog, 4 rows at a time, filled in as they come)
    search         Hub search (Enter in the search box); supported families get the same verdicts
    plan           Enter on a row: the exact verdict from the safetensors headers (a ranged read of each shard's
                   first 100 kB, never a weight body), the memory plan's decisions with their reasons, and what
                   the download will do (cached files, partial files resumed, bytes to fetch)
    download       Hub.download with a progress sink and a cancel Event: the bar, the rate, the file; Escape or
                   the Cancel button stop it within one chunk (what arrived is kept and resumed next time)
    done           the screen dismisses with the snapshot's path; the app opens the chat on it

Every Hub call blocks, so each runs in a thread worker and answers with the messages in messages.py; the engine
(huggingface_hub, the planner) is imported inside the workers, so opening the app stays torch-free. A verdict
for a 60 GB model reads about 2 MB. Errors are the engine's typed messages (gated, not found, no space, offline,
bad token), shown as notices and kept beside the row.

Offline (HF_HUB_OFFLINE, or the endpoint not answering a TCP connect within HUB_PROBE_TIMEOUT_S) the Hub is not
asked at all: downloaded models get their exact verdict from the local snapshot, the others an estimate from
what the catalog knows (parameters and expert format -> download size and the memory a token's weights need;
`catalog_estimate`), marked "(est.)" ("disk short (est.)" when only the disk is short); the Predicted column says
the speed needs the Hub (it needs config.json); search filters the catalog and says at once that the Hub itself
is not searched.

The table shows only whole columns: the columns that fit the width, in order (the rest are in the detail pane),
and under the width of the first four (80 columns) the model's name without its owner and the speed without its
unit (the header says "tok/s"); no column is cut at the edge ("Downl", "~12.8").
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

from rich.cells import cell_len
from textual import on, work
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Header, Input, Label, ProgressBar, Static
from textual.worker import get_current_worker

from moechat.engine.plan.catalog import CATALOG, MISSING_FEATURES, CatalogEntry

from ..messages import (
    CatalogRowChecked,
    DownloadFinished,
    DownloadProgressed,
    HardwareProbed,
    PlanReady,
    SearchFinished,
    SetupFailed,
)

# The note comes before the family and parameters (also in the detail pane), so a normal terminal shows it whole.
COLUMNS = (("Model", "model"), ("Verdict", "verdict"), ("Predicted", "speed"), ("Download", "download"),
           ("Note", "note"), ("Experts", "format"), ("Family", "family"), ("Params / active", "params"))
NARROW_LABELS = {"speed": "tok/s"}  # the unit in the header when the cells drop it
FIRST_COLUMNS = 4  # Model, Verdict, Predicted, Download: always shown (in their narrow form when need be)
NAME_WIDTH = 30  # a narrow table's model name, cut at a '-' with '…' past this
OFFLINE_SPEED = "? offline"  # a row without a verdict while the Hub cannot be asked: the speed needs config.json
HUB_PROBE_TIMEOUT_S = 2.0  # a TCP connect to the endpoint: no answer in this long and the wizard works offline
# Bytes per parameter of a checkpoint by how its experts are stored (gpt-oss: MXFP4 experts, bf16 attention: 0.6).
BYTES_PER_PARAM = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "fp8": 1.05, "mxfp4": 0.6}
CHECK_WORKERS = 4  # rows checked at once: each is 2-3 small requests (listing, config.json, index)
SEARCH_LIMIT = 20
PICK_HINT = ("Enter on a model: its exact plan for this machine, read from the safetensors headers (no weights "
             "are downloaded). Then D, or the button, downloads it and opens the chat.")

# The engine's error class -> the notice's title (by name: the engine is not imported at start-up).
ERROR_TITLES = {
    "RepoGatedError": "Gated model",
    "RepoNotFoundError": "Not found",
    "HubAuthError": "Token rejected",
    "HubOfflineError": "Offline",
    "NetworkError": "Network problem",
    "DiskSpaceError": "Not enough disk",
    "DownloadIntegrityError": "Download discarded",
    "DownloadBusyError": "Already downloading",
    "DownloadCancelled": "Download cancelled",
    "UnsupportedModelError": "Not supported",
}


@dataclass(frozen=True)
class HubOptions:
    """The wizard's Hub and what it lists. The defaults follow huggingface_hub's environment (HF_ENDPOINT,
    HF_TOKEN, HF_HOME, HF_HUB_OFFLINE); tests point `endpoint` and `cache_dir` at a local Hub."""

    endpoint: str | None = None
    token: str | bool | None = None
    cache_dir: str | os.PathLike | None = None
    free_space: Callable[[str], int] | None = None  # bytes free at a path (tests: a small disk)
    entries: tuple[CatalogEntry, ...] = CATALOG
    hardware: object | None = None  # engine.hardware.Hardware (what-ifs); None: probe this machine
    prefs: object | None = None  # engine.plan.Preferences; None: the planner's defaults

    def client(self):
        from moechat.engine.plan.hub import Hub

        return Hub(self.endpoint, self.token, self.cache_dir, self.free_space)


def _size(n: float | None) -> str:
    if n is None:
        return "?"
    if n >= 1 << 40:
        return f"{n / (1 << 40):.2f} TiB"
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def _params(entry: CatalogEntry) -> str:
    """Total / active parameters per token, in billions ("30.5B / 3.3B")."""
    if not entry.total_params_b:
        return "?"
    total = f"{entry.total_params_b:.3g}B"
    return f"{total} / {entry.active_params_b:.3g}B" if entry.active_params_b else total


def _rate(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _tok_s(verdict) -> str:
    speed = verdict.decode_tok_s if verdict is not None else None
    if speed is None:
        return ""
    low, high = (_rate(x) for x in speed)
    return f"{low} tok/s" if low == high else f"{low}-{high} tok/s"


def _format(verdict) -> str:
    """The expert format a row's speed is predicted in: the recommended one ("native" is shown as stored)."""
    formats = getattr(verdict, "formats", None) if verdict is not None else None
    if formats is None or not verdict.fits:
        return ""
    if formats.recommended == "native":
        return f"native {verdict.spec.expert_format_name}"
    return formats.recommended


def format_lines(verdict) -> list[str]:
    """The plan's expert formats: the recommended one with why, then each format's line (engine/plan/format_plan.py)."""
    formats = getattr(verdict, "formats", None)
    if formats is None:
        return []
    best = formats.option(formats.recommended) if formats.recommended else None
    if best is None:
        lines = [f"expert format: {formats.reason}"]
    elif best.name == "native":
        lines = [f"expert format: native {verdict.spec.expert_format_name}, recommended ({formats.reason})"]
    else:
        lines = [f"expert format: {best.headline()}, recommended: {formats.reason}. Download and chat loads it in "
                 f"{best.name} (the first start converts the experts; the panel changes it)"]
    lines += [f"  {'*' if o.name == formats.recommended else '-'} {o.name}: {o.describe()}" for o in formats.options]
    return lines


def short_name(repo_id: str, width: int = NAME_WIDTH) -> str:
    """A narrow table's model name: without its owner, and past `width` cut after a '-' with '…'."""
    name = repo_id.split("/", 1)[-1]
    if len(name) <= width:
        return name
    cut = name.rfind("-", 0, width - 1)
    return name[:cut if cut > 0 else width - 1] + "…"


def matches(entry: CatalogEntry, query: str) -> bool:
    """An offline search: every word of `query` in the entry's repo id, family, format or note (any case)."""
    text = " ".join((entry.repo_id, entry.family, entry.format, entry.note)).lower()
    return all(word in text for word in query.lower().split())


def offline_search_text(offline: str, query: str) -> str:
    return (f"Hub search needs the Hub ({offline}); the list shows the catalog's models matching {query!r}, which "
            "moechat knows without it")


def strip_repo(text: str, repo_id: str) -> str:
    """`text` without the repo id it starts with (the line naming the repo already says it)."""
    return text[len(repo_id):].lstrip(":").strip() if repo_id and text.startswith(repo_id) else text


def _short(text: str, repo_id: str = "", limit: int = 60) -> str:
    """An error or reason cut for a table cell: without the repo id it starts with, up to the first ';'."""
    if repo_id and text.startswith(repo_id):
        text = text[len(repo_id):].lstrip(":").strip()
    text = text.split(";")[0]
    return text if len(text) <= limit else text[:limit - 1] + "…"


def error_title(e: BaseException, default: str) -> str:
    return ERROR_TITLES.get(type(e).__name__, default)


def hardware_summary(hw) -> str:
    """Three lines: the GPU (free VRAM, link), RAM, disk; what-ifs marked."""
    gpu = hw.best_gpu()
    if gpu is not None:
        link = "link unknown" if gpu.link_gbps is None else f"link {gpu.link_gbps:.1f} GB/s"
        if gpu.pcie_gen and gpu.pcie_width:
            link += f" (PCIe {gpu.pcie_gen}.0 x{gpu.pcie_width})"
        others = sum(1 for g in hw.gpus if g.usable) - 1
        gpu_line = (f"GPU   {gpu.name} ({gpu.label}): {_size(gpu.free_bytes)} free VRAM of {_size(gpu.total_bytes)}"
                    f", {link}" + (f"; {others} more GPU(s)" if others > 0 else ""))
    else:
        gpu_line = "GPU   none usable: the CPU computes from RAM"
    ram = hw.ram
    ram_line = f"RAM   {_size(ram.available_bytes)} available" + (
        f" of {_size(ram.total_bytes)}" if ram.total_bytes and ram.total_bytes != ram.available_bytes else "")
    disk = hw.disk
    disk_line = "disk  unknown" if disk is None else f"disk  {_size(disk.free_bytes)} free on {disk.path}"
    lines = [gpu_line, ram_line, disk_line]
    if hw.what_if:
        lines.append("what-if: " + ", ".join(hw.what_if))
    return "\n".join(lines)


def hub_offline_reason(endpoint: str | None, timeout: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Why the Hub cannot be asked now (HF_HUB_OFFLINE, or no TCP answer from the endpoint), or None."""
    from moechat.engine.plan.hub import is_offline

    if is_offline():
        return "offline: HF_HUB_OFFLINE is set"
    url = endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    result: list[str | None] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result.append(None)
        except OSError as e:
            result.append(f"offline: cannot reach {parts.scheme}://{parts.netloc} ({e.strerror or type(e).__name__})")

    # In a daemon thread joined with the timeout: a name lookup without a DNS server can block far longer.
    thread = threading.Thread(target=probe, name="moechat-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    if not result:
        return f"offline: no answer from {parts.scheme}://{parts.netloc} in {timeout:g} s"
    return result[0]


def catalog_estimate(entry: CatalogEntry, hw) -> tuple[str, str, int | None]:
    """(verdict word, note, download bytes) from what the catalog knows, for a supported entry without the Hub.

    The download is the parameters at the format's bytes per parameter; a token needs about its active
    parameters' bytes in RAM + VRAM (the dense part and its top-k experts; the other experts stream from disk)
    and 1 GiB of working room."""
    bpp = BYTES_PER_PARAM.get(entry.format.split()[0].lower() if entry.format else "")
    if bpp is None or not entry.total_params_b:
        return "unknown (offline)", "offline, and the catalog does not give its size", None
    total = int(entry.total_params_b * 1e9 * bpp)
    active = int((entry.active_params_b or entry.total_params_b) * 1e9 * bpp)
    gpu = hw.best_gpu() if hw is not None else None
    ram = hw.ram.total_bytes or hw.ram.available_bytes if hw is not None else None
    memory = (ram or 0) + (gpu.free_bytes or 0 if gpu is not None else 0)
    disk = hw.disk.free_bytes if hw is not None and hw.disk is not None else None
    need = active + (1 << 30)  # a token's weights (the dense part and its top-k experts) and working room
    disk_short = disk is not None and total > disk
    if memory and need > memory:
        note = f"estimate: needs ~{_size(need)} of RAM + VRAM, {_size(memory)} here"
        return "too big (est.)", note + (f"; and {_size(disk)} free on disk" if disk_short else ""), total
    if disk_short:  # it would run here: the download does not fit
        return "disk short (est.)", f"estimate: the download needs ~{_size(total)}, {_size(disk)} free on disk", total
    return "fits (est.)", "estimate from the catalog's sizes" + (f"; {entry.note}" if entry.note else ""), total


@dataclass
class _Row:
    entry: CatalogEntry
    status: object | None = None  # CatalogStatus once checked
    search_note: str | None = None  # why a search hit is not checked (an unsupported family)


def entry_for_hit(hit) -> CatalogEntry:
    """A search hit as a catalog row: the curated entry when there is one, else what the Hub says."""
    from moechat.engine.plan.catalog import find

    curated = find(hit.repo_id)
    if curated is not None:
        return curated
    return CatalogEntry(hit.repo_id, hit.model_type or "?", (hit.params or 0) / 1e9, 0.0, "?",
                        gated=bool(hit.gated), note="from Hub search")


class ModelTable(DataTable):
    """The catalog's table; a resize asks the screen which columns fit whole now."""

    def on_resize(self) -> None:
        fit = getattr(self.screen, "_fit_columns", None)
        if fit is not None:
            self.call_after_refresh(fit)


class SetupScreen(Screen[str | None]):
    """The setup wizard; dismisses with the downloaded snapshot's path (None: closed without a model)."""

    # Under 180 columns the detail pane goes under the table, so the table's columns (the note) show whole.
    HORIZONTAL_BREAKPOINTS = [(0, "-stacked"), (180, "-side")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (30, "-tall")]  # under 30 rows the boxes lose their borders

    BINDINGS = [
        Binding("escape", "back", "Back / cancel download"),
        Binding("slash", "focus_search", "Search"),
        Binding("d", "download", "Download"),
        Binding("r", "refresh", "Refresh"),
    ]

    def __init__(self, options: HubOptions | None = None):
        super().__init__()
        self.options = options or HubOptions()
        self.hardware = None  # engine Hardware, once probed
        self._hw_lock = threading.Lock()
        self.rows: dict[str, _Row] = {}
        self.listing_id = 0  # bumped at each fill of the table: late answers for an older one are dropped
        self.query_text = ""
        self.chosen: str | None = None  # the repo whose exact plan is shown
        self.verdict = None  # its FitVerdict
        self.local: str | None = None  # its complete snapshot, when downloaded
        self.cancel_event: threading.Event | None = None  # set while a download runs
        self.downloading: str | None = None
        self.last_progress = None  # the latest DownloadProgress
        self.offline: str | None = None  # why the Hub is not asked (set by the first check of the rows)
        self.plan_errors: dict[str, str] = {}  # repo -> why its plan failed (D says it)
        self.download_when_planned: str | None = None  # D pressed while that repo's plan was being read
        self.columns: tuple[str, ...] = ()  # the column keys the table shows now (those that fit whole)
        self.narrow = False  # the short forms of the first columns (owner-less names, speed without its unit)

    # -- layout ---------------------------------------------------------------------------------------
    def compose(self):
        yield Header(icon="◆")
        with Vertical(id="setup"):
            yield Static("Probing this machine…", id="setup-hardware", markup=False)
            yield Input(placeholder="Search the Hub for MoE models (Enter); empty: the catalog", id="setup-search")
            with Horizontal(id="setup-body"):
                yield ModelTable(id="setup-models", cursor_type="row", zebra_stripes=True)
                with VerticalScroll(id="setup-detail"):
                    yield Static(PICK_HINT, id="setup-summary", markup=False)
                    yield Static("", id="setup-decisions", markup=False)
                    yield Static("", id="setup-download-plan", markup=False)
            with Horizontal(id="setup-actions"):
                yield Button("Download and chat", id="setup-download", variant="primary", disabled=True)
                yield Button("Cancel download", id="setup-cancel", variant="error")
                with Vertical(id="setup-progress-box"):
                    yield ProgressBar(id="setup-progress", show_eta=True)
                    yield Label("", id="setup-progress-label", markup=False)
        yield Footer()

    @property
    def table(self) -> DataTable:
        return self.query_one("#setup-models", DataTable)

    def on_mount(self) -> None:
        self.sub_title = "model setup"
        self.query_one("#setup-hardware", Static).border_title = "This machine"
        self._set_columns(*self._fitting_columns())
        self.query_one("#setup-cancel", Button).display = False
        self.query_one("#setup-progress-box").display = False
        if self.options.hardware is not None:
            self._show_hardware(self.options.hardware)
        self.show_catalog()
        self.table.focus()

    # -- the rows -------------------------------------------------------------------------------------
    def _fill(self, rows: list[_Row], listing_id: int | None = None) -> int:
        self.listing_id = self.listing_id + 1 if listing_id is None else listing_id
        self.rows = {r.entry.repo_id: r for r in rows}
        table = self.table
        table.clear()
        for r in rows:
            table.add_row(*self._shown_cells(r), key=r.entry.repo_id)
        self._clear_plan()
        self._fit_columns()
        return self.listing_id

    # -- whole columns only -----------------------------------------------------------------------------
    def _shown_cells(self, r: _Row) -> tuple[str, ...]:
        cells = self._cell_texts(r, self.narrow)
        return tuple(cells[key] for key in self.columns)

    def _fitting_columns(self) -> tuple[tuple[str, ...], bool]:
        """(column keys, narrow): the longest prefix of COLUMNS whose widths (header or widest cell, padded) fit the
        table, at least the first four, in their short forms when the full ones do not fit."""
        width = max(self.table.size.width or self.app.size.width - 4, 1) - 2  # the vertical scrollbar
        rows = list(self.rows.values())
        for narrow in (False, True):
            texts = [self._cell_texts(r, narrow) for r in rows]
            total, keys = 0, []
            for label, key in COLUMNS:
                label = NARROW_LABELS.get(key, label) if narrow else label
                need = max([cell_len(label)] + [cell_len(t[key]) for t in texts]) + 2  # a cell's padding
                if total + need > width and len(keys) >= FIRST_COLUMNS:
                    break
                total += need
                keys.append(key)
            if total <= width or narrow:
                return tuple(keys), narrow
        raise AssertionError("unreachable")

    def _set_columns(self, keys: tuple[str, ...], narrow: bool) -> None:
        table = self.table
        cursor = table.cursor_row
        self.columns, self.narrow = keys, narrow
        table.clear(columns=True)
        for label, key in COLUMNS:
            if key in keys:
                table.add_column(NARROW_LABELS.get(key, label) if narrow else label, key=key)
        for r in self.rows.values():
            table.add_row(*self._shown_cells(r), key=r.entry.repo_id)
        if table.row_count:
            table.move_cursor(row=min(cursor, table.row_count - 1))

    def _fit_columns(self) -> None:
        """Show the columns that fit whole now (after a resize or a row's new values); a no-op when unchanged."""
        keys, narrow = self._fitting_columns()
        if (keys, narrow) != (self.columns, self.narrow):
            self._set_columns(keys, narrow)

    def _cells(self, r: _Row) -> tuple[str, ...]:
        """Every column's text for a row, in COLUMNS' order (the full forms)."""
        cells = self._cell_texts(r, narrow=False)
        return tuple(cells[key] for _, key in COLUMNS)

    def _cell_texts(self, r: _Row, narrow: bool) -> dict[str, str]:
        e, s = r.entry, r.status
        verdict = s.verdict if s is not None else None
        estimate = (catalog_estimate(e, self.hardware) if self.offline and s is not None and verdict is None
                    and e.supported and r.search_note is None else None)
        if verdict is not None:
            word = verdict.verdict
        elif r.search_note is not None or (s is not None and not e.supported):
            word = "unsupported"
        elif s is None:
            word = "checking…"
        elif estimate is not None:
            word = estimate[0]
        elif s.gated and s.error:
            word = "gated"
        else:
            word = "unknown"
        if s is not None and s.downloaded:
            download = "downloaded"
        elif verdict is not None:
            download = _size(verdict.download_bytes - verdict.cached_bytes)
        elif s is not None and s.download_bytes:
            download = _size(s.download_bytes)
        elif estimate is not None and estimate[2]:
            download = "~" + _size(estimate[2])
        else:
            download = ""
        if not e.supported:
            note = _short(e.why_unsupported or r.search_note or "")
        elif estimate is not None:
            note = estimate[1]
        elif s is not None and s.error and verdict is None:
            note = _short(s.error, e.repo_id)
        else:
            note = e.note
        speed = _tok_s(verdict)
        if not speed and estimate is not None:
            speed = OFFLINE_SPEED
        if narrow:
            speed = speed.removesuffix(" tok/s")
        cells = {"model": short_name(e.repo_id) if narrow else e.repo_id, "verdict": word, "speed": speed,
                 "format": _format(verdict), "download": download, "family": e.family, "params": _params(e),
                 "note": note}
        return cells

    def _update_row(self, repo_id: str) -> None:
        r = self.rows.get(repo_id)
        if r is None:
            return
        table = self.table
        for key, value in zip(self.columns, self._shown_cells(r), strict=True):
            table.update_cell(repo_id, key, value, update_width=True)
        self._fit_columns()

    def _show_offline_matches(self, query: str) -> None:
        """Offline, a search filters the catalog (each row's estimate or local verdict, as the full list has)."""
        entries = [e for e in self.options.entries if matches(e, query)]
        listing_id = self._fill([_Row(e) for e in entries])
        if not entries:
            self.query_one("#setup-summary", Static).update(
                f"No model in moechat's catalog matches {query!r} (offline: the Hub is not searched). Empty the "
                "search box for the whole catalog.")
        self._check(listing_id, entries)

    def show_catalog(self) -> None:
        self.query_text = ""
        entries = list(self.options.entries)
        listing_id = self._fill([_Row(e) for e in entries])
        self._check(listing_id, entries)

    def cell(self, repo_id: str, column: str) -> str:
        """What the table shows for a row (tests and the detail pane read it); a column too wide to show now: what
        it would show (the full form)."""
        if column in self.columns:
            return str(self.table.get_cell(repo_id, column))
        return self._cell_texts(self.rows[repo_id], narrow=False)[column]

    # -- workers --------------------------------------------------------------------------------------
    def _machine(self):
        """The hardware the verdicts are for: the given what-if, else probed once (in a worker)."""
        with self._hw_lock:
            if self.hardware is None:
                hw = self.options.hardware
                if hw is None:
                    from moechat.engine.plan.hardware import probe

                    hw = probe(self.options.client().cache)
                self.hardware = hw
                self.post_message(HardwareProbed(hw))
            return self.hardware

    def _check_entries(self, listing_id: int, entries: list[CatalogEntry]) -> None:
        """Each entry's live state and verdict (config.json only), posted row by row as they come.

        Offline, the Hub is not asked: downloaded entries get their verdict from the snapshot, the rest are
        marked for the catalog's estimate."""
        worker = get_current_worker()
        hw = self._machine()
        hub = self.options.client()
        offline = hub_offline_reason(self.options.endpoint)
        if offline is not None:
            for status in hub.catalog(hw, self.options.prefs, entries=entries, refresh=False, workers=1):
                self.post_message(CatalogRowChecked(listing_id, status, offline=offline))
            return

        def one(entry: CatalogEntry) -> None:
            if worker.is_cancelled:
                return
            (status,) = hub.catalog(hw, self.options.prefs, entries=[entry], workers=1)  # never raises
            self.post_message(CatalogRowChecked(listing_id, status))

        with ThreadPoolExecutor(max_workers=CHECK_WORKERS, thread_name_prefix="moechat-catalog") as pool:
            list(pool.map(one, entries))

    @work(thread=True, exclusive=True, group="setup-rows", exit_on_error=False)
    def _check(self, listing_id: int, entries: list[CatalogEntry]) -> None:
        self._check_entries(listing_id, entries)

    @work(thread=True, exclusive=True, group="setup-rows", exit_on_error=False)
    def _search(self, listing_id: int, query: str) -> None:
        from moechat.engine.errors import MoechatError

        self._machine()
        offline = hub_offline_reason(self.options.endpoint)
        if offline is not None:  # at once, not after the HTTP client's retries; the UI filters the catalog instead
            self.post_message(SetupFailed("search", None, "Offline", offline_search_text(offline, query)))
            return
        try:
            hits = self.options.client().search(query, limit=SEARCH_LIMIT, supported_only=False)
        except MoechatError as e:
            self.post_message(SetupFailed("search", None, error_title(e, "Search failed"), str(e)))
            return
        self.post_message(SearchFinished(listing_id, query, hits))
        self._check_entries(listing_id, [entry_for_hit(h) for h in hits if h.supported])

    @work(thread=True, exclusive=True, group="setup-plan", exit_on_error=False)
    def _plan(self, repo_id: str) -> None:
        from moechat.engine.errors import MoechatError
        from moechat.engine.plan.hub import is_offline

        from ..bridge import describe_error

        hw = self._machine()
        hub = self.options.client()
        offline = hub_offline_reason(self.options.endpoint) if hub.local_snapshot(repo_id) is None else None
        if offline is not None:
            how = "unset HF_HUB_OFFLINE" if "HF_HUB_OFFLINE" in offline else "check the connection or proxy"
            self.post_message(SetupFailed("plan", repo_id, "Offline", f"{repo_id}: its exact plan and its download "
                                          f"need the Hub ({offline}): {how}, or use a model that is already "
                                          "downloaded; the row shows the catalog's estimate"))
            return
        try:
            verdict = hub.fit(repo_id, hw, self.options.prefs)  # the local snapshot, else the Hub's headers
            local = hub.local_snapshot(repo_id)
            download = None if local is not None and is_offline() else hub.plan_download(repo_id)
        except MoechatError as e:
            self.post_message(SetupFailed("plan", repo_id, error_title(e, "No plan"), str(e)))
            return
        except Exception as e:  # noqa: BLE001 - a notice, never a traceback in the TUI
            self.post_message(SetupFailed("plan", repo_id, "No plan", describe_error(e)))
            return
        self.post_message(PlanReady(repo_id, verdict, download, None if local is None else str(local)))

    @work(thread=True, exclusive=True, group="setup-download", exit_on_error=False)
    def _download(self, repo_id: str, cancel: threading.Event) -> None:
        from moechat.engine.errors import DownloadCancelled, MoechatError

        from ..bridge import describe_error

        try:
            path = self.options.client().download(repo_id, progress=lambda p: self.post_message(DownloadProgressed(p)),
                                                  cancel=cancel)
        except MoechatError as e:
            self.post_message(SetupFailed("download", repo_id, error_title(e, "Download failed"), str(e),
                                          cancelled=isinstance(e, DownloadCancelled)))
            return
        except Exception as e:  # noqa: BLE001 - a notice, never a traceback in the TUI
            self.post_message(SetupFailed("download", repo_id, "Download failed", describe_error(e)))
            return
        self.post_message(DownloadFinished(repo_id, str(path)))

    # -- messages from the workers ----------------------------------------------------------------------
    def _show_hardware(self, hw) -> None:
        self.query_one("#setup-hardware", Static).update(hardware_summary(hw))

    def on_hardware_probed(self, message: HardwareProbed) -> None:
        self._show_hardware(message.hardware)

    def on_catalog_row_checked(self, message: CatalogRowChecked) -> None:
        status = message.status
        r = self.rows.get(status.entry.repo_id)
        if message.listing_id != self.listing_id or r is None:
            return
        if message.offline != self.offline:
            self.offline = message.offline
            # the reason is in the detail pane and the notices; the header keeps one word (it cut the URL mid-way)
            self.sub_title = "model setup" + (" · offline" if message.offline else "")
        r.status = status
        self._update_row(status.entry.repo_id)
        if self.chosen is None and self._highlighted() == status.entry.repo_id:
            self._show_brief(r)

    def on_search_finished(self, message: SearchFinished) -> None:
        if message.listing_id != self.listing_id:
            return
        self.table.loading = False
        rows = [_Row(entry_for_hit(h), search_note=None if h.supported else h.why_unsupported) for h in message.hits]
        self._fill(rows, message.listing_id)  # the worker's checks of these rows carry the same id
        if not rows:
            self.query_one("#setup-summary", Static).update(
                f"No MoE model on the Hub matches {message.query!r}. Empty the search box for the catalog.")

    def on_plan_ready(self, message: PlanReady) -> None:
        if message.repo_id != self.chosen:
            return
        self.verdict, self.local = message.verdict, message.local
        self._show_plan(message.verdict, message.download, message.local)
        button = self.query_one("#setup-download", Button)
        button.label = "Open in chat" if message.local else "Download and chat"
        button.disabled = not message.verdict.supported or self.downloading is not None
        self.plan_errors.pop(message.repo_id, None)
        r = self.rows.get(message.repo_id)
        if r is not None and r.status is not None:  # the exact verdict replaces the estimate in the row
            from dataclasses import replace

            r.status = replace(r.status, verdict=message.verdict, downloaded=message.local is not None)
            self._update_row(message.repo_id)
        if self.download_when_planned == message.repo_id:  # D was pressed while the plan was read
            self.download_when_planned = None
            self.action_download()

    def on_download_progressed(self, message: DownloadProgressed) -> None:
        p = message.progress
        if p.repo_id != self.downloading:
            return
        self.last_progress = p
        if p.plan is not None:
            self.query_one("#setup-download-plan", Static).update("\n".join(p.plan.describe()))
        if p.note:
            self.notify(p.note, title="Download", timeout=6)
        self.query_one("#setup-progress", ProgressBar).update(total=max(1, p.total), progress=p.done)
        rate = f"{p.bytes_per_s / 1e6:.1f} MB/s" if p.bytes_per_s else ""
        where = f"{p.files_done}/{p.files_total} files" + (f" · {p.file}" if p.file and p.stage != "done" else "")
        self.query_one("#setup-progress-label", Label).update(
            " · ".join(x for x in (f"{_size(p.done)} / {_size(p.total)}", rate, where) if x))

    def on_download_finished(self, message: DownloadFinished) -> None:
        self._download_ended()
        self.notify(f"{message.repo_id} is ready: opening the chat on it.", title="Downloaded", timeout=6)
        self._finish(message.path)

    def _finish(self, path: str) -> None:
        """Dismiss with the model's path; a recommended conversion becomes that model's expert format (settings),
        which the chat then loads it in, unless the user chose one for it before."""
        verdict = self.verdict
        fmt = verdict.expert_format if verdict is not None else "native"
        settings = getattr(self.app, "settings", None)
        if settings is not None and fmt != "native" and path not in settings.expert_formats:
            settings.set_expert_format(path, fmt)
            problem = settings.save()
            if problem:
                self.notify(problem, severity="warning")
        self.dismiss(path)

    def on_setup_failed(self, message: SetupFailed) -> None:
        if message.what == "download":
            self._download_ended()
            label = self.query_one("#setup-progress-label", Label)
            label.update(f"Cancelled: {message.error}. D resumes it here." if message.cancelled
                         else f"Failed: {message.error}")
        elif message.what == "search":
            self.table.loading = False
            if message.title == "Offline":
                self.offline = self.offline or "offline"
                self._show_offline_matches(self.query_text)
        elif message.what == "plan" and message.repo_id == self.chosen:
            self.plan_errors[message.repo_id] = message.error
            self.download_when_planned = None
            self.query_one("#setup-summary", Static).update(
                f"{message.repo_id}: {strip_repo(message.error, message.repo_id)}")
        self.notify(message.error, title=message.title, severity="warning" if message.cancelled else "error",
                    timeout=12)

    # -- the detail pane ------------------------------------------------------------------------------
    def _highlighted(self) -> str | None:
        table = self.table
        if not table.row_count:
            return None
        try:
            key = table.coordinate_to_cell_key((table.cursor_row, 0)).row_key
        except Exception:  # noqa: BLE001 - an empty or shrinking table
            return None
        return key.value

    def _clear_plan(self) -> None:
        self.chosen = self.verdict = self.local = None
        self.query_one("#setup-decisions", Static).update("")
        self.query_one("#setup-download-plan", Static).update("")
        if self.downloading is None:
            self.query_one("#setup-download", Button).disabled = True

    def _show_brief(self, r: _Row) -> None:
        """What the row knows without another request: the catalog entry and its estimated verdict."""
        e, s = r.entry, r.status
        lines = [e.repo_id, f"{e.family} · {_params(e)} parameters" + (f" · experts in {e.format}"
                                                                        if e.format != "?" else "")]
        if e.features:
            lines.append("needs: " + ", ".join(e.features))
        if not e.supported:
            why = e.why_unsupported or r.search_note or MISSING_FEATURES.get(e.family, "")
            lines.append(f"not supported yet: {why}")
        if s is None:
            lines.append("checking the Hub…" if r.search_note is None else "")
        elif s.verdict is not None:
            lines.append(f"on this machine: {s.verdict.summary()} (estimate from config.json)")
        elif self.offline and e.supported and r.search_note is None:
            word, note, _ = catalog_estimate(e, self.hardware)
            lines.append(f"{self.offline}. {word}: {note}; the predicted speed needs config.json from the Hub")
        elif s.error:
            lines.append(strip_repo(s.error, e.repo_id))
        if e.note and not any(e.note in line for line in lines):  # the estimate's note may carry it already
            lines.append(e.note)
        lines += ["", PICK_HINT]
        self.query_one("#setup-summary", Static).update("\n".join(x for x in lines if x is not None))

    def _show_plan(self, verdict, download, local: str | None) -> None:
        spec, plan = verdict.spec, verdict.best_plan  # the plan in the recommended expert format
        head = {"fits": "FITS", "does not fit": "DOES NOT FIT", "unsupported": "NOT SUPPORTED YET"}[verdict.verdict]
        lines = [f"{verdict.repo_id}" + (f" at {verdict.sha[:12]}" if verdict.sha else "") + f" ({spec.model_type})"
                 f": {head} on this machine"]
        if not verdict.supported:
            lines.append(f"moechat cannot run it yet: {verdict.why_unsupported}")
        d = plan.decode
        if d is not None:
            lines.append(f"predicted decode {d.low:.1f}-{d.high:.1f} tok/s (bound {d.bound:.1f} tok/s, set by "
                         f"{d.bound_by})")
        if plan.refusal is not None:
            lines.append(f"does not fit: {plan.refusal.message}")
        lines.append(f"{spec.num_layers} layers, {spec.num_moe_layers} MoE x {spec.num_experts} experts, top-"
                     f"{spec.top_k}; {spec.total_experts:,} experts = {_size(spec.all_experts_bytes)}"
                     f"; dense {_size(spec.dense_bytes)}")
        lines.append(f"{spec.expert_format_line()}; stored as {spec.expert_format}")
        lines.append(f"sizes from {verdict.source}" + (" (estimates)" if spec.estimated else " (exact)")
                     + f"; plan: {plan.expert_slots} of {plan.total_experts} experts in device slots, "
                     f"{plan.host_tier}, context {plan.context:,}")
        lines += format_lines(verdict)
        self.query_one("#setup-summary", Static).update("\n".join(lines))
        self.query_one("#setup-decisions", Static).update("\n".join(
            f"• {d.item}" + ("" if d.bytes is None else f" {_size(d.bytes)}") + ("" if d.where in ("", "-") else
                                                                                  f" on {d.where}") + f": {d.reason}"
            for d in plan.decisions))
        if local is not None:
            tail = [f"downloaded: {local}", "Open in chat loads it."]
        elif download is not None:
            tail = download.describe()
        else:
            tail = []
        self.query_one("#setup-download-plan", Static).update("\n".join(tail))

    # -- user actions -----------------------------------------------------------------------------------
    @on(DataTable.RowHighlighted, "#setup-models")
    def _highlight(self, event: DataTable.RowHighlighted) -> None:
        if self.downloading is not None:
            return
        repo_id = event.row_key.value
        if repo_id == self.chosen:
            return
        self._clear_plan()
        r = self.rows.get(repo_id)
        if r is not None:
            self._show_brief(r)

    @on(DataTable.RowSelected, "#setup-models")
    def _select(self, event: DataTable.RowSelected) -> None:
        self.pick(event.row_key.value)

    def pick(self, repo_id: str) -> None:
        """Show `repo_id`'s exact plan (a worker reads config.json and the safetensors headers)."""
        if self.downloading is not None:
            return
        self._clear_plan()
        self.chosen = repo_id
        self.plan_errors.pop(repo_id, None)
        self.query_one("#setup-summary", Static).update(
            f"{repo_id}: reading config.json and the safetensors headers from the Hub (no weights)…")
        self._plan(repo_id)

    @on(Input.Submitted, "#setup-search")
    def _search_submitted(self, event: Input.Submitted) -> None:
        query = event.value.strip()
        if not query:
            if self.query_text:
                self.show_catalog()
            self.table.focus()
            return
        self.query_text = query
        self.table.focus()
        if self.offline:  # known offline: the catalog filtered at once, no worker to wait for
            self.notify(offline_search_text(self.offline, query), title="Offline", severity="error", timeout=12)
            self._show_offline_matches(query)
            return
        self.listing_id += 1
        self.table.loading = True
        self._search(self.listing_id, query)

    @on(Button.Pressed, "#setup-download")
    def action_download(self) -> None:
        if self.downloading is not None:
            return
        repo_id, verdict = self.chosen, self.verdict
        if repo_id is not None and verdict is None:
            if repo_id in self.plan_errors:  # its plan failed: say why, not "pick a model"
                self.notify(f"Cannot download {repo_id}: {self.plan_errors[repo_id]}", title="No plan",
                            severity="warning")
            else:  # the plan is on its way: the download starts when it arrives
                self.download_when_planned = repo_id
                self.notify(f"{repo_id}: reading its plan; the download starts when it is ready.", timeout=4)
            return
        if repo_id is None:
            highlighted = self._highlighted()
            if highlighted is None:
                self.notify("No model in the list to download.", severity="warning")
                return
            self.download_when_planned = highlighted  # D on a highlighted row: its plan first, then the download
            self.pick(highlighted)
            return
        if not verdict.supported:
            self.notify(f"{repo_id} is not supported yet: {verdict.why_unsupported}", severity="warning")
            return
        if self.local is not None:
            self._finish(self.local)
            return
        self.downloading = repo_id
        self.last_progress = None
        self.cancel_event = threading.Event()
        self.query_one("#setup-download", Button).disabled = True
        self.query_one("#setup-cancel", Button).display = True
        self.query_one("#setup-progress-box").display = True
        self.query_one("#setup-progress", ProgressBar).update(total=None, progress=0)
        self.query_one("#setup-progress-label", Label).update(f"starting the download of {repo_id}…")
        self.table.disabled = True
        self.query_one("#setup-search", Input).disabled = True
        self.query_one("#setup-cancel", Button).focus()
        self._download(repo_id, self.cancel_event)

    def _download_ended(self) -> None:
        self.downloading = None
        self.cancel_event = None
        self.query_one("#setup-cancel", Button).display = False
        self.table.disabled = False
        self.query_one("#setup-search", Input).disabled = False
        self.query_one("#setup-download", Button).disabled = self.verdict is None or not self.verdict.supported
        self.table.focus()

    @on(Button.Pressed, "#setup-cancel")
    def cancel_download(self) -> None:
        if self.cancel_event is not None:
            self.cancel_event.set()  # the worker stops within one chunk and answers with DownloadCancelled
            self.query_one("#setup-progress-label", Label).update("cancelling… (what arrived is kept)")

    def action_back(self) -> None:
        if self.downloading is not None:
            self.cancel_download()
            return
        self.dismiss(None)

    def action_focus_search(self) -> None:
        self.query_one("#setup-search", Input).focus()

    def action_refresh(self) -> None:
        if self.downloading is not None:
            return
        if self.query_text:
            self.listing_id += 1
            self._search(self.listing_id, self.query_text)
        else:
            self.show_catalog()

    def on_unmount(self) -> None:
        if self.cancel_event is not None:
            self.cancel_event.set()  # leaving mid-download: stop it, keep the bytes
