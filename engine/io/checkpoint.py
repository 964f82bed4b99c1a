"""Reading a Hugging Face checkpoint directory: JSON configs, the safetensors index and headers, tensors.

Nothing is materialised here. Headers are parsed and validated up front (a few KB per shard), so a
truncated shard, a header that points past the end of the file or an index naming a missing shard is
a typed `CheckpointError` naming the file *before* any weight is touched; tensors are then read through
`safetensors.safe_open`, which memory-maps the shard, so "loading" a 60 GB checkpoint costs page-cache
reads of exactly the tensors asked for, when they are asked for.

Pickle checkpoints (`pytorch_model.bin`, `*.pt`) are refused: unpickling runs arbitrary code.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from . import validate
from .files import open_regular, parse_json, read_json_file, read_json_object

# safetensors dtype tags -> torch dtypes. FP8/FP4-style tags are readable as raw bytes by the quant
# formats of a later issue; here only these can be computed with.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 0.5}
FLOAT_DTAGS = {"F64", "F32", "F16", "BF16"}

# A header is JSON of at most this many bytes (safetensors' own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000
PICKLE_NAMES = validate.PICKLE_NAMES


def read_json(path: Path, what: str) -> dict:
    """Parse a JSON file into a dict, or raise ConfigError naming the file and the problem. A FIFO, a device or
    a file past the size cap is refused before it is read (engine/io/files.py)."""
    return read_json_object(path, what)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it."""

    name: str
    file: Path
    dtype: str  # safetensors tag: "BF16", "F32", ...
    shape: tuple[int, ...]
    start: int  # byte offsets into the file, data section included
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one shard's header without reading any tensor data.

    Checked as strictly as the safetensors library checks what it memory-maps, because experts are read with
    preadv and never pass through it: every entry well-typed, offsets >= 0, sizes matching shape x dtype, inside
    the file, and no two tensors sharing a byte (an overlap or a negative offset would compute with another
    tensor's bytes, or the header's, as weights). A FIFO or a device is refused before it is read."""
    def error(message: str, tensor: str | None = None) -> CheckpointError:
        return CheckpointError(message, path=str(path), tensor=tensor)

    try:
        fd = open_regular(path, "safetensors shard", error)
    except FileNotFoundError:
        raise error(f"{path}: safetensors shard not found") from None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise error(f"{path}: file is {size} bytes, too short to be safetensors "
                        "(truncated download? delete it and download again)")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
            raise error(f"{path}: header length {hlen} runs past the end of the {size}-byte file "
                        "(truncated or not a safetensors file: download it again)")
        raw = bytearray()
        while len(raw) < hlen:
            chunk = os.pread(fd, hlen - len(raw), 8 + len(raw))
            if not chunk:
                raise error(f"{path}: the file ended inside its {hlen}-byte header (truncated: download it again)")
            raw += chunk
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    header = parse_json(bytes(raw), str(path), "safetensors header",
                        lambda m: error(m + "; the file is corrupt: download it again"))
    if not isinstance(header, dict):
        raise error(f"{path}: safetensors header is not valid JSON (a {type(header).__name__}, not an object); "
                    "the file is corrupt: download it again")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise error(f"{path}: the header's __metadata__ must map strings to strings; the file is corrupt")
    data_start = 8 + hlen
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtag = entry.get("dtype") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(dtag, str) and isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(x) for x in offsets)):
            raise error(f"{path}: malformed header entry for tensor {name!r} (needs a dtype string, a shape of "
                        "integers >= 0 and two integer data_offsets); the file is corrupt", name)
        if dtag not in DTYPE_SIZES:
            raise error(f"{path}: tensor {name!r} has unknown dtype {dtag!r}", name)
        numel = 1
        for d in shape:
            numel *= d
        begin, end = offsets
        if begin < 0 or end < begin or end - begin != numel * DTYPE_SIZES[dtag]:
            raise error(f"{path}: tensor {name!r} header is inconsistent (shape {shape}, {dtag}, offsets "
                        f"{begin}..{end}); the file is corrupt", name)
        if data_start + end > size:
            raise error(f"{path}: tensor {name!r} ends at byte {data_start + end} but the file has {size} bytes "
                        "(truncated download? delete it and download again)", name)
        out[name] = TensorInfo(name, path, dtag, tuple(shape), data_start + begin, data_start + end)
    previous = None
    for info in sorted(out.values(), key=lambda t: (t.start, t.end)):
        if previous is not None and info.start < previous.end:
            raise error(f"{path}: tensors {previous.name!r} (bytes {previous.start}..{previous.end}) and {info.name!r} "
                        f"(bytes {info.start}..{info.end}) overlap; the file is corrupt or crafted: download it "
                        "again", info.name)
        if info.end > info.start:
            previous = info
    return out


def tensors_from_entries(where: str, entries: dict, shards: dict[str, str] | None = None) -> dict[str, TensorInfo]:
    """Header entries fetched from elsewhere (the Hub: name -> object with .dtype, .shape, .nbytes) as TensorInfos
    `Checkpoint` can be checked over, each entry held to the rules a local header is: a known dtype, a shape of
    integers >= 0, a size of shape x dtype. Each names `where`/its shard (`shards`: tensor -> file name, when
    known) as its file. Offsets are unknown: each tensor starts at 0 (nothing is read)."""
    out = {}
    shards = shards or {}
    for name, entry in entries.items():
        dtag, shape, nbytes = (getattr(entry, k, None) for k in ("dtype", "shape", "nbytes"))
        shape = tuple(shape) if isinstance(shape, (list, tuple)) else None
        if not (isinstance(dtag, str) and shape is not None and all(_is_int(d) and d >= 0 for d in shape)
                and _is_int(nbytes)):
            raise CheckpointError(f"{where}: malformed header entry for tensor {name!r} (needs a dtype string and a "
                                  "shape of integers >= 0)", path=where, tensor=name)
        if dtag not in DTYPE_SIZES:
            raise CheckpointError(f"{where}: tensor {name!r} has unknown dtype {dtag!r}", path=where, tensor=name)
        numel = 1
        for d in shape:
            numel *= d
        if nbytes != numel * DTYPE_SIZES[dtag]:
            raise CheckpointError(f"{where}: tensor {name!r} header is inconsistent (shape {list(shape)}, {dtag}, "
                                  f"{nbytes} bytes); the file is corrupt", path=where, tensor=name)
        file = Path(where) / shards[name] if name in shards else Path(where)
        out[name] = TensorInfo(name, file, dtag, shape, 0, nbytes)
    return out


def check_finite(t: torch.Tensor, name: str, file: str | os.PathLike, what: str = "") -> None:
    """CheckpointError naming the tensor when a floating tensor holds NaN or Inf; integer (packed) tensors pass.

    One `aminmax` pass, which propagates NaN and shows an Inf as the min or max: ~4-10 GB/s on one CPU core for
    bf16, against ~0.3 GB/s for `isfinite(t).all()`. FP8 has no Inf; its NaN is a bit pattern (E4M3: S.1111.111).
    The reference, and the path without the native library: loading scans the exponent bits in C instead, fused
    with the read (engine/quant/native_check.c, cache/store.py's `scan_finite`)."""
    if t.numel() == 0:
        return
    if t.dtype == torch.float8_e4m3fn:
        bad = bool(torch.bitwise_and(t.view(torch.uint8), 0x7F).eq_(0x7F).any())
    elif t.dtype == torch.float8_e5m2:
        bad = bool(torch.bitwise_and(t.view(torch.uint8), 0x7C).eq_(0x7C).any())
    elif t.is_floating_point():
        lo, hi = torch.aminmax(t)
        bad = not (torch.isfinite(lo) and torch.isfinite(hi))
    else:
        return
    if bad:
        raise nonfinite_error(t, name, file, what)


def nonfinite_error(t: torch.Tensor, name: str, file: str | os.PathLike, what: str = "") -> CheckpointError:
    """The error for a tensor found to hold NaN or Inf (here, or by the native scan of engine/quant/native_check.c
    as it is read): the tensor, the file, `what` (which expert), and how many values are bad."""
    values = t.float() if t.dtype.itemsize == 1 else t
    n = int((~torch.isfinite(values)).sum()) if t.dtype.itemsize > 1 else "some"
    return CheckpointError(f"{file}: tensor {name!r}{what} holds NaN or Inf ({n} of {t.numel():,} values); the "
                           "weights are damaged: download the model again", path=str(file), tensor=name)


class Checkpoint:
    """The safetensors weights of a model directory: validated headers plus lazy, memory-mapped reads."""

    def __init__(self, model_dir: Path, tensors: dict[str, TensorInfo]):
        self.model_dir = model_dir
        self.tensors = tensors
        self._handles: dict[Path, object] = {}

    @classmethod
    def open(cls, model_dir: str | os.PathLike) -> Checkpoint:
        model_dir = Path(model_dir)
        index_path = model_dir / "model.safetensors.index.json"
        if os.path.lexists(index_path):
            index = read_json_file(index_path, "safetensors index",
                                   error=lambda m: CheckpointError(m, path=str(index_path)))
            weight_map = validate.check_index(index, str(index_path))["weight_map"]
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not os.path.lexists(model_dir / shard):
                    raise CheckpointError(f"{index_path}: names shard {shard!r}, which is missing from {model_dir} "
                                          "(incomplete download? download the model again)",
                                          path=str(model_dir / shard))
        else:
            shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
            weight_map = None
        if not shards:
            pickles = [n for n in PICKLE_NAMES if (model_dir / n).exists()]
            if pickles:
                raise CheckpointError(f"{model_dir}: only pickle weights ({', '.join(pickles)}); moechat loads "
                                      "safetensors only, since unpickling can run arbitrary code. Use the "
                                      "model's safetensors variant.", path=str(model_dir / pickles[0]))
            raise CheckpointError(f"{model_dir}: no *.safetensors weights found", path=str(model_dir))
        tensors: dict[str, TensorInfo] = {}
        for shard in shards:
            for name, info in read_safetensors_header(model_dir / shard).items():
                if weight_map is not None and weight_map.get(name, shard) != shard:
                    continue  # the index says another shard owns it
                if name in tensors:
                    raise CheckpointError(f"{model_dir / shard}: tensor {name!r} also appears in "
                                          f"{tensors[name].file.name}", path=str(model_dir / shard), tensor=name)
                tensors[name] = info
        if weight_map is not None:
            for name, shard in weight_map.items():
                if name not in tensors:
                    raise CheckpointError(f"{model_dir / shard}: the index says tensor {name!r} is here, but the "
                                          "shard's header has no such tensor", path=str(model_dir / shard),
                                          tensor=name)
        return cls(model_dir, tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} is missing from the checkpoint",
                                  path=str(self.model_dir), tensor=name) from None

    def check(self, name: str, shape: tuple[int, ...], *, floating: bool = True) -> TensorInfo:
        """The tensor's header, after checking it exists with this shape (and a float dtype)."""
        info = self.info(name)
        if info.shape != tuple(shape):
            raise CheckpointError(f"{info.file}: tensor {name!r} has shape {list(info.shape)}, the config implies "
                                  f"{list(shape)} (config.json and weights disagree)", path=str(info.file), tensor=name)
        if floating and info.dtype not in FLOAT_DTAGS:
            raise CheckpointError(f"{info.file}: tensor {name!r} is stored as {info.dtype}; moechat expects "
                                  "F32, F16 or BF16 here (quantised checkpoints are not supported yet)",
                                  path=str(info.file), tensor=name)
        return info

    def get(self, name: str) -> torch.Tensor:
        """The tensor, memory-mapped (no copy until it is converted or moved)."""
        info = self.info(name)
        handle = self._handles.get(info.file)
        if handle is None:
            try:
                handle = safe_open(str(info.file), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own SafetensorError for corrupt files
                raise CheckpointError(f"{info.file}: cannot open: {e}", path=str(info.file)) from None
            self._handles[info.file] = handle
        try:
            return handle.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{info.file}: cannot read tensor {name!r}: {e}", path=str(info.file),
                                  tensor=name) from None

    def files(self) -> list[Path]:
        return sorted({t.file for t in self.tensors.values()})

    def close(self) -> None:
        self._handles.clear()
