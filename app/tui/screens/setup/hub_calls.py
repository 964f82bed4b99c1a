"""The wizard's Hub calls, each run on a thread worker of the screen (app/tui/screens/setup/screen.py) and
answering with the messages in app/tui/messages.py: the rows' verdicts (config.json and the index alone, 4 rows at
a time), a Hub search, a picked model's exact plan (a ranged read of each shard's first 100 kB, never a weight
body: a verdict for a 60 GB model reads about 2 MB), a GGUF repo's quants (each quant's verdict from its header), and
the download (a progress sink and a cancel Event; a GGUF repo: the chosen quant's files only).

The engine (huggingface_hub, the planner) is imported inside these calls, so opening the app stays torch-free.
Offline (HF_HUB_OFFLINE, or the endpoint not answering a TCP connect within HUB_PROBE_TIMEOUT_S) the Hub is not
asked at all: downloaded models get their exact verdict from the local snapshot, search says at once that the Hub
itself is not searched.
"""

from __future__ import annotations

import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from textual.worker import get_current_worker

from moechat.engine.plan.catalog import CatalogEntry

from ...messages import (
    CatalogRowChecked,
    DownloadFinished,
    DownloadProgressed,
    PlanReady,
    QuantsChecked,
    SearchFinished,
    SetupFailed,
)
from .listing import entry_for_hit, error_title, offline_search_text, strip_repo

HUB_PROBE_TIMEOUT_S = 2.0  # a TCP connect to the endpoint: no answer in this long and the wizard works offline
CHECK_WORKERS = 4  # rows checked at once: each is 2-3 small requests (listing, config.json, index)
SEARCH_LIMIT = 20


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


def check_entries(screen, listing_id: int, entries: list[CatalogEntry]) -> None:
    """Each entry's live state and verdict (config.json only), posted row by row as they come.

    Offline, the Hub is not asked: downloaded entries get their verdict from the snapshot, the rest are
    marked for the catalog's estimate."""
    worker = get_current_worker()
    hw = screen.machine()
    hub = screen.options.client()
    offline = hub_offline_reason(screen.options.endpoint)
    if offline is not None:
        for status in hub.catalog(hw, screen.options.prefs, entries=entries, refresh=False, workers=1):
            screen.post_message(CatalogRowChecked(listing_id, status, offline=offline))
        return

    def one(entry: CatalogEntry) -> None:
        if worker.is_cancelled:
            return
        (status,) = hub.catalog(hw, screen.options.prefs, entries=[entry], workers=1)  # never raises
        screen.post_message(CatalogRowChecked(listing_id, status, quants=gguf_only(hub, status)))

    with ThreadPoolExecutor(max_workers=CHECK_WORKERS, thread_name_prefix="moechat-catalog") as pool:
        list(pool.map(one, entries))


def gguf_only(hub, status) -> tuple:
    """A row without a verdict whose repo holds GGUF quants and no safetensors (so no config.json): its quants
    (one more listing, for such rows only; each quant's verdict waits for Enter, a header read per quant)."""
    from moechat.engine.errors import MoechatError

    if status.verdict is not None or status.error is None or status.sha is None:  # a verdict, gated, unreachable
        return ()
    try:
        listing, quants = hub.quants(status.entry.repo_id)
    except MoechatError:
        return ()
    return () if any(f.path.endswith(".safetensors") for f in listing.files) else tuple(quants)


def search(screen, listing_id: int, query: str) -> None:
    """A Hub search for `query`: the hits (SearchFinished), then each supported hit's verdict as the rows have."""
    from moechat.engine.errors import MoechatError

    screen.machine()
    offline = hub_offline_reason(screen.options.endpoint)
    if offline is not None:  # at once, not after the HTTP client's retries; the UI filters the catalog instead
        screen.post_message(SetupFailed("search", None, "Offline", offline_search_text(offline, query)))
        return
    try:
        hits = screen.options.client().search(query, limit=SEARCH_LIMIT, supported_only=False)
    except MoechatError as e:
        screen.post_message(SetupFailed("search", None, error_title(e, "Search failed"), str(e)))
        return
    screen.post_message(SearchFinished(listing_id, query, hits))
    check_entries(screen, listing_id, [entry_for_hit(h) for h in hits if h.supported])


