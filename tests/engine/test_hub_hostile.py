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
import time
from pathlib import Path

import pytest

from moechat.engine.errors import (
    DownloadIntegrityError,
    HubError,
    NetworkError,
    NotDownloadedError,
    UnsafeHubResponseError,
)
from moechat.engine.plan import hub as hubmod
from moechat.engine.plan import hubhttp

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
    from moechat.engine.plan.hardware import probe

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


# -- a hostile or broken Hub API: every answer bounded in pages, time and size, and checked in shape ---------------

def _tree_gets(hub) -> list:
    return [r for r in list(hub.server.requests) if "/tree/" in r.path]


def test_a_tree_listing_ends_at_an_empty_page_whatever_its_link_says(hub):
    f = hub.server.faults
    f.info_without_sizes, f.tree_page, f.tree_endless = True, 4, "empty"  # pages of 4, then empty ones
    path = hub.client.download(hub.repo)
    assert not hubmod.snapshot_problems(path)
    pages = -(-(len(hub.server.repos[hub.repo].files) + 1) // 4)  # the files and a folder
    assert pages >= 3 and len(_tree_gets(hub)) == pages + 1  # and the first empty one, not a thousand


@pytest.mark.parametrize("endless, message", [
    ("junk", r"the Hub's tree listing \(http://127.0.0.1:\d+/api/models/tiny-org/chat-moe/tree/[0-9a-f]{40}\) is not "
             r"usable: it goes on past 6 pages"),
    ("same", r"the Hub's tree listing .* is not usable: page \d+ links back to a page already fetched"),
    ("foreign", r"the Hub's tree listing .* is not usable: page \d+ links its next page to another server "
                r"\(http://127.0.0.1:\d+\), where the token would follow"),
])
def test_a_tree_listing_without_end_is_one_typed_error(hub, monkeypatch, endless, message):
    monkeypatch.setattr(hubhttp, "MAX_PAGES", 6)
    f = hub.server.faults
    f.info_without_sizes, f.tree_page, f.tree_endless = True, 4, endless
    with pytest.raises(UnsafeHubResponseError, match=message + r".*nothing was written: check HF_ENDPOINT"):
        hub.client.download(hub.repo)
    assert len(_tree_gets(hub)) <= 6
    assert not [r for r in hub.server.requests if r.origin == "cdn"]  # the token never went to the other server
    assert hub.client.local_snapshot(hub.repo) is None


def test_a_dripped_model_info_ends_at_the_metadata_deadline(hub, monkeypatch):
    monkeypatch.setattr(hubhttp, "METADATA_DEADLINE_S", 0.6)
    hub.server.faults.drip_s = 0.05  # ~3 kB of model info: 2.5 minutes, each byte well within the read timeout
    start = time.monotonic()
    with pytest.raises(NetworkError, match=r"^tiny-org/chat-moe: the Hub's model info \(http://127.0.0.1:\d+/api/"
                       r"models/tiny-org/chat-moe/revision/main\) took more than 0.6 s \(\d+ B received\): the server "
                       r"or the connection is too slow; try again later"):
        hub.client.download(hub.repo)
    assert time.monotonic() - start < 3.0


def test_a_slow_download_that_moves_is_not_cut_by_the_metadata_deadline(hub, monkeypatch):
    monkeypatch.setattr(hubhttp, "METADATA_DEADLINE_S", 0.5)
    hub.server.faults.slow_s = 0.04  # 16 KiB every 40 ms: each ~250 kB shard takes ~0.6 s
    start = time.monotonic()
    path = hub.client.download(hub.repo)
    assert time.monotonic() - start > 2 * 0.5  # the weights took longer than one metadata deadline, and arrived
    assert (path / SHARD).read_bytes() == hub.server.repos[hub.repo].files[SHARD]


@pytest.mark.parametrize("kind", ["info", "tree", "search"])
def test_a_gzip_bomb_is_cut_off_at_the_cap_in_bounded_memory(hub, monkeypatch, kind):
    import tracemalloc

    monkeypatch.setattr(hubhttp, "MAX_METADATA_BYTES", 2 << 20)
    f = hub.server.faults
    f.gzip_pad[kind] = 48 << 20  # valid JSON padded to 48 MiB: ~50 kB on the wire
    f.info_without_sizes = kind == "tree"
    what = {"info": "model info", "tree": "tree listing", "search": "search"}[kind]
    call = (lambda: hub.client.search("moe")) if kind == "search" else (lambda: hub.client.listing(hub.repo))
    message = rf"the Hub's {what} \(.*\) is not usable: the body is larger than 2097152 B decompressed"
    with pytest.raises(UnsafeHubResponseError, match=message + r" \(a real answer is far smaller\)"):
        call()  # the server compresses its bomb once, here; the second call measures the client alone
    tracemalloc.start()
    try:
        with pytest.raises(UnsafeHubResponseError, match=message):
            call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 << 20, peak  # the cap and a piece, not the 48 MiB (nor 2 GiB)


def test_gzip_answers_under_the_cap_are_read_whole(hub):
    f = hub.server.faults
    f.gzip_pad.update(info=300_000, tree=300_000, search=300_000)  # padded JSON, gzipped: still the answer
    f.info_without_sizes = True
    listing = hub.client.listing(hub.repo)
    assert listing.sha == hub.server.repos[hub.repo].sha and listing.file("config.json") is not None
    assert {h.repo_id for h in hub.client.search("moe")} >= {hub.repo}


_INFO_SHAPES = [
    (b"<html>502 Bad Gateway</html>", r"the answer is not JSON \(JSONDecodeError"),
    (b"[1, 2]", r"the answer is a list, not an object"),
    (b'{"sha": 5, "siblings": []}', r"the answer.sha is 5, not a string"),
    (b'{"sha": "main", "siblings": []}', r"sha 'main' is not a 40-hex commit id"),
    (b'{"sha": "' + b"a" * 40 + b'", "siblings": "config.json"}', r"siblings is a string, not a list"),
    (b'{"sha": "' + b"a" * 40 + b'", "siblings": ["config.json"]}', r"siblings\[0\] is a string, not an object"),
    (b'{"sha": "' + b"a" * 40 + b'", "siblings": [{"rfilename": "config.json", "size": "12"}]}',
     r"siblings\[0\].size is '12', not a byte count"),
    (b'{"sha": "' + b"a" * 40 + b'", "siblings": [{"rfilename": "x.safetensors", "size": 1, "lfs": [1]}]}',
     r"siblings\[0\].lfs is a list, not an object"),
    (b'{"sha": "' + b"a" * 40 + b'", "siblings": [], "config": {"model_type": ["qwen3_moe"]}}',
     r"the answer.config.model_type is a list, not a string"),
    (b"[" * 100_000, r"the answer is not JSON \(RecursionError"),
]


@pytest.mark.parametrize("body, problem", _INFO_SHAPES)
def test_hostile_model_info_shapes_are_one_typed_line(hub, body, problem):
    hub.server.faults.canned["info"] = hub.module.Canned(body=body)
    with pytest.raises(UnsafeHubResponseError, match=r"^tiny-org/chat-moe: the Hub's model info \(http://127.0.0.1:"
                       rf"\d+/api/models/tiny-org/chat-moe/revision/main\) is not usable: {problem}") as e:
        hub.client.download(hub.repo)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind, body, problem", [
    ("tree", b'{"files": []}', r"page 1 is an object, not a list"),
    ("tree", b'[{"type": "file", "size": 3}]', r"page 1\[0\].path is missing"),
    ("tree", b'[{"type": "file", "path": "config.json", "size": 3, "lfs": {"size": 3}}]',
     r"page 1\[0\].lfs.oid is missing"),
    ("search", b'{"models": []}', r"the answer is an object, not a list"),
    ("search", b'[{"id": 7}]', r"result\[0\].id is 7, not a string"),
    ("search", b'[{"id": "a/b", "downloads": "many"}]', r"result\[0\].downloads is 'many', not an integer"),
    ("search", b'[{"id": "a/b", "safetensors": {"total": -1}}]', r"result\[0\].safetensors.total is -1, not a byte"),
])
def test_hostile_tree_and_search_shapes_are_one_typed_line(hub, kind, body, problem):
    hub.server.faults.canned[kind] = hub.module.Canned(body=body)
    hub.server.faults.info_without_sizes = True
    what = {"tree": "tree listing", "search": "search"}[kind]
    with pytest.raises(UnsafeHubResponseError, match=rf"the Hub's {what} \(.*\) is not usable: {problem}"):
        hub.client.search("moe") if kind == "search" else hub.client.listing(hub.repo)


