"""What is on the Hub, as checked values: repo ids, file names and revisions, the files a pull takes, and the
listing of a repo at one commit (`RepoFile`, `RepoListing`).

Every name that comes from a server is hostile until checked: a file name, blob id, sha256 or commit id
becomes part of a path only after it matched its exact form (`RepoFile` cannot be built otherwise), and an
ETag is only ever compared, never used as a path. `hf_hub_download` is not used at all: it names the blob
after the server's ETag header, so a malicious endpoint could write outside the cache through it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ...errors import HubError
from ...units import GiB, MiB
from ..hubhttp import MAX_NAME_BYTES, MAX_PATH_BYTES

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SHA1 = _COMMIT  # a git blob id
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


MAX_GGUF_DEPTH = 4  # folders deep a GGUF file may sit in a repo (unsloth: UD-Q4_K_XL/<name>-00001-of-00003.gguf)


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


def _fmt(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


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
