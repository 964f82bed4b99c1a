"""Expert compute over slot buffers and slot ids (the torch path).

Kernels see only slots: `ExpertBatch.tensors["w13"]` [C, 2I, H], `["w2"]` [C, H, I] and `slot_ids`
[T, K]. Two shapes of work, two strategies:

* decode (T == 1): K matrix-vector products straight from the slot buffers. Gathering the K experts
  into a contiguous [K, 2I, H] batch first would copy every weight once more, doubling the bytes a
  bandwidth-bound decode step moves (for Qwen3-30B-A3B, 8 x 4.7 MB per layer).
* prefill (T > 1): sort (token, k) pairs by slot, one GEMM per slot that any token uses, then one
  weighted scatter-add back. Each expert's weights are read once per chunk, whatever T is.

Both read the slot ids on the host once (the one sync per layer the design allows) and are checked
against `moe.moe_reference` in the tests.

On a CPU a step whose experts are split between the slots and the RAM tier (hybrid `--on-miss host|auto`) is one
batch: slot ids >= C index `batch.host_tensors` (the RAM tier's buffers), and both strategies index per-slot
views of the two sets of buffers alike. A second pass over the host experts cost a second round of per-batch
work (slot ids to the host, views, the pairs' mask), a dispatch-bound share of a small model's layer.

Any other expert (a packed format such as MXFP4, biases, GPT-OSS's clamped SwiGLU, Nemotron-H's ungated relu^2 with
w13 = up only [I, H]) takes the same two
strategies through the format's `linear`, which computes from the packed slot tensors of one expert
(on the CPU: dequantized one projection at a time into a reused scratch buffer), so no layer is ever
expanded to full width.

One token on the CPU with packed experts (int4, int8, MXFP4, FP8) is one native call for all of the batch's pairs
(`_native_moe`: quant/native.py moe_decode), each weighted output into its own contrib row: 2 x top-k format
`linear` calls (~10 us of Python and ctypes each, a pool wake each) become one, bit for bit the same rows
(tests/engine/test_moe_decode.py). A Qwen3-30B-A3B layer (top-8, int4, one thread, loaded 2-core machine):
1.82 -> 1.35 ms.
"""

from __future__ import annotations

import ctypes
import os

import torch
import torch.nn.functional as F

from ..quant import native, prefill
from ..quant.base import ExpertFormat
from ..quant.dense import bf16_linear
from .moe import SWIGLU, ExpertActivation, ExpertBatch, combine  # noqa: F401 - combine re-exported
from .moe_device import MapBatch, map_expert_compute

FUSED_KINDS = ("swiglu", "clamped_swiglu")  # the activations the Triton MoE kernels fuse; others take the general path

# T = tokens, K = top-k, C = slots, H = hidden size, I = expert intermediate size


# Per-slot views of the slot buffers, built once per set of buffers (slot buffers and the RAM tier live at fixed
# addresses for the life of a provider): indexing a [C, ...] tensor costs a dispatcher call per use, and decode
# makes 2K of them per layer. A mixed batch's host buffers follow its slots (virtual slots C..C+N-1).
_VIEWS: dict[tuple, tuple[tuple[torch.Tensor, ...], object]] = {}
_VIEWS_MAX = 1024  # entries (one per layer of a resident model, a few for a cache): a retuned pool's old ones go


def forget_views() -> None:
    """Drop every memoised view: they keep their buffers alive, so an engine that closes calls this (the next call
    rebuilds what a live engine needs)."""
    _VIEWS.clear()


def _cached_views(kind: str, batch: ExpertBatch, build):
    """build(tensors) -> per-slot views of one set of buffers, memoised per (kind, buffers); a mixed batch's
    lists are its slots' then its host buffers'."""
    sets = (batch.tensors,) if batch.host_tensors is None else (batch.tensors, batch.host_tensors)
    firsts = tuple(next(iter(ts.values())) for ts in sets)
    key = (kind, *map(id, firsts))
    entry = _VIEWS.get(key)
    if entry is None or any(a is not b for a, b in zip(entry[0], firsts, strict=True)):
        if len(_VIEWS) >= _VIEWS_MAX:
            _VIEWS.clear()
        parts = [build(ts) for ts in sets]
        views = parts[0] if len(parts) == 1 else tuple(a + b for a, b in zip(*parts, strict=True))
        entry = _VIEWS[key] = (firsts, views)
    return entry[1]