def test_a_hostile_safetensors_header_is_one_typed_line(hub, tmp_path):
    from moechat.engine.plan.hardware import probe

    bad = b'{"w": {"dtype": "F32", "shape": [2, "x"], "data_offsets": [0, 8]}}'
    hub.server.faults.canned["cdn"] = hub.module.Canned(status=206, body=len(bad).to_bytes(8, "little") + bad)
    hardware = probe(tmp_path, nvml=None, cuda=None).with_overrides(vram_gb=0, ram_gb=16, disk_gb=100)
    with pytest.raises(UnsafeHubResponseError, match=r"the Hub's safetensors header of model-0000\d-of-00004."
                       r"safetensors \(.*\) is not usable: tensor 'w'.shape \[2, 'x'\] is not a list of sizes"):
        hub.client.fit(hub.repo, hardware=hardware)


def test_a_file_name_too_long_for_the_file_system_is_refused_up_front(hub, tmp_path):
    victim = _victim(tmp_path)
    hub.server.faults.listing_patch["tokenizer.json"] = {"rfilename": "t" * 300 + ".json"}
    result, log = _record(lambda: hub.client.download(hub.repo))
    assert isinstance(result, UnsafeHubResponseError), result
    assert "is 305 bytes long, more than a file name may be (255)" in str(result)
    assert "nothing was written" in str(result)
    repo = hub.cache / "models--tiny-org--chat-moe"
    assert not [p for ev, p in log if ev != "open-read" and _inside(p, repo)]  # not one blob, link or folder


