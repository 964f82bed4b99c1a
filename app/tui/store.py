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

Nothing is written to a file before it has been checked, on a read-only connection: `PRAGMA integrity_check`
(~0.1 s for 100 MB), then the marker (`application_id`) or, on files of versions 1-2 that have none, the schema.
A damaged file is never written: it is renamed `chats.sqlite3.damaged-<time>` (its -wal beside it), what can be
read is recovered (the sqlite3 CLI's `.recover` when it is installed, else row by row, skipping rows that fail)
into a fresh file, and `notice` says so. A file of a newer moechat (user_version above SCHEMA_VERSION) is read
into memory and never relabelled; another program's database is left untouched; both sessions keep their chats
in memory and `notice` says what to do.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import stat
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moechat.engine.io.files import atomic_write, file_kind

SCHEMA_VERSION = 2  # 2: messages.thinking
APPLICATION_ID = 0x6D6F6563  # "moec": PRAGMA application_id of moechat's chat files (from version 2 on)
TITLE_CHARS = 60
# The columns each version-1 file has (version 2 adds messages.thinking): a file without them is not moechat's.
COLUMNS = {"conversations": ("id", "title", "model", "system", "created", "updated"),
           "messages": ("id", "conversation_id", "role", "content", "status", "created", "stats")}
RECOVER_TIMEOUT_S = 60.0
MAX_PROBES = 200_000  # rowids tried one by one past a damaged page (a few seconds at most)

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


def _stats(text) -> dict | None:
    """A reply's saved stats; None for none, or for a value a damaged (recovered) row left unreadable."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except (TypeError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def title_of(text: str) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    line = re.sub(r"\s+", " ", line)
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"


def _uri(path: str | Path, **params: str) -> str:
    query = "&".join(f"{k}={v}" for k, v in params.items())
    return f"file:{urllib.parse.quote(str(Path(path).absolute()))}?{query}"


def _read_only(path: str | Path) -> sqlite3.Connection:
    """A connection that cannot write the file (a WAL file's log is read; immutable when no -shm can be made)."""
    try:
        db = sqlite3.connect(_uri(path, mode="ro"), uri=True)
        db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
    except sqlite3.OperationalError:  # a WAL file in a read-only folder: no -shm can be made
        db = sqlite3.connect(_uri(path, mode="ro", immutable="1"), uri=True)
    db.text_factory = lambda b: b.decode("utf-8", "replace")  # a damaged row's bad UTF-8 is not a crash
    return db


def _corrupt(e: sqlite3.Error) -> bool:
    return getattr(e, "sqlite_errorname", "") in ("SQLITE_CORRUPT", "SQLITE_NOTADB") or any(
        w in str(e) for w in ("malformed", "not a database", "corrupt"))


@dataclass(frozen=True)
class Inspection:
    """What a chat file is, found on a read-only connection: "new" (absent or empty), "ours", "newer", "foreign" or
    "damaged", and why in words."""

    kind: str
    why: str = ""
    version: int = 0


def inspect(path: str | Path) -> Inspection:
    """Check a chat file without writing it: integrity (integrity_check: b-trees, key order, indexes against
    tables), then its marker or schema and version."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return Inspection("new")
    if not stat.S_ISREG(st.st_mode):
        return Inspection("foreign", f"it is {file_kind(st.st_mode)}, not a database file")
    if st.st_size == 0 and not os.path.exists(f"{path}-wal"):
        return Inspection("new")
    try:
        db = _read_only(path)
    except sqlite3.Error as e:
        if _corrupt(e):
            return Inspection("damaged", str(e))
        raise
    try:
        try:
            check = [row[0] for row in db.execute("PRAGMA integrity_check")]
            app_id = db.execute("PRAGMA application_id").fetchone()[0]
            version = db.execute("PRAGMA user_version").fetchone()[0]
            names = [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                                    "AND name NOT LIKE 'sqlite_%'")]
            info = {name: {c[0]: (str(c[1]).upper(), c[2]) for c in
                           db.execute("SELECT name, type, pk FROM pragma_table_info(?)", (name,))} for name in names}
            tables = {name: set(cols) for name, cols in info.items()}
        except sqlite3.Error as e:
            if _corrupt(e):
                return Inspection("damaged", str(e))
            raise
    finally:
        db.close()
    if check != ["ok"]:
        return Inspection("damaged", f"the integrity check found: {check[0]}"[:200])
    if app_id not in (0, APPLICATION_ID):
        return Inspection("foreign", f"its application_id is {app_id:#x}, not moechat's")
    ours = all(set(cols) <= tables.get(name, set()) for name, cols in COLUMNS.items())
    if not tables and app_id == 0 and version == 0:
        return Inspection("new")  # an empty database: nothing to keep
    if not ours:
        return Inspection("foreign", f"it holds the tables {', '.join(sorted(tables)) or '(none)'}, not moechat's"
                          if app_id == 0 else "moechat's tables are missing")
    if any(info[name]["id"] != ("INTEGER", 1) for name in COLUMNS):  # the schema's text itself was damaged
        return Inspection("damaged", "the schema of moechat's tables is damaged (their ids are no longer keys)")
    if version > SCHEMA_VERSION:
        return Inspection("newer", f"its schema version is {version}; this moechat reads up to {SCHEMA_VERSION}",
                          version)
    extra = set(tables) - set(COLUMNS)
    if app_id == 0 and extra:  # a version 1-2 file has exactly these two tables
        return Inspection("foreign", f"it holds tables moechat never made ({', '.join(sorted(extra))})")
    return Inspection("ours", version=version)


def _rows(src: sqlite3.Connection, table: str, columns: list[str]):
    """Every row of `table` that can be read, in rowid order: a scan, and past a damaged page one rowid at a time."""
    select = f"SELECT rowid, {', '.join(columns)} FROM {table}"
    last = 0
    try:
        for row in src.execute(f"{select} WHERE rowid > 0 ORDER BY rowid"):
            last = row[0]
            yield row[1:]
        return
    except sqlite3.Error:
        pass
    try:
        top = src.execute(f"SELECT max(rowid) FROM {table}").fetchone()[0] or 0
    except sqlite3.Error:
        top = last + MAX_PROBES
    for rowid in range(last + 1, min(top, last + MAX_PROBES) + 1):
        try:
            row = src.execute(f"{select} WHERE rowid = ?", (rowid,)).fetchone()
        except sqlite3.Error:
            continue
        if row is not None:
            yield row[1:]


def salvage(src: sqlite3.Connection, dest: sqlite3.Connection) -> tuple[int, int]:
    """Copy every readable conversation and message of `src` into `dest` (moechat's schema, ids kept), skipping rows
    that fail or break a constraint; a message whose chat was lost gets a "(recovered)" chat. -> (chats, messages)."""
    counts = []
    for table in ("conversations", "messages"):
        try:
            have = [c[1] for c in src.execute(f"PRAGMA table_info({table})")]
        except sqlite3.Error:
            have = []
        want = [c for c in (*COLUMNS[table], "thinking") if c in have]
        n = 0
        if "id" in want:
            for row in _rows(src, table, want):
                values = dict(zip(want, row, strict=True))
                try:
                    with dest:
                        if table == "messages":
                            dest.execute("INSERT OR IGNORE INTO conversations(id, title, created, updated) "
                                         "VALUES (?, '(recovered)', ?, ?)",
                                         (values["conversation_id"], values.get("created") or 0,
                                          values.get("created") or 0))
                        dest.execute(f"INSERT INTO {table}({', '.join(want)}) VALUES ({', '.join('?' * len(want))})",
                                     row)
                    n += 1
                except (sqlite3.Error, OverflowError, TypeError, ValueError):
                    continue
        counts.append(n)
    return counts[0], counts[1]


def _recover_with_cli(path: Path, dest: sqlite3.Connection) -> tuple[int, int] | None:
    """The sqlite3 CLI's `.recover` (it reads pages a damaged b-tree no longer reaches) into a scratch file, then
    its rows into `dest`; None when the CLI is not installed or fails."""
    cli = shutil.which("sqlite3")
    if cli is None:
        return None
    with tempfile.TemporaryDirectory(prefix="moechat-recover-") as scratch:
        out = Path(scratch) / "recovered.sqlite3"
        try:
            sql = subprocess.run([cli, "-readonly", str(path), ".recover"], capture_output=True,
                                 timeout=RECOVER_TIMEOUT_S, check=False).stdout
            subprocess.run([cli, str(out)], input=sql, capture_output=True, timeout=RECOVER_TIMEOUT_S, check=False)
            if not out.exists():
                return None
            src = _read_only(out)
        except (OSError, subprocess.SubprocessError, sqlite3.Error):
            return None
        try:
            return salvage(src, dest)
        finally:
            src.close()


def _set_aside(path: Path) -> Path:
    """Rename a damaged file (and its -wal/-shm) to `<name>.damaged-<time>` beside it; OSError when it cannot be."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = path.with_name(f"{path.name}.damaged-{stamp}"), 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    os.rename(path, aside)
    try:  # the log holds committed chats too: it goes with its file
        os.rename(f"{path}-wal", f"{aside}-wal")
    except FileNotFoundError:
        pass
    _drop_scratch(path)
    return aside


def _drop_scratch(path: Path) -> None:
    """Remove the -shm (an index of the log, rebuilt by whoever opens the file next) and an empty -wal that a
    read-only connection to `path` made."""
    wal = Path(f"{path}-wal")
    try:
        if wal.stat().st_size == 0:
            wal.unlink()
    except OSError:
        pass
    try:
        Path(f"{path}-shm").unlink(missing_ok=True)
    except OSError:
        pass


class ChatStore:
    def __init__(self, path: str | Path | None = None):
        """`path=":memory:"` keeps everything in memory (tests); None is the XDG default. The file is checked before
        anything is written to it (see the module docstring); `notice` says what was found, for the app."""
        path = default_path() if path is None else path
        self.path = path
        self.problem: str | None = None  # set when the file stopped taking writes (the session went on in memory)
        self.notice: str | None = None  # a file found damaged, newer or foreign at start, and what was done
        self.on_problem: Callable[[str], None] | None = None  # told once, when that happens
        if str(path) == ":memory:":
            self.db = self._fresh(":memory:")
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        found = inspect(path)
        if found.kind in ("new", "ours"):
            self.db = self._fresh(str(path))
        elif found.kind == "damaged":
            self._open_damaged(path, found.why)
        elif found.kind == "newer":
            self.db = self._memory_copy(path)
            self.problem = self.notice = (
                f"{path} was written by a newer moechat ({found.why}): it is left as it is and this session keeps "
                "chats in memory only: upgrade moechat (pip install -U moechat) to save them there")
        else:
            self.db = self._fresh(":memory:")
            self.problem = self.notice = (
                f"{path} is not moechat's chat database ({found.why}): it is left untouched and this session keeps "
                "chats in memory only: move that file away or set XDG_DATA_HOME to another folder")

    def _fresh(self, where: str) -> sqlite3.Connection:
        db = self._connect(where)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        with db:
            self._create(db)
        return db

    def _memory_copy(self, path: Path) -> sqlite3.Connection:
        """A newer file's chats, read into memory (nothing written to it); empty when they cannot be read."""
        memory = self._connect(":memory:")
        try:
            src = _read_only(path)
            try:
                src.backup(memory)
            finally:
                src.close()
            with memory:
                self._create(memory)
        except sqlite3.Error:
            memory.close()
            memory = self._fresh(":memory:")
        return memory

    def _open_damaged(self, path: Path, why: str) -> None:
        """Set the damaged file aside, recover what can be read into a fresh file (in memory when it cannot be
        moved), and say so in `notice`."""
        try:
            aside = _set_aside(path)
        except OSError as e:
            self.db = self._fresh(":memory:")
            chats, messages = self._recover(path, self.db)
            _drop_scratch(path)
            self.problem = self.notice = (
                f"{path} is damaged ({why}) and could not be set aside ({e.strerror or e}); it is left as it is, "
                f"{chats} chats ({messages} messages) were read into memory and this session keeps chats there only: "
                "free its folder for writing or move the file away")
            return
        self.db = self._fresh(str(path))
        chats, messages = self._recover(aside, self.db)
        _drop_scratch(aside)
        self.notice = (f"{path} was damaged ({why}): it was kept as {aside.name}, and {chats} chats ({messages} "
                       "messages) were recovered into a new file")

    @staticmethod
    def _recover(path: Path, dest: sqlite3.Connection) -> tuple[int, int]:
        got = _recover_with_cli(path, dest)
        if got is not None and got != (0, 0):
            return got
        try:
            src = _read_only(path)
        except sqlite3.Error:
            return got or (0, 0)
        try:
            return salvage(src, dest)
        finally:
            src.close()

    BUSY_TIMEOUT_S = 5.0  # how long a write waits for another program's lock before the session moves to memory

    @classmethod
    def _connect(cls, where: str) -> sqlite3.Connection:
        db = sqlite3.connect(where, timeout=cls.BUSY_TIMEOUT_S)
        db.row_factory = sqlite3.Row
        db.text_factory = lambda b: b.decode("utf-8", "replace")  # a damaged byte in a message is not a crash
        db.execute("PRAGMA foreign_keys=ON")
        return db

    @staticmethod
    def _create(db: sqlite3.Connection) -> None:
        """The schema on a new file, or a checked version 1-2 file brought to this version (never a newer one)."""
        db.executescript(_SCHEMA)
        columns = {row["name"] for row in db.execute("PRAGMA table_info(messages)")}
        if "thinking" not in columns:  # a version 1 file
            db.execute("ALTER TABLE messages ADD COLUMN thinking TEXT NOT NULL DEFAULT ''")
        if db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        if db.execute("PRAGMA application_id").fetchone()[0] != APPLICATION_ID:
            db.execute(f"PRAGMA application_id={APPLICATION_ID}")

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
            ok = [row[0] for row in memory.execute("PRAGMA integrity_check")] == ["ok"]
            if ok:
                with memory:
                    self._create(memory)
                    # the copy takes the file's header: one that says "read-only" (a write version above 2) too
                    memory.execute(f"PRAGMA user_version={memory.execute('PRAGMA user_version').fetchone()[0]}")
        except sqlite3.Error:
            ok = False
        if not ok:  # damaged pages would fail again in memory: the rows that can be read, one by one
            memory.close()
            memory = self._connect(":memory:")
            with memory:
                self._create(memory)
            try:
                self.db.text_factory = lambda b: b.decode("utf-8", "replace")
                salvage(self.db, memory)
            except sqlite3.Error:
                pass
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
                         _stats(r["stats"]), r["thinking"])
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
