"""llama.cpp's importance matrix (imatrix) as a warm start for the expert cache.

Most GGUF releases ship the imatrix their quants were made with: llama-imatrix ran the model over a calibration
text and kept, per weight matrix, the sum of squares of its inputs and how many rows went through it. For the
stacked expert matrices (``blk.N.ffn_{gate,up,down}_exps.weight``) both are kept per expert, so the counts are a
routing profile of the calibration text: which experts each layer used, and how often. Filling the slots with each
layer's most used experts before the first token skips the cold start (the RFC measured 48-56% hits over the
first 80-160 tokens from it).

Two formats, both read here:
- GGUF (llama.cpp since 2025-07, the default output): ``general.type = imatrix``, per matrix the tensors
  ``<name>.in_sum2`` (F32, [n_mat, n_in]: raw sums of x^2) and ``<name>.counts`` (F32, [n_mat]: rows seen per
  expert), plus ``imatrix.chunk_count``, ``imatrix.chunk_size`` and ``imatrix.datasets``.
- the legacy ``.dat``: int32 n_entries, then per entry int32 name length, the name, int32 ncall, int32 nval and
  nval float32s = (sum / count) * ncall per expert row; then optionally int32 chunks and a dataset name. It keeps
  no per-expert counts (each expert's sums are divided by its own count), only which experts were never routed
  (llama.cpp stores 1.0 * ncall for those). Its experts are therefore ranked by their mean squared input, never
  routed ones last: a weaker order than counts, and said so in the notice.

Scores are per layer in [0, 1] (a layer's activation share per expert, or its rank for the .dat), so one flat sort
interleaves the layers: every layer's top experts come before any layer's tail.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ConfigError, MoechatError

MAX_IMATRIX_BYTES = 8 << 30  # a 1T-parameter model's imatrix is ~2 GB
MAX_NAME = 4096  # tensor names are < 100 bytes; a larger length is a damaged file
_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|gate_up|down)_exps\.weight$")
_KIND_ORDER = ("gate", "up", "gate_up", "down")  # the router's choice is the same for all: the first one wins
# The names llama.cpp (imatrix.gguf, imatrix.dat), unsloth (imatrix_unsloth.gguf) and others give it; the same rule
# as engine/plan/hub/names.py's is_imatrix_path, so what a pull fetches beside a quant is found here.
IMATRIX_NAMES = ("imatrix*.gguf", "imatrix*.dat", "*.imatrix.gguf", "*.imatrix.dat", "*imatrix*.dat", "*.imatrix")


@dataclass(frozen=True)
class ImatrixEntry:
    """One weight matrix's statistics: `sums` [n_mat, n_in] (the .dat: normalised means x ncall), `counts` [n_mat]
    (None in the .dat, which keeps no counts)."""

    sums: np.ndarray
    counts: np.ndarray | None


@dataclass(frozen=True)
class Imatrix:
    path: Path
    format: str  # "gguf" | "dat"
    entries: dict[str, ImatrixEntry]
    chunks: int | None = None
    datasets: tuple[str, ...] = field(default_factory=tuple)
    ncall: dict[str, int] = field(default_factory=dict)  # the .dat's per-entry call count

    def expert_entries(self) -> dict[int, tuple[str, ImatrixEntry]]:
        """Layer -> (name, entry) of the expert matrix whose statistics rank that layer's experts."""
        found: dict[int, dict[str, tuple[str, ImatrixEntry]]] = {}
        for name, entry in self.entries.items():
            m = _EXPERT_TENSOR.match(name)
            if m is not None:
                found.setdefault(int(m[1]), {})[m[2]] = (name, entry)
        return {layer: next(kinds[k] for k in _KIND_ORDER if k in kinds) for layer, kinds in found.items()}

    def expert_scores(self, num_layers: int, num_experts: int) -> np.ndarray:
        """[L, E] warm-start scores: each MoE layer's activation share per expert (GGUF counts), or for the .dat a
        rank score (E - rank) / E by mean squared input with never-routed experts at 0. Raises ConfigError when the
        file's expert matrices do not fit a model of this shape."""
        scores = np.zeros((num_layers, num_experts), dtype=np.float64)  # L x E
        experts = self.expert_entries()
        if not experts:
            raise ConfigError(f"{self.path}: no expert matrices (blk.N.ffn_*_exps.weight) in this imatrix: it was "
                              "made for a dense model, or by a tool moechat does not know; use --warm-start without "
                              "it")
        for layer, (name, entry) in sorted(experts.items()):
            n_mat = entry.counts.shape[0] if entry.counts is not None else entry.sums.shape[0]
            if layer >= num_layers or n_mat != num_experts:
                raise ConfigError(f"{self.path}: {name} has statistics for {n_mat} experts in layer {layer}, but the "
                                  f"model has {num_experts} experts in {num_layers} layers: this imatrix belongs to "
                                  "another model; pass this model's own imatrix")
            if entry.counts is not None:
                total = float(entry.counts.sum())
                if total > 0:
                    scores[layer] = entry.counts / total
                continue
            ncall = self.ncall.get(name, 0)
            means = entry.sums.mean(axis=1)  # E: each expert's mean squared input (x ncall)
            untouched = np.all(entry.sums == np.float32(ncall), axis=1) if ncall > 0 else np.zeros(n_mat, bool)
            order = [int(e) for e in np.lexsort((np.arange(n_mat), -means)) if not untouched[e]]
            for rank, expert in enumerate(order):
                scores[layer, expert] = (num_experts - rank) / num_experts
        return scores

    def ranking(self, layer: int, num_layers: int, num_experts: int) -> list[int]:
        """The experts of one layer, most used first (ties by id)."""
        row = self.expert_scores(num_layers, num_experts)[layer]
        return [int(e) for e in np.lexsort((np.arange(num_experts), -row))]

    def describe(self) -> str:
        how = ("activation counts per expert" if self.format == "gguf" else
               "mean squared input per expert (the legacy .dat keeps no counts; a GGUF imatrix from llama-imatrix "
               "--output-format gguf ranks by counts)")
        return f"{self.path.name}: {len(self.expert_entries())} MoE layers ranked by {how}"


