"""The disk tier from a repacked file (`RepackedStore`): each expert's stored bytes back to back, in the tiers' format.

Split from engine/cache/store.py (the shard reader, `DiskStore`, and the reading helpers it and this share)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..io.files import UnwritableFileError, atomic_write
from ..quant.base import ExpertFormat
from .store import DISK, DiskStore, _direct, _pool, _read_exact, expert_shapes, populate, read_threads

try:  # ISA-L's CRC-32 (python-isal): zlib's values, folded with carry-less multiplies, ~3x zlib's rate, GIL freed
    from isal.isal_zlib import crc32
except ImportError:  # a platform without its wheel: zlib's, the same values
    from zlib import crc32


class RepackedStore:
    """The disk tier from a repacked file: each expert's stored tensors back to back.

    One read per expert instead of 2-3 scattered ranges of the shards, and no dtype conversion:
    `bench/offload.py` measured 2,700 vs 1,770 MiB/s cold on the CI machine. With a `target` format
    (`--expert-format int8|int4`) the experts are quantized once, as the file is written, so every tier
    holds the small form. Written once through `files.atomic_write` (a temporary file beside it, fsynced, renamed:
    a symlinked `experts.bin` is written through, a device or FIFO there refused), then a sidecar JSON naming its
    source, its format, the file's size, inode and mtime, and a CRC-32 per expert (zlib's, computed by ISA-L where
    python-isal is installed: 11.9 against zlib's 3.7 GB/s on one Zen 2 core, 0.2 -> 0.06 s of a Qwen3-30B-A3B-shaped
    int8 load's 1.2 GB). A later run reuses it only when the sidecar matches (a changed source, format or file is
    rebuilt); each expert's CRC is checked the first time it is read, and a mismatch is a typed error that also
    invalidates the file for next start.
    """

    tier = DISK

    def __init__(self, disk: DiskStore, layers: list[int], num_experts: int, directory: Path,
                 target: ExpertFormat | None = None):
        self.disk = disk
        self.format = target or disk.format
        args = disk.args
        self.shapes = disk.shapes if target is None else expert_shapes(args, disk.dtype, target)
        self.expert_bytes = sum(torch.Size(s).numel() * d.itemsize for s, d in self.shapes.values())
        keys = [(layer, e) for layer in layers for e in range(num_experts)]
        self.index = {key: i for i, key in enumerate(keys)}
        self.path = Path(directory) / "experts.bin"
        self.sidecar = self.path.with_suffix(".json")
        meta = {"format": 3, "expert_format": self.format.name, "source_format": disk.format.name,
                "layers": layers, "num_experts": num_experts, "expert_bytes": self.expert_bytes,
                "tensors": {name: [list(shape), str(dtype)] for name, (shape, dtype) in self.shapes.items()},
                "source": disk.source_fingerprint()}
        found = _json_or_none(self.sidecar)
        self.crc: list[int] = []
        if not (isinstance(found, dict) and found.get("meta") == meta and found.get("file") == self._file_id()
                and isinstance(found.get("crc"), list) and len(found["crc"]) == len(keys)
                and all(type(c) is int for c in found["crc"])):
            self._write(keys, meta)
        else:
            self.crc = found["crc"]
        self._checked = bytearray(len(keys))  # experts whose CRC has been verified this run
        self._fd = os.open(self.path, os.O_RDONLY)
        self._staging: dict[str, torch.Tensor] = {}
        self._map: torch.Tensor | None = None  # the file memory-mapped (`mapped_layer`), kept by the views made of it

    def _file_id(self):
        try:
            st = self.path.stat()
        except OSError:
            return None
        return [st.st_size, st.st_ino, st.st_mtime_ns]

    def _pack(self, layer: int, e: int, buf: dict[str, torch.Tensor], src: dict[str, torch.Tensor] | None) -> None:
        """One expert into `buf` in the target format: read as stored, dequantized, quantized again."""
        if src is None:
            self.disk.read_into(layer, e, buf)
            return
        self.disk.read_into(layer, e, src)
        native = self.disk.format
        for which in ("w13", "w2"):
            packed = self.format.quantize(native.weight(src, which, torch.float32))
            for part, t in packed.items():
                buf[f"{which}_{part}"].copy_(t)
            if f"{which}_bias" in buf:  # a GGUF keeps gate's and up's apart: its format joins them (`bias`)
                bias = getattr(native, "bias", None)
                buf[f"{which}_bias"].copy_(bias(src, which) if bias else src[f"{which}_bias"])

    def _unwritable(self, e: OSError, need: int) -> CheckpointError:
        """The one line for a repack folder that refuses the file: the folder, why, and where else it can go."""
        folder = self.path.parent
        if isinstance(e, UnwritableFileError):
            why = str(e)
        else:
            why = f"{folder}: cannot write the repacked experts there ({e.strerror or e})"
        if e.errno == errno.ENOSPC:
            fix = "free disk space, or"
        else:
            fix = "the folder is read-only or not moechat's to write:"
        return CheckpointError(f"{why}; {fix} give --repack-dir a writable folder with {need / 2**30:.2f} GiB free "
                               "(the default is under $XDG_CACHE_HOME/moechat/repacked), or drop --expert-format",
                               path=str(self.path))

    def _write(self, keys, meta: dict) -> None:
        need = self.expert_bytes * len(keys)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.path.parent).free
        except OSError as e:  # a --repack-dir that cannot be a folder (read-only, a file in the way, /proc)
            raise self._unwritable(e, need) from None
        if free < need:
            raise CheckpointError(f"{self.path.parent}: repacking the experts needs {need / 2**30:.2f} GiB, "
                                  f"{free / 2**30:.2f} GiB free: free {(need - free) / 2**30:.2f} GiB, use another "
                                  "--repack-dir, or drop --repack-dir/--expert-format", path=str(self.path))
        buf = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in self.shapes.items()}
        src = (None if self.format is self.disk.format
               else {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in self.disk.shapes.items()})
        crc = []

        def write(f) -> None:
            for layer, e in keys:
                self._pack(layer, e, buf, src)
                c = 0
                for name in self.shapes:
                    data = memoryview(buf[name].view(torch.uint8).reshape(-1).numpy())
                    f.write(data)
                    c = crc32(data, c)
                crc.append(c)

        try:
            self.sidecar.unlink(missing_ok=True)  # no sidecar, no reuse: a crash mid-write leaves nothing trusted
            atomic_write(self.path, write, what="repacked experts file")  # all or nothing, fsynced before the rename
            atomic_write(self.sidecar, json.dumps({"meta": meta, "file": self._file_id(), "crc": crc}),
                         what="repacked experts' sidecar")
        except OSError as e:
            raise self._unwritable(e, need) from None
        self.crc = crc

    def mapped_layer(self, layer: int) -> dict[str, torch.Tensor] | None:
        """The layer's experts as views of the file's mapping, no copy: [E, *shape] per stored tensor, expert e's
        tensors back to back in its row as the file holds them (each t[e] contiguous, as a slot-layout row is), each
        unverified expert's CRC checked over the mapped bytes (several at once), every page mapped now. None where
        the layer's experts are not consecutive or a tensor's offset is not a multiple of its dtype's size."""
        E = self.disk.args.num_experts
        first = self.index.get((layer, 0))
        eb = self.expert_bytes
        if first is None or any(self.index.get((layer, e)) != first + e for e in range(E)):
            return None
        if self._map is None:
            import numpy as np

            self._map = torch.from_numpy(np.memmap(self.path, dtype=np.uint8, mode="c"))  # MAP_PRIVATE: page cache
        rows = self._map[first * eb : (first + E) * eb].view(E, eb)  # [E, expert bytes]
        out, at = {}, 0
        for name, (shape, dtype) in self.shapes.items():
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            if at % dtype.itemsize or eb % dtype.itemsize:
                return None
            out[name] = rows[:, at : at + nbytes].view(dtype).view(E, *shape)
            at += nbytes
        populate(rows)

        def crc(e: int) -> int:
            return crc32(memoryview(rows[e].numpy()))  # the GIL freed: experts side by side

        todo = [e for e in range(E) if not self._checked[first + e]]
        for e, c in zip(todo, _pool().map(crc, todo) if read_threads() > 1 else map(crc, todo), strict=True):
            if c != self.crc[first + e]:
                self._damaged(layer, e)
            self._checked[first + e] = 1
        return out

    def _damaged(self, layer: int, expert: int):
        try:
            self.sidecar.unlink(missing_ok=True)  # the next start rebuilds it
        except OSError:  # a read-only folder: the next start checks every expert again
            pass
        raise CheckpointError(f"{self.path}: expert {expert} of layer {layer} does not match the checksum "
                              "written with it (the file was damaged or changed); it is rebuilt on the "
                              "next start", path=str(self.path))

    def parallel_reads(self, jobs) -> bool:
        """Whether `fill` may run these reads at once: every destination a plain CPU tensor (no staging buffer)."""
        return all(_direct(dst) for _, _, dst in jobs)

    def read_into(self, layer: int, expert: int, dst: Mapping[str, torch.Tensor]) -> tuple[str, int]:
        i = self.index[(layer, expert)]
        offset = i * self.expert_bytes
        staged = not _direct(dst)
        c = 0
        for name, (shape, dtype) in self.shapes.items():
            out = dst[name]
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            if not staged:  # straight into the destination; the first read's CRC over it (the GIL freed)
                _read_exact(self._fd, self.path, out, offset)
                if not self._checked[i]:
                    c = crc32(memoryview(out.view(torch.uint8).reshape(-1).numpy()), c)
            else:  # through a host buffer: to the device
                staging = self._staging.get(name)
                if staging is None:
                    staging = self._staging[name] = torch.empty(shape, dtype=dtype,
                                                                pin_memory=torch.cuda.is_available())
                _read_exact(self._fd, self.path, staging, offset)
                if not self._checked[i]:
                    c = crc32(memoryview(staging.view(torch.uint8).reshape(-1).numpy()), c)
                out.copy_(staging)
            offset += nbytes
        if not self._checked[i]:
            if c != self.crc[i]:
                self._damaged(layer, expert)
            self._checked[i] = 1
        return DISK, self.expert_bytes

    def close(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self):
        self.close()


def default_repack_dir(model_dir: str | os.PathLike, fmt: str) -> Path:
    """Where `--expert-format` keeps a model's converted experts: $XDG_CACHE_HOME/moechat/repacked/<model>-<fmt>
    (the model key changes with its path and config.json, like its routing profile)."""
    from .prefetch import profile_key

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moechat" / "repacked" / f"{profile_key(model_dir)}-{fmt}"


def _json_or_none(path: Path):
    """A sidecar's JSON, or None when it is missing or damaged (a FIFO, a huge file, bad JSON): then it is rebuilt."""
    from ..errors import MoechatError
    from ..io.files import read_json_file

    try:
        return read_json_file(path, "repack sidecar")
    except (MoechatError, OSError):
        return None
