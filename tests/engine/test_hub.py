"""Downloads from a local Hub (tests/hubserver.py) through the real huggingface_hub: a clean pull the engine
loads, and every way the real world breaks one. After each failure the snapshot is never presented as
complete, and the message says what happened and what to do."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from moechat.engine.errors import (
    DiskSpaceError,
    DownloadBusyError,
    DownloadCancelled,
    DownloadIntegrityError,
    HubAuthError,
    HubOfflineError,
    NetworkError,
    NotDownloadedError,
    RepoGatedError,
    RepoNotFoundError,
)
from moechat.engine.plan import hub as hubmod
from moechat.engine.plan import hubhttp
from moechat.engine.plan.hub import transfer as hubtransfer  # the download loop's knobs are read there

SHARD = "model-00001-of-00004.safetensors"
WEIGHT_TIMEOUT = 30


def _weights(hub_repo_dir: Path) -> list[str]:
    return sorted(p.name for p in hub_repo_dir.glob("*.safetensors"))


def _assert_not_complete(hub, repo=None):
    repo = repo or hub.repo
    assert hub.client.local_snapshot(repo) is None
    with pytest.raises(NotDownloadedError, match=f"moechat pull {repo}"):
        hub.client.resolve(repo)


def _weight_gets(hub, file=SHARD):
    return [r for r in hub.server.file_requests(file, "GET") if r.origin == "cdn"]


def test_clean_download_is_pinned_verified_and_the_engine_generates_from_it(hub, hub_repo_dir):
    from moechat.engine.runtime.generate import Engine

    events = []
    path = hub.client.download(hub.repo, progress=events.append)
    repo = hub.server.repos[hub.repo]
    # the standard cache layout, pinned to the commit: snapshot links into blobs named by ETag
    storage = hub.cache / "models--tiny-org--chat-moe"
    assert path == storage / "snapshots" / repo.sha
    assert (storage / "refs" / "main").read_text() == repo.sha
    for name in _weights(hub_repo_dir) + ["config.json", "tokenizer.json", "chat_template.jinja"]:
        link = path / name
        assert link.is_symlink() and link.resolve().parent == (storage / "blobs").resolve(), name
        assert link.read_bytes() == (hub_repo_dir / name).read_bytes(), name
    assert (path / SHARD).resolve().name == repo.sha256(SHARD)
    # never pickle weights, never the README; the token-less CDN got the weights
    assert not hub.server.file_requests("pytorch_model.bin") and not hub.server.file_requests("README.md")
    assert not (path / "pytorch_model.bin").exists()
    # progress: the plan first, bytes only growing, the end at the total
    plan = events[0].plan
    assert plan is not None and plan.to_download_bytes == plan.total_bytes == events[-1].total
    assert "README.md" in plan.skipped and "pytorch_model.bin" in plan.skipped
    dones = [e.done for e in events]
    assert dones == sorted(dones) and events[-1].stage == "done" and events[-1].done == events[-1].total
    assert hub.client.resolve(hub.repo) == path
    # a second pull finds everything cached and moves no weight byte
    hub.server.requests.clear()
    again = []
    assert hub.client.download(hub.repo, progress=again.append) == path
    assert again[0].plan.to_download_bytes == 0 and not _weight_gets(hub)
    # the engine loads the snapshot and generates exactly what it generates from the original folder
    ids = [5, 17, 42, 7]
    outs = []
    for folder in (path, hub_repo_dir):
        engine = Engine.load(folder)
        chunks = list(engine.generate(ids, sampling=engine.sampling(temperature=0), max_tokens=6))
        outs.append([t for c in chunks for t in c.token_ids])
    assert outs[0] == outs[1] and len(outs[0]) > 0


def test_connection_dropped_mid_file_resumes_with_range(hub):
    hub.server.faults.drop_at[SHARD] = 100_000
    events = []
    path = hub.client.download(hub.repo, progress=events.append)
    gets = _weight_gets(hub)
    assert len(gets) == 2 and gets[0].range is None and gets[1].range == "bytes=100000-" and gets[1].status == 206
    assert any(e.note and "connection dropped during " + SHARD in e.note for e in events)
    assert (path / SHARD).read_bytes() == hub.server.repos[hub.repo].files[SHARD]


def test_network_gone_mid_file_keeps_the_bytes_and_the_next_pull_resumes(hub, monkeypatch):
    monkeypatch.setattr(hubtransfer, "RETRY_DELAY_S", 0.01)
    hub.server.faults.drop_at[SHARD] = 100_000
    hub.server.faults.hang_up_from[SHARD] = 100_000
    with pytest.raises(NetworkError, match=r"^model-00001.*dropped or stalled 5 times in a row.*kept: run "
                       r"moechat pull tiny-org/chat-moe again to resume"):
        hub.client.download(hub.repo)
    _assert_not_complete(hub)
    plan = hub.client.plan_download(hub.repo)
    shard = next(f for f in plan.files if f.path == SHARD)
    assert shard.action == "resume" and shard.kept_bytes == 100_000
    assert any(line.startswith(f"resuming {SHARD} at") for line in plan.describe())
    hub.server.reset()
    path = hub.client.download(hub.repo)
    assert [g.range for g in _weight_gets(hub)] == ["bytes=100000-"]
    assert (path / SHARD).read_bytes() == hub.server.repos[hub.repo].files[SHARD]


def test_a_trickling_server_is_dropped_resumed_and_the_file_bounded_in_time(hub, monkeypatch):
    """A server that sends a few bytes at a time never times out a read; the pull drops it when a window brings
    less than the minimum rate, resumes, gives up after RETRIES such windows with the bytes kept, and the next
    pull resumes from them."""
    monkeypatch.setattr(hubtransfer, "RETRY_DELAY_S", 0.01)
    monkeypatch.setattr(hubtransfer, "STALL_WINDOW_S", 0.3)
    monkeypatch.setattr(hubtransfer, "MIN_RATE_BPS", 1 << 20)  # 1 MiB/s wanted, ~10 KiB/s sent
    hub.server.faults.slow_s, hub.server.faults.piece = 0.05, 512
    events = []
    start = time.monotonic()
    with pytest.raises(NetworkError, match=r"^model-00001.*dropped or stalled 5 times in a row \(the server sent "
                       r".*/s, under 1.0 MiB/s\).*kept: run moechat pull tiny-org/chat-moe again to resume"):
        hub.client.download(hub.repo, progress=events.append)
    assert time.monotonic() - start < WEIGHT_TIMEOUT
    assert 2 <= len(_weight_gets(hub)) <= 5 and any(e.note and "dropping the connection and resuming" in e.note
                                                     for e in events)
    _assert_not_complete(hub)
    kept = next(f for f in hub.client.plan_download(hub.repo).files if f.path == SHARD).kept_bytes
    assert kept > 0
    hub.server.reset()
    path = hub.client.download(hub.repo)
    assert _weight_gets(hub)[0].range == f"bytes={kept}-"
    assert (path / SHARD).read_bytes() == hub.server.repos[hub.repo].files[SHARD]


def test_a_file_has_a_deadline_even_when_each_window_is_fast_enough(hub, monkeypatch):
    monkeypatch.setattr(hubtransfer, "FILE_DEADLINE_S", 0.2)
    monkeypatch.setattr(hubtransfer, "MIN_RATE_BPS", 1 << 30)  # the size term: nothing
    monkeypatch.setattr(hubtransfer, "STALL_WINDOW_S", 1e9)
    hub.server.faults.slow_s = 0.05
    with pytest.raises(NetworkError, match=r"^model-00001.*it is too slow: .* after \d+ s, the most moechat waits "
                       r"for a file this size.*kept: run moechat pull tiny-org/chat-moe again to resume"):
        hub.client.download(hub.repo)
    _assert_not_complete(hub)


def test_a_cdn_redirect_loop_is_one_clear_error(hub):
    hub.server.faults.redirect_loop.add(hub.server.repos[hub.repo].sha256(SHARD) and SHARD)
    with pytest.raises(NetworkError, match=r"^model-00001.*redirected more than 10 times \(a redirect loop at the "
                       r"CDN or a proxy\).*run moechat pull tiny-org/chat-moe again later to resume"):
        hub.client.download(hub.repo)
    assert 1 < len(_weight_gets(hub)) <= 12
    _assert_not_complete(hub)
    hub.server.reset()
    assert (hub.client.download(hub.repo) / SHARD).read_bytes() == hub.server.repos[hub.repo].files[SHARD]


def test_an_api_that_never_answers_times_out(hub, monkeypatch):
    monkeypatch.setattr(hubhttp, "READ_TIMEOUT_S", 0.5)
    hub.server.faults.api_hang_s = 5.0
    start = time.monotonic()
    with pytest.raises(NetworkError, match=r"cannot reach .* for tiny-org/chat-moe \((Read)?Timeout"):
        hub.client.download(hub.repo)
    assert time.monotonic() - start < 4.0
    with pytest.raises(NetworkError):
        hub.client.listing(hub.repo)


_KILLED = """
import sys
from moechat.engine.plan.hub import Hub
Hub(endpoint=sys.argv[1], cache_dir=sys.argv[2]).download(sys.argv[3])
"""


def test_process_killed_mid_download_resumes_after_restart(hub):
    repo = hub.server.repos[hub.repo]
    hub.server.faults.slow_s = 0.05  # 16 KiB pieces: a 250 kB shard takes ~0.8 s
    blobs = hub.cache / "models--tiny-org--chat-moe" / "blobs"
    partial = blobs / f"{repo.sha256(SHARD)}.incomplete"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, hub.server.url, str(hub.cache), hub.repo],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + WEIGHT_TIMEOUT
        while not (partial.exists() and partial.stat().st_size >= 48 * 1024):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < end, "the download never reached the first shard"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    _assert_not_complete(hub)
    kept = partial.stat().st_size
    plan = hub.client.plan_download(hub.repo)
    assert next(f for f in plan.files if f.path == SHARD).kept_bytes == kept
    assert plan.kept_bytes == kept and plan.to_download_bytes == plan.total_bytes - plan.cached_bytes - kept
    hub.server.reset()
    path = hub.client.download(hub.repo)
    assert [g.range for g in _weight_gets(hub)] == [f"bytes={kept}-"]
    assert (path / SHARD).read_bytes() == repo.files[SHARD]
    assert not list(blobs.glob("*.incomplete"))


def test_huggingface_hubs_own_orphaned_temp_file_is_adopted(hub):
    """huggingface_hub 2.x leaves <etag>.<uuid>.incomplete behind when killed and starts over; we resume it."""
    repo = hub.server.repos[hub.repo]
    blobs = hub.cache / "models--tiny-org--chat-moe" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{repo.sha256(SHARD)}.1a2b3c4d.incomplete").write_bytes(repo.files[SHARD][:70_000])
    plan = hub.client.plan_download(hub.repo)
    shard = next(f for f in plan.files if f.path == SHARD)
    assert shard.action == "resume" and shard.kept_bytes == 70_000 and "huggingface_hub" in shard.note
    path = hub.client.download(hub.repo)
    assert [g.range for g in _weight_gets(hub)] == ["bytes=70000-"]
    assert (path / SHARD).read_bytes() == repo.files[SHARD]


def test_server_ignoring_range_restarts_the_file(hub):
    hub.server.faults.drop_at[SHARD] = 100_000
    hub.server.faults.ignore_range = True
    events = []
    path = hub.client.download(hub.repo, progress=events.append)
    gets = _weight_gets(hub)
    assert [(g.range, g.status) for g in gets] == [(None, 200), ("bytes=100000-", 200)]
    assert any(e.note and "ignored the Range request: starting the file over" in e.note for e in events)
    assert (path / SHARD).read_bytes() == hub.server.repos[hub.repo].files[SHARD]


@pytest.mark.parametrize("fault, message", [
    ("corrupt", r"sha256 [0-9a-f]{16}\.\.\. does not match the Hub's [0-9a-f]{16}\.\.\.; the file was discarded"),
    ("longer", r"the server sent more than the \d+ B the Hub lists; the file was discarded"),
    ("shorter", r"received \d+ B but the Hub lists \d+ B; the file was discarded"),
])
def test_size_or_checksum_mismatch_discards_the_file(hub, fault, message):
    f = hub.server.faults
    if fault == "corrupt":
        f.corrupt.add(SHARD)
    else:
        f.size_delta[SHARD] = 1000 if fault == "longer" else -1000
    with pytest.raises(DownloadIntegrityError, match=message):
        hub.client.download(hub.repo)
    _assert_not_complete(hub)
    blobs = hub.cache / "models--tiny-org--chat-moe" / "blobs"
    digest = hub.server.repos[hub.repo].sha256(SHARD)
    assert not (blobs / digest).exists() and not list(blobs.glob(f"{digest}*"))
    hub.server.reset()
    path = hub.client.download(hub.repo)  # nothing bad was kept: a clean pull from byte 0
    assert [g.range for g in _weight_gets(hub)] == [None]
    assert (path / SHARD).read_bytes() == hub.server.repos[hub.repo].files[SHARD]


def test_listing_and_server_disagree_on_size_nothing_is_written(hub):
    # the HEAD (X-Linked-Size) says something else than the listing: refused before the GET
    repo = hub.server.repos[hub.repo]
    listing = hub.client.listing(hub.repo)
    bad = replace(listing, files=tuple(replace(f, size=f.size + 1) if f.path == SHARD else f for f in listing.files))
    transfer = hubtransfer._Transfer(hub.client, hubhttp.Ctx(hub.client, hub.repo), bad,
                                hub.client.plan_download(hub.repo, listing=bad), None, None)
    with pytest.raises(DownloadIntegrityError, match=r"the server says \d+ B, the Hub's listing \d+ B"):
        transfer.fetch(bad.file(SHARD))
    assert not _weight_gets(hub) and repo.sha


def test_disk_too_small_is_refused_before_the_first_byte(hub):
    small = hubmod.Hub(endpoint=hub.server.url, cache_dir=hub.cache, free_space=lambda path: 300 * 2**20)
    with pytest.raises(DiskSpaceError, match=r"tiny-org/chat-moe needs 0.9 MiB more on disk \(\+ 512.0 MiB margin\) "
                       r"and 300.0 MiB is free on .*: free 212.\d MiB, or set HF_HOME to a bigger disk"):
        small.download(hub.repo)
    assert not [r for r in hub.server.requests if r.file is not None]
    _assert_not_complete(hub)


def test_gated_private_missing_and_bad_token_are_told_apart(hub, monkeypatch):
    with pytest.raises(RepoGatedError, match=r"tiny-org/gated-moe is gated \(401\): accept its conditions on the "
                       r"model page, then set HF_TOKEN to a read token of that account: http://127.0.0.1:\d+/tiny-org"):
        hub.client.download(hub.gated)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token_not_approved")
    with pytest.raises(RepoGatedError, match=r"gated \(403\): accept its conditions on the model page with the "
                       "account of your token"):
        hub.client.download(hub.gated)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_valid_token")
    with pytest.raises(HubAuthError, match=r"rejected the token \(401 invalid credentials\): create a new read token "
                       r"at http://127.0.0.1:\d+/settings/tokens and set HF_TOKEN"):
        hub.client.download(hub.repo)
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(RepoNotFoundError, match=r"nobody/nothing: no such model on http://127.0.0.1:\d+ \(404\), or "
                       r"it is private and no token is set \(set HF_TOKEN to a read token\) has no access"):
        hub.client.download("nobody/nothing")
    with pytest.raises(RepoNotFoundError, match="has no revision 'v9' \\(404\\): check the branch, tag or commit"):
        hub.client.download(hub.repo, revision="v9")
    _assert_not_complete(hub, hub.gated)
    # HF_TOKEN of an approved account: the gated repo downloads, and the token never leaves the Hub for the CDN
    monkeypatch.setenv("HF_TOKEN", hub.token)
    hub.server.requests.clear()
    path = hub.client.download(hub.gated)
    assert hub.client.resolve(hub.gated) == path
    hub_reqs = [r for r in hub.server.requests if r.origin == "hub"]
    cdn_reqs = [r for r in hub.server.requests if r.origin == "cdn"]
    assert hub_reqs and all(r.auth for r in hub_reqs) and cdn_reqs and not any(r.auth for r in cdn_reqs)


def test_cancel_stops_within_a_chunk_keeps_the_bytes_and_resumes(hub):
    hub.server.faults.slow_s = 0.02
    cancel = threading.Event()

    def sink(e):
        if e.file == SHARD and e.file_done >= 32 * 1024:
            cancel.set()

    with pytest.raises(DownloadCancelled, match=r"download of tiny-org/chat-moe cancelled during model-00001.*kept in "
                       r"the cache: moechat pull tiny-org/chat-moe resumes it"):
        hub.client.download(hub.repo, progress=sink, cancel=cancel)
    _assert_not_complete(hub)
    kept = hub.client.plan_download(hub.repo).kept_bytes
    assert 32 * 1024 <= kept < len(hub.server.repos[hub.repo].files[SHARD])
    assert not [r for r in hub.server.requests if r.file and r.file.startswith("model-00002")]
    hub.server.reset()
    path = hub.client.download(hub.repo)
    assert [g.range for g in _weight_gets(hub)] == [f"bytes={kept}-"]
    assert not hubmod.snapshot_problems(path)


def test_one_download_per_repo(hub):
    hub.server.faults.slow_s = 0.02
    started, cancel = threading.Event(), threading.Event()
    errors = []

    def first():
        try:
            hub.client.download(hub.repo, progress=lambda e: started.set() if e.file == SHARD else None,
                                cancel=cancel)
        except DownloadCancelled as e:
            errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    try:
        assert started.wait(WEIGHT_TIMEOUT)
        with pytest.raises(DownloadBusyError, match="tiny-org/chat-moe is already being downloaded by another moechat"):
            hub.client.download(hub.repo)
    finally:
        cancel.set()
        t.join(WEIGHT_TIMEOUT)
    assert errors and isinstance(errors[0], DownloadCancelled)
    hub.server.reset()
    hub.client.download(hub.repo)  # the lock was released


def test_offline_uses_the_cache_and_never_the_network(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubOfflineError, match="tiny-org/chat-moe is not downloaded and HF_HUB_OFFLINE is set: unset "
                       "HF_HUB_OFFLINE to download it"):
        hub.client.download(hub.repo)
    assert hub.server.requests == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    path = hub.client.download(hub.repo)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.server.requests.clear()
    assert hub.client.download(hub.repo) == path and hub.client.resolve(hub.repo) == path
    assert hub.server.requests == []


def test_a_partial_snapshot_from_other_tools_is_not_complete(hub, tmp_path):
    # what `fit` (config.json + index, verified and cached) or a crashed download leaves behind
    hub.client.fit(hub.repo, hardware=_hardware(tmp_path))
    snapshot = hub.cache / "models--tiny-org--chat-moe" / "snapshots" / hub.server.repos[hub.repo].sha
    assert (snapshot / "config.json").is_file()
    assert hubmod.snapshot_problems(snapshot) == ["4 of 4 weight shards missing"]
    with pytest.raises(NotDownloadedError, match=r"tiny-org/chat-moe is only partly downloaded \(4 of 4 weight "
                       r"shards missing\): run moechat pull tiny-org/chat-moe to finish it"):
        hub.client.resolve(hub.repo)


def _hardware(tmp_path, vram_gb=0, ram_gb=16):
    from moechat.engine.plan.hardware import probe

    return probe(tmp_path, nvml=None, cuda=None).with_overrides(vram_gb=vram_gb, ram_gb=ram_gb, disk_gb=100)


def test_fit_verdict_from_headers_alone_never_fetches_a_weight_file(hub, hub_repo_dir, tmp_path):
    from moechat.engine.plan import read_model_spec

    verdict = hub.client.fit(hub.repo, hardware=_hardware(tmp_path))
    local = read_model_spec(hub_repo_dir)
    spec = verdict.spec
    assert verdict.source == "Hub safetensors headers" and not spec.estimated and not spec.weights_present
    for attr in ("expert_bytes", "dense_bytes", "num_experts", "top_k", "num_moe_layers", "kv_elems_full"):
        assert getattr(spec, attr) == getattr(local, attr), attr
    repo = hub.server.repos[hub.repo]
    wanted = [f for f in repo.files if hubmod.wanted_file(f)]
    assert verdict.download_bytes == sum(len(repo.files[f]) for f in wanted)
    # config.json and the index were verified into the cache; nothing else
    assert verdict.cached_bytes == len(repo.files["config.json"]) + len(repo.files["model.safetensors.index.json"])
    assert verdict.supported and verdict.fits and verdict.verdict == "fits" and verdict.decode_tok_s is not None
    assert "fits" in verdict.summary() and "to download" in verdict.summary()
    # every expert format planned from the same headers; the verdict is the recommended one's
    assert [o.name for o in verdict.formats.options] == ["native", "int8", "int4"]
    assert verdict.formats.option("native").plan is verdict.plan and verdict.best_plan is verdict.formats.best.plan
    assert verdict.to_json()["expert_format"] == verdict.expert_format == verdict.formats.recommended
    # only ranged reads of the headers (huggingface_hub reads the first 100 kB), never a whole weight file
    weight_reqs = [r for r in hub.server.requests if r.file and r.file.endswith((".safetensors", ".bin"))]
    assert {r.file for r in weight_reqs} == set(_weights(hub_repo_dir))
    for r in weight_reqs:
        assert r.method == "HEAD" or (r.range == "bytes=0-100000" and r.body_bytes <= 100_001), r
    assert sum(r.body_bytes for r in weight_reqs) < sum(len(repo.files[f]) for f in _weights(hub_repo_dir))
    # too little memory: the verdict says so, from the same headers
    tight = hub.client.fit(hub.repo, hardware=_hardware(tmp_path, ram_gb=0.5))
    assert not tight.fits and tight.verdict == "does not fit" and "does not fit" in tight.summary()


def test_catalog_verdicts_and_errors_per_entry(hub, tmp_path):
    from moechat.engine.plan.catalog import CatalogEntry

    entries = [CatalogEntry(hub.repo, "qwen3_moe", 0.0002, 0.0001, "fp32"),
               CatalogEntry(hub.gated, "qwen3_moe", 0.0002, 0.0001, "fp32", gated=True),
               CatalogEntry("nobody/nothing", "phimoe", 80.0, 3.0, "bf16")]
    statuses = hub.client.catalog(_hardware(tmp_path), entries=entries)
    ok, gated, missing = statuses
    assert ok.sha == hub.server.repos[hub.repo].sha and ok.download_bytes > 0 and not ok.downloaded
    assert ok.verdict is not None and ok.verdict.fits and ok.verdict.source == "Hub config.json (estimate)"
    assert ok.error is None and gated.verdict is None and gated.gated and "is gated (401)" in gated.error
    assert missing.verdict is None and "no such model" in missing.error and not missing.entry.supported
    assert not [r for r in hub.server.requests if r.file and r.file.endswith(".safetensors")]
    # offline: no request, only downloaded entries get a verdict
    hub.client.download(hub.repo)
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        hub.server.requests.clear()
        offline = hub.client.catalog(_hardware(tmp_path), entries=entries)
    finally:
        del os.environ["HF_HUB_OFFLINE"]
    assert hub.server.requests == []
    assert offline[0].downloaded and offline[0].verdict.source == "local snapshot" and offline[0].verdict.fits
    assert offline[1].verdict is None and "offline" in offline[1].error


def test_search_keeps_supported_model_types(hub, monkeypatch):
    planned = "other-org/phimoe-tiny"  # a family moechat does not run yet, for this test only
    monkeypatch.setitem(hub.server.repos, planned, hub.module.Repo(
        planned, {"config.json": b'{"model_type": "phimoe"}'}, "e" * 40, model_type="phimoe", downloads=5))
    hits = hub.client.search("moe")
    assert {h.repo_id for h in hits} == {hub.repo, hub.gated, "other-org/mixtral-moe-tiny"}
    assert all(h.supported and h.why_unsupported is None for h in hits)
    assert hits[0].repo_id == hub.repo and hits[0].downloads == 100  # most downloaded first
    everything = {h.repo_id: h for h in hub.client.search("o", supported_only=False)}
    assert "other-org/dense-llama" not in everything  # dense: nothing to offload
    assert everything["other-org/gpt-oss-tiny"].supported  # gpt_oss is registered in engine/models
    assert not everything[planned].supported and "SparseMixer" in everything[planned].why_unsupported


def test_the_catalog_is_consistent_with_the_engine():
    from moechat.engine.models import ARCHITECTURES, PLANNED_MOE
    from moechat.engine.plan.catalog import CATALOG, SUPPORTED_TYPES, find

    assert SUPPORTED_TYPES == set(ARCHITECTURES)
    assert len({e.repo_id for e in CATALOG}) == len(CATALOG)
    assert any(e.supported for e in CATALOG) and any(not e.supported for e in CATALOG)
    for e in CATALOG:
        assert e.total_params_b > e.active_params_b > 0
        if not e.supported:
            assert e.family in PLANNED_MOE and e.why_unsupported and "not implemented" not in e.why_unsupported
    assert find("openai/GPT-OSS-20B").family == "gpt_oss"
    configs = Path(__file__).resolve().parents[3] / "shared" / "model-configs"
    import json

    for e in CATALOG:
        cfg = configs / e.repo_id.replace("/", "--") / "config.json"
        if cfg.is_file():
            assert json.loads(cfg.read_text())["model_type"] == e.family, e.repo_id
    # gpt-oss runs, and its notes' numbers are the planner's for the real configs
    from moechat.engine.plan import gib, read_model_spec

    for repo_id in ("openai/gpt-oss-20b", "openai/gpt-oss-120b"):
        e = find(repo_id)
        assert e.supported and e.why_unsupported is None and "MXFP4 experts" in e.features
        folder = configs / repo_id.replace("/", "--")
        if (folder / "config.json").is_file():
            s = read_model_spec(folder)
            each = f"MXFP4 experts, {gib(s.expert_bytes)} each (bf16 would be {gib(s.bf16_expert_bytes)})"
            total = (f"MXFP4 experts, {s.all_experts_bytes / 2**30:.1f} GiB in all (bf16 would be "
                     f"{s.total_experts * s.bf16_expert_bytes / 2**30:.1f} GiB)")
            assert e.note in (each, total), (e.note, each, total)


def test_listing_the_catalog_does_not_import_torch(tmp_path):
    """SUPPORTED_TYPES is read from engine/models/__init__.py's source, not by importing it (torch)."""
    code = ("import sys\nfrom moechat.engine.plan.catalog import CATALOG, SUPPORTED_TYPES\n"
            "assert 'torch' not in sys.modules, 'torch imported'\nprint(sorted(SUPPORTED_TYPES))")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    from moechat.engine.models import ARCHITECTURES

    assert result.stdout.strip() == str(sorted(ARCHITECTURES))
