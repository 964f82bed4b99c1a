"""docs/architecture.md names every module of the package and only modules that exist: its module table is read
(first column: a path from the repository root, then short names in the same folder) and compared with the files
under engine/ and app/. A module added, moved or split without its line fails here, naming it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SOURCES = ("*.py", "*.c", "*.tcss")


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def named_in_table(section: str) -> list[str]:
    """Every path the first column names: `a/b/c.py`, `d.py` -> a/b/c.py, a/b/d.py."""
    names = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first = line[2:].split(" | ", 1)[0]
        folder = None
        for token in re.findall(r"`([^`]+)`", first):
            if "/" in token.rstrip("/"):
                folder = token.rsplit("/", 1)[0]
                names.append(token)
            elif folder is not None:
                names.append(f"{folder}/{token}")
    return names


def package_files() -> set[str]:
    files = set()
    for top in ("engine", "app"):
        for pattern in SOURCES:
            for path in (ROOT / top).rglob(pattern):
                if "__pycache__" not in path.parts and path.name != "__init__.py":
                    files.add(path.relative_to(ROOT).as_posix())
    return files


def test_the_table_reader_expands_short_names():
    section = "\n| `engine/models/a.py`, `b.py` | x |\n| `app/tui/c.tcss` | y |\n| module | owns |\n"
    assert named_in_table(section) == ["engine/models/a.py", "engine/models/b.py", "app/tui/c.tcss"]


def test_every_module_has_its_line_and_every_line_a_module():
    named = named_in_table(_section(DOC.read_text(encoding="utf-8"), "Modules"))
    files = package_files()
    missing = sorted(files - set(named))
    stale = sorted(set(named) - files)
    twice = sorted({n for n in named if named.count(n) > 1})
    assert missing == [], f"modules without a line in docs/architecture.md's module table: {missing}"
    assert stale == [], f"lines in docs/architecture.md's module table for files that do not exist: {stale}"
    assert twice == [], f"modules named twice: {twice}"


def test_every_room_has_its_line():
    rooms = {token.rstrip("/") for token in named_in_table(_section(DOC.read_text(encoding="utf-8"), "Rooms"))}
    folders = {p.parent.relative_to(ROOT).as_posix() for top in ("engine", "app")
               for p in (ROOT / top).rglob("__init__.py")} - {"engine", "app"}
    # a room's sub-folders (quant/kernels, tui/screens, tui/widgets) are described in the room's line
    tops = {f for f in folders if not any(f.startswith(g + "/") for g in folders)}
    assert tops == rooms, f"rooms missing: {sorted(tops - rooms)}; listed but absent: {sorted(rooms - tops)}"


def test_the_docs_name_only_files_that_exist():
    """A path the README or a doc names (engine/..., app/..., bench/..., tests/...) is a file or folder that exists:
    a move or a split leaves no reader looking for a file that is gone."""
    pattern = re.compile(r"\b(?:engine|app|bench|tests|packaging)/[A-Za-z0-9_/.-]*[A-Za-z0-9_/]")
    gone = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for path in set(pattern.findall(doc.read_text(encoding="utf-8"))):
            if not (ROOT / path.rstrip("/.")).exists():
                gone.append(f"{doc.name}: {path}")
    assert sorted(gone) == []