def read_plan(screen, repo_id: str) -> None:
    """`repo_id`'s exact verdict (the local snapshot, else the Hub's safetensors headers) and its download plan."""
    from moechat.engine.errors import MoechatError
    from moechat.engine.plan.hub import is_offline

    from ...bridge import describe_error

    hw = screen.machine()
    hub = screen.options.client()
    offline = hub_offline_reason(screen.options.endpoint) if hub.local_snapshot(repo_id) is None else None
    if offline is not None:
        how = "unset HF_HUB_OFFLINE" if "HF_HUB_OFFLINE" in offline else "check the connection or proxy"
        screen.post_message(SetupFailed("plan", repo_id, "Offline", f"{repo_id}: its exact plan and its download "
                                        f"need the Hub ({offline}): {how}, or use a model that is already "
                                        "downloaded; the row shows the catalog's estimate"))
        return
    try:
        if offline is None and not is_offline():
            listing, quants = hub.quants(repo_id)  # one listing: a GGUF repo is planned quant by quant
            if quants and not any(f.path.endswith(".safetensors") for f in listing.files):
                check_quants(screen, repo_id, hub, listing, quants)
                return
        verdict = hub.fit(repo_id, hw, screen.options.prefs)  # the local snapshot, else the Hub's headers
        local = hub.local_snapshot(repo_id)
        download = None if local is not None and is_offline() else hub.plan_download(repo_id)
    except MoechatError as e:
        screen.post_message(SetupFailed("plan", repo_id, error_title(e, "No plan"), str(e)))
        return
    except Exception as e:  # noqa: BLE001 - a notice, never a traceback in the TUI
        screen.post_message(SetupFailed("plan", repo_id, "No plan", describe_error(e)))
        return
    screen.post_message(PlanReady(repo_id, verdict, download, None if local is None else str(local)))


def check_quants(screen, repo_id: str, hub, listing, quants) -> None:
    """A GGUF repo's quants with their verdicts: the list at once (each "checking…"), then each complete quant's
    verdict from its header (a ranged read of a few MB at most, CHECK_WORKERS at a time), posted as they come; the
    last message has `done`. A quant whose header fails keeps its error as its line."""
    from moechat.engine.errors import MoechatError
    from moechat.engine.plan.hub.gguf import QuantFit

    from ...bridge import describe_error

    worker = get_current_worker()
    hw = screen.machine()
    fits = [QuantFit.of(q) if q.complete else
            QuantFit.of(q, error=f"only {len(q.files)} of {q.expected_parts} parts listed") for q in quants]
    screen.post_message(QuantsChecked(repo_id, tuple(fits), done=False))
    # A snapshot may hold some quants: those are planned from their files (fit without the listing looks there).
    shared = None if hub.local_snapshot(repo_id) is not None else listing
    lock = threading.Lock()

    def one(i: int) -> None:
        if worker.is_cancelled:
            return
        q = quants[i]
        try:
            fit = QuantFit.of(q, hub.fit(repo_id, hw, screen.options.prefs, quant=q.name, listing=shared))
        except MoechatError as e:
            fit = QuantFit.of(q, error=strip_repo(str(e), f"{repo_id}:{q.name}"))
        except Exception as e:  # noqa: BLE001 - a line in the pane, never a traceback in the TUI
            fit = QuantFit.of(q, error=describe_error(e))
        with lock:
            fits[i] = fit
            screen.post_message(QuantsChecked(repo_id, tuple(fits), done=False))

    with ThreadPoolExecutor(max_workers=CHECK_WORKERS, thread_name_prefix="moechat-quants") as pool:
        list(pool.map(one, [i for i, q in enumerate(quants) if q.complete]))
    if not worker.is_cancelled:
        screen.post_message(QuantsChecked(repo_id, tuple(fits), done=True))


def download(screen, repo_id: str, cancel: threading.Event, quant: str | None = None) -> None:
    """Download `repo_id` (`quant`: that GGUF quant's files only), its progress posted as it comes; `cancel` set
    stops it within one chunk. Finishes with the snapshot's path, or the quant's first file."""
    from moechat.engine.errors import DownloadCancelled, MoechatError

    from ...bridge import describe_error

    def sink(p) -> None:
        screen.post_message(DownloadProgressed(p))

    try:
        hub = screen.options.client()
        if quant is None:
            path = hub.download(repo_id, progress=sink, cancel=cancel)
        else:
            path = hub.download_quant(repo_id, quant, progress=sink, cancel=cancel)
    except MoechatError as e:
        screen.post_message(SetupFailed("download", repo_id, error_title(e, "Download failed"), str(e),
                                        cancelled=isinstance(e, DownloadCancelled)))
        return
    except Exception as e:  # noqa: BLE001 - a notice, never a traceback in the TUI
        screen.post_message(SetupFailed("download", repo_id, "Download failed", describe_error(e)))
        return
    screen.post_message(DownloadFinished(repo_id, str(path)))
