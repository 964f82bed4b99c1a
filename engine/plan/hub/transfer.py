"""The download loop: one file's bytes streamed into the cache with resume, retry, a sha256 and a deadline.

The weight files are fetched by this loop rather than `hf_hub_download` because huggingface_hub 2.x
writes each attempt to a process-unique temporary file and deletes it on failure: nothing survives a crash
or a cancel, and it checks sizes but not checksums. Here a file streams into `blobs/<etag>.incomplete`
(the name huggingface_hub 0.x resumed from), its sha256 (git blob sha1 for small files) is computed as it
arrives and compared with the Hub's listing, the cancel event is checked between chunks, and a dropped
connection resumes with a Range request (and starts the file over when the server ignores Range). GGUF quants'
files (paths with folders) go through the same loop.

The knobs below are read when a file is fetched: a test patches them here (`transfer.RETRY_DELAY_S`).
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from ...errors import DiskSpaceError, DownloadCancelled, DownloadIntegrityError, NetworkError
from ...units import MiB
from .. import hubhttp
from ..hubhttp import MAX_REDIRECTS
from ..hubhttp import Ctx as _Ctx
from ..hubhttp import redirect_loop as _redirect_loop
from ..hubhttp import transport_errors as _transport_errors
from .names import RepoFile, RepoListing, _fmt
from .reports import DownloadPlan, DownloadProgress, ProgressSink
from .snapshot import _blob_ok, _repo_folder

if TYPE_CHECKING:
    import threading

    from .client import Hub

RETRIES = 5  # attempts per file without progress before giving up (as huggingface_hub's http_get)
RETRY_DELAY_S = 0.5  # first back-off; doubles up to RETRY_DELAY_MAX_S
RETRY_DELAY_MAX_S = 8.0
# A connection that delivers less than MIN_RATE_BPS over STALL_WINDOW_S (a server trickling a byte every few
# seconds) is dropped and resumed, like a silent one; RETRIES such attempts in a row end the pull with the bytes
# kept. A file also gets at most FILE_DEADLINE_S + size / MIN_RATE_BPS in all, so no pull runs without end.
MIN_RATE_BPS = 16 * 1024
STALL_WINDOW_S = 30.0
FILE_DEADLINE_S = 300.0
PROGRESS_EVERY_S = 0.1


class _Transfer:
    """One download session's byte loop: resume, retry, verify, report, cancel."""

    def __init__(self, hub: Hub, ctx: _Ctx, listing: RepoListing, plan: DownloadPlan, progress: ProgressSink | None,
                 cancel: threading.Event | None):
        self.hub, self.ctx, self.listing, self.plan = hub, ctx, listing, plan
        self.sink, self.cancel = progress, cancel
        self.blobs = hub.storage(listing.repo_id) / "blobs"
        self.done = plan.cached_bytes  # bytes of finished files
        self.files_done = sum(1 for f in plan.files if f.action == "cached")
        self.transferred = 0
        self.started = time.monotonic()
        self.last_report = 0.0

    # -- reporting -----------------------------------------------------------------------------------------
    def report(self, stage: str, f: RepoFile | None, file_done: int, file_total: int, *, note: str | None = None,
               plan: DownloadPlan | None = None, force: bool = True) -> None:
        if self.sink is None:
            return
        now = time.monotonic()
        if not force and now - self.last_report < PROGRESS_EVERY_S:
            return
        self.last_report = now
        rate = self.transferred / max(1e-6, now - self.started)
        self.sink(DownloadProgress(self.listing.repo_id, self.listing.sha, stage, f.path if f else None, file_done,
                                   file_total, self.done + file_done, self.plan.total_bytes, self.files_done,
                                   len(self.plan.files), rate, note, plan))

    def _check_cancel(self, f: RepoFile, have: int) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise DownloadCancelled(f"download of {self.listing.repo_id} cancelled during {f.path}; "
                                    f"{_fmt(self.done + have)} of {_fmt(self.plan.total_bytes)} kept in the cache: "
                                    f"moechat pull {self.listing.repo_id} resumes it",
                                    repo_id=self.listing.repo_id)

    # -- one file --------------------------------------------------------------------------------------------
    def fetch(self, f: RepoFile) -> None:
        blob = self.blobs / f.etag
        if _blob_ok(blob, f.size):
            return  # counted as cached in the plan
        url, auth = self._locate(f)  # the server's ETag and size checked before any file is touched
        self.blobs.mkdir(parents=True, exist_ok=True)
        partial = self.blobs / f"{f.etag}.incomplete"
        if blob.exists():
            blob.unlink()  # wrong size: the plan said it is downloaded again
        self._adopt_or_clear(f, partial)
        st = _FileState(partial.stat().st_size if partial.exists() else 0, self._new_hasher(f))
        if st.have:
            self.report("verify", f, st.have, f.size, note=f"resuming {f.path} at {_fmt(st.have)} of {_fmt(f.size)}")
            with partial.open("rb") as fh:
                while chunk := fh.read(4 * MiB):
                    st.hasher.update(chunk)
        failures, reason = 0, ""
        started = time.monotonic()
        deadline = started + FILE_DEADLINE_S + (f.size - st.have) / MIN_RATE_BPS
        while True:
            self._check_cancel(f, st.have)
            before = st.have
            try:
                self._stream(f, url, auth, partial, st, deadline)
                break
            except _transport_errors() as e:  # dropped, reset, timed out: resume from what arrived
                reason = f"{type(e).__name__}: {str(e) or 'connection lost'}"
            except _RangeMismatch as e:  # resumed at the wrong offset: the partial file is useless
                partial.unlink(missing_ok=True)
                st.have, st.hasher, reason = 0, self._new_hasher(f), str(e)
            except _Stalled as e:  # trickling: counts as a drop unless it brought a window's worth
                reason = str(e)
            except Exception as e:
                if not _redirect_loop(e):
                    raise
                raise NetworkError(f"{f.path}: the download server redirected more than {MAX_REDIRECTS} times (a "
                                   f"redirect loop at the CDN or a proxy) after {_fmt(st.have)} of {_fmt(f.size)}; "
                                   f"the bytes are kept: run moechat pull {self.listing.repo_id} again later to "
                                   "resume", repo_id=self.listing.repo_id) from None
            progressed = st.have - before >= min(MIN_RATE_BPS * STALL_WINDOW_S, f.size - before)
            failures = 0 if progressed and st.have > before else failures + 1
            if failures >= RETRIES or time.monotonic() >= deadline:
                elapsed = time.monotonic() - started
                why = (f"the connection dropped or stalled {failures} times in a row ({reason})" if failures >= RETRIES
                       else f"it is too slow: {_fmt(st.have)} of {_fmt(f.size)} after {elapsed:.0f} s, the most "
                       f"moechat waits for a file this size ({reason})")
                raise NetworkError(f"{f.path}: {why}; {_fmt(st.have)} of {_fmt(f.size)} kept: run moechat pull "
                                   f"{self.listing.repo_id} again to resume", repo_id=self.listing.repo_id)
            delay = min(RETRY_DELAY_MAX_S, RETRY_DELAY_S * (2 ** max(0, failures - 1)))
            self.report("download", f, st.have, f.size, note=f"connection dropped during {f.path} at "
                        f"{_fmt(st.have)} ({reason}); resuming in {delay:g} s")
            if self.cancel is not None:
                self.cancel.wait(delay)
            else:
                time.sleep(delay)
        have, hasher = st.have, st.hasher
        self._verify(f, partial, have, hasher)
        os.replace(partial, blob)
        self.done += f.size
        self.files_done += 1
        self.report("download", f, 0, f.size)

    def _adopt_or_clear(self, f: RepoFile, partial: Path) -> None:
        if partial.exists() and partial.stat().st_size > f.size:
            partial.unlink()
        if partial.exists():
            return
        # huggingface_hub 2.x's own temp files (<etag>.<uuid>.incomplete) are left behind by a crash; adopt the
        # longest (holding its per-blob lock, so a live huggingface_hub download of it is never touched).
        others = sorted(self.blobs.glob(f"{f.etag}.*.incomplete"), key=lambda p: p.stat().st_size)
        if not others:
            return
        from filelock import FileLock, Timeout

        lock = FileLock(str(self.hub.cache / ".locks" / _repo_folder(self.listing.repo_id) / f"{f.etag}.lock"),
                        timeout=0)
        try:
            with lock:
                best = others[-1]
                if 0 < best.stat().st_size <= f.size:
                    os.replace(best, partial)
                for p in others[:-1]:
                    p.unlink(missing_ok=True)
        except Timeout:
            pass  # huggingface_hub is downloading it right now: leave its file alone, start our own

    @staticmethod
    def _new_hasher(f: RepoFile):
        if f.sha256:
            return hashlib.sha256()
        h = hashlib.sha1()  # git's blob id: sha1("blob <size>\0" + content)
        h.update(b"blob %d\0" % f.size)
        return h

    def _locate(self, f: RepoFile) -> tuple[str, bool]:
        """HEAD the file at the pinned commit: the CDN location, and a check of its ETag and size."""
        from huggingface_hub import hf_hub_url

        url = hf_hub_url(self.listing.repo_id, f.path, revision=self.listing.sha, endpoint=self.hub.endpoint_url)
        meta = hubhttp.file_metadata(url, self.ctx, self.hub._auth_headers(), f"file metadata of {f.path}")
        if meta.commit and meta.commit != self.listing.sha:
            raise DownloadIntegrityError(f"{self.listing.repo_id}/{f.path}: the Hub served commit "
                                         f"{meta.commit[:12]!r}, not the pinned {self.listing.sha[:12]}: run the "
                                         "pull again", repo_id=self.listing.repo_id)
        if meta.etag and meta.etag != f.etag:
            raise DownloadIntegrityError(f"{self.listing.repo_id}/{f.path}: the server's ETag {meta.etag[:16]} "
                                         f"differs from the Hub's listing {f.etag[:16]}: a proxy or mirror is "
                                         "serving another file; nothing was written", repo_id=self.listing.repo_id)
        if meta.size is not None and meta.size != f.size:
            raise DownloadIntegrityError(f"{self.listing.repo_id}/{f.path}: the server says {meta.size} B, the "
                                         f"Hub's listing {f.size} B: a proxy or mirror is serving another file; "
                                         "nothing was written", repo_id=self.listing.repo_id)
        location = meta.location or url
        same = _origin(location) == _origin(url)
        return location, same  # the token goes to the Hub only, never to the CDN

    def _stream(self, f: RepoFile, url: str, auth: bool, partial: Path, st: _FileState, deadline: float) -> None:
        """One GET from `st.have` on; `st` follows every byte written, so a drop mid-way loses nothing. A
        connection that trickles (under MIN_RATE_BPS over STALL_WINDOW_S) or outlives the file's deadline is
        dropped with _Stalled."""
        headers = dict(self.hub._auth_headers()) if auth else {"user-agent": "moechat"}
        headers["Accept-Encoding"] = "identity"
        if st.have:
            headers["Range"] = f"bytes={st.have}-"
        window_start, window_have = time.monotonic(), st.have
        with hubhttp.open_stream("GET", url, self.ctx, f"download of {f.path}", headers=headers) as r:
            if st.have and r.status_code == 206:
                start = _content_range_start(r.headers.get("Content-Range"))
                if start != st.have:
                    raise _RangeMismatch(f"the server resumed at byte {start}, not {st.have}")
            elif st.have:  # 200: the whole file again
                self.report("download", f, 0, f.size, note=f"{f.path}: the server ignored the Range request: "
                            f"starting the file over ({_fmt(st.have)} dropped)")
                st.have, st.hasher = 0, self._new_hasher(f)
            try:
                with partial.open("ab" if st.have else "wb") as out:
                    for chunk in r.iter_bytes():  # as the network delivers: cancel and progress stay live
                        if not chunk:
                            continue
                        if st.have + len(chunk) > f.size:
                            out.close()
                            partial.unlink(missing_ok=True)
                            raise DownloadIntegrityError(
                                f"{self.listing.repo_id}/{f.path}: the server sent more than the {f.size} B the Hub "
                                "lists; the file was discarded: run the pull again, and if it repeats a proxy or "
                                "mirror is altering downloads", repo_id=self.listing.repo_id)
                        out.write(chunk)
                        out.flush()  # what the hasher saw is what a crash leaves on disk
                        st.hasher.update(chunk)
                        st.have += len(chunk)
                        self.transferred += len(chunk)
                        self.report("download", f, st.have, f.size, force=False)
                        self._check_cancel(f, st.have)
                        now = time.monotonic()
                        if now >= deadline:
                            raise _Stalled(f"{_fmt(st.have)} of {_fmt(f.size)} by the file's deadline")
                        if now - window_start >= STALL_WINDOW_S:
                            rate = (st.have - window_have) / (now - window_start)
                            if rate < MIN_RATE_BPS:
                                self.report("download", f, st.have, f.size, note=f"{f.path}: the server sends "
                                            f"{_fmt(rate)}/s: dropping the connection and resuming")
                                raise _Stalled(f"the server sent {_fmt(rate)}/s, under {_fmt(MIN_RATE_BPS)}/s")
                            window_start, window_have = now, st.have
            except OSError as e:
                if e.errno == 28:  # ENOSPC: the disk filled up under us (another program wrote to it)
                    raise DiskSpaceError(f"the disk filled up while writing {f.path} ({_fmt(st.have)} kept): free "
                                         f"space and run moechat pull {self.listing.repo_id} again to resume",
                                         repo_id=self.listing.repo_id) from None
                raise

    def _verify(self, f: RepoFile, partial: Path, have: int, hasher) -> None:
        repo = self.listing.repo_id
        if have != f.size:
            partial.unlink(missing_ok=True)
            raise DownloadIntegrityError(f"{repo}/{f.path}: received {have} B but the Hub lists {f.size} B; the file "
                                         "was discarded: run the pull again, and if it repeats a proxy or mirror is "
                                         "altering downloads", repo_id=repo)
        digest = hasher.hexdigest()
        if digest != f.etag:
            partial.unlink(missing_ok=True)
            kind = "sha256" if f.sha256 else "git blob id"
            raise DownloadIntegrityError(f"{repo}/{f.path}: {kind} {digest[:16]}... does not match the Hub's "
                                         f"{f.etag[:16]}...; the file was discarded: run the pull again, and if it "
                                         "repeats a proxy or mirror is altering downloads", repo_id=repo)


class _RangeMismatch(Exception):
    pass


class _Stalled(Exception):
    """The connection delivers too slowly to finish the file in bounded time: drop it and resume."""


@dataclass
class _FileState:
    have: int  # bytes of the file in the partial file, all hashed
    hasher: object


def _content_range_start(value: str | None) -> int | None:
    m = re.match(r"bytes (\d+)-", value or "")
    return int(m.group(1)) if m else None


def _origin(url: str) -> tuple[str, str, int | None]:
    p = urlparse(url)
    return p.scheme, (p.hostname or "").lower(), p.port
