"""The chat store: WAL, token batches committed as they come, interrupted replies, Markdown export."""

from __future__ import annotations

import sqlite3

from moechat.app.store import ChatStore, export_file, title_of


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
