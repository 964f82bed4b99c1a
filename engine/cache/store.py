"""Where experts live when they are not in a slot: the host tier (RAM) over the disk tier.

An expert is a set of named tensors, as its format stores them (`w13` [2I, H] ([I, H]: up alone for ungated
experts, Nemotron-H's relu^2), `w2` [H, I] at full
width; `w13_blocks`, `w13_scales`, ... packed): a store copies one expert's stored bytes into the slot
views it is given and says which tier the bytes came from. Packed experts stay packed in every tier.
The stores:

* `DiskStore` reads an expert straight from the safetensors shards with `os.preadv` into the
  destination memory: no mmap, so streamed experts do not pile up in the process's RSS, and a
  per-expert read is 2-3 contiguous ranges (gate, up, down) of the shard. Measured against the mmap
  path in `bench/offload.py`.
* `RamStore` (engine/cache/ram_tier.py): every expert in RAM (pinned when CUDA is present, so copies to the device
  are DMA).
* `RamCache` (engine/cache/ram_tier.py): a fixed slab of N experts (N = budget // expert bytes, allocated once, so
  the tier can never exceed its budget) managed by an eviction policy, over a `DiskStore`.
* `RepackedStore` (engine/cache/repacked.py): the disk tier from a repacked file, one read an expert.

Every float expert byte is checked for NaN/Inf the first time it is read, in the read itself: native_check.c preads
512 KB at a time into the destination and scans each chunk's exponent bits while it is in the cache, so the check
costs ~nothing beside the read (it was ~40% of a bf16 load as a separate `aminmax` pass). Filling a whole tier
(`fill`: the resident experts, `RamStore`) reads several experts at once, one thread each (the reads release
the GIL): on this 2-core VM most of a fill is the kernel faulting in and zeroing fresh pages, which two threads
share (bench/load_time.py).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import CheckpointError
from ..io.checkpoint import Checkpoint, TensorInfo, check_finite, nonfinite_error
from ..quant.base import ExpertFormat, TensorSpec
from ..quant.dense import DENSE

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
    """Threads a fill or a big scan uses: the compute threads (--threads: native.c's pool where `set_threads` pinned
    it, else torch's intra-op count), at most 8."""
    lib = _native()
    n = getattr(lib, "moechat_pinned", None) if lib is not None else None
    return max(1, min(n or torch.get_num_threads(), 8))


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
