"""Routing traces: which experts each MoE layer routed each token to, in the order the engine ran them.

One row per (token, layer) that ran: its `layer`, `token` position, `phase` and top-k expert ids.
Rows are in execution order: during decode, token-major then layer; within a prefill chunk,
layer-major then the chunk's tokens. `requests()` turns the rows into the `(layer, expert)` request
stream that the eviction policies and `bench/replay.py` consume. A row costs 11 + 2K bytes in memory:
the DeepSeek trace below (22,287 tokens x 26 layers, top-6) is 13 MB, and 3.0 MB saved.

moechat's .npz (np.savez_compressed; no pickles, `np.load(path)` reads it):

| key        | shape, dtype  | meaning                                                          |
|------------|---------------|------------------------------------------------------------------|
| `layer`    | [N] int16     | model layer index of each row (dense layers never appear)        |
| `token`    | [N] int32     | token position of the row within its sequence                    |
| `phase`    | [N] uint8     | 0 prefill, 1 decode                                              |
| `topk_ids` | [N, K] int16  | routed expert ids, in the router's order                         |
| `sequence` | [N] int32     | which prompt / generation the row belongs to (0, 1, ...)         |
| `meta_json`| scalar str    | JSON: format "moechat-routing-trace", version 1, num_layers,     |
|            |               | num_experts, top_k, model                                        |

`RoutingTrace.load` also reads the two converted traces in ../shared/traces (see its README):
DeepSeek-V2-Lite prefill (`experts [T, 26, 6]`: rows become token-major then layer, model layers
1..26, one sequence per prompt) and Mixtral-8x7B decode (a flat table of rows: per generation,
sorted by token then layer).
"""

from __future__ import annotations

import json
import os
import zipfile
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import MoechatError
from ..io.files import atomic_write, open_regular


class TraceError(MoechatError, ValueError):
    """A file that is not a routing trace this version reads (damaged, truncated, another format); a ValueError too,
    as `RoutingTrace.load` raised before."""

Key = tuple[int, int]  # (layer, expert)

FORMAT = "moechat-routing-trace"
VERSION = 1
PREFILL, DECODE = 0, 1