def _dense_lists(ts) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    w2 = ts["w2"].unbind(0)
    return list(ts["w13"].unbind(0)), list(w2), [w.t() for w in w2]


def _slot_views(batch: ExpertBatch) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """w13[s] [2I, H], w2[s] [H, I] and w2[s].t() [I, H] for every (virtual) slot s of a full-width batch."""
    return _cached_views("dense", batch, _dense_lists)


def _expert_lists(ts) -> tuple[list[dict[str, torch.Tensor]]]:
    per_name = {name: t.unbind(0) for name, t in ts.items()}
    return ([{name: v[s] for name, v in per_name.items()} for s in range(next(iter(ts.values())).shape[0])],)


def _expert_views(batch: ExpertBatch) -> list[dict[str, torch.Tensor]]:
    """Per (virtual) slot, that expert's stored tensors by name (views)."""
    return _cached_views("expert", batch, _expert_lists)[0]


def _swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = bf16_linear(x, w13).chunk(2, dim=-1)  # [n, I], [n, I]
    return bf16_linear(F.silu(gate) * up, w2)  # [n, H]


def _expert(x: torch.Tensor, fmt: ExpertFormat, tensors, act: ExpertActivation) -> torch.Tensor:
    """One expert on x [n, H] from its stored tensors -> [n, H]."""
    if not act.gated and x.shape[0] == 1 and (lib := _bf16_dense_lib(x, fmt, tensors)) is not None:
        # one bf16 CPU token through ungated full-width experts: native.c's GEMV per projection, each rounded to bf16
        # once as F.linear's. A Nemotron-3-width MoE layer (top-6 of 16 experts of 19 MiB + the shared one, one
        # thread, loaded 2-core machine): 44.8 ms with torch's one-row GEMMs, 24.9 ms so. Gated experts keep their
        # own fast path (`expert_compute`).
        h = act(native.bf16_gemv(lib, x, tensors["w13"], x.dtype))  # [1, I]
        return native.bf16_gemv(lib, h, tensors["w2"], x.dtype)  # [1, H]
    return fmt.linear(act(fmt.linear(x, tensors, "w13")), tensors, "w2")


def _plain_bf16(*ws: torch.Tensor) -> bool:
    """Contiguous bf16 matrices: what native.c's bf16 GEMV reads."""
    return all(w.dtype == torch.bfloat16 and w.is_contiguous() for w in ws)


def _bf16_dense_lib(x: torch.Tensor, fmt: ExpertFormat, tensors):
    """native.c's library where one expert's projections are plain contiguous bf16 matrices on the CPU, else None."""
    if fmt.packed or x.dtype != torch.bfloat16 or x.device.type != "cpu" or "w13_bias" in tensors:
        return None
    w13, w2 = tensors["w13"], tensors["w2"]
    if not (w13.dtype == w2.dtype == torch.bfloat16 and w13.is_contiguous() and w2.is_contiguous()):
        return None
    return native.library()


# -- one token on the CPU: the layer's experts in one native call (quant/native.py moe_decode) ------------------------
# Per (virtual) slot, its tensors' addresses and the layer's shape, built once per set of buffers as the views are:
# ((w13, w13 scale, w2, w2 scale, w13 bias or 0, w2 bias or 0), (kind, H, I, group13, group2, block, bias kind)),
# or None where the kernels do not take that slot's tensors (another dtype, a strided buffer: the general path).
_MOE_NAMES = {"int4": ("w13_q", "w13_scale", "w2_q", "w2_scale"), "int8": ("w13_q", "w13_scale", "w2_q", "w2_scale"),
              "mxfp4": ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"), "fp8": ("w13", "w13_scale", "w2",
                                                                                        "w2_scale")}
