"""A malicious Hub endpoint cannot make moechat touch a file outside the Hugging Face cache.

Every name a server sends (blob ids, sha256, ETags, file names, commit ids) could be a path. The listing
is patched with traversal names, and a process-wide audit hook records every file the download opens for
writing, removes, renames, links or creates, and every file opened at all under the victim directory:
nothing outside the cache may appear, the victim's file must survive byte for byte, and the error must be
typed and say that nothing was written.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from moechat.engine import hub as hubmod
from moechat.engine.errors import DownloadIntegrityError, HubError, UnsafeHubResponseError

SHARD = "model-00001-of-00004.safetensors"

_WATCH = threading.local()
_LOG: list[tuple[str, str]] | None = None
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_FS_EVENTS = {"os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.symlink", "os.link", "os.truncate",
              "os.chmod", "shutil.rmtree", "shutil.copyfile", "shutil.move", "os.utime"}


def _hook(event: str, args) -> None:
    log = _LOG
    if log is None or getattr(_WATCH, "inside", False):
        return
    _WATCH.inside = True
    try:
        if event == "open":
            path, mode, flags = args
            if isinstance(path, (str, bytes, os.PathLike)):
                writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(flags & _WRITE_FLAGS)
                log.append(("open-write" if writes else "open-read", os.fsdecode(path)))
        elif event == "os.symlink":  # (target, link): the link is written, the target is where it points
            target, link = os.fsdecode(args[0]), os.fsdecode(args[1])
            log.append((event, link))
            log.append(("symlink-target", os.path.join(os.path.dirname(link), target)))
        elif event in _FS_EVENTS:
            for a in args[:2]:
                if isinstance(a, (str, bytes, os.PathLike)):
                    log.append((event, os.fsdecode(a)))
    finally:
        _WATCH.inside = False


sys.addaudithook(_hook)  # hooks cannot be removed; it records only while _LOG is set


def _inside(path: str, root: Path) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(root) + os.sep)


def _record(fn):
    global _LOG
    _LOG = []
    try:
        return fn(), _LOG
    except Exception as e:  # noqa: BLE001 - returned to the test, which checks its type
        return e, _LOG
    finally:
        _LOG = None


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("the user's own file")
    return victim


def _assert_contained(log, cache: Path, victim: Path) -> None:
    writes = [(ev, p) for ev, p in log if ev != "open-read"]
    assert writes, "the audit hook saw nothing: the test would pass vacuously"
    ancestors = {os.path.realpath(cache), *map(str, Path(os.path.realpath(cache)).parents)}
    # creating the cache folder itself (and its parents) is the one step that lands outside it
    outside = [(ev, p) for ev, p in writes if not _inside(p, cache)
               and not (ev == "os.mkdir" and os.path.realpath(p) in ancestors)]
    assert outside == [], outside
    touched = [(ev, p) for ev, p in log if _inside(p, victim) or os.path.realpath(p) == os.path.realpath(victim)]
    assert touched == [], touched
    assert sorted(os.listdir(victim)) == ["precious.txt"]
    assert (victim / "precious.txt").read_text() == "the user's own file"


def _escape(cache: Path, victim: Path) -> str:
    """A relative path from the repo's blobs folder to the victim's file."""
    blobs = cache / "models--tiny-org--chat-moe" / "blobs"
    return os.path.relpath(victim / "precious.txt", blobs)


@pytest.mark.parametrize("field", ["blobId", "lfs.sha256", "rfilename-backslash", "rfilename-dotdot", "size"])
def test_traversal_names_in_the_listing_are_refused_before_any_file_is_touched(hub, tmp_path, field):
    victim = _victim(tmp_path)
    repo = hub.server.repos[hub.repo]
    evil = _escape(hub.cache, victim)
    if field == "blobId":
        hub.server.faults.listing_patch["config.json"] = {"blobId": evil}
    elif field == "lfs.sha256":
        entry = repo.entry(SHARD)
        hub.server.faults.listing_patch[SHARD] = {"lfs": {**entry["lfs"], "sha256": evil}, "blobId": evil}
    elif field == "rfilename-backslash":
        hub.server.faults.listing_patch["config.json"] = {"rfilename": "..\\..\\victim\\config.json"}
    elif field == "rfilename-dotdot":
        hub.server.faults.listing_patch["tokenizer.json"] = {"rfilename": "...json"}  # a legal, odd name
        hub.server.faults.listing_patch["config.json"] = {"rfilename": ".."}
    else:
        hub.server.faults.listing_patch["config.json"] = {"size": -5}
    # the blob a traversal would have unlinked as "stale" exists beforehand
    result, log = _record(lambda: hub.client.download(hub.repo))
    if field == "rfilename-dotdot":
        # ".." is not a file moechat wants (skipped, never a path); "...json" is a plain name: the pull
        # goes on and fails only because config.json is gone from the listing
        assert isinstance(result, HubError), result
    else:
        assert isinstance(result, UnsafeHubResponseError), result
        assert "nothing was written" in str(result)
    _assert_contained(log, hub.cache, victim)
    assert hub.client.local_snapshot(hub.repo) is None


def test_traversal_etag_header_is_only_compared(hub, tmp_path):
    victim = _victim(tmp_path)
    evil = _escape(hub.cache, victim)
    hub.server.faults.etag["config.json"] = evil
    hub.server.faults.etag[SHARD] = evil
    result, log = _record(lambda: hub.client.download(hub.repo))
    assert isinstance(result, DownloadIntegrityError) and "nothing was written" in str(result), result
    _assert_contained(log, hub.cache, victim)


def test_fit_reads_config_without_trusting_the_etag(hub, tmp_path):
    # huggingface_hub's hf_hub_download would name the blob after this ETag; moechat's fit does not use it
    from moechat.engine.hardware import probe

    victim = _victim(tmp_path)
    hub.server.faults.etag["config.json"] = _escape(hub.cache, victim)
    hub.server.faults.etag["model.safetensors.index.json"] = _escape(hub.cache, victim)
    hardware = probe(tmp_path, nvml=None, cuda=None).with_overrides(vram_gb=0, ram_gb=16, disk_gb=100)
    result, log = _record(lambda: hub.client.fit(hub.repo, hardware=hardware))
    assert not isinstance(result, Exception), result
    assert result.spec.num_experts > 0
    _assert_contained(log, hub.cache, victim)


def test_a_config_sent_with_other_bytes_is_refused_and_not_cached(hub, tmp_path):
    victim = _victim(tmp_path)
    hub.server.faults.corrupt.add("config.json")
    hardware_result, log = _record(lambda: hub.client.remote_spec(hub.repo))
    assert isinstance(hardware_result, DownloadIntegrityError), hardware_result
    assert not list((hub.cache / "models--tiny-org--chat-moe").rglob("config.json"))
    _assert_contained(log + [("open-write", str(hub.cache / "x"))], hub.cache, victim)


@pytest.mark.parametrize("revision", ["../../../victim", "refs/../../x", "a\\b", "/abs"])
def test_revision_names_cannot_leave_the_refs_folder(hub, revision):
    with pytest.raises(HubError, match="is not a branch, tag or commit name"):
        hub.client.download(hub.repo, revision=revision)
    with pytest.raises(HubError, match="is not a branch, tag or commit name"):
        hub.client.local_snapshot(hub.repo, revision=revision)


@pytest.mark.parametrize("name", ["ok.json", "tokenizer.model"])
def test_plain_names_pass(name):
    assert hubmod.unsafe_file_name(name) is None
    assert hubmod.RepoFile(name, 3, None, "a" * 40).etag == "a" * 40


@pytest.mark.parametrize("name", ["", ".", "..", "a/b.json", "a\\b.json", "c:x.json", "x\0.json", "x\n.json"])
def test_unsafe_names_fail(name):
    assert hubmod.unsafe_file_name(name) is not None
    with pytest.raises(ValueError):
        hubmod.RepoFile(name, 3, None, "a" * 40)