@dataclass(frozen=True, eq=False)
class RoutingTrace:
    """A routing trace (see the module docstring); arrays are converted to the documented dtypes."""

    num_layers: int
    num_experts: int
    top_k: int
    layer: np.ndarray  # [N] int16
    token: np.ndarray  # [N] int32
    phase: np.ndarray  # [N] uint8
    topk_ids: np.ndarray  # [N, K] int16
    model: str = ""
    sequence: np.ndarray | None = field(default=None)  # [N] int32; None: all rows one sequence

    def __post_init__(self):
        N = len(self.layer)
        fix = object.__setattr__
        fix(self, "layer", np.asarray(self.layer, dtype=np.int16).reshape(N))
        fix(self, "token", np.asarray(self.token, dtype=np.int32).reshape(N))
        fix(self, "phase", np.asarray(self.phase, dtype=np.uint8).reshape(N))
        fix(self, "topk_ids", np.asarray(self.topk_ids, dtype=np.int16).reshape(N, self.top_k))
        seq = np.zeros(N, dtype=np.int32) if self.sequence is None else self.sequence
        fix(self, "sequence", np.asarray(seq, dtype=np.int32).reshape(N))
        if N and not (0 <= self.layer.min() and self.layer.max() < self.num_layers):
            raise ValueError(f"routing trace: layer ids span {self.layer.min()}..{self.layer.max()}, "
                             f"outside 0..{self.num_layers - 1}")
        if N and not (0 <= self.topk_ids.min() and self.topk_ids.max() < self.num_experts):
            raise ValueError(f"routing trace: expert ids span {self.topk_ids.min()}..{self.topk_ids.max()}, "
                             f"outside 0..{self.num_experts - 1}")
        if N and self.phase.max() > DECODE:
            raise ValueError("routing trace: phase must be 0 (prefill) or 1 (decode)")

    def __len__(self) -> int:
        return len(self.layer)

    @property
    def moe_layers(self) -> np.ndarray:
        """The layer ids that appear in the trace, ascending."""
        return np.unique(self.layer)

    def requests(self) -> list[Key]:
        """The request stream in execution order: each row's K experts, as (layer, expert) keys."""
        layers = np.repeat(self.layer.astype(np.int64), self.top_k)  # [N*K]
        experts = self.topk_ids.astype(np.int64).reshape(-1)  # [N*K]
        return list(zip(layers.tolist(), experts.tolist(), strict=True))

    def take(self, rows) -> RoutingTrace:
        """The trace of the selected rows (a boolean mask, a slice or indices), order kept."""
        return RoutingTrace(self.num_layers, self.num_experts, self.top_k, self.layer[rows], self.token[rows],
                            self.phase[rows], self.topk_ids[rows], self.model, self.sequence[rows])

    # -- files -------------------------------------------------------------------------------------
    def save(self, path) -> None:
        meta = dict(format=FORMAT, version=VERSION, num_layers=self.num_layers, num_experts=self.num_experts,
                    top_k=self.top_k, model=self.model)
        # To a file object (numpy would append .npz to a name without it), written whole or not at all: a full
        # disk or a kill leaves any earlier trace at `path` as it was (OSError says why).
        atomic_write(path, lambda f: np.savez_compressed(
            f, layer=self.layer, token=self.token, phase=self.phase, topk_ids=self.topk_ids, sequence=self.sequence,
            meta_json=np.array(json.dumps(meta))))

    @classmethod
    def load(cls, path) -> RoutingTrace:
        """moechat's own .npz, or either converted trace of ../shared/traces; TraceError (a ValueError) for anything
        else: a damaged or truncated file, a FIFO or a directory, arrays of the wrong shape or type."""
        path = Path(path)
        fd = open_regular(path, "routing trace", error=TraceError)  # FileNotFoundError passes; a FIFO never blocks
        try:
            with os.fdopen(fd, "rb") as f, np.load(f, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError, zipfile.BadZipFile, EOFError, zlib.error, MemoryError, KeyError, TypeError,
                AttributeError, NotImplementedError, RuntimeError) as exc:  # AttributeError: a bare .npy, not a zip
            raise TraceError(f"{path}: not a routing trace: cannot read it as .npz ({exc})") from None
        meta = {}
        if "meta_json" in arrays:
            try:
                meta = json.loads(str(arrays["meta_json"]))
            except (ValueError, RecursionError) as exc:
                raise TraceError(f"{path}: meta_json is not JSON ({exc})") from None
            if not isinstance(meta, dict):
                raise TraceError(f"{path}: meta_json must be a JSON object, found {type(meta).__name__}")
        keys = set(arrays)
        try:
            if meta.get("format") == FORMAT:
                return cls._from_moechat(arrays, meta, path)
            if {"experts", "prompt_offsets", "layer_ids"} <= keys and arrays["experts"].ndim == 3:
                return cls._from_token_layer_table(arrays, meta)
            if {"experts", "layer", "token_idx", "problem_id", "dataset"} <= keys and arrays["experts"].ndim == 2:
                return cls._from_flat_decode_table(arrays, meta)
        except TraceError:
            raise
        except KeyError as exc:
            raise TraceError(f"{path}: routing trace lacks the array {exc}") from None
        except (ValueError, TypeError, IndexError, OverflowError, MemoryError) as exc:  # shapes, types, ranges
            raise TraceError(f"{path}: not a valid routing trace ({exc})") from None
        raise TraceError(f"{path}: not a routing trace this version reads (arrays: {', '.join(sorted(keys))}); "
                         f"expected moechat's format ({FORMAT}) or a converted trace of shared/traces")

    @classmethod
    def _from_moechat(cls, a: dict, meta: dict, path: Path) -> RoutingTrace:
        if meta.get("version") != VERSION:
            raise TraceError(f"{path}: routing trace version {meta.get('version')}; this moechat reads {VERSION}")
        return cls(int(meta["num_layers"]), int(meta["num_experts"]), int(meta["top_k"]), a["layer"], a["token"],
                   a["phase"], a["topk_ids"], str(meta.get("model", "")), a["sequence"])

    @classmethod
    def _from_token_layer_table(cls, a: dict, meta: dict) -> RoutingTrace:
        """DeepSeek-V2-Lite prefill (moe-beyond): experts [T, L, K] and prompt_offsets [P+1]."""
        experts = a["experts"]  # [T, L, K]
        T, L, K = experts.shape
        layer_ids = a["layer_ids"].astype(np.int64)  # [L] model layer ids
        offsets = a["prompt_offsets"].astype(np.int64)  # [P+1]
        if offsets[0] != 0 or offsets[-1] != T or len(layer_ids) != L:
            raise ValueError("token-layer routing table: prompt_offsets or layer_ids do not match experts")
        prompt = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))  # [T]
        position = np.arange(T) - offsets[prompt]  # [T]
        num_experts = int(meta.get("routed_experts_per_layer", int(experts.max()) + 1))
        return cls(int(layer_ids.max()) + 1, num_experts, K,
                   layer=np.tile(layer_ids, T),  # [T*L]: token-major, then layer
                   token=np.repeat(position, L),
                   phase=np.full(T * L, PREFILL),
                   topk_ids=experts.reshape(T * L, K),
                   model=str(meta.get("model", "")),
                   sequence=np.repeat(prompt, L))

    @classmethod
    def _from_flat_decode_table(cls, a: dict, meta: dict) -> RoutingTrace:
        """Mixtral decode (speculative-moe): one row per (sequence, layer, token_idx), layer-major on file."""
        pairs = np.stack([a["dataset"].astype(np.int64), a["problem_id"].astype(np.int64)], axis=1)  # [N, 2]
        seqs, seq = np.unique(pairs, axis=0, return_inverse=True)
        if "sequences" in a:  # keep the file's order of generations
            rank = {tuple(p): i for i, p in enumerate(a["sequences"].tolist())}
            remap = np.array([rank[tuple(p)] for p in seqs.tolist()])
            seq = remap[seq.reshape(-1)]
        layer = a["layer"].astype(np.int64)
        token = a["token_idx"].astype(np.int64)
        order = np.lexsort((layer, token, seq))  # per generation: token-major, then layer
        experts = a["experts"]  # [N, K]
        num_layers = int(meta.get("num_moe_layers", int(layer.max()) + 1))
        num_experts = int(meta.get("experts_per_layer", int(experts.max()) + 1))
        return cls(num_layers, num_experts, experts.shape[1],
                   layer=layer[order], token=token[order], phase=np.full(len(order), DECODE),
                   topk_ids=experts[order], model=str(meta.get("model", "")), sequence=seq[order])