def _damaged(path: Path, what: str) -> ConfigError:
    return ConfigError(f"{path}: not a readable llama.cpp imatrix ({what}); re-download it or make it again with "
                       "llama-imatrix")


def read_imatrix(path: str | os.PathLike) -> Imatrix:
    """Either format, told apart by the GGUF magic. Raises ConfigError (one line) for a missing or damaged file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the imatrix ({e.strerror or e}); check the path") from None
    if not path.is_file():
        raise ConfigError(f"{path}: not a regular file; pass llama.cpp's imatrix file")
    if size > MAX_IMATRIX_BYTES:
        raise _damaged(path, f"{size:,} bytes, more than any imatrix")
    return _read_gguf(path) if magic == b"GGUF" else _read_dat(path)


def _read_dat(path: Path) -> Imatrix:
    data = path.read_bytes()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        n = struct.calcsize(fmt)
        if pos + n > len(data):
            raise _damaged(path, f"ends at byte {len(data)} inside an entry")
        value = struct.unpack_from(fmt, data, pos)
        pos += n
        return value

    (n_entries,) = take("<i")
    if n_entries < 0 or n_entries > len(data) // 12:
        raise _damaged(path, f"{n_entries} entries in {len(data)} bytes")
    entries: dict[str, ImatrixEntry] = {}
    ncall: dict[str, int] = {}
    for _ in range(n_entries):
        (length,) = take("<i")
        if not 0 < length <= MAX_NAME:
            raise _damaged(path, f"a tensor name of {length} bytes")
        (raw,) = take(f"<{length}s")
        name = raw.decode("utf-8", "replace")
        calls, nval = take("<ii")
        if nval < 0 or pos + 4 * nval > len(data):
            raise _damaged(path, f"{name}: {nval} values past the end of the file")
        values = np.frombuffer(data, dtype="<f4", count=nval, offset=pos).astype(np.float32)
        pos += 4 * nval
        entries[name] = ImatrixEntry(values.reshape(1, -1), None)
        ncall[name] = calls
    chunks, datasets = None, ()
    if pos + 4 <= len(data):
        (chunks,) = take("<i")
        if pos + 4 <= len(data):
            (length,) = take("<i")
            if 0 <= length <= len(data) - pos:
                datasets = (data[pos:pos + length].decode("utf-8", "replace"),)
    return _DatImatrix(path, "dat", entries, chunks, datasets, ncall)


class _DatImatrix(Imatrix):
    """The .dat keeps each matrix's values flat: split into experts once the model says how many there are."""

    def expert_scores(self, num_layers: int, num_experts: int) -> np.ndarray:
        split = {}
        for name, entry in self.entries.items():
            flat = entry.sums.reshape(-1)
            if _EXPERT_TENSOR.match(name):
                if flat.size % num_experts:
                    raise ConfigError(f"{self.path}: {name} has {flat.size} values, not a multiple of the model's "
                                      f"{num_experts} experts: this imatrix belongs to another model; pass this "
                                      "model's own imatrix")
                split[name] = ImatrixEntry(flat.reshape(num_experts, -1), None)
            else:
                split[name] = entry
        return Imatrix.expert_scores(Imatrix(self.path, self.format, split, self.chunks, self.datasets, self.ncall),
                                     num_layers, num_experts)


