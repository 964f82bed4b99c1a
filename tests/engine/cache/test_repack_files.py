"""The repacked experts file (`--expert-format int8|int4`, engine/cache/store.py) in a folder that refuses writes: a
typed line naming the folder and the option that moves it, never "unexpected OSError"; a whole repack there is
still reused; the sidecar is written through the one safe-write helper (issue 25)."""

from __future__ import annotations

import builtins
import errno
import os

import pytest

from moechat.engine.cache.provider import CacheConfig
from moechat.engine.errors import CheckpointError
from moechat.engine.runtime.generate import Engine


@pytest.fixture
def read_only(monkeypatch):
    """read_only(folder): from then on the folder answers writes as a read-only mount does (EROFS, even to unlink a
    name that is not there: the kernel asks for write access before the lookup). Root ignores permission bits, so a
    chmod would not do."""

    def make(folder):
        top = os.path.abspath(folder)

        def under(p) -> bool:
            try:
                p = os.path.abspath(os.fsdecode(p))
            except TypeError:  # a descriptor
                return False
            return p == top or p.startswith(top + os.sep)

        def refuse(p):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(p))

        real_open, real_unlink, real_mkdir = os.open, os.unlink, os.mkdir
        real_replace, real_rename, real_bopen = os.replace, os.rename, builtins.open
        writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC

        def os_open(p, flags, *a, **k):
            if flags & writes and under(p):
                refuse(p)
            return real_open(p, flags, *a, **k)

        def unlink(p, *a, **k):
            if under(p):
                refuse(p)
            return real_unlink(p, *a, **k)

        def mkdir(p, *a, **k):
            if under(p):
                if os.path.exists(p):
                    raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(p))
                refuse(p)
            return real_mkdir(p, *a, **k)

        def move(real):
            def moved(src, dst, *a, **k):
                if under(src) or under(dst):
                    refuse(dst)
                return real(src, dst, *a, **k)
            return moved

        def bopen(file, mode="r", *a, **k):
            if isinstance(file, (str, bytes, os.PathLike)) and set(mode) & set("wax+") and under(file):
                refuse(file)
            return real_bopen(file, mode, *a, **k)

        monkeypatch.setattr(os, "open", os_open)
        monkeypatch.setattr(os, "unlink", unlink)
        monkeypatch.setattr(os, "remove", unlink)
        monkeypatch.setattr(os, "mkdir", mkdir)
        monkeypatch.setattr(os, "replace", move(real_replace))
        monkeypatch.setattr(os, "rename", move(real_rename))
        monkeypatch.setattr(builtins, "open", bopen)

    return make


def test_a_read_only_repack_folder_is_one_typed_line(tiny_models, tmp_path, read_only):
    path, _ = tiny_models["qwen3_moe"]
    folder = tmp_path / "repack"
    folder.mkdir()
    read_only(folder)
    with pytest.raises(CheckpointError) as e:
        Engine.load(path, dtype="float32", expert_format="int8",
                    cache=CacheConfig(expert_slots=2, repack_dir=str(folder)))
    line = str(e.value)
    assert "\n" not in line and str(folder) in line and "Read-only file system" in line
    assert "--repack-dir" in line and "XDG_CACHE_HOME" in line
    assert list(folder.iterdir()) == []


def test_the_cli_says_it_in_one_line(tiny_models, tmp_path, read_only, capsys):
    from moechat.app.cli.main import main

    path, _ = tiny_models["qwen3_moe"]
    folder = tmp_path / "repack"
    folder.mkdir()
    read_only(folder)
    code = main(["run", str(path), "--prompt-ids", "1,2", "--max-tokens", "1", "--dtype", "float32",
                 "--expert-slots", "2", "--expert-format", "int8", "--repack-dir", str(folder)])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and "unexpected" not in err
    assert err.startswith("moechat: error:") and str(folder) in err and "--repack-dir" in err


def test_a_whole_repack_in_a_read_only_folder_is_reused(tiny_models, tmp_path, read_only):
    path, _ = tiny_models["qwen3_moe"]
    folder = tmp_path / "repack"
    config = CacheConfig(expert_slots=2, ram_cache_bytes=0, repack_dir=str(folder))
    Engine.load(path, dtype="float32", expert_format="int8", cache=config).close()
    assert sorted(p.name for p in folder.iterdir()) == ["experts.bin", "experts.json"]  # no temporary file left
    stamp = (folder / "experts.bin").stat().st_mtime_ns
    read_only(folder)
    engine = Engine.load(path, dtype="float32", expert_format="int8", cache=config)
    assert len(list(engine.generate([1, 2, 3], max_tokens=2))) > 0
    engine.close()
    assert (folder / "experts.bin").stat().st_mtime_ns == stamp


def test_a_sidecar_that_is_a_fifo_is_rebuilt_not_a_hang(tiny_models, tmp_path):
    path, _ = tiny_models["qwen3_moe"]
    folder = tmp_path / "repack"
    folder.mkdir()
    os.mkfifo(folder / "experts.json")
    config = CacheConfig(expert_slots=2, ram_cache_bytes=0, repack_dir=str(folder))
    # read as "no sidecar" (never opened blocking: the old read_text() waited for a writer forever), then replaced
    Engine.load(path, dtype="float32", expert_format="int8", cache=config).close()
    assert sorted(p.name for p in folder.iterdir()) == ["experts.bin", "experts.json"]
    assert (folder / "experts.json").is_file()


def test_the_checksum_is_zlibs_crc32():
    """The sidecars' CRC-32 (ISA-L's where python-isal is installed) gives zlib's values, so files written by either
    verify under the other: empty, odd lengths and offsets, a running value."""
    import zlib

    from moechat.engine.cache.repacked import crc32

    data = os.urandom(1 << 20)
    for lo, hi in ((0, 0), (0, 1), (3, 4099), (17, len(data)), (1, 1 << 19)):
        view = memoryview(data)[lo:hi]
        assert crc32(view) == zlib.crc32(view)
        assert crc32(view, 0xDEADBEEF) == zlib.crc32(view, 0xDEADBEEF)
