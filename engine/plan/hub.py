"""The Hugging Face Hub: the catalog's live state, search, a fit verdict before download, and downloads that
survive the real world.

Every request goes through one bounded HTTP layer, engine/plan/hubhttp.py (model info, the tree listing, search,
each file's HEAD for its ETag, size and CDN location, safetensors headers, small JSON files, the download
connections), over huggingface_hub's HTTP session and read with its error types: each metadata answer has a
deadline, a decompressed-size cap and a shape check, a tree listing a page cap. Files land in the standard cache
(`$HF_HOME/hub`: `models--org--name/{blobs,snapshots/<commit>,refs}`), so other tools see what moechat pulled and
the other way round. Reading the headers of a model costs one ranged request per shard (the first 100 kB), so a
verdict for a 60 GB model moves about 2 MB.

The weight files are fetched by our own loop rather than `hf_hub_download` because huggingface_hub 2.x
writes each attempt to a process-unique temporary file and deletes it on failure: nothing survives a crash
or a cancel, and it checks sizes but not checksums. Here a file streams into `blobs/<etag>.incomplete`
(the name huggingface_hub 0.x resumed from), its sha256 (git blob sha1 for small files) is computed as it
arrives and compared with the Hub's listing, the cancel event is checked between chunks, and a dropped
connection resumes with a Range request (and starts the file over when the server ignores Range). A
verified blob is renamed into place; the snapshot's links are made only when every file is verified,
weights last, so a snapshot that has all its weight shards is complete (`snapshot_problems`).

A GGUF repo holds many quants (Q4_K_M, UD-Q4_K_XL, Q8_0...), each one file or a split set
(`-00001-of-00003.gguf`), often one folder per quant: `gguf_quants` groups the listing into them (sizes summed, parts
ordered, a set missing a part flagged), and `download(..., quant=)` fetches that quant's files only, plus the repo's
imatrix (the expert cache's warm start), through the same resume/checksum loop; their paths may have folders, each
part checked like a file name. A repo with GGUF files and no safetensors needs a quant named (QuantChoiceError lists
them). Its snapshot is complete when every split set in it has all its parts.

One download per repo at a time: a file lock in `$HF_HUB_CACHE/.locks/`. HF_TOKEN, HF_ENDPOINT,
HF_HOME / HF_HUB_CACHE and HF_HUB_OFFLINE are read when called (huggingface_hub reads some at import).

Everything here is safe to call from a worker thread; nothing imports torch except `fit` on a model that is
already downloaded (its headers are then read locally).

Every name that comes from a server is hostile until checked: a file name, blob id, sha256 or commit id
becomes part of a path only after it matched its exact form (`RepoFile` cannot be built otherwise), and an
ETag is only ever compared, never used as a path. `hf_hub_download` is not used at all: it names the blob
after the server's ETag header, so a malicious endpoint could write outside the cache through it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlparse

from . import hubhttp
from .catalog import CATALOG, MISSING_FEATURES, SUPPORTED_TYPES, CatalogEntry, why_not_runnable
from ..errors import (
    ConfigError,
    DiskSpaceError,
    DownloadBusyError,
    DownloadCancelled,
    DownloadIntegrityError,
    HubError,
    HubOfflineError,
    MoechatError,
    NetworkError,
    NotDownloadedError,
    QuantChoiceError,
    RepoGatedError,
    RepoNotFoundError,
    UnsafeHubResponseError,
    UnsupportedModelError,
)
from .hubhttp import MAX_NAME_BYTES, MAX_PATH_BYTES, MAX_REDIRECTS
from .hubhttp import Ctx as _Ctx
from .hubhttp import Tensor as _Tensor
from .hubhttp import redirect_loop as _redirect_loop
from .hubhttp import transport_errors as _transport_errors
from ..paths import default_cache_dir  # noqa: F401 - the Hub's cache, also hub.default_cache_dir

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_ENDPOINT = "https://huggingface.co"
RETRIES = 5  # attempts per file without progress before giving up (as huggingface_hub's http_get)
RETRY_DELAY_S = 0.5  # first back-off; doubles up to RETRY_DELAY_MAX_S
RETRY_DELAY_MAX_S = 8.0
# A connection that delivers less than MIN_RATE_BPS over STALL_WINDOW_S (a server trickling a byte every few
# seconds) is dropped and resumed, like a silent one; RETRIES such attempts in a row end the pull with the bytes
# kept. A file also gets at most FILE_DEADLINE_S + size / MIN_RATE_BPS in all, so no pull runs without end.
MIN_RATE_BPS = 16 * 1024
STALL_WINDOW_S = 30.0
FILE_DEADLINE_S = 300.0
DISK_MARGIN_BYTES = 512 * MiB  # free space kept after the download, at least...
DISK_MARGIN_FRACTION = 0.02  # ...or this fraction of the download
PROGRESS_EVERY_S = 0.1

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SHA1 = _COMMIT  # a git blob id
MAX_JSON_BYTES = 64 * MiB  # config, index, tokenizer JSON read into memory (the largest tokenizer.json is ~30 MB)
INDEX_FILE = "model.safetensors.index.json"
# Non-JSON files a tokenizer or chat template may need. JSON files are all taken (config, generation config,
# index, tokenizer, special tokens...). Never pickle: .bin, .pt, .pth, .ckpt, .pkl are skipped.
TOKENIZER_FILES = {"tokenizer.model", "vocab.txt", "merges.txt", "spiece.model", "sentencepiece.bpe.model"}
TOKENIZER_SUFFIXES = (".tiktoken", ".jinja")


def looks_like_repo_id(text: str) -> bool:
    """`org/name` that is not a local path."""
    return bool(_REPO_ID.match(str(text))) and not Path(str(text)).expanduser().exists()


def is_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), read now; huggingface_hub reads it once at import."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    if env is not None:
        return env.strip().upper() in {"1", "ON", "YES", "TRUE"}
    return bool(constants.HF_HUB_OFFLINE)


def wanted_file(path: str) -> bool:
    """Files the engine needs: top-level safetensors, JSON and tokenizer files; never pickle weights."""
    if "/" in path:
        return False  # original/, metal/, onnx/ ...: other runtimes' copies
    return (path.endswith((".safetensors", ".json") + TOKENIZER_SUFFIXES) or path in TOKENIZER_FILES)


def _is_weight(path: str) -> bool:
    return path.endswith(".safetensors")


def _wanted_any(path: str) -> bool:
    """What one listing takes so that a pull can choose: the safetensors side and every GGUF/imatrix file."""
    return wanted_file(path) or is_gguf_path(path) or is_imatrix_path(path)


# -- GGUF repos: one repo, many quants (Q4_K_M, UD-Q4_K_XL, Q8_0...), each one file or a split set -----------------

MAX_GGUF_DEPTH = 4  # folders deep a GGUF file may sit in a repo (unsloth: UD-Q4_K_XL/<name>-00001-of-00003.gguf)
_GGUF_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})$")
# A quant's name at the end of a file stem, after '-', '.' or '_' (Qwen3-30B-A3B-UD-Q4_K_XL, model.Q8_0, x-BF16).
_QUANT_NAME = re.compile(r"(?:^|[-._])(?P<quant>(?:UD-)?(?:I?Q\d(?:_[0-9A-Z]+)*|TQ\d_\d|BF16|F16|F32|"
                         r"MXFP4(?:_MOE)?))$", re.IGNORECASE)


def is_gguf_path(path: str) -> bool:
    """A GGUF model file of a repo (vision projectors, mmproj-*.gguf, are not models; imatrix files are apart)."""
    name = path.rsplit("/", 1)[-1].lower()
    return name.endswith(".gguf") and not name.startswith("mmproj") and not is_imatrix_path(path)


def is_imatrix_path(path: str) -> bool:
    """llama.cpp's importance matrix shipped beside the quants (imatrix.dat, imatrix_unsloth.gguf, x.imatrix.gguf,
    x.imatrix): pulled with any quant, since `--warm-start` seeds the expert cache from it (engine/cache/imatrix.py).
    A model file with 'imatrix' inside its name (x-imatrix-Q4_K_M.gguf) stays a model."""
    name = path.rsplit("/", 1)[-1].lower()
    return (name.endswith((".imatrix", ".imatrix.gguf", ".imatrix.dat"))
            or (name.endswith(".dat") and "imatrix" in name)
            or (name.startswith("imatrix") and name.endswith(".gguf")))


def unsafe_repo_path(path: object) -> str | None:
    """Why a GGUF file's repo path cannot be a cache path (None when it can): up to MAX_GGUF_DEPTH folders, each
    part a plain name (`unsafe_file_name`)."""
    if not isinstance(path, str) or not path:
        return "not a non-empty string"
    parts = path.split("/")
    if len(parts) > MAX_GGUF_DEPTH + 1:
        return f"is more than {MAX_GGUF_DEPTH} folders deep"
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        return f"is longer than a path may be ({MAX_PATH_BYTES} bytes)"
    for part in parts:
        why = unsafe_file_name(part)
        if why is not None:
            return f"has a part that {why}"
    return None


@dataclass(frozen=True)
class LocalFile:
    """A file of a cached snapshot: what `gguf_quants` needs of a RepoFile."""

    path: str
    size: int


@dataclass(frozen=True)
class GGUFQuant:
    """One quant of a GGUF repo: its file, or its split set in order (`-00001-of-00003`)."""

    name: str  # as the file names spell it, upper case: Q4_K_M, UD-Q4_K_XL, BF16
    files: tuple[RepoFile | LocalFile, ...]
    expected_parts: int  # what the split names say (1 for a single file)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def complete(self) -> bool:
        return len(self.files) == self.expected_parts

    @property
    def first(self) -> str:
        """The path `moechat run` takes (the first file of a split set)."""
        return self.files[0].path

    def describe(self) -> str:
        parts = f", {len(self.files)} files" if self.expected_parts > 1 else ""
        missing = "" if self.complete else f" (only {len(self.files)} of {self.expected_parts} parts listed)"
        return f"{self.name:<14} {_fmt(self.size):>11}{parts}{missing}  {self.first}"


def _split_parts(path: str) -> tuple[str, int, int]:
    """(path without the split suffix and .gguf, part index, part count); a single file is part 1 of 1."""
    stem = path[: -len(".gguf")]
    m = _GGUF_SPLIT.match(stem)
    if m is None:
        return stem, 1, 1
    return m["stem"], int(m["index"]), int(m["count"])


def _quant_name(stem: str) -> str:
    """Q4_K_M from 'Q4_K_M/Qwen3-30B-A3B-Q4_K_M'; the folder's name when the file's has none; else the stem."""
    folder, _, name = stem.rpartition("/")
    for candidate in (name, folder.rsplit("/", 1)[-1]):
        m = _QUANT_NAME.search(candidate) if candidate else None
        if m is not None:
            return m["quant"].upper()
    return name


def gguf_quants(files: Iterable[RepoFile | LocalFile]) -> list[GGUFQuant]:
    """The quants a repo offers, grouped from its file listing (a split set is one quant), smallest first."""
    groups: dict[str, list[tuple[int, int, RepoFile | LocalFile]]] = {}
    for f in files:
        if not is_gguf_path(f.path):
            continue
        stem, index, count = _split_parts(f.path)
        groups.setdefault(stem, []).append((index, count, f))
    quants = []
    for stem, members in groups.items():
        members.sort(key=lambda m: m[0])
        quants.append(GGUFQuant(_quant_name(stem), tuple(m[2] for m in members), max(m[1] for m in members)))
    return sorted(quants, key=lambda q: (q.size, q.name))


def choose_quant(repo_id: str, quants: Sequence[GGUFQuant], wanted: str | None) -> GGUFQuant:
    """The quant named `wanted` (case-insensitive; 'Q4_K_XL' also finds 'UD-Q4_K_XL' when it is the only one), or
    QuantChoiceError listing what the repo has and how to pick one."""
    listed = tuple((q.name, q.size) for q in quants)
    offer = ", ".join(f"{q.name} {_fmt(q.size)}" for q in quants[:12]) + (", ..." if len(quants) > 12 else "")
    example = next((q.name for q in quants if q.name.endswith("Q4_K_M")), quants[0].name if quants else "Q4_K_M")
    if not quants:
        raise QuantChoiceError(f"{repo_id} has no GGUF model files; pull it without a quant for its safetensors",
                               repo_id=repo_id)
    if wanted is None:
        raise QuantChoiceError(f"{repo_id} offers {len(quants)} GGUF quants ({offer}): pick one with moechat pull "
                               f"{repo_id}:{example} (or --quant {example})", repo_id=repo_id, quants=listed)
    key = wanted.upper()
    found = [q for q in quants if q.name == key] or [q for q in quants if q.name.endswith("-" + key)]
    if len(found) > 1:
        names = ", ".join(q.first for q in found[:4])
        raise QuantChoiceError(f"{repo_id}: {len(found)} file sets are named {wanted} ({names}); this pull cannot "
                               "tell which you mean: download the one you want with another tool, or ask the repo's "
                               "owner", repo_id=repo_id, quants=listed)
    if not found:
        raise QuantChoiceError(f"{repo_id} has no {wanted} quant; it offers {offer}: pick one with moechat pull "
                               f"{repo_id}:{example}", repo_id=repo_id, quants=listed)
    quant = found[0]
    if not quant.complete:
        raise QuantChoiceError(f"{repo_id}: {quant.name} is split into {quant.expected_parts} parts but the repo "
                               f"lists {len(quant.files)}; pick another quant ({offer})", repo_id=repo_id,
                               quants=listed)
    return quant


def split_quant(repo: str) -> tuple[str, str | None]:
    """'org/name:Q4_K_M' -> ('org/name', 'Q4_K_M'); a repo id without ':' -> (repo, None)."""
    repo_id, sep, quant = str(repo).partition(":")
    return (repo_id, quant or None) if sep else (repo_id, None)


def _fmt(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


# -- what is on the Hub ------------------------------------------------------------------------------------

def unsafe_file_name(path: object) -> str | None:
    """Why a file name from the Hub cannot be a cache path (None when it can): one plain top-level name."""
    if not isinstance(path, str) or not path:
        return "not a non-empty string"
    if path in (".", "..") or any(c in path for c in "/\\\0") or ":" in path:
        return "holds a path separator, a drive or '.'/'..'"
    if any(ord(c) < 32 for c in path):
        return "holds a control character"
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid Unicode (a lone surrogate)"
    if len(encoded) > MAX_PATH_BYTES:
        return f"is {len(encoded)} bytes long, more than a path may be ({MAX_PATH_BYTES})"
    if any(len(part) > MAX_NAME_BYTES for part in encoded.split(b"/")):
        return f"is {len(encoded)} bytes long, more than a file name may be ({MAX_NAME_BYTES})"
    return None


def safe_revision(revision: str) -> str:
    """A branch, tag or commit the user named, checked before it names a file under refs/ (refs/pr/1 is fine)."""
    parts = revision.split("/")
    if (not revision or revision.startswith("/") or any(p in ("", ".", "..") for p in parts)
            or any(c in revision for c in "\\\0") or any(ord(c) < 32 for c in revision)):
        raise HubError(f"revision {revision!r} is not a branch, tag or commit name: no '..', empty parts or "
                       "separators other than '/'")
    return revision


@dataclass(frozen=True)
class RepoFile:
    """A file of the listing. Built only from names that passed the checks, so `etag` is safe in a path."""

    path: str
    size: int
    sha256: str | None  # LFS files: the content's sha256 (also the blob's name in the cache)
    blob_id: str | None  # git blob sha1 (the blob's name for non-LFS files)

    def __post_init__(self):
        gguf_file = isinstance(self.path, str) and (is_gguf_path(self.path) or is_imatrix_path(self.path))
        why = unsafe_repo_path(self.path) if gguf_file else unsafe_file_name(self.path)
        if why is not None:
            raise ValueError(f"file name {self.path!r} {why}")
        if self.sha256 is not None and not (isinstance(self.sha256, str) and _SHA256.match(self.sha256)):
            raise ValueError(f"{self.path}: lfs.sha256 {str(self.sha256)[:80]!r} is not 64 lowercase hex digits")
        if self.blob_id is not None and not (isinstance(self.blob_id, str) and _SHA1.match(self.blob_id)):
            raise ValueError(f"{self.path}: blobId {str(self.blob_id)[:80]!r} is not 40 lowercase hex digits")
        if self.sha256 is None and self.blob_id is None:
            raise ValueError(f"{self.path}: neither a sha256 nor a blob id")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 0:
            raise ValueError(f"{self.path}: size {self.size!r} is not a byte count")

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob_id or ""


@dataclass(frozen=True)
class RepoListing:
    """A repo at one commit: the files moechat takes and the ones it leaves (pickle weights, READMEs, ...)."""

    repo_id: str
    sha: str
    files: tuple[RepoFile, ...]
    skipped: tuple[str, ...]
    gated: bool
    model_type: str | None

    @property
    def weight_files(self) -> tuple[RepoFile, ...]:
        return tuple(f for f in self.files if _is_weight(f.path))

    @property
    def download_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, path: str) -> RepoFile | None:
        return next((f for f in self.files if f.path == path), None)


# -- progress, plans and verdicts: immutable values for the CLI and the wizard --------------------------------

@dataclass(frozen=True)
class FilePlan:
    path: str
    size: int
    action: str  # "cached" (verified blob present) | "resume" (partial kept) | "download"
    kept_bytes: int = 0
    note: str | None = None


@dataclass(frozen=True)
class DownloadPlan:
    """What a pull will do, said before it starts: cached files, partial files resumed, bytes to fetch."""

    repo_id: str
    sha: str
    files: tuple[FilePlan, ...]
    skipped: tuple[str, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def cached_bytes(self) -> int:
        return sum(f.size for f in self.files if f.action == "cached")

    @property
    def kept_bytes(self) -> int:
        return sum(f.kept_bytes for f in self.files if f.action == "resume")

    @property
    def to_download_bytes(self) -> int:
        return self.total_bytes - self.cached_bytes - self.kept_bytes

    def describe(self) -> list[str]:
        """The honest account: what is reused, what resumes where, what starts over and why."""
        def files(n: int) -> str:
            return f"{n} file" + ("" if n == 1 else "s")

        lines = [f"{self.repo_id} at {self.sha[:12]}: {files(len(self.files))}, {_fmt(self.total_bytes)}"
                 + (f" ({files(len(self.skipped))} not needed: {', '.join(self.skipped[:4])}"
                    + (", ..." if len(self.skipped) > 4 else "") + ")" if self.skipped else "")]
        cached = [f for f in self.files if f.action == "cached"]
        if cached:
            lines.append(f"already in the cache: {files(len(cached))}, {_fmt(self.cached_bytes)}")
        for f in self.files:
            if f.action == "resume":
                lines.append(f"resuming {f.path} at {_fmt(f.kept_bytes)} of {_fmt(f.size)} "
                             f"({_fmt(f.size - f.kept_bytes)} left)")
            elif f.note:
                lines.append(f"{f.path}: {f.note}")
        lines.append(f"to download: {_fmt(self.to_download_bytes)}")
        return lines

    def to_json(self) -> dict:
        return {"repo_id": self.repo_id, "revision": self.sha, "total_bytes": self.total_bytes,
                "cached_bytes": self.cached_bytes, "kept_bytes": self.kept_bytes,
                "to_download_bytes": self.to_download_bytes, "skipped": list(self.skipped),
                "files": [{"path": f.path, "size": f.size, "action": f.action, "kept_bytes": f.kept_bytes,
                           "note": f.note} for f in self.files]}


@dataclass(frozen=True)
class DownloadProgress:
    """One report to the caller's progress sink. `note` carries one-off events (resume, retry, restart)."""

    repo_id: str
    sha: str
    stage: str  # "plan" | "download" | "verify" | "done"
    file: str | None
    file_done: int
    file_total: int
    done: int  # bytes of all needed files present and verified, plus the current file's bytes so far
    total: int
    files_done: int
    files_total: int
    bytes_per_s: float = 0.0  # over this session's transfer (kept and cached bytes not counted)
    note: str | None = None
    plan: DownloadPlan | None = None  # on the first report

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 1.0


