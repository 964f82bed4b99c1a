"""Reading a Hugging Face checkpoint directory: JSON configs, the safetensors index and headers, tensors.

Nothing is materialised here. Headers are parsed and validated up front (a few KB per shard), so a
truncated shard, a header that points past the end of the file or an index naming a missing shard is
a typed `CheckpointError` naming the file *before* any weight is touched; tensors are then read through
`safetensors.safe_open`, which memory-maps the shard, so "loading" a 60 GB checkpoint costs page-cache
reads of exactly the tensors asked for, when they are asked for.

Pickle checkpoints (`pytorch_model.bin`, `*.pt`) are refused: unpickling runs arbitrary code.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import CheckpointError, ConfigError

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
PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")


def read_json(path: Path, what: str) -> dict:
    """Parse a JSON file into a dict, or raise ConfigError naming the file and the problem."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read {what}: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: {what} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: {what} must be a JSON object, found {type(data).__name__}")
    return data


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


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one shard's header without reading any tensor data."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: file is {size} bytes, too short to be safetensors "
                                      "(truncated download? delete it and download again)", path=str(path))
            (hlen,) = struct.unpack("<Q", head)
            if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
                raise CheckpointError(f"{path}: header length {hlen} runs past the end of the {size}-byte file "
                                      "(truncated or not a safetensors file: download it again)", path=str(path))
            raw = f.read(hlen)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}", path=str(path)) from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e}); the file is corrupt: "
                              "download it again", path=str(path)) from None
    data_start = 8 + hlen
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtag = meta["dtype"]
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}", path=str(path),
                                  tensor=name) from None
        numel = 1
        for d in shape:
            numel *= d
        if dtag not in DTYPE_SIZES:
            raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtag!r}", path=str(path), tensor=name)
        if any(d < 0 for d in shape) or end < begin or end - begin != numel * DTYPE_SIZES[dtag]:
            raise CheckpointError(f"{path}: tensor {name!r} header is inconsistent (shape {list(shape)}, "
                                  f"{dtag}, offsets {begin}..{end}); the file is corrupt", path=str(path), tensor=name)
        if data_start + end > size:
            raise CheckpointError(f"{path}: tensor {name!r} ends at byte {data_start + end} but the file has "
                                  f"{size} bytes (truncated download? delete it and download again)",
                                  path=str(path), tensor=name)
        out[name] = TensorInfo(name, path, dtag, shape, data_start + begin, data_start + end)
    return out


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
        if index_path.exists():
            index = read_json(index_path, "safetensors index")
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path}: has no 'weight_map'; the index is corrupt", path=str(index_path))
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not isinstance(shard, str) or "/" in shard or "\\" in shard or shard.startswith("."):
                    raise CheckpointError(f"{index_path}: names an invalid shard file {shard!r}", path=str(index_path))
                if not (model_dir / shard).is_file():
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
