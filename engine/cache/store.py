"""Where experts live when they are not in a slot: the host tier (RAM) over the disk tier.

An expert is a set of named tensors, as its format stores them (`w13` [2I, H] ([I, H]: up alone for ungated
experts, Nemotron-H's relu^2), `w2` [H, I] at full
width; `w13_blocks`, `w13_scales`, ... packed): a store copies one expert's stored bytes into the slot
views it is given and says which tier the bytes came from. Packed experts stay packed in every tier.
Three stores:

* `DiskStore` reads an expert straight from the safetensors shards with `os.preadv` into the
  destination memory: no mmap, so streamed experts do not pile up in the process's RSS, and a
  per-expert read is 2-3 contiguous ranges (gate, up, down) of the shard. Measured against the mmap
  path in `bench/offload.py`.
* `RamStore`: every expert in RAM (pinned when CUDA is present, so copies to the device are DMA).
* `RamCache`: a fixed slab of N experts (N = budget // expert bytes, allocated once, so the tier can
  never exceed its budget) managed by an eviction policy, over a `DiskStore`.

Every float expert byte is checked for NaN/Inf the first time it is read, in the read itself: native_check.c preads
512 KB at a time into the destination and scans each chunk's exponent bits while it is in the cache, so the check
costs ~nothing beside the read (it was ~40% of a bf16 load as a separate `aminmax` pass). Filling a whole tier
(`fill`: the resident experts, `RamStore`) reads several experts at once, one thread each (the reads release
the GIL): on this 2-core VM most of a fill is the kernel faulting in and zeroing fresh pages, which two threads
share (bench/load_time.py).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import CheckpointError
from ..io.checkpoint import Checkpoint, TensorInfo, check_finite, nonfinite_error
from ..io.files import UnwritableFileError, atomic_write
from ..quant.base import ExpertFormat, TensorSpec
from ..quant.dense import DENSE
from .policy import make_policy
from .slots import SlotLayout

if TYPE_CHECKING:  # a type only: the cache never imports the model files
    from ..models.base import MoEForCausalLM

RAM, DISK = "ram", "disk"


# -- NaN/Inf checks and parallel fills ----------------------------------------------------------------------------
def _native():
    """The kernel library when it is built (its NaN/Inf scan and checked pread), else None: torch's check."""
    from ..quant import native

    return native.library()


_POOL: list = []  # [the executor, the pid that made it]
_POOL_LOCK = threading.Lock()


def read_threads() -> int:
    """Threads a fill or a big scan uses: torch's intra-op count (--threads), at most 8."""
    return max(1, min(torch.get_num_threads(), 8))


def _pool() -> ThreadPoolExecutor:
    """The reading threads, made at first use, and again in a forked child (whose copy of the pool has no threads)."""
    with _POOL_LOCK:
        if not _POOL or _POOL[1] != os.getpid():
            _POOL[:] = [ThreadPoolExecutor(8, thread_name_prefix="moechat-read"), os.getpid()]
        return _POOL[0]


SCAN_SPLIT = 64 << 20  # bytes: a tensor past this is scanned by read_threads() threads at once