ProgressSink = Callable[[DownloadProgress], None]


@dataclass(frozen=True)
class FitVerdict:
    """Will this repo run here, how fast, and how much to download: `plan` is the engine's MemoryPlan."""

    repo_id: str
    sha: str | None
    spec: object  # plan.ModelSpec
    plan: object  # plan.MemoryPlan
    hardware: object  # hardware.Hardware
    supported: bool
    why_unsupported: str | None
    download_bytes: int
    cached_bytes: int
    source: str  # "local snapshot" | "Hub safetensors headers" | "Hub config.json (estimate)"
    formats: object | None = None  # format_plan.FormatAdvice: every expert format planned, the one to run

    @property
    def expert_format(self) -> str:
        """The --expert-format to run it with: the recommended one ("native" when none fits)."""
        return getattr(self.formats, "recommended", None) or "native"

    @property
    def best_plan(self):
        """The plan in the recommended expert format (the native `plan` when none is recommended)."""
        return self.formats.best.plan if self.formats is not None else self.plan

    @property
    def fits(self) -> bool:
        return bool(self.best_plan.ok)

    @property
    def verdict(self) -> str:
        if not self.supported:
            return "unsupported"
        return "fits" if self.fits else "does not fit"

    @property
    def decode_tok_s(self) -> tuple[float, float] | None:
        d = self.best_plan.decode
        return None if d is None else (d.low, d.high)

    def summary(self) -> str:
        parts = []
        if not self.supported:
            parts.append(f"not supported yet ({self.why_unsupported})")
        plan = self.best_plan
        if plan.ok:
            from . import rate_range

            d = plan.decode
            how = "" if self.expert_format == "native" else f" with --expert-format {self.expert_format}"
            parts.append(f"fits{how}" + (f", {rate_range(d.low, d.high)} tok/s predicted" if d is not None else ""))
        else:
            parts.append(f"does not fit: {plan.refusal.message}")
        left = self.download_bytes - self.cached_bytes
        parts.append(f"{_fmt(left)} to download" if left > 0 else "downloaded")
        return "; ".join(parts)

    def to_json(self) -> dict:
        return {"repo_id": self.repo_id, "revision": self.sha, "verdict": self.verdict, "fits": self.fits,
                "supported": self.supported, "why_unsupported": self.why_unsupported,
                "download_bytes": self.download_bytes, "cached_bytes": self.cached_bytes, "source": self.source,
                "decode_tok_s": self.decode_tok_s, "plan": self.plan.to_json(), "spec": self.spec.to_json(),
                "expert_format": self.expert_format,
                "formats": None if self.formats is None else self.formats.to_json()}


