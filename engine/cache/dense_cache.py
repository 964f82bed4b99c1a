"""The LM head in int8 (`--dense-format int8|int4`) kept from one load to the next, beside the repacked experts.

Why: quantizing a 151,936 x 2,048 bf16 head at every load read 622 MB and wrote 311 MB (0.14 s of an int8 load's 0.38
on a 2-core Zen 2, the largest step once the experts' checksums ran at ISA-L's rate). The codes and scales it gives
depend only on the head's bytes, so the first load writes them to `lm_head-int8.bin` (one file, through
`files.atomic_write`) and a sidecar naming the source file (name, size, inode, mtime), the shape, dtype and format, and
a CRC-32 of each tensor; a later load maps the file (MAP_PRIVATE: page-cache pages, no copy) and checks the CRCs
(~0.02 s). A sidecar that does not match, a CRC that fails, or a file that cannot be read is quantized again and
rewritten; a folder that refuses the write only costs the next load the quantization (the cache is never needed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from ..io.files import atomic_write
from .repacked import _json_or_none, crc32

VERSION = 1  # the layout of the file and the quantizer's bits (quant/intq.py); a change rebuilds every cached head


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


class HeadCache:
    """`get(weight, fmt)`: the head quantized in `fmt` (quant/dense_quant.py QuantLinear), from `directory` when a
    previous load left it there for the same source file, else quantized now and left there."""

    def __init__(self, directory: str | os.PathLike, source: str | os.PathLike):
        self.directory = Path(directory)
        self.source = Path(source)
        self.hit = False  # whether the last `get` mapped the cached file

    def _source_id(self) -> list:
        st = self.source.stat()
        return [self.source.name, st.st_size, st.st_ino, st.st_mtime_ns]

    def get(self, weight: torch.Tensor, fmt: str):
        from ..quant.dense_quant import QuantLinear

        path = self.directory / f"lm_head-{fmt}.bin"
        sidecar = path.with_suffix(".json")
        try:
            meta = {"version": VERSION, "format": fmt, "shape": list(weight.shape), "dtype": str(weight.dtype),
                    "source": self._source_id()}
        except OSError:  # no source file to key it by (a model built in memory): quantize, keep nothing
            return QuantLinear(weight, None, fmt)
        found = _json_or_none(sidecar)
        if isinstance(found, dict) and found.get("meta") == meta:
            got = self._mapped(path, found)
            if got is not None:
                self.hit = True
                return QuantLinear.packed(got["q"], got["scale"], None, fmt)
        self.hit = False
        head = QuantLinear(weight, None, fmt)
        self._write(path, sidecar, meta, {"q": head.q, "scale": head.scale})
        return head

    def _mapped(self, path: Path, found: dict) -> dict[str, torch.Tensor] | None:
        """The tensors as views of the file's private mapping, each CRC checked; None where anything disagrees."""
        tensors = found.get("tensors")
        try:
            st = path.stat()
            if found.get("file") != [st.st_size, st.st_ino, st.st_mtime_ns] or not isinstance(tensors, dict):
                return None
            data = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))
        except (OSError, ValueError):
            return None
        out = {}
        for name in ("q", "scale"):
            spec = tensors.get(name)
            try:
                offset, shape, dtype, crc = spec
                dt = getattr(torch, dtype.removeprefix("torch."))
                n = int(np.prod(shape)) * dt.itemsize
                raw = data[offset : offset + n]
                if raw.numel() != n or offset % dt.itemsize or crc32(memoryview(raw.numpy())) != crc:
                    return None
                out[name] = raw.view(dt).view(shape)
            except (TypeError, ValueError, AttributeError, RuntimeError):
                return None
        return out

    def _write(self, path: Path, sidecar: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        layout, at = {}, 0
        for name, t in tensors.items():
            layout[name] = [at, list(t.shape), str(t.dtype), crc32(_tensor_bytes(t))]
            at += t.numel() * t.element_size()

        def write(f) -> None:
            for t in tensors.values():
                f.write(_tensor_bytes(t))

        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            sidecar.unlink(missing_ok=True)  # no sidecar, no reuse: a crash mid-write leaves nothing trusted
            atomic_write(path, write, what="cached LM head")
            st = path.stat()
            atomic_write(sidecar, json.dumps({"meta": meta, "file": [st.st_size, st.st_ino, st.st_mtime_ns],
                                              "tensors": layout}), what="cached LM head's sidecar")
        except OSError:  # a full disk, a read-only folder: the next load quantizes again (this one has its head)
            pass
