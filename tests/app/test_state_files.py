"""The files moechat writes survive a full disk, a read-only place, a lock and a kill -9: an error line or a
notice, the previous good file whole, no temporary files left; damaged ones never stop the app (issue 19)."""

from __future__ import annotations

import errno
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest

from moechat.app.tui.settings import Settings
from moechat.app.tui.store import ChatStore, export_file
from moechat.engine.cache.prefetch import load_profile, save_profile
from moechat.engine.io.files import atomic_write


def _names(folder):
    return sorted(p.name for p in folder.iterdir())


# -- settings.toml -----------------------------------------------------------------------------------------

GOOD = '[models]\nrecent = ["/m/a", "/m/b"]\n\n[chat]\nsystem_prompt = "Be brief."\n'


@pytest.mark.parametrize("text, problem, kept", [
    (GOOD + "\n[ui]\nshow_dashboard = 1\n", "ui.show_dashboard = 1 is not allowed: true or false", True),
    ('models = 5\n[chat]\nsystem_prompt = "Be brief."\n', "models must be a table", True),
    (GOOD.replace("system_prompt", "sytem_prompt"), "unknown setting chat.sytem_prompt (a typo?)", True),
    (GOOD + "[sampling]\ntemperature = nan\n", "sampling.temperature = nan is not allowed", True),
    (GOOD + "[chat\n", "cannot read the settings", False),
])
def test_a_bad_settings_file_is_set_aside_never_overwritten(tmp_path, text, problem, kept):
    path = tmp_path / "settings.toml"
    path.write_text(text)
    s = Settings.load(path)
    assert problem in s.problem and "the file was kept as settings.toml.bad-" in s.problem
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("settings.toml.bad-")]
    assert len(aside) == 1 and aside[0].read_text() == text and not path.exists()
    if kept:  # what was valid is used: the user's system prompt survives a typo elsewhere
        assert s.system_prompt == "Be brief." or "sytem" in text
    assert s.save() is None and Settings.load(path).problem is None  # a clean file from here on
    assert aside[0].read_text() == text


def test_a_bad_settings_file_that_cannot_be_moved_is_not_overwritten(tmp_path, monkeypatch):
    path = tmp_path / "settings.toml"
    path.write_text("models = 5\n")

    def refuse(*a):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "rename", refuse)
    s = Settings.load(path)
    assert "could not be set aside (Read-only file system) and is not overwritten" in s.problem
    assert "not saving the settings" in s.save() and path.read_text() == "models = 5\n"


def test_settings_that_are_a_fifo_do_not_block(tmp_path):
    path = tmp_path / "settings.toml"
    os.mkfifo(path)
    s = Settings.load(path)
    assert "FIFO" in s.problem


@pytest.fixture
def full_disk(monkeypatch):
    """full_disk(): from then on, writes through engine/io/files.py fail after 3 bytes with ENOSPC."""
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(bytes(data)[:3])
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    return lambda: monkeypatch.setattr(os, "fdopen", lambda fd, mode="r", *a, **k: Full(real_fdopen(fd, mode)))


def test_settings_save_on_a_full_disk_keeps_the_old_file(tmp_path, full_disk, monkeypatch):
    path = tmp_path / "settings.toml"
    Settings(path=path, system_prompt="old").save()
    full_disk()
    assert "No space left on device" in Settings(path=path, system_prompt="new").save()
    monkeypatch.undo()
    assert Settings.load(path).system_prompt == "old" and _names(tmp_path) == ["settings.toml"]


# -- routing profiles ---------------------------------------------------------------------------------------

def test_a_profile_nested_200k_deep_is_ignored_and_replaced(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"counts": ' + "[" * 200_000 + "]" * 200_000 + "}")
    assert load_profile(path, 2, 3) is None
    save_profile(path, np.ones((2, 3)))
    assert load_profile(path, 2, 3).tolist() == [[1.0] * 3] * 2 and _names(tmp_path) == ["p.json"]


def test_a_profile_that_cannot_be_written_leaks_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    save_profile(path, np.ones((2, 3)))

    def refuse(src, dst):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError):
        save_profile(path, np.full((2, 3), 5.0))
    monkeypatch.undo()
    assert _names(tmp_path) == ["p.json"] and load_profile(path, 2, 3).tolist() == [[1.0] * 3] * 2
    os.mkfifo(tmp_path / "fifo.json")
    assert load_profile(tmp_path / "fifo.json", 2, 3) is None  # not a hang


def test_engine_saving_a_profile_in_a_read_only_place_is_quiet(tiny_models, tmp_path, monkeypatch):
    from moechat.engine.cache.provider import CacheConfig
    from moechat.engine.runtime.generate import Engine

    engine = Engine.load(tiny_models["qwen3_moe"][0], cache=CacheConfig(expert_slots=4, warm_start=False))
    list(engine.generate([1, 2, 3], max_tokens=2))
    engine.profile_path = tmp_path / "ro" / "sub" / "p.json"
    (tmp_path / "ro").mkdir()
    monkeypatch.setattr("tempfile.mkstemp", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EROFS, "ro")))
    assert engine.save_routing_profile() is None  # best effort: the run does not fail for it
    assert _names(tmp_path / "ro") == ["sub"] and _names(tmp_path / "ro" / "sub") == []