@dataclass(frozen=True)
class CatalogStatus:
    """A catalog entry with what the Hub says now and its verdict on this machine (None when unknown)."""

    entry: CatalogEntry
    sha: str | None = None
    gated: bool | None = None
    download_bytes: int | None = None
    downloaded: bool = False  # a complete snapshot is in the local cache
    verdict: FitVerdict | None = None
    error: str | None = None  # why the live part is missing (offline, gated, network...)


@dataclass(frozen=True)
class SearchHit:
    repo_id: str
    model_type: str | None
    supported: bool
    why_unsupported: str | None
    downloads: int | None = None
    likes: int | None = None
    gated: bool | None = None
    params: int | None = None  # from the Hub's safetensors summary
    in_catalog: bool = False


# -- the cache layout -----------------------------------------------------------------------------------------

def _repo_folder(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def snapshot_problems(path: Path) -> list[str]:
    """Why a snapshot folder is not a complete model ([] when it is).

    Complete: config.json, and every shard the index names (else at least one *.safetensors), each link
    resolving to a blob. moechat links weights last, after everything is verified, so a crash leaves this
    list non-empty; snapshots made by other tools are judged by the same rule.
    """
    if not path.is_dir():
        return ["no snapshot folder"]
    if not (path / "config.json").exists() and not any(path.glob("*.safetensors")):
        ggufs = _gguf_in_snapshot(path)
        if ggufs is not None:
            return ggufs
    problems = []
    if not (path / "config.json").is_file():
        problems.append("config.json missing")
    index = path / INDEX_FILE
    if index.is_file():
        try:
            shards = sorted({v for v in json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return problems + [f"{INDEX_FILE} unreadable"]
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            problems.append(f"{len(missing)} of {len(shards)} weight shards missing")
    elif not any(p.is_file() for p in path.glob("*.safetensors")):
        problems.append("no *.safetensors weights")
    dangling = [p.name for p in path.iterdir() if p.is_symlink() and not p.exists()]
    if dangling:
        problems.append(f"{len(dangling)} links to missing blobs")
    return problems


def _gguf_in_snapshot(path: Path) -> list[str] | None:
    """A GGUF snapshot's problems ([] when every split set in it has all its parts); None when it holds no GGUF."""
    found = [p for depth in range(MAX_GGUF_DEPTH + 1) for p in path.glob("/".join(["*"] * (depth + 1)))
             if p.name.endswith(".gguf") and (p.is_symlink() or p.is_file())]
    if not found:
        return None
    problems = []
    dangling = [p.name for p in found if not p.exists()]
    if dangling:
        problems.append(f"{len(dangling)} links to missing blobs")
    sets: dict[str, tuple[int, set[int]]] = {}
    for p in found:
        stem, index, count = _split_parts(p.relative_to(path).as_posix())
        sets.setdefault(stem, (count, set()))[1].add(index)
    for stem, (count, have) in sorted(sets.items()):
        if len(have) < count:
            problems.append(f"{stem.rsplit('/', 1)[-1]}: {count - len(have)} of {count} parts missing")
    return problems


# -- the Hub client -----------------------------------------------------------------------------------------

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
                                 truncate=True, deadline_s=hubhttp.METADATA_DEADLINE_S + f.size / MIN_RATE_BPS).content
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
        from . import spec_from_config, spec_from_headers

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

    def fit(self, repo_id: str, hardware=None, prefs=None, *, revision: str | None = None, exact: bool = True,
            listing: RepoListing | None = None) -> FitVerdict:
        """Verdict, predicted speed and download size for this machine (or `hardware`), before any weight byte.

        A complete local snapshot is planned from its own files; else config.json and the safetensors headers
        come from the Hub (`exact=False`: config.json alone, faster for long lists).
        """
        from .format_plan import plan_formats
        from .hardware import probe
        from . import Preferences, read_model_spec

        local = self.local_snapshot(repo_id, revision) if listing is None else None
        if local is not None:
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
        from .hardware import probe

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
        from .catalog import find

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

    def _what_to_pull(self, listing: RepoListing, quant: str | None) -> RepoListing:
        """The listing cut to what this pull fetches: the named quant's files (and the repo's imatrix) for a GGUF
        pull; the safetensors checkpoint otherwise, or QuantChoiceError when the repo has only GGUF files."""
        gguf_side = [f for f in listing.files if is_gguf_path(f.path) or is_imatrix_path(f.path)]
        plain = [f for f in listing.files if f not in gguf_side]
        repo_id = listing.repo_id
        if quant is None and (any(_is_weight(f.path) for f in plain) or not gguf_side):
            if not any(_is_weight(f.path) for f in plain):
                raise UnsupportedModelError(f"{repo_id} has no safetensors weights (only "
                                            f"{', '.join(listing.skipped[:6]) or 'no files'}); moechat runs "
                                            "safetensors checkpoints and GGUF files")
            return replace(listing, files=tuple(plain),
                           skipped=listing.skipped + tuple(f.path for f in gguf_side))
        chosen = choose_quant(repo_id, gguf_quants(listing.files), quant)
        # the imatrix beside the quants seeds the expert cache (--warm-start); one file, shipped once per repo
        imatrix = sorted((f for f in gguf_side if is_imatrix_path(f.path)), key=lambda f: (f.path.count("/"), f.path))
        keep = chosen.files + tuple(imatrix[:1])
        return replace(listing, files=keep, skipped=listing.skipped + tuple(
            f.path for f in listing.files if f not in keep))

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
            listing = self._what_to_pull(listing, quant)
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


def _blob_ok(path: Path, size: int) -> bool:
    """A blob in the cache: placed atomically after a complete download (ours verify the checksum, huggingface_hub's
    the size), so its size is the check that stays cheap on a 60 GB model."""
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def _partial_size(blobs: Path, f: RepoFile) -> tuple[int, str | None]:
    """Bytes kept from an interrupted download of this file, and what happens to anything unusable."""
    ours = blobs / f"{f.etag}.incomplete"
    theirs = sorted(blobs.glob(f"{f.etag}.*.incomplete")) if blobs.is_dir() else []
    size = ours.stat().st_size if ours.is_file() else 0
    if size > f.size:
        return 0, f"a partial file larger than the file ({size} B) is discarded: downloaded from the start"
    if size:
        return size, None
    if theirs:
        best = max(theirs, key=lambda p: p.stat().st_size)
        kept = best.stat().st_size
        if 0 < kept <= f.size:
            return kept, "resumed from huggingface_hub's interrupted download (it would start over)"
    return 0, None


def _link(blob: Path, pointer: Path) -> None:
    """snapshots/<sha>/<file> -> ../../blobs/<etag>, as huggingface_hub lays it out (a copy where links fail)."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    target = os.path.relpath(blob, pointer.parent)
    if pointer.is_symlink() and os.readlink(pointer) == target:
        return
    tmp = pointer.with_name(f".{pointer.name}.moechat-tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        os.symlink(target, tmp)
    except OSError:
        shutil.copyfile(blob, tmp)
    os.replace(tmp, pointer)


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
