"""Saved conversations: one SQLite file under the XDG data dir ($XDG_DATA_HOME/moechat/chats.sqlite3).

WAL mode with synchronous=NORMAL: a commit is an append to the write-ahead log without an fsync, so
committing every token batch (a few per second) costs tens of microseconds, and a committed batch
survives the app being killed (only an OS crash or power loss can drop the last commits). A reply is
a row that grows: created as status "streaming", `append` adds each batch, `finish` sets "done",
"stopped" or "error". A row still "streaming" when read back was cut off by a kill: `load` reports it
as "interrupted". A reasoning model's thinking grows beside the reply's content in its own column (added
to version 1 files when they are opened). Each connection belongs to the thread that opened it (the UI
thread).

A file that stops taking writes (locked by another process for more than the 5 s busy timeout, a full
disk, a read-only or vanished folder, a damaged file) never ends the session: the first failed write
copies what can be read into an in-memory database, the write is made there, `problem` says what happened
and `on_problem` (the app's notice) is called once; the chat goes on, kept in memory for the rest of the
session. Exports are written whole or not at all.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moechat.engine.files import atomic_write

SCHEMA_VERSION = 2  # 2: messages.thinking
TITLE_CHARS = 60

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL DEFAULT '',
    model TEXT NOT NULL DEFAULT '',
    system TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL DEFAULT '',
    status TEXT NOT NULL DEFAULT 'done',
    created REAL NOT NULL,
    stats TEXT,
    thinking TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""


@dataclass(frozen=True)
class SavedMessage:
    id: int
    role: str  # "user" | "assistant"
    content: str
    status: str  # "done" | "stopped" | "error" | "interrupted"
    stats: dict | None = None
    thinking: str = ""  # a reasoning model's thinking before the content


@dataclass(frozen=True)
class SavedConversation:
    id: int
    title: str
    model: str
    system: str
    created: float
    updated: float
    messages: tuple[SavedMessage, ...] = ()


@dataclass(frozen=True)
class ConversationSummary:
    id: int
    title: str
    model: str
    updated: float
    num_messages: int


def default_path() -> Path:
    from .settings import data_dir

    return data_dir() / "chats.sqlite3"


def title_of(text: str) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    line = re.sub(r"\s+", " ", line)
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"


class ChatStore:
    def __init__(self, path: str | Path | None = None):
        """`path=":memory:"` keeps everything in memory (tests); None is the XDG default."""
        path = default_path() if path is None else path
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.problem: str | None = None  # set when the file stopped taking writes (the session went on in memory)
        self.on_problem: Callable[[str], None] | None = None  # told once, when that happens
        self.db = self._connect(str(path))
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        with self.db:
            self._create(self.db)

    BUSY_TIMEOUT_S = 5.0  # how long a write waits for another program's lock before the session moves to memory

    @classmethod
    def _connect(cls, where: str) -> sqlite3.Connection:
        db = sqlite3.connect(where, timeout=cls.BUSY_TIMEOUT_S)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA foreign_keys=ON")
        return db

    @staticmethod
    def _create(db: sqlite3.Connection) -> None:
        db.executescript(_SCHEMA)
        columns = {row["name"] for row in db.execute("PRAGMA table_info(messages)")}
        if "thinking" not in columns:  # a version 1 file
            db.execute("ALTER TABLE messages ADD COLUMN thinking TEXT NOT NULL DEFAULT ''")
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        try:
            self.db.close()
        except sqlite3.Error:
            pass

    def _write(self, work: Callable[[sqlite3.Connection], object]):
        """One transaction; when the file refuses it, the session moves to memory and the write is made there."""
        try:
            with self.db:
                return work(self.db)
        except sqlite3.Error as e:
            if self.problem is not None:  # already in memory: a real bug, not the file
                raise
            self._move_to_memory(e)
            with self.db:
                return work(self.db)

    def _move_to_memory(self, error: sqlite3.Error) -> None:
        memory = self._connect(":memory:")
        try:
            self.db.backup(memory)  # what the file holds so far (readable even when another writer locks it)
        except sqlite3.Error:
            memory.close()
            memory = self._connect(":memory:")
        with memory:
            self._create(memory)
        self.close()
        self.db = memory
        why = (f"it stayed locked by another program for {self.BUSY_TIMEOUT_S:g} s" if "locked" in str(error)
               else str(error))
        self.problem = (f"Chats can no longer be saved to {self.path} ({why}); this session keeps them in memory "
                        "only: export a chat (Ctrl+S) to keep it")
        if self.on_problem is not None:
            self.on_problem(self.problem)

    # -- writing ------------------------------------------------------------------------------------
    def new_conversation(self, model: str, system: str = "", title: str = "") -> int:
        now = time.time()
        cur = self._write(lambda db: db.execute("INSERT INTO conversations(title, model, system, created, updated) "
                                                "VALUES (?, ?, ?, ?, ?)", (title, model, system, now, now)))
        return int(cur.lastrowid)

    def add_message(self, conversation_id: int, role: str, content: str = "", status: str = "done") -> int:
        now = time.time()

        def work(db):
            cur = db.execute("INSERT INTO messages(conversation_id, role, content, status, created) "
                             "VALUES (?, ?, ?, ?, ?)", (conversation_id, role, content, status, now))
            db.execute("UPDATE conversations SET updated = ?, title = CASE WHEN title = '' AND ? = 'user' "
                       "THEN ? ELSE title END WHERE id = ?", (now, role, title_of(content), conversation_id))
            return cur

        return int(self._write(work).lastrowid)

    def append(self, message_id: int, text: str, thinking: str = "") -> None:
        """Add a token batch to a reply (its answer and its thinking), committed at once."""
        if not text and not thinking:
            return
        self._write(lambda db: db.execute("UPDATE messages SET content = content || ?, thinking = thinking || ? "
                                          "WHERE id = ?", (text, thinking, message_id)))

    def finish(self, message_id: int, status: str, stats: dict | None = None) -> None:
        def work(db):
            db.execute("UPDATE messages SET status = ?, stats = ? WHERE id = ?",
                       (status, json.dumps(stats) if stats else None, message_id))
            db.execute("UPDATE conversations SET updated = ? WHERE id = "
                       "(SELECT conversation_id FROM messages WHERE id = ?)", (time.time(), message_id))

        self._write(work)

    def delete_message(self, message_id: int) -> None:
        self._write(lambda db: db.execute("DELETE FROM messages WHERE id = ?", (message_id,)))

    def set_system(self, conversation_id: int, system: str) -> None:
        self._write(lambda db: db.execute("UPDATE conversations SET system = ?, updated = ? WHERE id = ?",
                                          (system, time.time(), conversation_id)))

    def delete_conversation(self, conversation_id: int) -> None:
        self._write(lambda db: db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,)))

    # -- reading ------------------------------------------------------------------------------------
    def _read(self, work: Callable[[sqlite3.Connection], object]):
        """A query; a file that cannot be read (damaged, vanished) moves the session to memory like a failed write."""
        try:
            return work(self.db)
        except sqlite3.Error as e:
            if self.problem is not None:
                raise
            self._move_to_memory(e)
            return work(self.db)

    def list_conversations(self, limit: int = 200) -> list[ConversationSummary]:
        rows = self._read(lambda db: db.execute(
            "SELECT c.id, c.title, c.model, c.updated, COUNT(m.id) AS n FROM conversations c "
            "LEFT JOIN messages m ON m.conversation_id = c.id GROUP BY c.id "
            "ORDER BY c.updated DESC, c.id DESC LIMIT ?", (limit,)).fetchall())
        return [ConversationSummary(r["id"], r["title"] or "(untitled)", r["model"], r["updated"], r["n"])
                for r in rows]

    def recent_prompts(self, limit: int = 200) -> list[str]:
        """The user's last `limit` distinct messages over every chat, oldest first: the prompt's history."""
        rows = self._read(lambda db: db.execute(
            "SELECT content, MAX(id) AS last FROM messages WHERE role = 'user' AND content != '' "
            "GROUP BY content ORDER BY last DESC LIMIT ?", (limit,)).fetchall())
        return [r["content"] for r in reversed(rows)]

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        """A title the user chose (kept as typed, one line); the chat's place in the list does not move."""
        title = " ".join(title.split())
        self._write(lambda db: db.execute("UPDATE conversations SET title = ? WHERE id = ?",
                                          (title, conversation_id)))

    def search_conversations(self, text: str, limit: int = 200) -> list[ConversationSummary]:
        """Chats whose title or any message contains `text` (case-insensitive for ASCII), newest first."""
        if not text.strip():
            return self.list_conversations(limit)
        pattern = "%" + text.strip().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = self._read(lambda db: db.execute(
            "SELECT c.id, c.title, c.model, c.updated, "
            "(SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS n FROM conversations c "
            "WHERE c.title LIKE ?1 ESCAPE '\\' OR EXISTS (SELECT 1 FROM messages m "
            "WHERE m.conversation_id = c.id AND m.content LIKE ?1 ESCAPE '\\') "
            "ORDER BY c.updated DESC, c.id DESC LIMIT ?2", (pattern, limit)).fetchall())
        return [ConversationSummary(r["id"], r["title"] or "(untitled)", r["model"], r["updated"], r["n"])
                for r in rows]

    def load(self, conversation_id: int) -> SavedConversation | None:
        c = self._read(lambda db: db.execute("SELECT * FROM conversations WHERE id = ?", (conversation_id,)).fetchone())
        if c is None:
            return None
        rows = self._read(lambda db: db.execute("SELECT * FROM messages WHERE conversation_id = ? ORDER BY id",
                                                (conversation_id,)).fetchall())
        messages = tuple(
            SavedMessage(r["id"], r["role"], r["content"], "interrupted" if r["status"] == "streaming" else r["status"],
                         json.loads(r["stats"]) if r["stats"] else None, r["thinking"])
            for r in rows)
        return SavedConversation(c["id"], c["title"] or "(untitled)", c["model"], c["system"], c["created"],
                                 c["updated"], messages)

    def export_markdown(self, conversation_id: int) -> str:
        conv = self.load(conversation_id)
        if conv is None:
            raise KeyError(conversation_id)
        return to_markdown(conv)