@pytest.mark.parametrize("name, why", [
    ("é" * 127 + ".json", "is 259 bytes long, more than a file name may be (255)"),  # 132 characters, 259 bytes
    ("\udc80.json", "is not valid Unicode"),
])
def test_names_the_file_system_cannot_take_fail(name, why):
    assert why in hubmod.unsafe_file_name(name)
    assert hubmod.unsafe_file_name("a" * 250 + ".json") is None


def test_a_damaged_ref_is_ignored_and_main_resolved_by_the_snapshot(hub):
    path = hub.client.download(hub.repo)
    ref = hub.cache / "models--tiny-org--chat-moe" / "refs" / "main"
    ref.write_bytes(b"\xff\xfe\x00\x9c not a commit")
    assert hub.client.cached_sha(hub.repo) is None
    assert hub.client.resolve(hub.repo) == path and hub.client.local_snapshot(hub.repo) == path
    hub.client.download(hub.repo)  # online, the pull writes it again
    assert ref.read_text() == hub.server.repos[hub.repo].sha


def test_a_complete_snapshot_without_a_ref_is_usable_and_two_are_told_apart(hub):
    import shutil

    path = hub.client.download(hub.repo)
    (hub.cache / "models--tiny-org--chat-moe" / "refs" / "main").unlink()
    assert hub.client.resolve(hub.repo) == path
    shutil.copytree(path, path.with_name("b" * 40), symlinks=True)  # another complete commit, no ref to choose
    with pytest.raises(NotDownloadedError, match=r"^tiny-org/chat-moe: refs/main is missing or damaged and 2 "
                       r"complete snapshots are cached \(.*\): run moechat pull tiny-org/chat-moe to settle main, or "
                       r"name one with --revision <commit>$"):
        hub.client.resolve(hub.repo)
    assert hub.client.resolve(hub.repo, revision="b" * 40) == path.with_name("b" * 40)