def scan_finite(t: torch.Tensor, name: str, file, what: str = "") -> None:
    """`check_finite` (the same typed error naming the tensor, the file and `what`) through the native exponent-bit
    scan when the library is built and t is a contiguous CPU float tensor: one pass at memory speed, split over
    threads for a big tensor (a memory-mapped embedding table); otherwise check_finite itself."""
    from ..quant.native import CHECK_KINDS, first_nonfinite

    lib = _native()
    if lib is None or t.dtype not in CHECK_KINDS or t.device.type != "cpu" or not t.is_contiguous():
        return check_finite(t, name, file, what)
    flat = t.reshape(-1)
    parts = min(read_threads(), -(-flat.numel() * flat.element_size() // SCAN_SPLIT))
    if parts <= 1:
        bad = first_nonfinite(lib, flat) >= 0
    else:
        step = -(-flat.numel() // parts)
        bad = any(i >= 0 for i in _pool().map(lambda a: first_nonfinite(lib, flat[a : a + step]),
                                               range(0, flat.numel(), step)))
    if bad:
        raise nonfinite_error(t, name, file, what)


def fill(store, jobs: Sequence[tuple[int, int, Mapping[str, torch.Tensor]]]) -> None:
    """`store.read_into(layer, expert, dst)` for every job, `read_threads()` at a time where the store can read
    these destinations at once (`parallel_reads`: plain CPU tensors, no shared staging buffer), else in turn. The
    first failing job in order raises its own error, whatever the threads' timing."""
    threads = read_threads()
    can = getattr(store, "parallel_reads", None)
    if threads <= 1 or len(jobs) < 2 or can is None or not can(jobs):
        for layer, expert, dst in jobs:
            store.read_into(layer, expert, dst)
        return
    futures = [_pool().submit(store.read_into, *job) for job in jobs[:threads]]
    try:  # at most `threads` reads in flight (the pool's 8 threads serve every caller): each done one starts the next
        for i in range(len(jobs)):
            futures[i].result()
            if i + threads < len(jobs):
                futures.append(_pool().submit(store.read_into, *jobs[i + threads]))
    finally:
        for f in futures:  # none left running past a failure (they write into the caller's buffers)
            f.cancel() or f.exception()


MADV_POPULATE_READ = 22  # Linux 5.14+: fault every page of a range in now, as a read would


def populate(t: torch.Tensor) -> None:
    """Map every page under a memory-mapped tensor now (page-cache pages; from disk where the cache lacks them),
    so the first tokens do not fault them in one by one; best effort (an older kernel: they fault in as used)."""
    from . import hostmem

    madvise = hostmem._madvise()
    if madvise is None or t.numel() == 0:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    madvise(start, t.data_ptr() + t.numel() * t.element_size() - start, MADV_POPULATE_READ)


def _direct(dst: Mapping[str, torch.Tensor]) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in dst.values())


@dataclass(frozen=True)
class Segment:
    """One contiguous byte range of a shard and the rows of a named expert tensor it fills."""

    name: str
    row_start: int
    row_end: int
    file: Path
    offset: int
    nbytes: int
    stored: torch.dtype  # the dtype of the bytes in the shard (converted on the way when it is not the slot's)
    tensor: str = ""  # the checkpoint tensor the bytes belong to (named when they hold NaN or Inf)


def expert_shapes(args, dtype: torch.dtype, fmt: ExpertFormat = DENSE) -> dict[str, TensorSpec]:
    """The stored tensors of one expert of this model in this format (what every tier holds)."""
    if not args.gated_experts:  # w13 = up alone ([I, H]); GGUF layouts take no `gated` (no ungated GGUF is read)
        return fmt.layout(args.hidden_size, args.moe_intermediate, dtype, bias=args.expert_bias, gated=False)
    return fmt.layout(args.hidden_size, args.moe_intermediate, dtype, bias=args.expert_bias)


def expert_tensor_names(cls: type[MoEForCausalLM], args, ckpt: Checkpoint,
                        layer: int) -> tuple[str, ...]:
    """Which naming this checkpoint uses for a layer's experts: per-expert (3 per expert) or fused."""
    n = cls.expert_naming
    fused = n.fused_gate_up.format(layer=layer), n.fused_down.format(layer=layer)
    if fused[0] in ckpt and fused[1] in ckpt:
        return fused
    return ()


class DiskStore:
    """Experts read from the shards on every request (the page cache may still help; see bench).

    Building one checks every expert tensor's name, shape and dtype against the format's layout (a typed
    error naming the tensor), without reading any weight."""

    tier = DISK

    def __init__(self, cls: type[MoEForCausalLM], args, ckpt: Checkpoint, dtype: torch.dtype,
                 fmt: ExpertFormat = DENSE):
        self.args = args
        self.dtype = dtype
        self.format = fmt
        self.shapes = expert_shapes(args, dtype, fmt)
        self.expert_bytes = sum(torch.Size(s).numel() * d.itemsize for s, d in self.shapes.values())
        self._segments: dict[tuple[int, int], list[Segment]] = {}
        E = args.num_experts
        for layer in cls.moe_layers(args):
            per_expert = self._layer_segments(cls, args, ckpt, layer)
            for e in range(E):
                self._segments[(layer, e)] = per_expert(e)
        self._fds: dict[Path, int] = {}
        self._staging: dict[str, torch.Tensor] = {}
        self._finite: set[tuple[int, int]] = set()  # experts whose weights were checked for NaN/Inf this run

    def _layer_segments(self, cls, args, ckpt: Checkpoint, layer: int):
        """expert -> its segments, after checking this layer's expert tensors."""
        I, H, E = args.moe_intermediate, args.hidden_size, args.num_experts
        n = cls.expert_naming
        fmt = self.format
        scale_suffix = getattr(fmt, "scale_suffix", None)
        if scale_suffix is not None and fmt.name not in n.packed:
            return self._scaled_per_expert(n, ckpt, layer, scale_suffix)
        if fmt.packed or args.expert_bias:
            names = getattr(fmt, "tensor_names", None) or n.packed.get(fmt.name)  # GGUF: the format names its own
            if names is None:
                raise CheckpointError(f"{ckpt.model_dir}: {args.model_type} experts cannot be read in the "
                                      f"{fmt.name} format (moechat reads them as {', '.join(n.packed) or 'dense'})",
                                      path=str(ckpt.model_dir))
            infos = {}
            for name, (shape, _) in self.shapes.items():
                if name not in names:
                    raise CheckpointError(f"{ckpt.model_dir}: no checkpoint tensor for expert {name}",
                                          path=str(ckpt.model_dir))
                info = ckpt.info(names[name].format(layer=layer))
                self._check(info, name, (E, *shape))
                infos[name] = info
            return lambda e: [self._slice(info, name, 0, self.shapes[name][0][0], e) for name, info in infos.items()]
        fused = expert_tensor_names(cls, args, ckpt, layer)
        rows13 = (2 if args.gated_experts else 1) * I
        if fused:
            gu, dn = ckpt.info(fused[0]), ckpt.info(fused[1])
            self._check(gu, "w13", (E, rows13, H))
            self._check(dn, "w2", (E, H, I))
            return lambda e: [self._slice(gu, "w13", 0, rows13, e), self._slice(dn, "w2", 0, H, e)]
        if not args.gated_experts:  # up (w13's I rows) and down: no gate projection
            def per_expert_ungated(e: int) -> list[Segment]:
                infos = [ckpt.info(name.format(layer=layer, expert=e)) for name in (n.up, n.down)]
                self._check(infos[0], "w13", (I, H))
                self._check(infos[1], "w2", (H, I))
                return [self._whole(infos[0], "w13", 0, I), self._whole(infos[1], "w2", 0, H)]

            return per_expert_ungated

        def per_expert(e: int) -> list[Segment]:
            infos = [ckpt.info(name.format(layer=layer, expert=e)) for name in (n.gate, n.up, n.down)]
            for info, name, shape in zip(infos, ("w13", "w13", "w2"), ((I, H), (I, H), (H, I)), strict=True):
                self._check(info, name, shape)
            return [self._whole(infos[0], "w13", 0, I), self._whole(infos[1], "w13", I, 2 * I),
                    self._whole(infos[2], "w2", 0, H)]

        return per_expert

    def _scaled_per_expert(self, n, ckpt: Checkpoint, layer: int, suffix: str):
        """Per-expert weights each with its own scale tensor (FP8: `gate_proj.weight` + `.weight_scale_inv`):
        gate and up fill w13's rows and w13_scale's rows in turn, down fills w2 and w2_scale."""
        (rows13, _), (srows13, _) = self.shapes["w13"][0], self.shapes["w13_scale"][0]
        gated = self.args.gated_experts
        I, nb = (rows13 // 2, srows13 // 2) if gated else (rows13, srows13)
        parts = (((n.gate, "w13", 0, 0), (n.up, "w13", I, nb)) if gated else ((n.up, "w13", 0, 0),)) + \
            ((n.down, "w2", 0, 0),)

        def per_expert(e: int) -> list[Segment]:
            segs = []
            for template, target, r0, s0 in parts:
                name = template.format(layer=layer, expert=e)
                w, scale = ckpt.info(name), ckpt.info(name + suffix)
                wshape = self.shapes[target][0]
                sshape = self.shapes[target + "_scale"][0]
                self._check(w, target, (I, wshape[1]) if target == "w13" else wshape)
                self._check(scale, target + "_scale", (nb, sshape[1]) if target == "w13" else sshape)
                segs.append(self._whole(w, target, r0, r0 + w.shape[0]))
                segs.append(self._whole(scale, target + "_scale", s0, s0 + scale.shape[0]))
            return segs

        return per_expert

    def _check(self, info: TensorInfo, name: str, shape: tuple[int, ...]) -> None:
        from ..io.checkpoint import FLOAT_DTAGS, SAFETENSORS_DTYPES

        if info.shape != tuple(shape):
            raise CheckpointError(f"{info.file}: tensor {info.name!r} has shape {list(info.shape)}, the config and "
                                  f"the {self.format.name} expert format imply {list(shape)}", path=str(info.file),
                                  tensor=info.name)
        want = self.shapes[name][1]
        full_width = want.is_floating_point and want.itemsize >= 2  # the compute dtype: any float is converted
        ok = info.dtype in FLOAT_DTAGS if full_width else SAFETENSORS_DTYPES.get(info.dtype) == want
        if not ok:
            need = "F32, F16 or BF16" if full_width else str(want).replace("torch.", "")
            raise CheckpointError(f"{info.file}: tensor {info.name!r} is stored as {info.dtype}; the "
                                  f"{self.format.name} expert format needs {need} here", path=str(info.file),
                                  tensor=info.name)

    @staticmethod
    def _stored(info: TensorInfo) -> torch.dtype:
        from ..io.checkpoint import SAFETENSORS_DTYPES

        return SAFETENSORS_DTYPES[info.dtype]

    @classmethod
    def _whole(cls, info: TensorInfo, name: str, r0: int, r1: int) -> Segment:
        return Segment(name, r0, r1, info.file, info.start, info.nbytes, cls._stored(info), info.name)

    @classmethod
    def _slice(cls, info: TensorInfo, name: str, r0: int, r1: int, expert: int) -> Segment:
        per = info.nbytes // info.shape[0]  # bytes of one expert in a fused [E, ...] tensor
        return Segment(name, r0, r1, info.file, info.start + expert * per, per, cls._stored(info), info.name)

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:  # two reading threads may both open it: one fd is kept
            fd = os.open(path, os.O_RDONLY)
            if self._fds.setdefault(path, fd) != fd:
                os.close(fd)
                fd = self._fds[path]
        return fd

    def _pread(self, seg: Segment, out: torch.Tensor) -> None:
        _read_exact(self._fd(seg.file), seg.file, out, seg.offset)

    def _read(self, seg: Segment, out: torch.Tensor, check: bool, layer: int, expert: int) -> None:
        """The segment's bytes into `out` (contiguous, CPU), checked for NaN/Inf as they land when `check`. A
        `_pread` set on the instance (bench/prefetch.py's cold reads) is used as it is, then scanned."""
        lib = _native()
        if lib is None or "_pread" in self.__dict__:
            self._pread(seg, out)
            if check:
                self._check_finite(seg, out, layer, expert)
            return
        from ..quant.native import read_checked

        n, bad = read_checked(lib, self._fd(seg.file), out, seg.offset, check)
        if n < 0:
            raise CheckpointError(f"{seg.file}: cannot read expert {expert} of layer {layer} at byte {seg.offset}: "
                                  f"{os.strerror(-n)}", path=str(seg.file), tensor=seg.tensor or None)
        if n < seg.nbytes:
            raise CheckpointError(f"{seg.file}: ended while reading an expert at byte {seg.offset + n} "
                                  "(was the file truncated or replaced while moechat ran?)", path=str(seg.file))
        if bad >= 0:
            raise nonfinite_error(out, seg.tensor or seg.name, seg.file, f" (expert {expert} of layer {layer})")

    def mapped_names(self, layer: int) -> dict[str, str] | None:
        """Stored name -> the checkpoint tensor that holds it for every expert of this layer, back to back as
        [E, *shape] in the slot's dtype (a fused checkpoint: GPT-OSS's MXFP4 blocks, scales and biases); None where
        any is split per expert (gate and up apart) or converted on the way. Where it is not None, a
        memory-mapped view of the shard is the layer's resident stack, byte for byte what `read_into` copies."""
        out: dict[str, str] = {}
        first: dict[str, int] = {}
        for e in range(self.args.num_experts):
            for seg in self._segments[(layer, e)]:
                shape, dtype = self.shapes[seg.name]
                if (seg.stored != dtype or seg.row_start != 0 or seg.row_end != shape[0] or not seg.tensor
                        or out.setdefault(seg.name, seg.tensor) != seg.tensor
                        or seg.offset != first.setdefault(seg.name, seg.offset) + e * seg.nbytes):
                    return None
        return out if set(out) == set(self.shapes) else None

    def parallel_reads(self, jobs) -> bool:
        """Whether `fill` may run these reads at once: each segment lands in its destination as stored (no shared
        staging buffer between them)."""
        for layer, expert, dst in jobs:
            if not _direct(dst) or any(seg.stored != dst[seg.name].dtype for seg in self._segments[(layer, expert)]):
                return False
        return True

    def read_into(self, layer: int, expert: int, dst: Mapping[str, torch.Tensor]) -> tuple[str, int]:
        first = (layer, expert) not in self._finite  # every tier fills from here: one NaN/Inf check per expert
        for seg in self._segments[(layer, expert)]:
            target = dst[seg.name][seg.row_start : seg.row_end]
            if seg.stored == target.dtype and target.device.type == "cpu" and target.is_contiguous():
                self._read(seg, target, first, layer, expert)
            else:  # convert dtype and/or cross to the device through a host staging buffer
                staging = self._staging_for(seg.name, seg.stored)[: seg.row_end - seg.row_start]
                self._read(seg, staging, first, layer, expert)  # checked on the host copy: no device sync
                target.copy_(staging)
        self._finite.add((layer, expert))
        return DISK, self.expert_bytes

    @staticmethod
    def _check_finite(seg: Segment, data: torch.Tensor, layer: int, expert: int) -> None:
        scan_finite(data, seg.tensor or seg.name, seg.file, f" (expert {expert} of layer {layer})")

    def source_fingerprint(self) -> list:
        """The shards the experts come from (name, size, mtime): a repacked copy is valid while these hold."""
        files = sorted({seg.file for segs in self._segments.values() for seg in segs})
        return [[f.name, f.stat().st_size, int(f.stat().st_mtime)] for f in files]

    def _staging_for(self, name: str, stored: torch.dtype) -> torch.Tensor:
        full = self.shapes[name][0]
        buf = self._staging.get(name)
        if buf is None or buf.dtype != stored:
            buf = torch.empty(full, dtype=stored, pin_memory=torch.cuda.is_available())
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
    """The disk tier from a repacked file: each expert's stored tensors back to back.

    One read per expert instead of 2-3 scattered ranges of the shards, and no dtype conversion:
    `bench/offload.py` measured 2,700 vs 1,770 MiB/s cold on the CI machine. With a `target` format
    (`--expert-format int8|int4`) the experts are quantized once, as the file is written, so every tier
    holds the small form. Written once through `files.atomic_write` (a temporary file beside it, fsynced, renamed:
    a symlinked `experts.bin` is written through, a device or FIFO there refused), then a sidecar JSON naming its source,
    its format, the file's size, inode and mtime, and a CRC-32 per expert. A later run reuses it only when
    the sidecar matches (a changed source, format or file is rebuilt); each expert's CRC is checked the
    first time it is read, and a mismatch is a typed error that also invalidates the file for next start.
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
        import zlib

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
                    c = zlib.crc32(data, c)
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
        import zlib

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
            return zlib.crc32(memoryview(rows[e].numpy()))  # zlib frees the GIL: experts side by side

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
        import zlib

        c = 0
        for name, (shape, dtype) in self.shapes.items():
            out = dst[name]
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            if not staged:  # straight into the destination; the first read's CRC over it (zlib frees the GIL)
                _read_exact(self._fd, self.path, out, offset)
                if not self._checked[i]:
                    c = zlib.crc32(memoryview(out.view(torch.uint8).reshape(-1).numpy()), c)
            else:  # through a host buffer: to the device
                staging = self._staging.get(name)
                if staging is None:
                    staging = self._staging[name] = torch.empty(shape, dtype=dtype,
                                                                pin_memory=torch.cuda.is_available())
                _read_exact(self._fd, self.path, staging, offset)
                if not self._checked[i]:
                    c = zlib.crc32(memoryview(staging.view(torch.uint8).reshape(-1).numpy()), c)
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


class RamStore:
    """Every expert in RAM, stacked per layer; filled once from the disk store."""

    tier = RAM

    def __init__(self, disk: DiskStore, layers: list[int], num_experts: int):
        pin = torch.cuda.is_available()
        self.disk = disk
        self.format = disk.format
        self.shapes = disk.shapes
        self.expert_bytes = disk.expert_bytes
        self.used_bytes = self.expert_bytes * len(layers) * num_experts
        self.budget_bytes = 0
        self.layout = SlotLayout(self.shapes)  # the slots' layout: a load is one copy of an expert's row
        self.raw: dict[int, torch.Tensor] = {}  # layer -> [E, slot_bytes] uint8
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}
        for layer in layers:
            self.raw[layer], self.tensors[layer] = self.layout.empty(num_experts, pin=pin)  # [E, ...] views
            fill(disk, [(layer, e, {name: t[e] for name, t in self.tensors[layer].items()})
                        for e in range(num_experts)])  # one read per segment into its row, experts side by side

    def read_into(self, layer: int, expert: int, dst: Mapping[str, torch.Tensor]) -> tuple[str, int]:
        src = self.tensors[layer]
        for name, out in dst.items():
            out.copy_(src[name][expert], non_blocking=True)
        return RAM, self.expert_bytes

    def raw_row(self, layer: int, expert: int) -> tuple[torch.Tensor, str, int]:
        """The expert's bytes in the slot layout [slot_bytes] (pinned under CUDA): the source of a one-copy load."""
        return self.raw[layer][expert], RAM, self.expert_bytes

    # -- host compute (hybrid execution): experts used in place, no copy --------------------------------
    def host_slot(self, layer: int, expert: int) -> tuple[dict[str, torch.Tensor], int, str, int]:
        """(host buffers [N, ...] by name, the expert's index in them, tier its bytes came from, bytes read)."""
        return self.tensors[layer], expert, RAM, 0

    def release_host(self) -> None:
        pass


class RamCache:
    """A RAM tier bounded by a byte budget, with its own eviction policy, over the disk tier."""

    tier = RAM

    def __init__(self, disk: DiskStore, budget_bytes: int, policy: str = "lru"):
        self.disk = disk
        self.format = disk.format
        self.shapes = disk.shapes
        self.expert_bytes = disk.expert_bytes
        self.budget_bytes = budget_bytes
        self.layout = SlotLayout(self.shapes)  # the slots' layout: a load is one copy of an entry's row
        self.capacity = budget_bytes // self.layout.nbytes  # entries with their alignment padding
        pin = torch.cuda.is_available()
        self.raw, self.slab = self.layout.empty(self.capacity, pin=pin)  # [N, slot_bytes], allocated once; views
        self.entry: dict[tuple[int, int], int] = {}
        self.owner: list[tuple[int, int] | None] = [None] * self.capacity
        self.policy = make_policy(policy, capacity=max(self.capacity, 1))
        self._copies: dict[int, torch.cuda.Event] = {}  # CUDA: slab entry -> its last async copy to the device
        self.pinned: set[tuple[int, int]] = set()  # entries a host computation of this step reads: never victims

    @property
    def used_bytes(self) -> int:
        return len(self.entry) * self.expert_bytes

    def read_into(self, layer: int, expert: int, dst: Mapping[str, torch.Tensor]) -> tuple[str, int]:
        if self.capacity == 0:
            return self.disk.read_into(layer, expert, dst)
        idx, tier = self._fill(layer, expert)
        if not dst:
            return tier, self.expert_bytes
        for name, out in dst.items():
            out.copy_(self.slab[name][idx], non_blocking=True)
        if out.is_cuda:
            self._copied(idx, torch.cuda.current_stream(out.device))
        return tier, self.expert_bytes

    def raw_row(self, layer: int, expert: int) -> tuple[torch.Tensor, str, int] | None:
        """The expert's slab row [slot_bytes] after reading it in from disk if needed (None with no slab): the
        source of a one-copy load. A caller copying it asynchronously calls `copied_from` after enqueuing."""
        if self.capacity == 0:
            return None
        idx, tier = self._fill(layer, expert)
        return self.raw[idx], tier, self.expert_bytes

    def copied_from(self, layer: int, expert: int, stream) -> None:
        """An async copy out of the expert's row was enqueued on the CUDA `stream`: a refill of the entry waits."""
        self._copied(self.entry[(layer, expert)], stream)

    def _copied(self, idx: int, stream) -> None:
        event = torch.cuda.Event()
        event.record(stream)
        self._copies[idx] = event

    def _fill(self, layer: int, expert: int) -> tuple[int, str]:
        """The slab entry holding the expert (read from disk when absent) and the tier it came from."""
        key = (layer, expert)
        self.policy.access(key)
        idx = self.entry.get(key)
        tier = RAM
        if idx is None:
            tier = DISK
            if len(self.entry) < self.capacity:
                idx = len(self.entry)
            else:
                victim = self.policy.victim(self.pinned)
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
        return idx, tier

    # -- host compute (hybrid execution) --------------------------------------------------------------------
    def host_slot(self, layer: int, expert: int) -> tuple[dict[str, torch.Tensor], int, str, int] | None:
        """The expert's slab entry for computing in place (read from disk into the slab first when needed; it
        stays pinned until `release_host`), or None when the RAM tier cannot hold one more for this step."""
        key = (layer, expert)
        # one entry always stays unpinned: the loads of this step pass through it
        if len(self.pinned) + 1 >= self.capacity:
            return None
        tier, nbytes = self.read_into(layer, expert, {})
        self.pinned.add(key)
        return self.slab, self.entry[key], tier, nbytes if tier == DISK else 0

    def release_host(self) -> None:
        self.pinned.clear()
