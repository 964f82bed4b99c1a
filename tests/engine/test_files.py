"""The one safe-write helper (engine/io/files.py `atomic_write`) and its start-of-run check (`check_writable`): regular
files or new names only, through symlinks, the target's permission bits kept, never onto a device (issue 25)."""

from __future__ import annotations

import os
import socket
import stat

import pytest

from moechat.engine.errors import MoechatError
from moechat.engine.io.files import UnwritableFileError, atomic_write, check_writable


def _socket_file(path):
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    return s


@pytest.fixture
def odd_files(tmp_path):
    """name -> a path that is not a regular file: a directory, a FIFO, a socket, a device (through a link: never the
    node itself, which a wrong helper running as root would replace)."""
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    sock = _socket_file(tmp_path / "sock")
    (tmp_path / "dev").symlink_to("/dev/null")
    yield {"directory": tmp_path / "dir", "FIFO": tmp_path / "fifo", "socket": tmp_path / "sock",
           "character device": tmp_path / "dev"}
    sock.close()


@pytest.mark.parametrize("kind", ["directory", "FIFO", "socket", "character device"])
def test_atomic_write_refuses_what_is_not_a_regular_file(odd_files, kind, tmp_path):
    path = odd_files[kind]
    before = os.lstat(path)
    with pytest.raises(UnwritableFileError, match=kind) as e:
        atomic_write(path, b"new")
    assert isinstance(e.value, MoechatError) and isinstance(e.value, OSError)  # typed, and a failed write to callers
    after = os.lstat(path)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)  # the same node, not a file renamed over it
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(UnwritableFileError, match=kind):
        check_writable(path, "routing trace")


def test_check_writable_refuses_a_device_named_directly():
    # /dev/full as root: the old check passed (root can create a file in /dev) and the trace was renamed over the
    # node; the check itself never writes the node
    with pytest.raises(UnwritableFileError, match="character device"):
        check_writable("/dev/full", "routing trace")
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_a_symlink_is_written_through(tmp_path):
    real = tmp_path / "dotfiles" / "settings.toml"
    real.parent.mkdir()
    real.write_text("old")
    link = tmp_path / "settings.toml"
    link.symlink_to("dotfiles/settings.toml")  # relative, as dotfile managers make them
    chain = tmp_path / "chain"
    chain.symlink_to(link)
    assert check_writable(chain, "file") == real
    assert atomic_write(chain, "new") == real
    assert chain.is_symlink() and link.is_symlink() and real.read_text() == "new"
    assert sorted(p.name for p in real.parent.iterdir()) == ["settings.toml"]  # the temp file was beside the target


def test_a_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "trace.npz"
    link.symlink_to(tmp_path / "elsewhere.npz")
    assert check_writable(link, "routing trace") == tmp_path / "elsewhere.npz"
    atomic_write(link, b"abc")
    assert link.is_symlink() and (tmp_path / "elsewhere.npz").read_bytes() == b"abc"


def test_a_symlink_loop_is_a_typed_error(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(UnwritableFileError):
        atomic_write(tmp_path / "a", b"x")
    with pytest.raises(UnwritableFileError):
        check_writable(tmp_path / "a", "routing trace")
    assert (tmp_path / "a").is_symlink() and (tmp_path / "b").is_symlink()


def test_permission_bits_are_kept_and_new_files_get_mode(tmp_path):
    path = tmp_path / "secret.toml"
    path.write_text("old")
    path.chmod(0o600)
    atomic_write(path, "new")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "new"
    fresh = tmp_path / "lib.so"
    atomic_write(fresh, b"\x7fELF", mode=0o755)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o755


def test_check_writable_a_missing_folder(tmp_path):
    with pytest.raises(UnwritableFileError, match="does not exist"):
        check_writable(tmp_path / "no" / "t.npz", "routing trace")
    assert check_writable(tmp_path / "t.npz", "routing trace") == tmp_path / "t.npz"
    assert list(tmp_path.iterdir()) == []