class TraceRecorder:
    """Collects the routing of a generation as the cache sees it; `to_trace()` makes a RoutingTrace.

    `record` is one small int16 copy per call (the caller may reuse its buffer). Token positions count
    per layer from the last `new_sequence()`: a [T, K] record at a layer takes the next T positions.
    With `max_rows`, the oldest records are dropped once that many newer rows are kept.
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int, model: str = "", max_rows: int | None = None):
        self.num_layers, self.num_experts, self.top_k, self.model = num_layers, num_experts, top_k, model
        self.max_rows = max_rows  # keep only about the latest max_rows rows (a long chat's memory stays bounded)
        self._chunks: deque[tuple[int, np.ndarray, int, int, int]] = deque()  # (layer, ids [T,K], phase, token0, seq)
        self._next_token = [0] * num_layers
        self._sequence = 0
        self._rows = 0

    def record(self, layer: int, topk_ids, phase: int) -> None:
        """One routing call: `topk_ids` [T, K] (any integer array) at `layer`, phase 0 prefill / 1 decode."""
        ids = np.array(topk_ids, dtype=np.int16).reshape(-1, self.top_k)  # [T, K] copy
        self._chunks.append((layer, ids, phase, self._next_token[layer], self._sequence))
        self._next_token[layer] += len(ids)
        self._rows += len(ids)
        if self.max_rows is not None:
            while len(self._chunks) > 1 and self._rows - len(self._chunks[0][1]) >= self.max_rows:
                self._rows -= len(self._chunks.popleft()[1])

    def new_sequence(self) -> None:
        """The following records belong to a new prompt / generation (positions restart at 0)."""
        self._sequence += 1
        self._next_token = [0] * self.num_layers

    def __len__(self) -> int:
        return self._rows

    def to_trace(self) -> RoutingTrace:
        chunks = self._chunks
        sizes = [len(ids) for _, ids, _, _, _ in chunks]
        if not chunks:
            empty = np.zeros(0)
            return RoutingTrace(self.num_layers, self.num_experts, self.top_k, empty, empty, empty,
                                np.zeros((0, self.top_k)), self.model, empty)
        return RoutingTrace(
            self.num_layers, self.num_experts, self.top_k,
            layer=np.repeat([c[0] for c in chunks], sizes),
            token=np.concatenate([np.arange(c[3], c[3] + n) for c, n in zip(chunks, sizes, strict=True)]),
            phase=np.repeat([c[2] for c in chunks], sizes),
            topk_ids=np.concatenate([c[1] for c in chunks]),
            model=self.model,
            sequence=np.repeat([c[4] for c in chunks], sizes),
        )
