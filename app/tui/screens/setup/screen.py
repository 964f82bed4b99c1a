"""The setup wizard's screen: the layout, the table's rows and whole columns, the workers' answers, the detail
pane and the user's actions (pick, search, download, cancel, back). What each cell and the detail pane say is in
listing.py and details.py, the Hub calls the workers make in hub_calls.py.
"""

from __future__ import annotations

import threading

from rich.cells import cell_len
from textual import on, work
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Input, Label, ProgressBar, Static

from moechat.engine.plan.catalog import CatalogEntry

from ...messages import (
    CatalogRowChecked,
    DownloadFinished,
    DownloadProgressed,
    HardwareProbed,
    PlanReady,
    QuantsChecked,
    SearchFinished,
    SetupFailed,
)
from ...widgets.header import ScreenHeader
from . import hub_calls
from .details import brief_text, plan_texts, quant_texts
from .listing import (
    COLUMNS,
    FIRST_COLUMNS,
    NARROW_LABELS,
    PICK_HINT,
    HubOptions,
    ModelTable,
    _Row,
    _size,
    cell_texts,
    entry_for_hit,
    hardware_summary,
    matches,
    offline_search_text,
    strip_repo,
)


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
        Binding("left_square_bracket", "quant(-1)", "Prev quant"),  # a GGUF repo's quants (the table has Up/Down)
        Binding("right_square_bracket", "quant(1)", "Next quant"),
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
        self.quants: tuple = ()  # a picked GGUF repo's quants (engine.plan.hub.gguf.QuantFit), smallest first
        self.quants_done = False  # every quant's header read
        self.quant_pick: str | None = None  # the quant the user chose with [ and ]; None: the recommended one
        self.columns: tuple[str, ...] = ()  # the column keys the table shows now (those that fit whole)
        self.narrow = False  # the short forms of the first columns (owner-less names, speed without its unit)

    # -- layout ---------------------------------------------------------------------------------------
    def compose(self):
        yield ScreenHeader(icon="◆")
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
        return cell_texts(r, narrow, self.offline, self.hardware)

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
    def machine(self):
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

    @work(thread=True, exclusive=True, group="setup-rows", exit_on_error=False)
    def _check(self, listing_id: int, entries: list[CatalogEntry]) -> None:
        hub_calls.check_entries(self, listing_id, entries)

    @work(thread=True, exclusive=True, group="setup-rows", exit_on_error=False)
    def _search(self, listing_id: int, query: str) -> None:
        hub_calls.search(self, listing_id, query)

    @work(thread=True, exclusive=True, group="setup-plan", exit_on_error=False)
    def _plan(self, repo_id: str) -> None:
        hub_calls.read_plan(self, repo_id)

    @work(thread=True, exclusive=True, group="setup-download", exit_on_error=False)
    def _download(self, repo_id: str, cancel: threading.Event, quant: str | None = None) -> None:
        hub_calls.download(self, repo_id, cancel, quant)

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
        r.status, r.quants = status, message.quants
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

    def on_quants_checked(self, message: QuantsChecked) -> None:
        if message.repo_id != self.chosen:
            return
        self.quants, self.quants_done = message.quants, message.done
        self._show_quants()
        if not message.done:
            return
        self.refresh_bindings()  # [ and ] in the footer
        self.query_one("#setup-download", Button).label = "Download and chat"
        self.plan_errors.pop(message.repo_id, None)
        self._quant_marked()
        if self.download_when_planned == message.repo_id:  # D was pressed while the headers were read
            self.download_when_planned = None
            self.action_download()

    def _quant_marked(self) -> None:
        """The button and the row follow the marked quant (its verdict, speed and download)."""
        self.query_one("#setup-download", Button).disabled = (self.verdict is None or not self.verdict.supported
                                                              or self.downloading is not None)
        r = self.rows.get(self.chosen or "")
        if r is not None and r.status is not None and self.verdict is not None:
            from dataclasses import replace

            r.status = replace(r.status, verdict=self.verdict)
            self._update_row(self.chosen)

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "quant":  # [ and ]: only while a GGUF repo's quants are listed
            return bool(self.quants_done and self.quants)
        return True

    def chosen_quant(self):
        """The quant D fetches: the one chosen with [ and ], else the recommended one (None: no quant to take)."""
        from moechat.engine.plan.hub.gguf import recommend_quant

        picked = next((f for f in self.quants if f.name == self.quant_pick), None)
        return picked or recommend_quant(self.quants)

    def _show_quants(self) -> None:
        """The quant lines, the chosen quant's plan; `verdict` becomes the chosen quant's once all are read."""
        from moechat.engine.plan.hub.gguf import recommend_quant

        recommended, chosen = recommend_quant(self.quants), self.chosen_quant()
        self.verdict = chosen.verdict if self.quants_done and chosen is not None else None
        summary, decisions, download_plan = quant_texts(self.chosen or "", self.quants, chosen, recommended,
                                                        self.quants_done)
        self.query_one("#setup-summary", Static).update(summary)
        self.query_one("#setup-decisions", Static).update(decisions)
        self.query_one("#setup-download-plan", Static).update(download_plan)

    def action_quant(self, step: int) -> None:
        """Mark the previous or next quant (of those with a verdict) as the one D fetches."""
        if self.downloading is not None or not self.quants_done:
            return
        read = [f for f in self.quants if f.verdict is not None]
        if not read:
            return
        current = self.chosen_quant()
        names = [f.name for f in read]
        # none marked yet: ] marks the first, [ the last
        i = names.index(current.name) if current is not None and current.name in names else (-1 if step > 0 else 0)
        self.quant_pick = names[(i + step) % len(names)]
        self._show_quants()
        self._quant_marked()

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
        listed = bool(self.quants)
        self.quants, self.quants_done, self.quant_pick = (), False, None
        if listed:
            self.refresh_bindings()  # [ and ] leave the footer
        self.query_one("#setup-decisions", Static).update("")
        self.query_one("#setup-download-plan", Static).update("")
        if self.downloading is None:
            self.query_one("#setup-download", Button).disabled = True

    def _show_brief(self, r: _Row) -> None:
        """What the row knows without another request: the catalog entry and its estimated verdict."""
        self.query_one("#setup-summary", Static).update(brief_text(r, self.offline, self.hardware))

    def _show_plan(self, verdict, download, local: str | None) -> None:
        summary, decisions, download_plan = plan_texts(verdict, download, local)
        self.query_one("#setup-summary", Static).update(summary)
        self.query_one("#setup-decisions", Static).update(decisions)
        self.query_one("#setup-download-plan", Static).update(download_plan)

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
        if repo_id is not None and verdict is None and self.quants_done:  # a GGUF repo none of whose quants runs
            read = any(f.verdict is not None for f in self.quants)
            self.notify(f"No quant of {repo_id} runs on this machine: " + (
                "[ and ] mark one to download anyway" if read else "no quant's header could be read"),
                title="No quant", severity="warning")
            return
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
        quant = self.chosen_quant() if self.quants else None
        self.downloading = repo_id
        self.last_progress = None
        self.cancel_event = threading.Event()
        self.query_one("#setup-download", Button).disabled = True
        self.query_one("#setup-cancel", Button).display = True
        self.query_one("#setup-progress-box").display = True
        self.query_one("#setup-progress", ProgressBar).update(total=None, progress=0)
        self.query_one("#setup-progress-label", Label).update(
            f"starting the download of {repo_id}" + (f":{quant.name}" if quant is not None else "") + "…")
        self.table.disabled = True
        self.query_one("#setup-search", Input).disabled = True
        self.query_one("#setup-cancel", Button).focus()
        self._download(repo_id, self.cancel_event, None if quant is None else quant.name)

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
