"""`Hub`: the client. Where the Hub is, whose token, which cache; the local snapshots, a repo's listing, its
config and safetensors headers, the fit verdict, the catalog, search, and `download` (one quant of a GGUF repo, or
the safetensors checkpoint).

Every request goes through one bounded HTTP layer, engine/plan/hubhttp.py (model info, the tree listing, search,
each file's HEAD for its ETag, size and CDN location, safetensors headers, small JSON files, the download
connections). Reading the headers of a model costs one ranged request per shard (the first 100 kB), so a verdict
for a 60 GB model moves about 2 MB. A repo with GGUF files and no safetensors needs a quant named
(QuantChoiceError lists them); `download(..., quant=)` fetches that quant's files only, plus the repo's imatrix
(the expert cache's warm start).

One download per repo at a time: a file lock in `$HF_HUB_CACHE/.locks/`. HF_TOKEN, HF_ENDPOINT,
HF_HOME / HF_HUB_CACHE and HF_HUB_OFFLINE are read when called (huggingface_hub reads some at import).

Everything here is safe to call from a worker thread; nothing imports torch except `fit` on a model that is
already downloaded (its headers are then read locally).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from ...errors import (
    ConfigError,
    DiskSpaceError,
    DownloadBusyError,
    DownloadIntegrityError,
    HubError,
    HubOfflineError,
    MoechatError,
    NotDownloadedError,
    QuantChoiceError,
    RepoGatedError,
    RepoNotFoundError,
    UnsafeHubResponseError,
    UnsupportedModelError,
)
from ...paths import default_cache_dir
from ...units import MiB
from .. import hubhttp
from ..catalog import CATALOG, MISSING_FEATURES, SUPPORTED_TYPES, CatalogEntry, why_not_runnable
from ..hubhttp import MAX_NAME_BYTES
from ..hubhttp import Ctx as _Ctx
from ..hubhttp import Tensor as _Tensor
from . import transfer
from .gguf import GGUFQuant, LocalFile, choose_quant, gguf_quants, what_to_pull
from .names import (
    _COMMIT,
    _REPO_ID,
    INDEX_FILE,
    MAX_GGUF_DEPTH,
    RepoFile,
    RepoListing,
    _fmt,
    _is_weight,
    _wanted_any,
    is_gguf_path,
    is_offline,
    safe_revision,
    wanted_file,
)
from .reports import CatalogStatus, DownloadPlan, FilePlan, FitVerdict, ProgressSink, SearchHit
from .snapshot import _blob_ok, _link, _partial_size, _repo_folder, snapshot_problems
from .transfer import _Transfer

DEFAULT_ENDPOINT = "https://huggingface.co"
DISK_MARGIN_BYTES = 512 * MiB  # free space kept after the download, at least...
DISK_MARGIN_FRACTION = 0.02  # ...or this fraction of the download
MAX_JSON_BYTES = 64 * MiB  # config, index, tokenizer JSON read into memory (the largest tokenizer.json is ~30 MB)


@dataclass(frozen=True)
class Hub:
    """Where the Hub is, whose token, which cache. Defaults follow huggingface_hub's environment variables.

    `token=None`: HF_TOKEN or the saved login; `False`: anonymous. `free_space(path) -> bytes` is injectable
    (tests give a small disk).
    """

    endpoint: str | None = None
    token: str | bool | None = None
    cache_dir: str | os.PathLike | None = None
    free_space: Callable[[str], int] | None = None

    # -- basics ------------------------------------------------------------------------------------------
    @property
    def endpoint_url(self) -> str:
        return (self.endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")

    @property
    def cache(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir is not None else default_cache_dir()

    def token_in_use(self) -> bool:
        if self.token is False:
            return False
        if isinstance(self.token, str):
            return True
        from huggingface_hub import get_token

        return get_token() is not None

    def _auth_headers(self) -> dict[str, str]:
        from huggingface_hub.utils import build_hf_headers

        return build_hf_headers(token=self.token, library_name="moechat")

    def _check_online(self, ctx: _Ctx) -> None:
        if is_offline():
            raise HubOfflineError(f"{ctx.repo_id}: HF_HUB_OFFLINE is set and this needs the Hub: unset "
                                  "HF_HUB_OFFLINE, or use a model that is already downloaded", repo_id=ctx.repo_id)

    def storage(self, repo_id: str) -> Path:
        if (not isinstance(repo_id, str) or not _REPO_ID.match(repo_id) or ".." in repo_id
                or len(_repo_folder(repo_id).encode()) > MAX_NAME_BYTES):
            raise RepoNotFoundError(f"{repo_id!r} is not a Hub repo id (org/name, letters, digits, '-', '_', '.')",
                                    repo_id=str(repo_id))
        return self.cache / _repo_folder(repo_id)

    # -- the local cache ---------------------------------------------------------------------------------
    def cached_sha(self, repo_id: str, revision: str | None = None) -> str | None:
        """The commit `revision` names in the cache: itself when it is one, else what refs/<revision> holds. A ref
        that is not a commit id (another tool's half-written file, garbage bytes) counts as no ref."""
        rev = safe_revision(revision or "main")
        if _COMMIT.match(rev):
            return rev
        ref = self.storage(repo_id) / "refs" / rev
        try:
            sha = ref.read_bytes()[:256].strip().decode("ascii")
        except (OSError, UnicodeDecodeError):
            return None
        return sha if _COMMIT.match(sha) else None

    def _snapshots(self, repo_id: str) -> list[Path]:
        """The cached snapshot folders (named by a commit id), oldest first."""
        folder = self.storage(repo_id) / "snapshots"
        try:
            found = [p for p in folder.iterdir() if _COMMIT.match(p.name) and p.is_dir()]
        except OSError:
            return []
        return sorted(found, key=lambda p: p.stat().st_mtime)

    def local_snapshot(self, repo_id: str, revision: str | None = None) -> Path | None:
        """The complete cached snapshot of this repo at `revision` (default main), without the network. Without a
        usable refs/main (a crash between the last link and the ref, another tool's copy, a damaged ref), main is
        the one complete snapshot when exactly one is cached."""
        sha = self.cached_sha(repo_id, revision)
        if sha is None:
            if revision is not None:
                return None
            complete = [p for p in self._snapshots(repo_id) if not snapshot_problems(p)]
            return complete[0] if len(complete) == 1 else None
        path = self.storage(repo_id) / "snapshots" / sha
        return path if not snapshot_problems(path) else None

    def resolve(self, repo_id: str, revision: str | None = None) -> Path:
        """The complete cached snapshot, or NotDownloadedError saying what is missing and how to get it."""
        path = self.local_snapshot(repo_id, revision)
        if path is not None:
            return path
        sha = self.cached_sha(repo_id, revision)
        rev = f" --revision {revision}" if revision else ""
        if sha is None and revision is None:  # no usable ref: files fetched at a pinned commit (fit, a crashed pull)
            snaps = self._snapshots(repo_id)
            complete = [p.name for p in snaps if not snapshot_problems(p)]
            if len(complete) > 1:
                raise NotDownloadedError(f"{repo_id}: refs/main is missing or damaged and {len(complete)} complete "
                                         f"snapshots are cached ({', '.join(c[:12] for c in complete[:4])}): run "
                                         f"moechat pull {repo_id} to settle main, or name one with --revision "
                                         "<commit>", repo_id=repo_id)
            sha = snaps[-1].name if snaps else None
        if sha is None:
            raise NotDownloadedError(f"{repo_id} is not downloaded (nothing in {self.cache}): run moechat pull "
                                     f"{repo_id}{rev}", repo_id=repo_id)
        problems = snapshot_problems(self.storage(repo_id) / "snapshots" / sha) or ["its files changed while read"]
        raise NotDownloadedError(f"{repo_id} is only partly downloaded ({'; '.join(problems)}): run moechat pull "
                                 f"{repo_id}{rev} to finish it", repo_id=repo_id)

    # -- listing -----------------------------------------------------------------------------------------
    def listing(self, repo_id: str, revision: str | None = None, *,
                want: Callable[[str], bool] = wanted_file) -> RepoListing:
        """The repo at `revision` (default main) resolved to its commit, with file sizes and checksums; `want` says
        which files it takes (the rest are `skipped`)."""
        self.storage(repo_id)  # checks the repo id
        if revision is not None:
            safe_revision(revision)
        ctx = _Ctx(self, repo_id, revision)
        self._check_online(ctx)
        headers = self._auth_headers()
        info = hubhttp.model_info(self.endpoint_url, repo_id, revision or "main", ctx, headers)
        siblings = info.siblings
        if any(f.size is None for f in siblings if want(f.path)):  # sizes left out: the tree has them
            siblings = tuple(hubhttp.tree(self.endpoint_url, repo_id, info.sha, ctx, headers))
        files, skipped, seen = [], [], set()
        for f in siblings:
            if want(f.path) and f.size is not None and (f.sha256 or f.blob_id):
                try:
                    files.append(RepoFile(f.path, f.size, f.sha256, f.blob_id))
                except ValueError as e:
                    raise UnsafeHubResponseError(f"{repo_id}: the Hub's file listing is not usable ({e}); nothing "
                                                 "was written: check HF_ENDPOINT points at the real Hub or a mirror "
                                                 "you trust", repo_id=repo_id) from None
                if f.path in seen:
                    raise UnsafeHubResponseError(f"{repo_id}: the Hub's file listing is not usable (it lists "
                                                 f"{f.path!r} twice); nothing was written: check HF_ENDPOINT points "
                                                 "at the real Hub or a mirror you trust", repo_id=repo_id)
                seen.add(f.path)
            else:
                skipped.append(f.path)
        return RepoListing(repo_id, info.sha, tuple(files), tuple(skipped), info.gated, info.model_type)

    def _fetch_json(self, repo_id: str, filename: str, listing: RepoListing) -> dict:
        """A small JSON file of the listing, verified against its checksum and kept in the cache (as a pull
        would), without huggingface_hub's download (which names the blob after the server's ETag)."""
        from huggingface_hub import hf_hub_url

        f = listing.file(filename)
        if f is None:
            raise ConfigError(f"{repo_id} has no {filename} at {listing.sha[:12]}")
        if f.size > MAX_JSON_BYTES:
            raise UnsafeHubResponseError(f"{repo_id}/{filename} is listed at {_fmt(f.size)}, more than a JSON file "
                                         f"moechat reads ({_fmt(MAX_JSON_BYTES)})", repo_id=repo_id)
        storage = self.storage(repo_id)
        blob = storage / "blobs" / f.etag
        if not _blob_ok(blob, f.size):
            url = hf_hub_url(repo_id, filename, revision=listing.sha, endpoint=self.endpoint_url)
            ctx = _Ctx(self, repo_id, listing.sha)
            # one more byte than listed shows a longer body; a metadata deadline stretched by the size
            body = hubhttp.fetch(url, ctx, filename, headers=self._auth_headers(), max_bytes=f.size + 1,
                                 truncate=True,
                                 deadline_s=hubhttp.METADATA_DEADLINE_S + f.size / transfer.MIN_RATE_BPS).content
            hasher = _Transfer._new_hasher(f)
            hasher.update(body)
            if len(body) != f.size or hasher.hexdigest() != f.etag:
                raise DownloadIntegrityError(f"{repo_id}/{filename}: the server sent {len(body)} B that do not match "
                                             f"the Hub's listing ({f.size} B, {f.etag[:16]}...); nothing was written: "
                                             "run it again, and if it repeats a proxy or mirror is altering downloads",
                                             repo_id=repo_id)
            blob.parent.mkdir(parents=True, exist_ok=True)
            tmp = blob.with_name(f".{f.etag}.moechat-tmp")
            tmp.write_bytes(body)
            os.replace(tmp, blob)
            _link(blob, storage / "snapshots" / listing.sha / f.path)
        try:
            data = json.loads(blob.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as e:
            raise ConfigError(f"{repo_id}/{filename}: not valid JSON ({type(e).__name__}: {str(e)[:120]})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{repo_id}/{filename}: holds {type(data).__name__}, not a JSON object")
        return data

    def headers(self, repo_id: str, listing: RepoListing, workers: int = 8) -> dict[str, _Tensor]:
        """Every tensor's dtype, shape and size from the safetensors headers (a ranged read per shard)."""
        from huggingface_hub import hf_hub_url

        if listing.file(INDEX_FILE) is not None:
            weight_map = self._fetch_json(repo_id, INDEX_FILE, listing).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConfigError(f"{repo_id}/{INDEX_FILE}: weight_map is not an object of tensor -> shard")
            shards = sorted({v for v in weight_map.values() if isinstance(v, str)})
            unknown = [s for s in shards if listing.file(s) is None]
            if unknown:  # never a URL the listing did not name (and check)
                raise ConfigError(f"{repo_id}/{INDEX_FILE} names {len(unknown)} shards the Hub does not list "
                                  f"({', '.join(repr(u[:60]) for u in unknown[:3])}): the repo is incomplete")
        else:
            shards = [f.path for f in listing.weight_files]
        if not shards:
            raise UnsupportedModelError(f"{repo_id} has no safetensors weights (files: "
                                        f"{', '.join(listing.skipped[:6])}); moechat runs safetensors only")
        ctx, headers = _Ctx(self, repo_id, listing.sha), self._auth_headers()

        def read(shard: str) -> dict[str, _Tensor]:
            url = hf_hub_url(repo_id, shard, revision=listing.sha, endpoint=self.endpoint_url)
            return hubhttp.safetensors_header(url, ctx, headers, f"safetensors header of {shard}")

        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(shards)))) as pool:
            metas = list(pool.map(read, shards))
        return {name: t for meta in metas for name, t in meta.items()}

    def cached_bytes(self, repo_id: str, listing: RepoListing) -> int:
        blobs = self.storage(repo_id) / "blobs"
        return sum(f.size for f in listing.files if _blob_ok(blobs / f.etag, f.size))

    # -- the model spec and the verdict --------------------------------------------------------------------
    def remote_spec(self, repo_id: str, revision: str | None = None, *, listing: RepoListing | None = None,
                    exact: bool = True, headers: dict | None = None):
        """The ModelSpec from config.json and the safetensors headers on the Hub (`exact=False`: config.json and
        the index only, sizes labelled estimates). Never fetches a weight file's body."""
        from .. import spec_from_config, spec_from_headers

        listing = listing or self.listing(repo_id, revision)
        config = self._fetch_json(repo_id, "config.json", listing)
        where = f"{repo_id}/config.json"
        present = self.cached_bytes(repo_id, listing)
        if exact:
            headers = self.headers(repo_id, listing) if headers is None else headers  # (fit has them already)
            spec = spec_from_headers(config, headers, name=repo_id, where=where)
            return replace(spec, source="safetensors headers (Hub)", weights_present=False, present_bytes=present,
                           checkpoint_bytes=listing.download_bytes, path=None,
                           notes=("sizes read from the safetensors headers on the Hub",) + spec.notes[1:])
        index = self._fetch_json(repo_id, INDEX_FILE, listing) if listing.file(INDEX_FILE) else None
        spec = spec_from_config(config, name=repo_id, index=index, present_bytes=present, where=where)
        return replace(spec, checkpoint_bytes=max(spec.checkpoint_bytes, listing.download_bytes))

    def remote_gguf_spec(self, repo_id: str, quant: str | None, revision: str | None = None, *,
                         listing: RepoListing | None = None):
        """The ModelSpec of one GGUF quant of a repo from its header(s) on the Hub: a ranged read from the start of
        each file of the quant (metadata and tensor infos, a few MB), never its tensor data. The headers go into
        sparse files of the files' full sizes in a temporary folder, so the local reader plans them as it plans a
        downloaded file (the same numbers, tested). `quant` None: QuantChoiceError listing what the repo offers."""
        import tempfile
        from pathlib import PurePosixPath

        from huggingface_hub import hf_hub_url

        from ..spec_headers import gguf_spec

        listing = listing or self.listing(repo_id, revision, want=_wanted_any)
        chosen = choose_quant(repo_id, gguf_quants(listing.files), quant)
        ctx, headers = _Ctx(self, repo_id, listing.sha), self._auth_headers()
        with tempfile.TemporaryDirectory(prefix="moechat-gguf-") as tmp:
            for f in chosen.files:
                url = hf_hub_url(repo_id, f.path, revision=listing.sha, endpoint=self.endpoint_url)
                head = hubhttp.gguf_header(url, ctx, headers, f"GGUF header of {f.path}", f.size)
                with open(Path(tmp) / PurePosixPath(f.path).name, "wb") as out:
                    out.write(head)
                    out.truncate(f.size)  # sparse past the header: no disk, and nothing reads it
            spec = gguf_spec(Path(tmp) / PurePosixPath(chosen.first).name)
        cached = self.cached_bytes(repo_id, replace(listing, files=tuple(chosen.files)))
        return replace(spec, name=f"{repo_id}:{chosen.name}", source="GGUF headers (Hub)", weights_present=False,
                       present_bytes=cached, checkpoint_bytes=chosen.size, path=None,
                       notes=(f"sizes read from the GGUF header of {chosen.first} on the Hub",) + spec.notes[1:])

    def gguf_quant_spec(self, repo_id: str, quant: str, revision: str | None = None, *,
                        listing: RepoListing | None = None):
        """(the ModelSpec of one GGUF quant, the commit): from its files when a snapshot holds them, else from its
        header(s) on the Hub (`remote_gguf_spec`)."""
        from .. import gguf_spec

        local = self.local_snapshot(repo_id, revision) if listing is None else None
        if local is not None and self._has_quant(repo_id, local, quant):
            first = choose_quant(repo_id, gguf_quants(self.local_listing(repo_id, local)), quant).first
            spec = gguf_spec(local / first)
            return replace(spec, name=f"{repo_id}:{quant}", source="local snapshot",
                           present_bytes=spec.checkpoint_bytes), local.name
        if is_offline():
            raise HubOfflineError(f"{repo_id}:{quant} is not downloaded and HF_HUB_OFFLINE is set: unset "
                                  "HF_HUB_OFFLINE to read its header from the Hub", repo_id=repo_id)
        listing = listing or self.listing(repo_id, revision, want=_wanted_any)
        return self.remote_gguf_spec(repo_id, quant, listing=listing), listing.sha

    def fit(self, repo_id: str, hardware=None, prefs=None, *, revision: str | None = None, exact: bool = True,
            listing: RepoListing | None = None, quant: str | None = None) -> FitVerdict:
        """Verdict, predicted speed and download size for this machine (or `hardware`), before any weight byte.

        A complete local snapshot is planned from its own files; else config.json and the safetensors headers
        come from the Hub (`exact=False`: config.json alone, faster for long lists).
        """
        from .. import Preferences, read_model_spec
        from ..format_plan import plan_formats
        from ..hardware import probe

        local = self.local_snapshot(repo_id, revision) if listing is None else None
        if quant is not None:  # one GGUF quant: its own files when cached, else its header(s) from the Hub
            spec, sha = self.gguf_quant_spec(repo_id, quant, revision, listing=listing)
            download, cached, source = spec.checkpoint_bytes, spec.present_bytes, spec.source
        elif local is not None:
            spec = replace(read_model_spec(local), name=repo_id)
            sha, download, cached, source = local.name, spec.checkpoint_bytes, spec.checkpoint_bytes, "local snapshot"
        else:
            listing = listing or self.listing(repo_id, revision)
            spec = self.remote_spec(repo_id, listing=listing, exact=exact)
            sha, download = listing.sha, listing.download_bytes
            cached = self.cached_bytes(repo_id, listing)
            source = "Hub safetensors headers" if exact else "Hub config.json (estimate)"
        hw = hardware if hardware is not None else probe(self.cache)
        formats = plan_formats(spec, hw, prefs if prefs is not None else Preferences())  # native, int8, int4
        why = why_not_runnable(spec.model_type, spec.quant_method, spec.remote_code)  # the loader's reasons
        if why is not None and spec.model_type in MISSING_FEATURES:
            why = MISSING_FEATURES[spec.model_type]  # the wizard's column: the missing feature alone
        supported = why is None
        return FitVerdict(repo_id, sha, spec, formats.option("native").plan, hw, supported, why, download, cached,
                          source, formats)

    # -- the catalog and search ----------------------------------------------------------------------------
    def catalog(self, hardware=None, prefs=None, *, entries: Sequence[CatalogEntry] = CATALOG, refresh: bool = True,
                exact: bool = False, workers: int = 4) -> list[CatalogStatus]:
        """Each catalog entry with the Hub's current commit, size and gating, and its verdict on `hardware`.

        Offline (HF_HUB_OFFLINE, or `refresh=False`) only downloaded entries get a verdict. Errors (a gated
        repo, no network) are kept per entry, never raised: the list always comes back.
        """
        from ..hardware import probe

        hw = hardware if hardware is not None else probe(self.cache)
        online = refresh and not is_offline()

        def one(entry: CatalogEntry) -> CatalogStatus:
            downloaded = self.local_snapshot(entry.repo_id) is not None
            if not online:
                verdict, error = None, "offline: HF_HUB_OFFLINE is set" if refresh else "not refreshed"
                if downloaded:
                    with contextlib.suppress(MoechatError):
                        verdict, error = self.fit(entry.repo_id, hw, prefs), None
                return CatalogStatus(entry, self.cached_sha(entry.repo_id), entry.gated, None, downloaded, verdict,
                                     error)
            try:
                listing = self.listing(entry.repo_id)
            except MoechatError as e:
                return CatalogStatus(entry, None, isinstance(e, RepoGatedError) or entry.gated, None, downloaded,
                                     None, str(e))
            try:
                verdict, error = self.fit(entry.repo_id, hw, prefs, exact=exact, listing=listing), None
            except MoechatError as e:
                verdict, error = None, str(e)
            return CatalogStatus(entry, listing.sha, listing.gated, listing.download_bytes, downloaded, verdict, error)

        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            return list(pool.map(one, entries))

    def search(self, query: str, *, limit: int = 20, supported_only: bool = True) -> list[SearchHit]:
        """Hub search by name; `supported_only` keeps repos whose model_type moechat runs, else every known MoE
        family (with why it is not supported yet). model_type comes from the Hub's config summary."""
        ctx = _Ctx(self, query)
        self._check_online(ctx)
        from ..catalog import find

        hits: list[SearchHit] = []
        found = hubhttp.search(self.endpoint_url, query, min(500, limit * 5), ctx, self._auth_headers())
        for m in found:
            if not _REPO_ID.match(m.repo_id) or ".." in m.repo_id or len(m.repo_id) > 200:
                continue  # a legacy name without an org, or a name no pull could take
            mt = m.model_type
            supported = mt in SUPPORTED_TYPES
            if supported_only and not supported:
                continue
            if not supported and mt not in MISSING_FEATURES:
                continue  # dense or unknown: nothing for moechat to offload
            hits.append(SearchHit(m.repo_id, mt, supported, None if supported else MISSING_FEATURES[mt], m.downloads,
                                  m.likes, m.gated, m.params, find(m.repo_id) is not None))
            if len(hits) >= limit:
                break
        return hits

    # -- download --------------------------------------------------------------------------------------------
    def plan_download(self, repo_id: str, revision: str | None = None, *,
                      listing: RepoListing | None = None) -> DownloadPlan:
        """What `download` would do now: cached files, partial files it resumes, and what starts over."""
        listing = listing or self.listing(repo_id, revision)
        blobs = self.storage(repo_id) / "blobs"
        files = []
        for f in listing.files:
            blob = blobs / f.etag
            if blob.exists():
                if _blob_ok(blob, f.size):
                    files.append(FilePlan(f.path, f.size, "cached"))
                    continue
                files.append(FilePlan(f.path, f.size, "download", note=f"the cached blob has the wrong size "
                                      f"({blob.stat().st_size} B, not {f.size}): downloaded again"))
                continue
            kept, note = _partial_size(blobs, f)
            if kept:
                files.append(FilePlan(f.path, f.size, "resume", kept, note))
            else:
                files.append(FilePlan(f.path, f.size, "download", 0, note))
        return DownloadPlan(repo_id, listing.sha, tuple(files), listing.skipped)

    def quants(self, repo_id: str, revision: str | None = None) -> tuple[RepoListing, list[GGUFQuant]]:
        """The GGUF quants the repo offers (from one listing: names, sizes, split sets), smallest first."""
        listing = self.listing(repo_id, revision, want=_wanted_any)
        return listing, gguf_quants(listing.files)

    def download_quant(self, repo_id: str, quant: str, revision: str | None = None, *,
                       progress: ProgressSink | None = None, cancel: threading.Event | None = None) -> Path:
        """Download one GGUF quant (its split set whole) and return the path of its first file."""
        snapshot = self.download(repo_id, revision, progress=progress, cancel=cancel, quant=quant)
        listing = self.local_listing(repo_id, snapshot)
        return snapshot / choose_quant(repo_id, gguf_quants(listing), quant).first

    @staticmethod
    def local_listing(repo_id: str, snapshot: Path) -> list[LocalFile]:
        """The GGUF files linked in a cached snapshot (sizes from their blobs), for `gguf_quants`."""
        out = []
        for depth in range(MAX_GGUF_DEPTH + 1):
            for p in sorted(snapshot.glob("/".join(["*"] * (depth + 1)))):
                rel = p.relative_to(snapshot).as_posix()
                if is_gguf_path(rel) and p.is_file():
                    out.append(LocalFile(rel, p.stat().st_size))
        return out

    def download(self, repo_id: str, revision: str | None = None, *, progress: ProgressSink | None = None,
                 cancel: threading.Event | None = None, quant: str | None = None) -> Path:
        """Download what the engine needs into the cache and return the snapshot folder (pinned to the commit).

        `quant` (Q4_K_M, UD-Q4_K_XL...): that GGUF quant's files only (plus the repo's imatrix); a repo with GGUF
        files and no safetensors needs one (QuantChoiceError lists them).

        Blocking; call it from a worker thread. `progress` gets a DownloadProgress first with the plan, then as
        bytes arrive (at most every 0.1 s, and at each file boundary and event). Setting `cancel` stops it
        within one chunk (or the read timeout on a silent connection) with DownloadCancelled; partial files are
        kept for the next call to resume. Raises the typed HubError subclasses; after any failure the snapshot
        is not complete (`resolve` refuses it).
        """
        ctx = _Ctx(self, repo_id, revision)
        if is_offline():
            path = self.local_snapshot(repo_id, revision)
            if path is not None and (quant is None or self._has_quant(repo_id, path, quant)):
                return path
            raise HubOfflineError(f"{repo_id} is not downloaded and HF_HUB_OFFLINE is set: unset HF_HUB_OFFLINE to "
                                  "download it", repo_id=repo_id)
        with self._repo_lock(repo_id):
            listing = self.listing(repo_id, revision, want=_wanted_any)
            listing = what_to_pull(listing, quant)
            plan = self.plan_download(repo_id, listing=listing)
            self._check_disk(repo_id, plan)
            run = _Transfer(self, ctx, listing, plan, progress, cancel)
            run.report("plan", None, 0, 0, plan=plan)
            # small files first, weights last: all weight links present means every file is there
            order = sorted(listing.files, key=lambda f: (_is_weight(f.path), f.path))
            for f in order:
                run.fetch(f)
            snapshot = self._link_snapshot(repo_id, listing, revision, order)
            problems = snapshot_problems(snapshot)
            if problems:  # a listing without config.json, an index naming a shard that is not in the repo...
                raise HubError(f"{repo_id} at {listing.sha[:12]} is not a complete model ({'; '.join(problems)})",
                               repo_id=repo_id)
            run.report("done", None, 0, 0)
            return snapshot

    def _has_quant(self, repo_id: str, snapshot: Path, quant: str) -> bool:
        try:
            choose_quant(repo_id, gguf_quants(self.local_listing(repo_id, snapshot)), quant)
        except QuantChoiceError:
            return False
        return True

    @contextlib.contextmanager
    def _repo_lock(self, repo_id: str):
        from filelock import FileLock, Timeout

        lock_path = self.cache / ".locks" / _repo_folder(repo_id) / "moechat-download.lock"
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(lock_path), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            raise DownloadBusyError(f"{repo_id} is already being downloaded by another moechat (lock {lock_path}): "
                                    "wait for it to finish, or stop it", repo_id=repo_id) from None
        try:
            yield
        finally:
            lock.release()

    def _check_disk(self, repo_id: str, plan: DownloadPlan) -> None:
        need = plan.to_download_bytes
        if need <= 0:
            return
        where = self.storage(repo_id)
        probe_at = where
        while not probe_at.exists() and probe_at.parent != probe_at:
            probe_at = probe_at.parent
        free = (self.free_space or (lambda p: shutil.disk_usage(p).free))(str(probe_at))
        margin = max(DISK_MARGIN_BYTES, int(need * DISK_MARGIN_FRACTION))
        if free < need + margin:
            raise DiskSpaceError(f"{repo_id} needs {_fmt(need)} more on disk (+ {_fmt(margin)} margin) and "
                                 f"{_fmt(free)} is free on {probe_at}: free {_fmt(need + margin - free)}, or set "
                                 "HF_HOME to a bigger disk", repo_id=repo_id)

    def _link_snapshot(self, repo_id: str, listing: RepoListing, revision: str | None,
                       order: Iterable[RepoFile]) -> Path:
        storage = self.storage(repo_id)
        snapshot = storage / "snapshots" / listing.sha
        snapshot.mkdir(parents=True, exist_ok=True)
        for f in order:
            _link(storage / "blobs" / f.etag, snapshot / f.path)
        ref = safe_revision(revision or "main")
        if not _COMMIT.match(ref):
            target = storage / "refs" / ref  # refs/pr/1 nests, as huggingface_hub lays it out
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.moechat-tmp")
            tmp.write_text(listing.sha, encoding="utf-8")
            os.replace(tmp, target)
        return snapshot


