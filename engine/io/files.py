"""Files moechat reads from a model directory it did not write, and files it writes for itself.

Reading: a model directory is untrusted input. `open_regular` opens with O_NONBLOCK and checks the
opened descriptor (fstat, so a swap between check and open cannot fool it): a FIFO, a device, a socket
or a directory is refused before one byte is read, where a plain `open` of a FIFO would wait forever
for a writer. `read_json_file` adds a size cap (a 40 GB "config.json" is refused from its size, not by
running out of memory) and turns every way JSON can fail, deep nesting (RecursionError) and 5,000-digit
integers (ValueError) included, into one typed line naming the file.

Writing: `atomic_write` is the one way moechat writes a file of its own (settings, calibration, routing
profiles and traces, chat exports, the native kernels, the repack sidecar). It writes a temporary file beside
the target, fsyncs it and renames it over the target, so a full disk, a read-only directory or a kill -9
mid-write leaves the previous file whole; the temporary file is removed on every failure it sees (a kill
leaves one `.<name>.<pid>.*.tmp` file, which the next write removes once that pid is gone). The target is
resolved through symlinks first (a dotfiles `settings.toml -> ~/dotfiles/...` stays a link and its target gets
the new bytes) and must be a regular file or a new name: a directory, a device (`/dev/full` as root), a FIFO
or a socket there is refused with `UnwritableFileError`, never renamed over. An existing file keeps its
permission bits. `check_writable` applies the same rules before a long run. No torch here: `moechat fit` and
the app import this at start-up.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError, MoechatError

# config.json is a few KB, a big tokenizer_config.json a few MB, an index of 100k tensors ~10 MB.
MAX_JSON_BYTES = 64 * 2**20
_TEMP_SUFFIX = ".tmp"


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike, what: str, error: Callable[[str], MoechatError] = ConfigError) -> int:
    """A read-only descriptor of a regular file, or `error(message)`; never blocks on a FIFO or a device.

    FileNotFoundError is passed through for callers that treat a missing file on its own."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except IsADirectoryError:
        raise error(f"{path}: {what} is a directory, not a file") from None
    except OSError as e:
        raise error(f"{path}: cannot open {what}: {e.strerror or e}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{path}: {what} is {file_kind(mode)}, not a regular file; refusing to read it "
                        "(replace it with the real file)")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike, what: str, *, max_bytes: int,
                 error: Callable[[str], MoechatError] = ConfigError) -> bytes:
    """The bytes of a regular file of at most max_bytes (checked from its size before reading)."""
    fd = open_regular(path, what, error)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise error(f"{path}: {what} is {size:,} bytes, more than the {max_bytes:,} a {what} can sensibly be; "
                        "the file is damaged or not what its name says")
        chunks, total = [], 0
        while True:  # read to EOF (the file may have grown since fstat): still capped
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            total += len(chunk)
            if total > max_bytes:
                raise error(f"{path}: {what} grew past {max_bytes:,} bytes while being read")
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def parse_json(raw: bytes | str, where: str, what: str,
               error: Callable[[str], MoechatError] = ConfigError) -> Any:
    """json.loads, every failure one line: bad UTF-8, bad syntax, nesting too deep, an integer too long."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise error(f"{where}: {what} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise error(f"{where}: {what} is not valid JSON (not UTF-8: {e.reason} at byte {e.start})") from None
    except RecursionError:
        raise error(f"{where}: {what} is JSON nested too deeply to be a real {what}; the file is damaged") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise error(f"{where}: {what} holds a value JSON cannot represent here ({e})") from None


def read_json_file(path: str | os.PathLike, what: str, *, max_bytes: int = MAX_JSON_BYTES,
                   error: Callable[[str], MoechatError] = ConfigError) -> Any:
    """Parse a JSON file (any top-level type), or raise `error` naming the file and the problem."""
    try:
        raw = read_regular(path, what, max_bytes=max_bytes, error=error)
    except FileNotFoundError:
        raise error(f"{path}: {what} not found{_near_misses(Path(path))}") from None
    return parse_json(raw, str(path), what, error)


def _near_misses(path: Path) -> str:
    """A hint when the folder holds the file under another name (the Hub's model-configs keep config.json saved as
    config.reserialized.json or config.finetune-derived.json): which file would do, and what to do with it."""
    try:
        others = sorted(p.name for p in path.parent.glob(f"{path.stem}.*{path.suffix}") if p.is_file())
    except OSError:
        return ""
    if not others:
        return ""
    return (f"; {', '.join(others)} {'is' if len(others) == 1 else 'are'} there: moechat reads only {path.name}, so "
            f"copy the one that describes this model to {path.name} (cp {path.parent / others[0]} {path})")


def read_json_object(path: str | os.PathLike, what: str, *, max_bytes: int = MAX_JSON_BYTES,
                     error: Callable[[str], MoechatError] = ConfigError) -> dict:
    data = read_json_file(path, what, max_bytes=max_bytes, error=error)
    if not isinstance(data, dict):
        raise error(f"{path}: {what} must be a JSON object, found {type(data).__name__}")
    return data


# -- writing ---------------------------------------------------------------------------------------------

def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's live process
        return True
    return True


def sweep_temps(path: str | os.PathLike) -> None:
    """Remove temporary files that writes of `path` by processes no longer alive left behind (a kill -9)."""
    path = Path(path)
    prefix = _temp_prefix(path)
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return
    for entry in entries:
        name = entry.name
        if not (name.startswith(prefix) and name.endswith(_TEMP_SUFFIX)):
            continue
        pid = name[len(prefix):].split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            try:
                os.unlink(entry.path)
            except OSError:
                pass


class UnwritableFileError(MoechatError, OSError):
    """A file moechat would write is something else (a directory, a device, a FIFO, a socket, a symlink loop) or
    lies in a folder that does not exist: refused before any byte is written. An OSError too, so the callers that
    treat a failed write (a full disk) as a notice treat this one the same way."""


def write_target(path: str | os.PathLike, what: str = "file") -> Path:
    """The file a write of `path` lands in: the final target of its symlinks, which must be a regular file or a
    new name (then its folder must exist or be creatable). Raises UnwritableFileError otherwise."""
    path = Path(path).expanduser()
    target = Path(os.path.realpath(path))  # through every link; a dangling one gives the name it points to
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return target
    except OSError as e:  # ELOOP (a link cycle realpath gave up on), EACCES on a folder above
        raise UnwritableFileError(f"{path}: cannot write the {what} there: {e.strerror or e}") from None
    if stat.S_ISLNK(st.st_mode):  # realpath stops at a cycle
        raise UnwritableFileError(f"{path}: cannot write the {what}: its symlinks form a loop; point the link at "
                                  "a real file or remove it")
    if not stat.S_ISREG(st.st_mode):
        via = f" (through the link to {target})" if target != path.absolute() else ""
        raise UnwritableFileError(f"{path}: the {what} would replace {file_kind(st.st_mode)}{via}, not a regular "
                                  "file; refusing: give a new file name or a regular file's")
    return target


def atomic_write(path: str | os.PathLike, data: bytes | str | Callable[[Any], None], *, mode: int = 0o644,
                 fsync: bool = True, what: str = "file") -> Path:
    """Write `data` (bytes, text, or a function writing to a binary file object) to `path`, all or nothing; returns
    the file written (`path` itself, or the final target of its symlinks).

    The target must be a regular file or a new name (UnwritableFileError otherwise); a new file gets `mode`, an
    existing one keeps its permission bits. Raises OSError (ENOSPC, EROFS, EACCES...) with the previous file intact
    and no temporary file left."""
    target = write_target(path, what)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)  # keep what the user set (a 0600 settings file stays 0600)
    except FileNotFoundError:
        pass
    sweep_temps(target)
    fd, tmp = tempfile.mkstemp(prefix=f"{_temp_prefix(target)}{os.getpid()}.", suffix=_TEMP_SUFFIX, dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        write_target(path, what)  # once more just before the rename: nothing else took the name meanwhile
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync:  # the rename itself survives a crash once the directory is synced
        try:
            dfd = os.open(target.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass
    return target


def check_writable(path: str | os.PathLike, what: str) -> Path:
    """Fail now, with one line, if `path` cannot be written later by `atomic_write` (a missing or read-only folder,
    a directory, a device or a FIFO in the way): a file to write after a long run (a routing trace) is checked
    before the run starts. The same rules as the write: through symlinks, onto a regular file or a new name. The
    check creates and removes a temporary file beside the target, the only test a read-only mount cannot fool.
    Returns the file a write will land in."""
    path = Path(path).expanduser()
    target = write_target(path, what)
    parent = target.parent
    if not parent.is_dir():
        raise UnwritableFileError(f"{path}: cannot write the {what}: the folder {parent} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{_temp_prefix(target)}{os.getpid()}.", suffix=_TEMP_SUFFIX, dir=parent)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise UnwritableFileError(f"{path}: cannot write the {what} there: {e.strerror or e}") from None
    return target
