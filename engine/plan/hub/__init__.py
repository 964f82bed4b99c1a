"""The Hugging Face Hub: the catalog's live state, search, a fit verdict before download, and downloads that
survive the real world.

Every request goes through one bounded HTTP layer, engine/plan/hubhttp.py, over huggingface_hub's HTTP session and
read with its error types: each metadata answer has a deadline, a decompressed-size cap and a shape check, a tree
listing a page cap. Files land in the standard cache (`$HF_HOME/hub`: `models--org--name/{blobs,snapshots/<commit>,
refs}`), so other tools see what moechat pulled and the other way round.

The package, by seam (each module imports only those above it):

* `names.py`: what is on the Hub, as checked values: repo ids, file names and revisions (hostile until checked),
  the files a pull takes (`wanted_file`), `RepoFile` and `RepoListing`.
* `gguf.py`: a GGUF repo's quants: `gguf_quants` groups a listing into quants and split sets, `choose_quant` picks
  one (or lists them in QuantChoiceError), `what_to_pull` cuts a listing to what one pull fetches.
* `reports.py`: the immutable values the CLI and the wizard show: `DownloadPlan`, `DownloadProgress`,
  `FitVerdict`, `CatalogStatus`, `SearchHit`.
* `snapshot.py`: the cache's layout: `snapshot_problems` (is a snapshot complete?), blobs, partial files, links.
* `transfer.py`: the download loop: resume with Range, retry with back-off, drop a trickling connection, a
  per-file deadline, sha256 as the bytes arrive, cancel between chunks. Its knobs (`RETRIES`, `RETRY_DELAY_S`,
  `MIN_RATE_BPS`, `STALL_WINDOW_S`, `FILE_DEADLINE_S`) are read there, so a test patches them there.
* `client.py`: `Hub`, the client: local snapshots, listings, config and safetensors headers, `fit`, `catalog`,
  `search`, `download`; and the module-level shortcuts with the environment's defaults.

Re-exported here: every name callers took from the single module this package replaces, except its units and
tuning knobs (transfer's above; client's DEFAULT_ENDPOINT, MAX_JSON_BYTES, DISK_MARGIN_*): read or patch them in
the part that holds them, since patching a copy here would change nothing.
"""

from __future__ import annotations

from ...paths import default_cache_dir  # the Hub's cache, also hub.default_cache_dir
from .client import Hub, catalog, download, fit, resolve, search
from .gguf import GGUFQuant, LocalFile, choose_quant, gguf_quants, split_quant
from .names import (
    INDEX_FILE,
    MAX_GGUF_DEPTH,
    TOKENIZER_FILES,
    TOKENIZER_SUFFIXES,
    RepoFile,
    RepoListing,
    is_gguf_path,
    is_imatrix_path,
    is_offline,
    looks_like_repo_id,
    safe_revision,
    unsafe_file_name,
    unsafe_repo_path,
    wanted_file,
)
from .reports import CatalogStatus, DownloadPlan, DownloadProgress, FilePlan, FitVerdict, ProgressSink, SearchHit
from .snapshot import snapshot_problems

__all__ = [
    "INDEX_FILE",
    "MAX_GGUF_DEPTH",
    "TOKENIZER_FILES",
    "TOKENIZER_SUFFIXES",
    "CatalogStatus",
    "DownloadPlan",
    "DownloadProgress",
    "FilePlan",
    "FitVerdict",
    "GGUFQuant",
    "Hub",
    "LocalFile",
    "ProgressSink",
    "RepoFile",
    "RepoListing",
    "SearchHit",
    "catalog",
    "choose_quant",
    "default_cache_dir",
    "download",
    "fit",
    "gguf_quants",
    "is_gguf_path",
    "is_imatrix_path",
    "is_offline",
    "looks_like_repo_id",
    "resolve",
    "safe_revision",
    "search",
    "snapshot_problems",
    "split_quant",
    "unsafe_file_name",
    "unsafe_repo_path",
    "wanted_file",
]