def export_file(store: ChatStore, conversation_id: int, directory: str | Path) -> Path:
    """Write a conversation as Markdown into `directory`; returns the file (never overwrites one)."""
    conv = store.load(conversation_id)
    if conv is None:
        raise KeyError(conversation_id)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", conv.title.lower()).strip("-")[:40] or "chat"
    path = directory / f"moechat-{conv.id}-{slug}.md"
    n = 1
    while path.exists():
        n += 1
        path = directory / f"moechat-{conv.id}-{slug}-{n}.md"
    atomic_write(path, to_markdown(conv), fsync=False)  # a full disk leaves no half-written export
    return path


def to_markdown(conv: SavedConversation) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(conv.created))
    out = [f"# {conv.title}", "", f"*{conv.model or 'unknown model'} · {when}*", ""]
    if conv.system:
        out += ["## System", "", conv.system, ""]
    for m in conv.messages:
        heading = "You" if m.role == "user" else "Assistant"
        if m.status in ("stopped", "interrupted", "error"):
            heading += f" ({m.status})"
        out += [f"## {heading}", ""]
        if m.thinking:  # folded, as in the app: GitHub and most viewers render <details> closed
            out += ["<details><summary>Thinking</summary>", "", m.thinking, "", "</details>", ""]
        out += [m.content, ""]
    return "\n".join(out).rstrip() + "\n"
