"""The chat store: WAL, token batches committed as they come, interrupted replies, Markdown export."""

from __future__ import annotations

import errno
import sqlite3

import pytest

from moechat.app.tui.store import ChatStore, export_file, title_of


def test_wal_and_streamed_reply_survives_without_finish(tmp_path):
    path = tmp_path / "chats.sqlite3"
    store = ChatStore(path)
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    cid = store.new_conversation("/m/x", system="sys")
    store.add_message(cid, "user", "  first line of a long question\nsecond")
    mid = store.add_message(cid, "assistant", "", "streaming")
    for piece in ("Hel", "lo"):
        store.append(mid, piece)
    # A second connection, as after the app was killed: everything appended is there.
    other = sqlite3.connect(path)
    assert other.execute("SELECT content, status FROM messages WHERE id = ?", (mid,)).fetchone() == (
        "Hello", "streaming")
    other.close()
    conv = ChatStore(path).load(cid)
    assert conv.title == "first line of a long question" and conv.system == "sys"
    assert [(m.role, m.content, m.status) for m in conv.messages] == [
        ("user", "  first line of a long question\nsecond", "done"), ("assistant", "Hello", "interrupted")]
    store.finish(mid, "stopped", {"generated_tokens": 2})
    assert store.load(cid).messages[-1].status == "stopped"
    assert store.load(cid).messages[-1].stats == {"generated_tokens": 2}


def test_list_delete_and_export(tmp_path):
    store = ChatStore(":memory:")
    a = store.new_conversation("/m/a")
    store.add_message(a, "user", "# not a heading")
    b = store.new_conversation("/m/b", system="Be brief.")
    store.add_message(b, "user", "Why?")
    mid = store.add_message(b, "assistant", "Because.", "done")
    assert [c.id for c in store.list_conversations()] == [b, a]
    assert store.list_conversations()[0].num_messages == 2
    store.finish(mid, "stopped")
    md = store.export_markdown(b)
    assert md.startswith("# Why?\n") and "## System\n\nBe brief." in md
    assert "## You\n\nWhy?" in md and "## Assistant (stopped)\n\nBecause." in md
    first = export_file(store, b, tmp_path)
    second = export_file(store, b, tmp_path)
    assert first != second and first.read_text() == md and first.name == f"moechat-{b}-why.md"
    store.delete_conversation(a)
    assert [c.id for c in store.list_conversations()] == [b] and store.load(a) is None


def test_title_of():
    assert title_of("\n\n  hello   world \n more") == "hello world"
    assert len(title_of("x" * 200)) == 60 and title_of("x" * 200).endswith("…")


def test_thinking_grows_beside_the_reply_and_is_exported_folded(tmp_path):
    store = ChatStore(tmp_path / "chats.sqlite3")
    cid = store.new_conversation("/m/gpt-oss")
    store.add_message(cid, "user", "2+2?")
    mid = store.add_message(cid, "assistant", "", "streaming")
    store.append(mid, "", "Simple ")
    store.append(mid, "", "sum.")
    store.append(mid, "4", "")
    store.append(mid, "", "")  # nothing: no write
    store.finish(mid, "done")
    (_, reply) = store.load(cid).messages
    assert (reply.content, reply.thinking) == ("4", "Simple sum.")
    assert store.load(cid).messages[0].thinking == ""
    md = store.export_markdown(cid)
    assert "## Assistant\n\n<details><summary>Thinking</summary>\n\nSimple sum.\n\n</details>\n\n4\n" in md