# -- module-level shortcuts (the defaults of the environment) -------------------------------------------------

def download(repo_id: str, revision: str | None = None, *, progress: ProgressSink | None = None,
             cancel: threading.Event | None = None, endpoint: str | None = None, token: str | bool | None = None,
             cache_dir: str | os.PathLike | None = None) -> Path:
    return Hub(endpoint, token, cache_dir).download(repo_id, revision, progress=progress, cancel=cancel)


def fit(repo_id: str, hardware=None, prefs=None, *, revision: str | None = None, endpoint: str | None = None,
        token: str | bool | None = None, cache_dir: str | os.PathLike | None = None) -> FitVerdict:
    return Hub(endpoint, token, cache_dir).fit(repo_id, hardware, prefs, revision=revision)


def search(query: str, *, limit: int = 20, supported_only: bool = True, endpoint: str | None = None,
           token: str | bool | None = None) -> list[SearchHit]:
    return Hub(endpoint, token).search(query, limit=limit, supported_only=supported_only)


def catalog(hardware=None, prefs=None, *, refresh: bool = True, endpoint: str | None = None,
            token: str | bool | None = None, cache_dir: str | os.PathLike | None = None) -> list[CatalogStatus]:
    return Hub(endpoint, token, cache_dir).catalog(hardware, prefs, refresh=refresh)


def resolve(repo_id: str, revision: str | None = None, *, cache_dir: str | os.PathLike | None = None) -> Path:
    return Hub(cache_dir=cache_dir).resolve(repo_id, revision)