_MOE_SCALE_DTYPES = {"int4": torch.float16, "int8": torch.float32, "mxfp4": torch.uint8, "fp8": torch.float32}


def _moe_rows(fmt: ExpertFormat, ts) -> tuple[list]:
    names = _MOE_NAMES[fmt.name]
    w13, s13, w2, s2 = (ts[k] for k in names)
    b13, b2 = ts.get("w13_bias"), ts.get("w2_bias")
    C = w13.shape[0]
    # each slot's part contiguous (the kernels take one address per slot): a stack of them need not be (the mapped
    # views of a repacked file step over each expert's record header)
    ok = (all(t.device.type == "cpu" and t[0].is_contiguous() for t in (w13, s13, w2, s2))
          and s13.dtype == s2.dtype == _MOE_SCALE_DTYPES[fmt.name]
          and all(b is None or (b[0].is_contiguous() and b.dtype in native.BIAS_KINDS) for b in (b13, b2))
          and (b13 is None) == (b2 is None))
    if not ok:
        return ([None] * C,)
    hidden, inter = w2.shape[1], w13.shape[1] // 2  # w13 [C, 2I, ...], w2 [C, H, ...] in every format
    group13 = group2 = 0
    if fmt.name == "int4":
        group13, group2 = hidden // s13.shape[2], inter // s2.shape[2]
    block = tuple(getattr(fmt, "block", (0, 0)))
    if b13 is not None and b13.dtype != b2.dtype:
        return ([None] * C,)
    meta = (native.MOE_KINDS[fmt.name], hidden, inter, group13, group2, block,
            0 if b13 is None else native.BIAS_KINDS[b13.dtype])
    rows = []
    for s in range(C):
        addr = [t[s].data_ptr() for t in (w13, s13, w2, s2)]
        addr += [0, 0] if b13 is None else [b13[s].data_ptr(), b2[s].data_ptr()]
        rows.append((tuple(addr), meta))
    return (rows,)


def _native_moe(hidden_states: torch.Tensor, topk_weights: torch.Tensor, batch: ExpertBatch, act: ExpertActivation,
                contrib: torch.Tensor, slots: list[int], ks) -> bool:
    """The one-token pairs ks of a CPU batch through native.moe_decode into their contrib rows; False (nothing done)
    where the kernels do not take this batch: the per-projection path then runs (the same bits, tested)."""
    fmt = batch.format
    if not act.gated:  # the native kernels read w13 as [gate; up] (2I rows): an ungated expert takes the general path
        return False
    if (fmt.name not in _MOE_NAMES or act.kind not in native.ACT_KINDS or hidden_states.device.type != "cpu"
            or hidden_states.dtype not in (torch.float32, torch.bfloat16) or not contrib.is_contiguous()
            or (lib := native.library()) is None):
        return False
    rows = _cached_views(f"moe-{fmt.name}", batch, lambda ts: _moe_rows(fmt, ts))[0]
    ks = list(ks)
    entries = [rows[slots[k]] for k in ks]
    if not entries or any(e is None for e in entries):
        return not entries
    kind, hidden, inter, group13, group2, block, bias_kind = entries[0][1]
    if inter >= 32768 or contrib.shape[1] != hidden:  # torch would split the activation ops over threads
        return False
    x = hidden_states.contiguous()
    base, row = contrib.data_ptr(), contrib.stride(0) * 4
    flat = []
    for k, (addr, _) in zip(ks, entries, strict=True):
        flat += addr
        flat.append(base + k * row)
    weights = topk_weights[0].tolist()
    n = len(ks)
    ptrs = (ctypes.c_int64 * (7 * n))(*flat)
    ws = (ctypes.c_float * n)(*(weights[k] for k in ks))
    limit, alpha = act.limit, act.alpha
    native.moe_decode(lib, kind, x, ptrs, ws, n, hidden, inter, group13, group2, block, bias_kind,
                      native.ACT_KINDS[act.kind], limit, alpha)
    return True


