"""Saved conversations: one SQLite file under the XDG data dir ($XDG_DATA_HOME/moechat/chats.sqlite3).

WAL mode with synchronous=NORMAL: a commit is an append to the write-ahead log without an fsync, so
committing every token batch (a few per second) costs tens of microseconds, and a committed batch
survives the app being killed (only an OS crash or power loss can drop the last commits). A reply is
a row that grows: created as status "streaming", `append` adds each batch, `finish` sets "done",
"stopped" or "error". A row still "streaming" when read back was cut off by a kill: `load` reports it
as "interrupted". A reasoning model's thinking grows beside the reply's content in its own column (added
to version 1 files when they are opened). Each connection belongs to the thread that opened it (the UI
thread).
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

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
        self.db = sqlite3.connect(str(path), timeout=5.0)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        with self.db:
            self.db.executescript(_SCHEMA)
            columns = {row["name"] for row in self.db.execute("PRAGMA table_info(messages)")}
            if "thinking" not in columns:  # a version 1 file
                self.db.execute("ALTER TABLE messages ADD COLUMN thinking TEXT NOT NULL DEFAULT ''")
            self.db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        self.db.close()

    # -- writing ------------------------------------------------------------------------------------
    def new_conversation(self, model: str, system: str = "", title: str = "") -> int:
        now = time.time()
        with self.db:
            cur = self.db.execute("INSERT INTO conversations(title, model, system, created, updated) "
                                  "VALUES (?, ?, ?, ?, ?)", (title, model, system, now, now))
        return int(cur.lastrowid)

    def add_message(self, conversation_id: int, role: str, content: str = "", status: str = "done") -> int:
        now = time.time()
        with self.db:
            cur = self.db.execute("INSERT INTO messages(conversation_id, role, content, status, created) "
                                  "VALUES (?, ?, ?, ?, ?)", (conversation_id, role, content, status, now))
            self.db.execute("UPDATE conversations SET updated = ?, title = CASE WHEN title = '' AND ? = 'user' "
                            "THEN ? ELSE title END WHERE id = ?",
                            (now, role, title_of(content), conversation_id))
        return int(cur.lastrowid)

    def append(self, message_id: int, text: str, thinking: str = "") -> None:
        """Add a token batch to a reply (its answer and its thinking), committed at once."""
        if not text and not thinking:
            return
        with self.db:
            self.db.execute("UPDATE messages SET content = content || ?, thinking = thinking || ? WHERE id = ?",
                            (text, thinking, message_id))

    def finish(self, message_id: int, status: str, stats: dict | None = None) -> None:
        with self.db:
            self.db.execute("UPDATE messages SET status = ?, stats = ? WHERE id = ?",
                            (status, json.dumps(stats) if stats else None, message_id))
            self.db.execute("UPDATE conversations SET updated = ? WHERE id = "
                            "(SELECT conversation_id FROM messages WHERE id = ?)", (time.time(), message_id))

    def delete_message(self, message_id: int) -> None:
        with self.db:
            self.db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    def set_system(self, conversation_id: int, system: str) -> None:
        with self.db:
            self.db.execute("UPDATE conversations SET system = ?, updated = ? WHERE id = ?",
                            (system, time.time(), conversation_id))

    def delete_conversation(self, conversation_id: int) -> None:
        with self.db:
            self.db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # -- reading ------------------------------------------------------------------------------------
    def list_conversations(self, limit: int = 200) -> list[ConversationSummary]:
        rows = self.db.execute(
            "SELECT c.id, c.title, c.model, c.updated, COUNT(m.id) AS n FROM conversations c "
            "LEFT JOIN messages m ON m.conversation_id = c.id GROUP BY c.id "
            "ORDER BY c.updated DESC, c.id DESC LIMIT ?", (limit,)).fetchall()
        return [ConversationSummary(r["id"], r["title"] or "(untitled)", r["model"], r["updated"], r["n"])
                for r in rows]

    def load(self, conversation_id: int) -> SavedConversation | None:
        c = self.db.execute("SELECT * FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        if c is None:
            return None
        rows = self.db.execute("SELECT * FROM messages WHERE conversation_id = ? ORDER BY id",
                               (conversation_id,)).fetchall()
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
    path.write_text(to_markdown(conv), encoding="utf-8")
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