# -- kill -9 in the middle of a write ------------------------------------------------------------------------

def test_kill_9_mid_write_leaves_the_old_or_the_new_file_whole(tmp_path):
    path = tmp_path / "state.json"
    atomic_write(path, json.dumps({"v": "A" * 2_000_000}))
    child = subprocess.Popen([sys.executable, "-c", (
        "import json, sys\n"
        "from moechat.engine.io.files import atomic_write\n"
        "i = 0\n"
        "while True:\n"
        "    atomic_write(sys.argv[1], json.dumps({'v': 'AB'[i % 2] * 2_000_000}))\n"
        "    i += 1\n"), str(path)])
    try:
        time.sleep(1.5)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    value = json.loads(path.read_text())["v"]
    assert value in ("A" * 2_000_000, "B" * 2_000_000)
    atomic_write(path, "{}")  # the next write sweeps what the killed writer left
    assert _names(tmp_path) == ["state.json"]


# -- the chat database ---------------------------------------------------------------------------------------

def _chat(store):
    cid = store.new_conversation("m")
    store.add_message(cid, "user", "first question")
    return cid


def test_a_locked_database_moves_the_session_to_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(ChatStore, "BUSY_TIMEOUT_S", 0.2)
    path = tmp_path / "chats.sqlite3"
    store = ChatStore(path)
    told = []
    store.on_problem = told.append
    cid = _chat(store)
    other = sqlite3.connect(path)
    other.execute("BEGIN EXCLUSIVE")  # another program holds the write lock
    reply = store.add_message(cid, "assistant", "", "streaming")  # waits 0.2 s, then goes on in memory
    store.append(reply, "the answer")
    store.finish(reply, "done")
    assert len(told) == 1 and "locked by another program for 0.2 s" in told[0] and "memory only" in told[0]
    conv = store.load(cid)
    assert [m.content for m in conv.messages] == ["first question", "the answer"]  # nothing the user saw is lost
    t0 = time.monotonic()
    store.append(reply, " more")
    assert time.monotonic() - t0 < 0.1  # no more waiting on the lock
    other.rollback()
    other.close()
    store.close()


def test_a_full_disk_for_the_database(tmp_path):
    path = tmp_path / "chats.sqlite3"
    store = ChatStore(path)
    cid = _chat(store)
    store.db.execute("PRAGMA max_page_count = 1")  # the file cannot grow: SQLITE_FULL, like a full disk
    mid = store.add_message(cid, "user", "x" * 100_000)
    assert "full" in store.problem and store.load(cid).messages[-1].id == mid
    exported = export_file(store, cid, tmp_path / "out")
    assert "x" * 1000 in exported.read_text()


def test_a_read_only_database(tmp_path):
    path = tmp_path / "chats.sqlite3"
    store = ChatStore(path)
    cid = _chat(store)
    store.db.close()
    store.db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    store.db.row_factory = sqlite3.Row
    store.add_message(cid, "assistant", "kept")
    assert "readonly" in store.problem
    assert [m.content for m in store.load(cid).messages] == ["first question", "kept"]


def test_an_export_that_fails_leaves_no_partial_file(tmp_path, full_disk, monkeypatch):
    store = ChatStore(":memory:")
    cid = _chat(store)
    full_disk()
    with pytest.raises(OSError, match="No space"):
        export_file(store, cid, tmp_path)
    monkeypatch.undo()
    assert _names(tmp_path) == []


def test_the_app_is_told_when_chats_stop_being_saved():
    from moechat.app.tui.app import make_app

    store = ChatStore(":memory:")
    app = make_app(None, store=store, memory_probe=lambda: None)
    assert callable(store.on_problem) and app.store is store


# -- --record-trace PATH: never clobbers what is not a regular file, writes through a link (issue 25) ---------

def test_record_trace_onto_a_device_is_refused_before_the_run(tiny_models, capsys, monkeypatch):
    from moechat.app.cli.main import main
    from moechat.engine.runtime.generate import Engine

    monkeypatch.setattr(Engine, "load", classmethod(lambda *a, **k: pytest.fail("the model was loaded")))
    code = main(["run", str(tiny_models["qwen3_moe"][0]), "--prompt-ids", "1", "--record-trace", "/dev/full"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and "/dev/full" in err and "character device" in err
    assert os.path.exists("/dev/full") and not os.path.isfile("/dev/full")


def test_record_trace_through_a_symlink_keeps_the_link(tiny_models, tmp_path, capsys):
    from moechat.app.cli.main import main
    from moechat.engine.cache.trace import RoutingTrace

    target = tmp_path / "traces" / "run.npz"
    target.parent.mkdir()
    target.write_bytes(b"old")
    link = tmp_path / "latest.npz"
    link.symlink_to(target)
    code = main(["run", str(tiny_models["qwen3_moe"][0]), "--prompt-ids", "1,2", "--max-tokens", "2",
                 "--expert-slots", "4", "--record-trace", str(link)])
    assert code == 0, capsys.readouterr().err
    assert link.is_symlink() and len(RoutingTrace.load(target)) > 0
    assert _names(target.parent) == ["run.npz"]