def _put(contrib: torch.Tensor, idx: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> None:
    """contrib[idx] = w * y in fp32: each (token, k) pair's weighted expert output in its own row (a CPU chunk's
    through native_scatter.c in one pass over the pool, the same bits as the torch ops)."""
    if contrib.is_cpu and y.is_cpu and y.dtype in (torch.bfloat16, torch.float32) and contrib.is_contiguous() \
            and y.dim() == 2 and (lib := native.library()) is not None:
        native.scatter_weighted(lib, contrib, idx, y, w)
        return
    contrib.index_copy_(0, idx, y.float() * w.float()[:, None])


# -- a prefill chunk on the CPU: the layer's experts in one native call (quant/native.py moe_prefill) -----------------
LAYER_PREFILL_ENV = "MOECHAT_LAYER_PREFILL"  # "0": the per-expert path below (the A/B; the same bits)
_LAYER_PREFILL_KINDS = ("int4", "mxfp4", "int8")  # the formats with integer (Q8) prefill kernels


def _gguf_q8(fmt: ExpertFormat) -> bool:
    """A GGUF format whose rows the layer call reads as the file stores them: gate and up apart (not interleaved, not
    fused), each projection in a type of gguf.Q8_PREFILL_TYPES (Q8_0, Q4_0, MXFP4, Q4_K, Q5_K, Q6_K), gate's type
    up's."""
    from ..quant.gguf import Q8_PREFILL_TYPES, GGUFFormat

    return (isinstance(fmt, GGUFFormat) and not fmt.interleaved and set(fmt.types) == {"w1", "w3", "w2"}
            and fmt.types["w1"] == fmt.types["w3"] and all(t.name in Q8_PREFILL_TYPES for t in fmt.types.values()))


def _q8_layer(x: torch.Tensor, fmt: ExpertFormat, act: ExpertActivation):
    """The library where a chunk of bf16 tokens in this format and activation takes the integer kernels for each
    projection (quant/prefill.py `integer_path`, quant/gguf.py `prefill_q8`) and the layer call can do the same work
    in one go, else None."""
    if (x.dtype != torch.bfloat16 or x.device.type != "cpu" or not act.gated or act.kind not in native.ACT_KINDS
            or not (fmt.name in _LAYER_PREFILL_KINDS or (act.kind == "swiglu" and _gguf_q8(fmt)))):
        return None
    from ..quant.gguf import PREFILL_ENV as GGUF_PREFILL_ENV

    if fmt.name not in _LAYER_PREFILL_KINDS and os.environ.get(GGUF_PREFILL_ENV, "1") == "0":
        return None
    lib = native.decode_library()
    return lib if prefill.available(lib) and prefill.integer_path(x, lib) else None


def _gguf_rows(fmt: ExpertFormat, ts) -> tuple[list]:
    """Per slot, its gate, up and down rows' addresses (and no scales or biases) and the layer's (H, I, gate/up's
    and down's ggml type ids), as `_moe_rows` gives them for the safetensors formats; None: a slot not taken."""
    w1, w3, w2 = ts["w1"], ts["w3"], ts["w2"]
    C = w1.shape[0]
    if "w1_bias" in ts or not all(t.device.type == "cpu" and t.dtype == torch.uint8 and t[0].is_contiguous()
                                  for t in (w1, w3, w2)):
        return ([None] * C,)
    t13, t2 = fmt.types["w1"], fmt.types["w2"]
    hidden, inter = w1.shape[2] // t13.nbytes * t13.block, w1.shape[1]
    if w2.shape[1:] != (hidden, t2.row_bytes(inter)) or w3.shape != w1.shape:
        return ([None] * C,)
    meta = (hidden, inter, t13.id, t2.id)
    return ([((w1[s].data_ptr(), w3[s].data_ptr(), w2[s].data_ptr(), 0, 0, 0), meta) for s in range(C)],)


def _layer_prefill(hidden_states: torch.Tensor, topk_weights: torch.Tensor, batch: ExpertBatch, act, contrib,
                   slots: torch.Tensor, idx: torch.Tensor, K: int) -> bool:
    """The pairs idx (flat t*K + k, sorted by their slots `slots`) of a CPU chunk through native.moe_prefill into their
    contrib rows; False (nothing done) where it does not take this batch: the per-expert path then runs, with the same
    bits (each projection the same integer kernel, whose sums depend only on (token, row); the activation as torch's;
    tested)."""
    fmt = batch.format
    if (os.environ.get(LAYER_PREFILL_ENV, "1") == "0" or not contrib.is_contiguous()
            or (lib := _q8_layer(hidden_states, fmt, act)) is None):
        return False
    gguf = fmt.name not in _LAYER_PREFILL_KINDS
    used, counts = torch.unique_consecutive(slots, return_counts=True)
    rows = _cached_views(f"moe-{fmt.name}", batch, lambda ts: (_gguf_rows if gguf else _moe_rows)(fmt, ts))[0]
    entries = [rows[s] for s in used.tolist()]
    if any(e is None for e in entries):
        return False
    if gguf:
        hidden, inter, type13, type2 = entries[0][1]
    else:
        kind, hidden, inter, group13, group2, _, bias_kind = entries[0][1]
    vec = native.vector_step(hidden_states.dtype)
    if (contrib.shape[1] != hidden or hidden % prefill.Q8_BLOCK or inter % prefill.Q8_BLOCK
            or (vec and inter % vec)  # torch's activation: vectorised over each whole row, as the native one
            or (fmt.name == "int4" and not group13 == group2 == prefill.Q8_BLOCK)):
        return False
    ptrs = torch.tensor([e[0] for e in entries], dtype=torch.int64)  # [n, 6]
    start = torch.zeros(len(entries) + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=start[1:])
    wt = topk_weights.reshape(-1).float().index_select(0, idx.to(topk_weights.device)).cpu().contiguous()
    x, tok, dst = hidden_states.contiguous(), (idx // K).contiguous(), idx.contiguous()
    if gguf:
        native.moe_prefill_gguf(lib, type13, type2, x, ptrs, start, tok, dst, wt, inter, contrib)
    else:
        native.moe_prefill(lib, kind, x, ptrs, start, tok, dst, wt, inter, bias_kind, native.ACT_KINDS[act.kind],
                           act.limit, act.alpha, contrib)
    return True


def _general_compute(hidden_states, topk_weights, batch: ExpertBatch, residual, act,
                     contrib: torch.Tensor | None = None) -> torch.Tensor | None:
    """Any format, biases, any activation: per used slot, its tokens through the format's linear."""
    views = _expert_views(batch)
    slot_ids = batch.slot_ids_cpu if batch.slot_ids_cpu is not None else batch.slot_ids.cpu()  # [T, K]
    dtype = hidden_states.dtype
    T, K = slot_ids.shape
    if T == 1:
        ks = range(K) if batch.pairs is None else batch.pairs.tolist()
        slots = slot_ids[0].tolist()
        if contrib is not None:
            if _native_moe(hidden_states, topk_weights, batch, act, contrib, slots, ks):
                return None
            weights = topk_weights[0].tolist()
            for k in ks:
                y = _expert(hidden_states, batch.format, views[slots[k]], act)  # [1, H]
                contrib[k].add_(y[0], alpha=weights[k])
            return None
        out = residual if residual is not None else torch.zeros_like(hidden_states)  # [1, H]
        for k in ks:
            y = _expert(hidden_states, batch.format, views[slots[k]], act)  # [1, H]
            out = out + (y * topk_weights[:, k : k + 1]).to(dtype)
        return out
    flat = slot_ids.reshape(-1)  # [T*K]
    idx = torch.arange(T * K) if batch.pairs is None else batch.pairs.cpu()  # [P] flat (t, k)
    flat = flat.index_select(0, idx)
    order = torch.argsort(flat, stable=True)
    sorted_flat, idx = flat[order], idx[order]
    if contrib is not None and _layer_prefill(hidden_states, topk_weights, batch, act, contrib, sorted_flat, idx, K):
        return None
    sorted_slots = sorted_flat.tolist()
    # a lone token of an expert goes through the many-token kernels as a pair (itself twice, row 0 kept), as the
    # layer call computes it, wherever that call would take this format: the same bits either way
    lone = T > 1 and _q8_layer(hidden_states, batch.format, act) is not None
    device_idx = idx.to(hidden_states.device)
    token_idx = device_idx // K  # [P]
    x_sorted = hidden_states.index_select(0, token_idx)  # [P, H]
    w_sorted = topk_weights.reshape(-1).index_select(0, device_idx)  # [P]
    y_sorted = torch.empty_like(x_sorted)  # [P, H]
    start = 0
    while start < len(sorted_slots):
        s = sorted_slots[start]
        end = start
        while end < len(sorted_slots) and sorted_slots[end] == s:
            end += 1
        if lone and end - start == 1:
            y_sorted[start:end] = _expert(x_sorted[start:end].expand(2, -1), batch.format, views[s], act)[:1]
        else:
            y_sorted[start:end] = _expert(x_sorted[start:end], batch.format, views[s], act)
        start = end
    if contrib is not None:
        _put(contrib, device_idx, y_sorted, w_sorted)
        return None
    out = residual.clone() if residual is not None else torch.zeros_like(hidden_states)  # [T, H]
    out.index_add_(0, token_idx, (y_sorted * w_sorted[:, None]).to(dtype))
    return out


def expert_compute(hidden_states: torch.Tensor, topk_weights: torch.Tensor, batch: ExpertBatch,
                   residual: torch.Tensor | None = None, act: ExpertActivation = SWIGLU,
                   contrib: torch.Tensor | None = None) -> torch.Tensor | None:
    """[residual +] sum_k topk_weights[t, k] * Expert_{slot_ids[t, k]}(hidden_states[t]) -> [T, H], input dtype.

    With `batch.pairs` set (an expert-major group of a chunk that needs more experts than slots), only
    those flat (t, k) pairs are computed; the others' slot ids are never read.

    With `contrib` (fp32 [T*K, H]), each computed pair's weighted output goes to its own row t*K + k instead
    and nothing is returned: the caller sums the rows in k order once every batch ran (`combine`), so the
    result does not depend on which slots hold the experts, how a chunk was split into groups, or where a
    group ran (the CPU paths; CUDA's fused kernels accumulate onto the residual).
    """
    if isinstance(batch, MapBatch):  # the device-resident step: ids never read on the host (moe_device.py)
        return map_expert_compute(hidden_states, topk_weights, batch, residual, act, contrib)
    if batch.format.packed or act.kind != "swiglu" or "w13_bias" in batch.tensors:
        fused = getattr(batch.format, "fused_moe", None)
        # the Triton kernels fuse gated activations only (w13 = [gate; up]); ungated (relu2) experts never reach them
        if fused is not None and hidden_states.is_cuda and contrib is None and act.gated and act.kind in FUSED_KINDS:
            return fused(hidden_states, topk_weights, batch, residual, act)
        return _general_compute(hidden_states, topk_weights, batch, residual, act, contrib)
    w13 = batch.tensors["w13"]  # [C, 2I, H]
    w2 = batch.tensors["w2"]  # [C, H, I]
    slot_ids = batch.slot_ids_cpu if batch.slot_ids_cpu is not None else batch.slot_ids.cpu()  # [T, K]
    dtype = hidden_states.dtype
    T, K = slot_ids.shape
    pairs = batch.pairs
    if T == 1:
        ks = range(K) if pairs is None else pairs.tolist()
        slots = slot_ids[0].tolist()
        if contrib is not None:  # as below, each weighted output into its own fp32 row (add_ into zeros)
            w13s, w2s, w2ts = _slot_views(batch)
            inter = w2.shape[-1]
            weights = topk_weights[0].tolist()
            lib = native.library() if hidden_states.dtype == torch.bfloat16 and hidden_states.is_cpu else None
            for k in ks:
                if lib is not None and _plain_bf16(w13s[slots[k]], w2s[slots[k]]):
                    # native.c's GEMVs (~20 GB/s where torch's one-row bf16 GEMM reads ~12; fp32 sums, each output
                    # rounded once, as F.linear's)
                    gate_up = native.bf16_gemv(lib, hidden_states, w13s[slots[k]], dtype)  # [1, 2I]
                    y = native.bf16_gemv(lib, F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2s[slots[k]], dtype)
                else:
                    gate_up = F.linear(hidden_states, w13s[slots[k]])  # [1, 2I]
                    y = torch.mm(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2ts[slots[k]])  # [1, H]
                contrib[k].add_(y[0], alpha=weights[k])
            return None
        if topk_weights.device.type == "cpu":
            # Host weights cost nothing to read here: fold each into its down-projection GEMM, and the
            # residual (or the previous expert's sum) into its accumulator: 4 ops per expert.
            w13s, _, w2ts = _slot_views(batch)
            inter = w2.shape[-1]
            weights = topk_weights[0].tolist()
            out = residual if residual is not None else torch.zeros_like(hidden_states)  # [1, H]
            for k in ks:
                gate_up = F.linear(hidden_states, w13s[slots[k]])  # [1, 2I]
                out = torch.addmm(out, F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2ts[slots[k]],
                                  alpha=weights[k])  # [1, H]
            return out
        out = residual if residual is not None else torch.zeros_like(hidden_states)  # [1, H]
        for k in ks:
            s = slots[k]
            out = out + (_swiglu(hidden_states, w13[s], w2[s]) * topk_weights[:, k : k + 1]).to(dtype)  # [1, H]
        return out

    flat = slot_ids.reshape(-1)  # [T*K]
    if pairs is not None:
        pairs_cpu = pairs.cpu()
        flat = flat.index_select(0, pairs_cpu)  # [P]
    order = torch.argsort(flat, stable=True)  # [P], pairs grouped by slot
    w13s, w2s, _ = _slot_views(batch) if batch.host_tensors is not None else (w13, w2, None)
    counts = torch.bincount(flat, minlength=len(w13s)).tolist()
    if pairs is not None:
        order = pairs_cpu.index_select(0, order)  # back to flat (t, k) indices
    device_order = order.to(hidden_states.device)
    token_idx = device_order // K  # [P]
    x_sorted = hidden_states.index_select(0, token_idx)  # [P, H]
    w_sorted = topk_weights.reshape(-1).index_select(0, device_order)  # [P]
    y_sorted = torch.empty_like(x_sorted)  # [P, H]
    start = 0
    for s, n in enumerate(counts):
        if n:
            y_sorted[start : start + n] = _swiglu(x_sorted[start : start + n], w13s[s], w2s[s])
            start += n
    if contrib is not None:
        _put(contrib, device_order, y_sorted, w_sorted)
        return None
    out = residual.clone() if residual is not None else torch.zeros_like(hidden_states)  # [T, H]
    out.index_add_(0, token_idx, (y_sorted * w_sorted[:, None]).to(dtype))
    return out


# -- hybrid execution on CUDA: host experts computed on the CPU while the device runs the resident ones -------

class HostJob:
    """A host batch started before the device batch is enqueued: the activations (and routing weights) are copied
    to pinned host memory on the compute stream with an event, so the CPU waits for exactly that copy, not for
    the device experts enqueued after it; `finish` computes on the CPU and adds the result back on the device."""

    def __init__(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, batch: ExpertBatch):
        self.batch = batch
        self.device = hidden_states.device
        self.x = torch.empty(hidden_states.shape, dtype=hidden_states.dtype, pin_memory=True)  # [T, H]
        self.w = torch.empty(topk_weights.shape, dtype=topk_weights.dtype, pin_memory=True)  # [T, K]
        self.x.copy_(hidden_states, non_blocking=True)
        self.w.copy_(topk_weights, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(self.device))

    def finish(self, residual: torch.Tensor, act: ExpertActivation) -> torch.Tensor:
        self.ready.synchronize()  # the two small copies only
        y = expert_compute(self.x, self.w, self.batch, None, act)  # [T, H] on the CPU
        return residual + y.pin_memory().to(self.device, non_blocking=True)