def test_a_version_1_file_gains_the_thinking_column(tmp_path):
    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL DEFAULT '',
            model TEXT NOT NULL DEFAULT '', system TEXT NOT NULL DEFAULT '', created REAL NOT NULL,
            updated REAL NOT NULL);
        CREATE TABLE messages (id INTEGER PRIMARY KEY, conversation_id INTEGER NOT NULL REFERENCES
            conversations(id) ON DELETE CASCADE, role TEXT NOT NULL, content TEXT NOT NULL DEFAULT '',
            status TEXT NOT NULL DEFAULT 'done', created REAL NOT NULL, stats TEXT);
        INSERT INTO conversations VALUES (1, 'Old', '/m/x', '', 0, 0);
        INSERT INTO messages VALUES (1, 1, 'user', 'hi', 'done', 0, NULL);
        INSERT INTO messages VALUES (2, 1, 'assistant', 'hello', 'done', 0, NULL);
        PRAGMA user_version=1;
    """)
    old.close()
    store = ChatStore(path)
    assert [(m.content, m.thinking) for m in store.load(1).messages] == [("hi", ""), ("hello", "")]
    mid = store.add_message(1, "assistant", "", "streaming")
    store.append(mid, "answer", "thought")
    assert store.load(1).messages[-1].thinking == "thought"
    assert store.db.execute("PRAGMA user_version").fetchone()[0] == 2
    store.close()
    assert ChatStore(path).load(1).messages[-1].content == "answer"  # opening it again changes nothing


# -- a damaged, newer or foreign file is checked before anything is written (issue 25) ----------------------

def _filled(path, chats=6, per_chat=30):
    store = ChatStore(path)
    for c in range(chats):
        cid = store.new_conversation("/m/x", title=f"chat {c}")
        for i in range(per_chat):
            store.add_message(cid, "user" if i % 2 == 0 else "assistant", f"c{c} m{i} " + "w" * 300)
    store.close()  # the last connection: the log is checkpointed into the file
    return chats * per_chat


def _damage(path, page, size=4096):
    data = bytearray(path.read_bytes())
    assert len(data) > (page + 2) * size
    data[page * size + 8: (page + 1) * size] = bytes([0xA5]) * (size - 8)  # a b-tree page's cells turned to garbage
    path.write_bytes(bytes(data))
    return bytes(data)


@pytest.mark.parametrize("cli", [True, False], ids=["sqlite3-cli", "row-by-row"])
def test_a_damaged_database_is_set_aside_and_recovered(tmp_path, monkeypatch, cli):
    import moechat.app.tui.store as store_module

    if cli and store_module.shutil.which("sqlite3") is None:
        pytest.skip("no sqlite3 CLI here")
    if not cli:
        monkeypatch.setattr(store_module.shutil, "which", lambda name: None)
    path = tmp_path / "chats.sqlite3"
    total = _filled(path)
    damaged = _damage(path, 10)
    store = ChatStore(path)
    assert store.problem is None and store.notice.startswith(f"{path} was damaged (")
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("chats.sqlite3.damaged-")]
    assert len(aside) == 1 and aside[0].read_bytes() == damaged  # untouched: no pragma, no checkpoint written
    assert aside[0].name in store.notice and "recovered into a new file" in store.notice
    chats = store.list_conversations()  # the old code: DatabaseError, database disk image is malformed
    recovered = sum(c.num_messages for c in chats)
    assert 0 < recovered < total and f"({recovered} messages)" in store.notice
    for c in chats:
        for m in store.load(c.id).messages:
            assert m.content.startswith(f"c{c.title[-1]} m") or c.title == "(recovered)"
    cid = store.new_conversation("/m/y")  # the app goes on, on a fresh file
    store.add_message(cid, "user", "after")
    store.close()
    again = ChatStore(path)
    assert again.notice is None and again.load(cid).messages[-1].content == "after"


def test_a_damaged_database_in_a_read_only_place_is_read_into_memory(tmp_path, monkeypatch):
    import moechat.app.tui.store as store_module

    path = tmp_path / "chats.sqlite3"
    _filled(path, chats=2, per_chat=40)
    damaged = _damage(path, 5)

    def refuse(*a):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(store_module.os, "rename", refuse)
    store = ChatStore(path)
    assert "could not be set aside (Read-only file system)" in store.notice and store.problem == store.notice
    assert sum(c.num_messages for c in store.list_conversations()) > 0
    store.add_message(store.new_conversation("m"), "user", "kept in memory")
    assert path.read_bytes() == damaged and sorted(p.name for p in tmp_path.iterdir()) == ["chats.sqlite3"]


def test_the_in_memory_fallback_does_not_copy_damaged_pages(tmp_path):
    path = tmp_path / "chats.sqlite3"
    total = _filled(path)
    store = ChatStore(path)  # checked whole at start; damaged while it runs
    _damage(path, 10)
    told = []
    store.on_problem = told.append
    prompts = store.recent_prompts()  # reads every message: the damaged page
    assert len(told) == 1 and "memory only" in told[0] and prompts
    chats = store.list_conversations()
    assert 0 < sum(c.num_messages for c in chats) < total
    store.add_message(chats[0].id, "user", "still saved in memory")
    assert store.load(chats[0].id).messages[-1].content == "still saved in memory"


def test_a_newer_database_is_read_never_relabelled(tmp_path):
    path = tmp_path / "chats.sqlite3"
    _filled(path, chats=1, per_chat=2)
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version=7")
    db.execute("CREATE TABLE folders (id INTEGER PRIMARY KEY)")  # what a newer moechat might add
    db.commit()
    db.close()
    before = path.read_bytes()
    store = ChatStore(path)
    assert "written by a newer moechat" in store.notice and "upgrade moechat" in store.notice
    assert [c.num_messages for c in store.list_conversations()] == [2]  # its chats are readable
    store.add_message(store.new_conversation("m"), "user", "new")  # kept in memory
    store.close()
    assert path.read_bytes() == before
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 7


def test_another_program_s_database_is_left_untouched(tmp_path):
    path = tmp_path / "chats.sqlite3"
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE conversations (id INTEGER PRIMARY KEY, topic TEXT);"
                     "CREATE TABLE messages (id INTEGER PRIMARY KEY, body TEXT);"
                     "INSERT INTO messages(body) VALUES ('theirs'); PRAGMA user_version=1;")
    db.close()
    before = path.read_bytes()
    store = ChatStore(path)
    assert "is not moechat's chat database" in store.notice and "left untouched" in store.notice
    cid = store.new_conversation("m")
    store.add_message(cid, "user", "hi")
    assert store.load(cid).messages[0].content == "hi"
    store.close()
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["chats.sqlite3"]
    other = sqlite3.connect(path)
    other.execute("PRAGMA application_id=1234")
    other.commit()
    other.close()
    assert "application_id is 0x4d2" in ChatStore(path).notice


def test_moechat_files_get_the_marker_and_the_app_shows_the_notice(tmp_path):
    from moechat.app.tui.app import make_app

    path = tmp_path / "chats.sqlite3"
    ChatStore(path).close()
    assert sqlite3.connect(path).execute("PRAGMA application_id").fetchone()[0] == 0x6D6F6563
    path.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 20)
    store = ChatStore(path)
    assert store.notice and "was damaged" in store.notice
    app = make_app(None, store=store, memory_probe=lambda: None)
    assert store.notice in app.startup_notices