def _read_gguf(path: Path) -> Imatrix:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises ValueError/struct.error/... for damaged files
        raise _damaged(path, f"{type(e).__name__}: {str(e)[:120]}") from None
    field_type = reader.fields.get("general.type")
    kind = field_type.contents() if field_type is not None else None
    if kind not in (None, "imatrix"):
        raise ConfigError(f"{path}: a GGUF {kind} file, not an imatrix; pass the imatrix (imatrix.gguf) shipped "
                          "beside the quants")
    tensors = {t.name: t for t in reader.tensors}
    entries: dict[str, ImatrixEntry] = {}
    for name, t in tensors.items():
        if not name.endswith(".in_sum2"):
            continue
        base = name[: -len(".in_sum2")]
        counts_t = tensors.get(base + ".counts")
        if counts_t is None:
            raise _damaged(path, f"{name} has no {base}.counts")
        sums = np.asarray(t.data, dtype=np.float32)
        counts = np.asarray(counts_t.data, dtype=np.float32).reshape(-1)
        sums = sums.reshape(counts.shape[0], -1) if sums.size % max(counts.shape[0], 1) == 0 else None
        if sums is None or not np.isfinite(counts).all() or (counts < 0).any():
            raise _damaged(path, f"{base}: {counts.shape[0]} counts do not fit its in_sum2, or are negative")
        entries[base] = ImatrixEntry(sums, counts)
    if not entries and tensors:
        raise _damaged(path, "no <name>.in_sum2 tensors")

    def value(key: str):
        f = reader.fields.get(key)
        return f.contents() if f is not None else None

    datasets = value("imatrix.datasets")
    return Imatrix(path, "gguf", entries, value("imatrix.chunk_count"),
                   tuple(datasets) if isinstance(datasets, list) else ())


def write_gguf_imatrix(path: str | os.PathLike, counts: np.ndarray, *, n_in: int = 1, sums: np.ndarray | None = None,
                       kinds: Iterable[str] = ("gate", "up", "down"), datasets: Iterable[str] = (),
                       chunk_size: int = 512) -> Path:
    """An imatrix in llama.cpp's GGUF layout from recorded routing counts [L, E] (what a bench records from
    moechat's own routing): per layer and kind, ``blk.N.ffn_<kind>_exps.weight.{in_sum2,counts}``. ``sums``
    [L, E, n_in] defaults to the counts (inputs of unit mean square)."""
    import gguf

    counts = np.asarray(counts, dtype=np.float32)  # L x E
    if sums is None:
        sums = np.repeat(counts[:, :, None], n_in, axis=2)
    writer = gguf.GGUFWriter(str(path), arch="imatrix")  # the arch key is ignored by readers of imatrix files
    writer.add_type("imatrix")
    writer.add_array("imatrix.datasets", list(datasets) or ["moechat routing"])
    writer.add_uint32("imatrix.chunk_count", max(1, int(counts.sum(axis=1).max(initial=0)) // chunk_size))
    writer.add_uint32("imatrix.chunk_size", chunk_size)
    for layer in range(counts.shape[0]):
        if not counts[layer].any():
            continue
        for kind in kinds:
            name = f"blk.{layer}.ffn_{kind}_exps.weight"
            writer.add_tensor(f"{name}.in_sum2", np.ascontiguousarray(sums[layer], dtype=np.float32))
            writer.add_tensor(f"{name}.counts", np.ascontiguousarray(counts[layer].reshape(-1, 1)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def find_imatrix(model: str | os.PathLike) -> Path | None:
    """The imatrix beside a model (in its folder, or beside its .gguf file): imatrix*.dat, *.imatrix.gguf..."""
    model = Path(model)
    folder = model if model.is_dir() else model.parent
    seen: list[Path] = []
    for pattern in IMATRIX_NAMES:
        for p in sorted(folder.glob(pattern)):
            if p.is_file() and p != model and p not in seen:
                seen.append(p)
    return seen[0] if seen else None


def parse_warm_start(value: object) -> bool | str:
    """``--warm-start``'s value: True/False, or 'imatrix:FILE' (checked to name a file now, not at load)."""
    if isinstance(value, bool):
        return value
    text = str(value)
    if text.startswith("imatrix:") and len(text) > len("imatrix:"):
        return text
    raise ConfigError(f"--warm-start takes imatrix:FILE (or nothing, for the saved routing profile), not {text!r}; "
                      "put MODEL before the flag: moechat run MODEL --warm-start imatrix:imatrix.gguf")


def warm_start_counts(source: bool | str, profile: Path | None, model: str | os.PathLike, num_layers: int,
                      num_experts: int) -> tuple[np.ndarray | None, str | None]:
    """What fills the slots before the first token, and a line saying so: `source` 'imatrix:FILE' reads that
    imatrix; True takes the saved routing profile, else an imatrix beside the model (said in the notice)."""
    from .prefetch import load_profile

    if not source:
        return None, None
    if isinstance(source, str):
        imatrix = read_imatrix(Path(parse_warm_start(source)[len("imatrix:"):]).expanduser())
        return imatrix.expert_scores(num_layers, num_experts), f"warm start from {imatrix.describe()}"
    if profile is not None:
        counts = load_profile(profile, num_layers, num_experts)
        if counts is not None:
            return counts, None
    found = find_imatrix(model)
    if found is None:
        return None, None
    try:
        imatrix = read_imatrix(found)
        scores = imatrix.expert_scores(num_layers, num_experts)
    except MoechatError as e:  # a stray file beside the model never stops a load: it is said and skipped
        return None, f"not warm-started from {found.name}: {e}"
    return scores, (f"warm start from the imatrix beside the model ({imatrix.describe()}); no routing profile "
                    "saved yet (--no-warm-start starts cold)")
