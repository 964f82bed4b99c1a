"""Where experts live when they are not in a slot: the host tier (RAM) over the disk tier.

An expert is a set of named tensors (`w13` [2I, H], `w2` [H, I]); a store copies one expert into the
slot views it is given and says which tier the bytes came from. Three stores:

* `DiskStore` reads an expert straight from the safetensors shards with `os.preadv` into the
  destination memory: no mmap, so streamed experts do not pile up in the process's RSS, and a
  per-expert read is 2-3 contiguous ranges (gate, up, down) of the shard. Measured against the mmap
  path in `bench/offload.py`.
* `RamStore`: every expert in RAM (pinned when CUDA is present, so copies to the device are DMA).
* `RamCache`: a fixed slab of N experts (N = budget // expert bytes, allocated once, so the tier can
  never exceed its budget) managed by an eviction policy, over a `DiskStore`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import Checkpoint, TensorInfo
from ..errors import CheckpointError
from ..models.base import MoEForCausalLM
from .policy import make_policy

RAM, DISK = "ram", "disk"


@dataclass(frozen=True)
class Segment:
    """One contiguous byte range of a shard and the rows of a named expert tensor it fills."""

    name: str
    row_start: int
    row_end: int
    file: Path
    offset: int
    nbytes: int


def expert_shapes(args, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    I, H = args.moe_intermediate, args.hidden_size
    return {"w13": ((2 * I, H), dtype), "w2": ((H, I), dtype)}


class DiskStore:
    """Experts read from the shards on every request (the page cache may still help; see bench)."""

    tier = DISK

    def __init__(self, cls: type[MoEForCausalLM], args, ckpt: Checkpoint, dtype: torch.dtype):
        self.args = args
        self.dtype = dtype
        self.shapes = expert_shapes(args, dtype)
        self.expert_bytes = sum(torch.Size(s).numel() * d.itemsize for s, d in self.shapes.values())
        self._segments: dict[tuple[int, int], list[Segment]] = {}
        self._stored_dtype: torch.dtype | None = None
        from ..checkpoint import SAFETENSORS_DTYPES
        from ..loader import expert_tensor_names

        I, H, E = args.moe_intermediate, args.hidden_size, args.num_experts
        n = cls.expert_naming
        for layer in cls.moe_layers(args):
            fused = expert_tensor_names(cls, args, ckpt, layer)
            for e in range(E):
                if fused:
                    gu, dn = ckpt.info(fused[0]), ckpt.info(fused[1])
                    segs = [self._slice(gu, "w13", 0, 2 * I, e), self._slice(dn, "w2", 0, H, e)]
                    infos = [gu, dn]
                else:
                    infos = [ckpt.info(name.format(layer=layer, expert=e)) for name in (n.gate, n.up, n.down)]
                    segs = [self._whole(infos[0], "w13", 0, I), self._whole(infos[1], "w13", I, 2 * I),
                            self._whole(infos[2], "w2", 0, H)]
                for info in infos:
                    stored = SAFETENSORS_DTYPES[info.dtype]
                    if self._stored_dtype not in (None, stored):
                        raise CheckpointError(f"{info.file}: experts are stored in mixed dtypes ({info.dtype} and "
                                              f"{self._stored_dtype}); moechat streams one dtype", path=str(info.file),
                                              tensor=info.name)
                    self._stored_dtype = stored
                self._segments[(layer, e)] = segs
        self._fds: dict[Path, int] = {}
        self._staging: dict[str, torch.Tensor] = {}

    @staticmethod
    def _whole(info: TensorInfo, name: str, r0: int, r1: int) -> Segment:
        return Segment(name, r0, r1, info.file, info.start, info.nbytes)

    @staticmethod
    def _slice(info: TensorInfo, name: str, r0: int, r1: int, expert: int) -> Segment:
        per = info.nbytes // info.shape[0]  # bytes of one expert in a fused [E, ...] tensor
        return Segment(name, r0, r1, info.file, info.start + expert * per, per)

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def _pread(self, seg: Segment, out: torch.Tensor) -> None:
        _read_exact(self._fd(seg.file), seg.file, out, seg.offset)

    def read_into(self, layer: int, expert: int, dst: Mapping[str, torch.Tensor]) -> tuple[str, int]:
        direct = self._stored_dtype == self.dtype
        for seg in self._segments[(layer, expert)]:
            target = dst[seg.name][seg.row_start : seg.row_end]
            if direct and target.device.type == "cpu" and target.is_contiguous():
                self._pread(seg, target)
            else:  # convert dtype and/or cross to the device through a host staging buffer
                staging = self._staging_for(seg.name, target.shape)[: seg.row_end - seg.row_start]
                self._pread(seg, staging)
                target.copy_(staging)
        return DISK, self.expert_bytes

    def source_fingerprint(self) -> list:
        """The shards the experts come from (name, size, mtime): a repacked copy is valid while these hold."""
        files = sorted({seg.file for segs in self._segments.values() for seg in segs})
        return [[f.name, f.stat().st_size, int(f.stat().st_mtime)] for f in files]

    def _staging_for(self, name: str, shape) -> torch.Tensor:
        full = self.shapes[name][0]
        buf = self._staging.get(name)
        if buf is None:
            buf = torch.empty(full, dtype=self._stored_dtype, pin_memory=torch.cuda.is_available())
            self._staging[name] = buf
        return buf

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _read_exact(fd: int, path: Path, out: torch.Tensor, offset: int) -> None:
    """Fill a contiguous CPU tensor with its size in bytes from `offset` of the file."""
    view = memoryview(out.view(torch.uint8).numpy()).cast("B")  # the tensor's own bytes
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"{path}: ended while reading an expert at byte {offset + done} "
                                  "(was the file truncated or replaced while moechat ran?)", path=str(path))
        done += n


class RepackedStore:
    """The disk tier from a repacked file: each expert's tensors back to back, in the compute dtype.

    One read per expert instead of 2-3 scattered ranges of the shards, and no dtype conversion:
    `bench/offload.py` measured 2,700 vs 1,770 MiB/s cold on the CI machine. It costs as much
    disk as the experts, so it is opt-in (`--repack-dir`). Written once through a `.partial` file and
    a sidecar JSON naming its source; a later run reuses it only when the sidecar matches.
    """

    tier = DISK

    def __init__(self, disk: DiskStore, layers: list[int], num_experts: int, directory: Path):
        self.disk = disk
        self.shapes = disk.shapes
        self.expert_bytes = disk.expert_bytes
        keys = [(layer, e) for layer in layers for e in range(num_experts)]
        self.index = {key: i for i, key in enumerate(keys)}
        self.path = Path(directory) / "experts.bin"
        meta = {"format": 1, "layers": layers, "num_experts": num_experts, "expert_bytes": self.expert_bytes,
                "tensors": {name: [list(shape), str(dtype)] for name, (shape, dtype) in self.shapes.items()},
                "source": disk.source_fingerprint()}
        sidecar = self.path.with_suffix(".json")
        if not (self.path.exists() and sidecar.exists() and _json_or_none(sidecar) == meta
                and self.path.stat().st_size == self.expert_bytes * len(keys)):
            self._write(keys, meta, sidecar)
        self._fd = os.open(self.path, os.O_RDONLY)
        self._staging: dict[str, torch.Tensor] = {}

    def _write(self, keys, meta: dict, sidecar: Path) -> None:
        need = self.expert_bytes * len(keys)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.path.parent).free
        if free < need:
            raise CheckpointError(f"{self.path.parent}: repacking the experts needs {need / 2**30:.2f} GiB, "
                                  f"{free / 2**30:.2f} GiB free: free {(need - free) / 2**30:.2f} GiB or drop "
                                  "--repack-dir", path=str(self.path))
        partial = self.path.with_suffix(".partial")
        buf = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in self.shapes.items()}
        try:
            with open(partial, "wb") as f:
                for layer, e in keys:
                    self.disk.read_into(layer, e, buf)
                    for name in self.shapes:
                        f.write(memoryview(buf[name].view(torch.uint8).numpy()))
            os.replace(partial, self.path)
            sidecar.write_text(json.dumps(meta))
        except OSError as e:
            partial.unlink(missing_ok=True)
            raise CheckpointError(f"{self.path}: could not write the repacked experts ({e.strerror}); free disk "
                                  "space or drop --repack-dir", path=str(self.path)) from None

    def read_into(self, layer: int, expert: int, dst: Mapping[str, torch.Tensor]) -> tuple[str, int]:
        offset = self.index[(layer, expert)] * self.expert_bytes
        for name, (shape, dtype) in self.shapes.items():
            out = dst[name]
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            if out.device.type == "cpu" and out.is_contiguous():
                _read_exact(self._fd, self.path, out, offset)
            else:  # to the device through a pinned host buffer
                staging = self._staging.get(name)
                if staging is None:
                    staging = self._staging[name] = torch.empty(shape, dtype=dtype,
                                                                pin_memory=torch.cuda.is_available())
                _read_exact(self._fd, self.path, staging, offset)
                out.copy_(staging)
            offset += nbytes
        return DISK, self.expert_bytes

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def _json_or_none(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class RamStore:
    """Every expert in RAM, stacked per layer; filled once from the disk store."""

    tier = RAM

    def __init__(self, disk: DiskStore, layers: list[int], num_experts: int):
        pin = torch.cuda.is_available()
        self.disk = disk
        self.shapes = disk.shapes
        self.expert_bytes = disk.expert_bytes
        self.used_bytes = self.expert_bytes * len(layers) * num_experts
        self.budget_bytes = 0
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}
        for layer in layers:
            self.tensors[layer] = {name: torch.empty((num_experts, *shape), dtype=dtype, pin_memory=pin)
                                   for name, (shape, dtype) in self.shapes.items()}  # [E, ...]
            for e in range(num_experts):
                disk.read_into(layer, e, {name: t[e] for name, t in self.tensors[layer].items()})

    def read_into(self, layer: int, expert: int, dst: Mapping[str, torch.Tensor]) -> tuple[str, int]:
        src = self.tensors[layer]
        for name, out in dst.items():
            out.copy_(src[name][expert], non_blocking=True)
        return RAM, self.expert_bytes


class RamCache:
    """A RAM tier bounded by a byte budget, with its own eviction policy, over the disk tier."""

    tier = RAM

    def __init__(self, disk: DiskStore, budget_bytes: int, policy: str = "lru"):
        self.disk = disk
        self.shapes = disk.shapes
        self.expert_bytes = disk.expert_bytes
        self.budget_bytes = budget_bytes
        self.capacity = budget_bytes // self.expert_bytes
        pin = torch.cuda.is_available()
        self.slab = {name: torch.empty((self.capacity, *shape), dtype=dtype, pin_memory=pin)
                     for name, (shape, dtype) in self.shapes.items()}  # [N, ...], allocated once
        self.entry: dict[tuple[int, int], int] = {}
        self.owner: list[tuple[int, int] | None] = [None] * self.capacity
        self.policy = make_policy(policy, capacity=max(self.capacity, 1))
        self._copies: dict[int, torch.cuda.Event] = {}  # CUDA: slab entry -> its last async copy to the device

    @property
    def used_bytes(self) -> int:
        return len(self.entry) * self.expert_bytes

    def read_into(self, layer: int, expert: int, dst: Mapping[str, torch.Tensor]) -> tuple[str, int]:
        if self.capacity == 0:
            return self.disk.read_into(layer, expert, dst)
        key = (layer, expert)
        self.policy.access(key)
        idx = self.entry.get(key)
        tier = RAM
        if idx is None:
            tier = DISK
            if len(self.entry) < self.capacity:
                idx = len(self.entry)
            else:
                victim = self.policy.victim(())
                idx = self.entry.pop(victim)
                self.policy.evict(victim)
            pending = self._copies.pop(idx, None)
            if pending is not None:
                pending.synchronize()  # an async copy out of this entry may still be reading it
            self.disk.read_into(layer, expert, {name: t[idx] for name, t in self.slab.items()})
            self.entry[key] = idx
            self.owner[idx] = key
            self.policy.admit(key)
            assert self.used_bytes <= self.budget_bytes
        for name, out in dst.items():
            out.copy_(self.slab[name][idx], non_blocking=True)
        if out.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(out.device))
            self._copies[idx] = event
        return tier, self.expert_bytes
