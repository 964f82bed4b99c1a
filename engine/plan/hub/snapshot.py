"""The standard cache's layout (`$HF_HOME/hub`: `models--org--name/{blobs,snapshots/<commit>,refs}`), shared with
huggingface_hub: when a snapshot is complete, which blobs are in place, what a partial download kept, and the
snapshot's links to the blobs.

A verified blob is renamed into place; the snapshot's links are made only when every file is verified, weights
last, so a snapshot that has all its weight shards is complete (`snapshot_problems`); a GGUF snapshot is complete
when every split set in it has all its parts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from .gguf import _split_parts
from .names import INDEX_FILE, MAX_GGUF_DEPTH, RepoFile


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
