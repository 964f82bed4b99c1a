"""Shared blocks of the decoder-only MoE architectures: RMSNorm, RoPE, GQA attention, SwiGLU MLP,
the sparse MoE block, and the decoder stack.

Attribute names follow the checkpoint keys (`model.layers.3.self_attn.q_proj.weight`), so dense
weights load with `load_state_dict(assign=True)` into a model built on the meta device and only the
routed experts need a mapping (`ExpertNaming`). The routed experts are not parameters of this module:
they belong to an `ExpertProvider`, which the MoE block asks for slots.

The forward pass is written for decode latency (one token through L layers is ~40 small ops per
layer, so Python and dispatch overhead matter as much as FLOPs): q/k/v are one fused GEMM, per-head
q/k norms and RoPE run on q and k together, RoPE uses a precomputed table and `roll` instead of
rotate-half's slices and concat, and decode attention folds the GQA group into the query length so
K/V are never repeated.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError
from ..layers.experts import HostJob, combine, expert_compute
from ..layers.kv_cache import KVCache
from ..layers.moe import SWIGLU, ExpertActivation, ExpertProvider, softmax_topk
from ..quant import native, prefill
from ..quant.cpu import split_addmm
from .config import ROPE_TYPES, BaseModelArgs, ExpertNaming, rope_frequencies  # noqa: F401 - re-exported

# T = tokens, S = positions in the KV cache, H = hidden size, D = head dim, E = experts, K = top-k


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


_NORM_MAX_ELEMENTS = 16384  # a decode step's rows (a token's hidden state, its q/k heads); more take torch's ops
_NORM_DTYPES = (torch.bfloat16, torch.float32)


def _native_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                     fp32_weight: bool) -> torch.Tensor | None:
    """x's RMSNorm by native_norm.c where x is a decode step's rows on a CPU, else None (torch's ops)."""
    if x.device.type != "cpu" or x.numel() > _NORM_MAX_ELEMENTS or (lib := native.library()) is None:
        return None
    kind = _norm_kind(x, weight, fp32_weight)
    return None if kind is None else native.rms_norm(lib, x, weight, eps, kind)


def _norm_kind(x: torch.Tensor, weight: torch.Tensor | None, fp32_weight: bool) -> int | None:
    """native_norm.c's kind for a contiguous CPU x of a decode step and its weight, or None (torch's ops)."""
    if x.dtype not in _NORM_DTYPES or not x.is_contiguous():
        return None
    if weight is None:
        return native.NORM_NONE
    if weight.dim() != 1 or not weight.is_contiguous() or weight.device.type != "cpu":
        return None
    if fp32_weight:
        return native.NORM_FP32_W if weight.dtype == torch.float32 else None
    return native.NORM_AFTER if weight.dtype == x.dtype else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """transformers' order: normalise in fp32, cast back, then scale (matters for bf16).

    Spelled out rather than F.rms_norm: on CPU the fused kernel costs ~0.2 ms on a [1, 1024] row inside a
    decode step (its internal dtype round trip), more than the layer's attention GEMMs. A decode step's rows take
    native_norm.c (one call for 7-8 torch ops of dispatch: 4 norms a layer a token).
    """
    if (y := _native_rms_norm(x, weight, eps, False)) is not None:
        return y
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight * y


def rms_norm_fp32_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GPT-OSS's order: the weight (kept in fp32) multiplies the fp32 normalised input, then one cast."""
    if (y := _native_rms_norm(x, weight, eps, True)) is not None:
        return y
    xf = x.float()
    return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """x*cos + rotate_half(x)*sin on the first rotary_dim dims of x [..., D] (the rest pass through), with
    rotate_half(x) == roll(x, R/2) * [-1..., +1...] and that sign folded into the sin table [T, 1, R]."""
    if rotary_dim == x.shape[-1]:
        return x * cos + x.roll(rotary_dim // 2, dims=-1) * sin
    rot = x[..., :rotary_dim]
    return torch.cat([rot * cos + rot.roll(rotary_dim // 2, dims=-1) * sin, x[..., rotary_dim:]], dim=-1)


def _bf16_gemv_lib(x: torch.Tensor, weight_t: torch.Tensor):
    """native.c's bf16 GEMV for one bf16 token on a CPU over a bf16 [in, out] view of a contiguous [out, in] weight
    (1.8x torch 2.13's one-row bf16 GEMM: 21.6 vs 11.9 GB/s over an LM head of 151,936 x 2048, one thread), or None."""
    if x.dtype != torch.bfloat16 or weight_t.dtype != torch.bfloat16 or x.device.type != "cpu":
        return None
    if not weight_t.t().is_contiguous():
        return None
    return native.library()


def _in_out(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's [out, in] weight as [in, out]: a contiguous copy for fp32 on CPU (one-row GEMMs over it
    stream 1.0-1.25x faster there), else a view of the [out, in] weight. CPU bf16/fp16 GEMMs take the view: over a
    contiguous [in, out] copy torch 2.13's one-row GEMM ran 25-50x slower on an AVX2 CPU (50 vs 2.1 ms for a
    [2048 -> 5120] projection, 620 vs 16 ms for [2048 -> 37984]); CUDA takes either layout at full speed."""
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        return weight.t().contiguous()
    return weight.t()


class Attention(nn.Module):
    """GQA attention with optional q/k RMSNorm: per head (Qwen3) or over the whole projection (OLMoE)."""

    def __init__(self, args: BaseModelArgs, qk_norm: str | None, layer: int):
        super().__init__()
        H, D = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv, self.head_dim = args.num_attention_heads, args.num_key_value_heads, D
        self.layer = layer
        self.qk_norm = qk_norm
        self.eps = args.rms_norm_eps
        self.scale = D**-0.5
        self.window = args.layer_window(layer)
        self.sinks = nn.Parameter(torch.empty(self.n_heads)) if args.attention_sinks else None
        self.clip_qkv = getattr(args, "clip_qkv", None)
        self.rotary_dim = args.rotary_dim
        self.q_proj = nn.Linear(H, self.n_heads * D, bias=args.attention_qkv_bias)
        self.k_proj = nn.Linear(H, self.n_kv * D, bias=args.attention_qkv_bias)
        self.v_proj = nn.Linear(H, self.n_kv * D, bias=args.attention_qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=args.attention_out_bias)
        if qk_norm == "head":
            self.q_norm = RMSNorm(D, args.rms_norm_eps)
            self.k_norm = RMSNorm(D, args.rms_norm_eps)
        elif qk_norm == "full":
            self.q_norm = RMSNorm(self.n_heads * D, args.rms_norm_eps)
            self.k_norm = RMSNorm(self.n_kv * D, args.rms_norm_eps)
        self.split = [self.n_heads * D, self.n_kv * D, self.n_kv * D]

    def finalize(self) -> None:
        """After loading: fuse q/k/v into one GEMM and stack per-head norm weights for q and k together."""
        qkv_weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])  # [(nH+2nKV)*D, H]
        self.qkv_t = _in_out(qkv_weight)  # [H, out]: a copy for fp32 on CPU, else a view (see _in_out)
        self.qkv_bias = (torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
                         if self.q_proj.bias is not None else None)
        del self.q_proj, self.k_proj, self.v_proj
        # Plain tensors, not Parameters, for the hot path: a Parameter or sub-module attribute goes through
        # nn.Module.__getattr__, ~1 us a lookup, dozens per decode step.
        self.o_weight_t = _in_out(self.o_proj.weight.detach())  # [nH*D, H], for addmm
        self.o_proj.weight.data = self.o_weight_t.t()  # one copy of the weights, not two
        self.o_bias = None if self.o_proj.bias is None else self.o_proj.bias.detach()
        if self.qk_norm == "full":
            self.q_norm_weight, self.k_norm_weight = self.q_norm.weight.detach(), self.k_norm.weight.detach()
        if self.qk_norm == "head":
            self.qk_norm_weight = torch.cat([self.q_norm.weight.expand(self.n_heads, -1),
                                             self.k_norm.weight.expand(self.n_kv, -1)])  # [nH+nKV, D]
        if self.sinks is not None:  # decode's scores are [nKV, G, S]: the sinks as [nKV, G, 1]
            self.sink_logits = self.sinks.detach().view(self.n_kv, self.n_heads // self.n_kv, 1)
        self.qkv_q = self.o_q = None  # int8 / int4 projections (`quantize_dense`)

    def keep_packed(self, q, k, v, o) -> None:
        """q/k/v and o as a GGUF file stores them (quant/gguf_dense.py `GGUFProjection`, their weights loaded as meta):
        held as `quantize_dense`'s are, the biases in the compute dtype beside them."""
        from ..quant.gguf_dense import GGUFProjection

        nH, nKV, D = self.n_heads, self.n_kv, self.head_dim
        want = ((nH * D, None), (nKV * D, None), (nKV * D, None), (None, nH * D))
        for m, (rows, cols) in zip((q, k, v, o), want, strict=True):
            if (rows is not None and m.shape[0] != rows) or (cols is not None and m.shape[1] != cols):
                raise CheckpointError(f"layer {self.layer}: a packed attention projection of {list(m.shape)} does "
                                      f"not fit {nH} heads of {D} ({nKV} for k and v)")
        self.qkv_q = GGUFProjection([q, k, v], self.qkv_bias)
        self.o_q = GGUFProjection([o], self.o_bias)
        self.qkv_t = self.o_weight_t = None
        del self.o_proj

    def quantize_dense(self, name: str = "int8") -> None:
        """q/k/v and o in `name` (int8 or int4, quant/dense_quant.py); the full-precision copies are freed. Kept
        packed from a GGUF (`keep_packed`), they stay as the file has them."""
        from ..quant.dense_quant import QuantLinear

        if self.qkv_t is None:
            return

        self.qkv_q = QuantLinear(self.qkv_t.t(), self.qkv_bias, name)
        self.o_q = QuantLinear(self.o_weight_t.t(), self.o_bias, name)
        self.qkv_t = self.o_weight_t = None
        del self.o_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, start: int,
                residual: torch.Tensor) -> torch.Tensor:
        """residual + attention(x) [T, H]; x is the normed input [T, H], positions start..start+T-1."""
        T = x.shape[0]
        nH, nKV, D = self.n_heads, self.n_kv, self.head_dim
        if self.qkv_q is not None:
            qkv = self.qkv_q(x)  # [T, out]
        elif T == 1 and (lib := _bf16_gemv_lib(x, self.qkv_t)) is not None:
            qkv = native.bf16_gemv(lib, x, self.qkv_t.t(), torch.float32 if self.qkv_bias is not None else x.dtype)
            if self.qkv_bias is not None:
                qkv = (qkv + self.qkv_bias.float()).to(x.dtype)  # [1, out]
        else:
            qkv = split_addmm(x, self.qkv_t, self.qkv_bias)  # [T, out]: a prompt's on both cores
        if self.qk_norm == "full" or self.clip_qkv is not None:
            q, k, v = qkv.split(self.split, dim=-1)
            if self.qk_norm == "full":
                q = rms_norm(q, self.q_norm_weight, self.eps)
                k = rms_norm(k, self.k_norm_weight, self.eps)
            if self.clip_qkv is not None:
                q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
            qk = torch.cat([q, k], dim=-1).view(T, nH + nKV, D)  # [T, nH+nKV, D]
        else:
            qk = qkv[:, : (nH + nKV) * D].view(T, nH + nKV, D)  # [T, nH+nKV, D]
            v = qkv[:, (nH + nKV) * D :]
        if self.qk_norm == "head":
            qk = rms_norm(qk, None, self.eps) * self.qk_norm_weight
        qk = apply_rope(qk, cos, sin, self.rotary_dim)  # [T, nH+nKV, D]
        end = start + T
        kc, vc = kv.k[self.layer], kv.v[self.layer]  # [nKV, S, D]
        first = 0 if self.window is None else max(0, start - self.window + 1)  # oldest key any query sees
        ring = kv.ring[self.layer]  # a sliding layer's ring of `window` slots (position p in slot p % window), or None
        if ring is not None and end > ring:  # the ring wraps: read the window's past in order, then write the chunk
            return self._ring_forward(qk[:, :nH], qk[:, nH:].transpose(0, 1), v.reshape(T, nKV, D).transpose(0, 1),
                                      kc, vc, ring, start, residual)
        if T == 1:
            kc.select(1, start).copy_(qk[0, nH:])
            vc.select(1, start).copy_(v.view(nKV, D))
            # The G query heads sharing a KV head become G "query positions" of that head: no repeat of K/V.
            q = qk[0, :nH].view(nKV, nH // nKV, D)  # [nKV, G, D]
            if self.sinks is None and q.dtype == torch.bfloat16 and q.device.type == "cpu":
                # bf16 on a CPU: native.c's decode kernel (fp32, each K/V row read once for the G heads), 2.7x
                # faster than SDPA's fused kernel at S=4000; without it SDPA (fp32 accumulation), 5x faster there
                # than two bf16 matmuls whose shape changes every token (bench/soak.py); fp32 and fp16 keep the
                # matmuls below, where SDPA's CPU path gains little or loses.
                # Chosen by dtype and layout, never by the thread count: a path that changed with the count would
                # change the rounding, and greedy tokens with it (issue 27: SDPA at 3 threads, this at 1 and 2).
                # The kernel runs on one thread, so SDPA's split over heads may be faster on many cores at long
                # contexts; the same tokens at any --threads are worth more here.
                lib = native.library()
                if lib is not None and kc.stride(2) == 1 and kc.stride(1) == D and vc.stride(2) == 1 \
                        and vc.stride(1) == D:
                    out = native.attn_decode(lib, q, kc, vc, first, end, self.scale).to(torch.bfloat16)
                    return self._out(out.view(1, nH * D), residual)
                out = F.scaled_dot_product_attention(q[None], kc[None, :, first:end], vc[None, :, first:end],
                                                     scale=self.scale)[0]  # [nKV, G, D]
                return self._out(out.reshape(1, nH * D), residual)
            # Written out rather than SDPA in fp32: SDPA's CPU math path scales a copy of all S keys every step.
            scores = torch.matmul(q, kc[:, first:end].transpose(1, 2))  # [nKV, G, S]
            if self.sinks is None:
                probs = torch.softmax(scores * self.scale, dim=-1)  # [nKV, G, S]
            else:  # the sink joins the softmax as one more logit per head and is dropped after it
                logits = torch.cat([scores * self.scale, self.sink_logits], dim=-1)  # [nKV, G, S+1]
                probs = torch.softmax(logits, dim=-1)[..., :-1]  # [nKV, G, S]
            out = torch.matmul(probs, vc[:, first:end])  # [nKV, G, D]
            return self._out(out.view(1, nH * D), residual)
        kc[:, start:end] = qk[:, nH:].transpose(0, 1)
        vc[:, start:end] = v.view(T, nKV, D).transpose(0, 1)
        keys, values = kc[:, first:end], vc[:, first:end]  # [nKV, S, D]
        if nH != nKV:
            # Repeated K/V rather than enable_gqa: with it, CPU SDPA falls back to its math path (3x slower
            # on a 512-token chunk than the flash kernel), and the copy is small next to the attention.
            G = nH // nKV
            keys = keys[:, None].expand(nKV, G, *keys.shape[1:]).reshape(nH, -1, D)  # [nH, S, D]
            values = values[:, None].expand(nKV, G, *values.shape[1:]).reshape(nH, -1, D)  # [nH, S, D]
        q = qk[:, :nH].transpose(0, 1)  # [nH, T, D]
        if self.sinks is not None:
            return self._out(self._prefill_with_sinks(q, keys, values, start, first, end), residual)
        if start == 0 and self.window is None:
            # 4-D ([1, nH, T, D]): CPU SDPA picks its flash kernel only for batched 4-D inputs.
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None], is_causal=True)[0]
        else:
            qpos = torch.arange(start, end, device=x.device)[:, None]  # [T, 1]
            kpos = torch.arange(first, end, device=x.device)[None, :]  # [1, S]
            mask = kpos <= qpos  # [T, S]
            if self.window is not None:
                mask &= kpos > qpos - self.window
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask)[0]
        return self._out(out.transpose(0, 1).reshape(T, nH * D), residual)  # [T, H]

    def _ring_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                      ring: int, start: int, residual: torch.Tensor) -> torch.Tensor:
        """residual + attention of q [T, nH, D] at positions start.. over a sliding layer's ring kc / vc [nKV, W, D]
        (W = the window) once it wraps, with this chunk's k / v [nKV, T, D]; writes the chunk's last W positions.
        One token: written at slot start % W, then the whole ring is its window (softmax reads keys in any order).
        A chunk: the window's past (start - W + 1 .. start - 1) gathered in position order, the chunk after it and
        the causal window mask over both, as the buffer of the whole context gives; the ring is written after."""
        T, nH, D = q.shape
        nKV, end = self.n_kv, start + T
        if T == 1:
            kc[:, start % ring], vc[:, start % ring] = k[:, 0], v[:, 0]
            qh = q[0].reshape(nKV, nH // nKV, D)  # [nKV, G, D]
            lib = native.library() if q.dtype == torch.bfloat16 and q.device.type == "cpu" else None
            if self.sinks is None and lib is not None:
                out = native.attn_decode(lib, qh.contiguous(), kc, vc, 0, ring, self.scale).to(torch.bfloat16)
                return self._out(out.view(1, nH * D), residual)
            scores = torch.matmul(qh, kc.transpose(1, 2)) * self.scale  # [nKV, G, W]
            if self.sinks is None:
                probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            else:  # the sink joins the softmax as one more logit per head and is dropped after it
                probs = torch.softmax(torch.cat([scores, self.sink_logits], dim=-1).float(), -1)[..., :-1].to(q.dtype)
            return self._out(torch.matmul(probs, vc).view(1, nH * D), residual)
        first = max(0, start - self.window + 1)
        past = torch.arange(first, start, device=q.device) % ring  # the slots of the window's past, oldest first
        keys, values = torch.cat([kc[:, past], k], dim=1), torch.cat([vc[:, past], v], dim=1)  # [nKV, S, D]
        G, S = nH // nKV, keys.shape[1]
        keys = keys[:, None].expand(nKV, G, S, D).reshape(nH, S, D)  # [nH, S, D]
        values = values[:, None].expand(nKV, G, S, D).reshape(nH, S, D)
        qh = q.transpose(0, 1)  # [nH, T, D]
        if self.sinks is not None:
            out = self._prefill_with_sinks(qh, keys, values, start, first, end)  # [T, nH*D]
        else:
            qpos = torch.arange(start, end, device=q.device)[:, None]  # [T, 1]
            kpos = torch.arange(first, end, device=q.device)[None, :]  # [1, S]
            mask = (kpos <= qpos) & (kpos > qpos - self.window)
            out = F.scaled_dot_product_attention(qh[None], keys[None], values[None], attn_mask=mask)[0]
            out = out.transpose(0, 1).reshape(T, nH * D)
        keep = torch.arange(max(start, end - ring), end, device=q.device)  # the chunk's last W positions
        kc[:, keep % ring], vc[:, keep % ring] = k[:, keep - start], v[:, keep - start]
        return self._out(out, residual)

    def _prefill_with_sinks(self, q, keys, values, start: int, first: int, end: int) -> torch.Tensor:
        """Attention with a sink logit per head through SDPA: the sink is one more key that every query sees,
        with value 0 and a logit of exactly sinks[h], made by one extra dimension (1 in every query, 0 in
        every key, sinks[h] / scale in the sink key). No [nH, T, S] score tensor is materialised."""
        nH, T, D = q.shape
        S = keys.shape[1]
        dev, dt = q.device, q.dtype
        q1 = torch.cat([q, q.new_ones(nH, T, 1)], dim=-1)  # [nH, T, D+1]
        k1 = torch.cat([keys, keys.new_zeros(nH, S, 1)], dim=-1)  # [nH, S, D+1]
        sink_key = torch.cat([keys.new_zeros(nH, 1, D), (self.sinks.to(dt) / self.scale)[:, None, None]], dim=-1)
        k1 = torch.cat([sink_key, k1], dim=1)  # [nH, S+1, D+1]
        v1 = torch.cat([values.new_zeros(nH, 1, D + 1), torch.cat([values, values.new_zeros(nH, S, 1)], -1)], 1)
        qpos = torch.arange(start, end, device=dev)[:, None]  # [T, 1]
        kpos = torch.arange(first, end, device=dev)[None, :]  # [1, S]
        mask = kpos <= qpos  # [T, S]
        if self.window is not None:
            mask &= kpos > qpos - self.window
        mask = torch.cat([mask.new_ones(T, 1), mask], dim=1)  # [T, S+1]: the sink is always seen
        out = F.scaled_dot_product_attention(q1[None], k1[None], v1[None], attn_mask=mask, scale=self.scale)[0]
        return out[..., :D].transpose(0, 1).reshape(T, nH * D)  # [T, nH*D]

    def _out(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + o_proj(attn) as one GEMM-with-accumulate."""
        if self.o_q is not None:
            return self.o_q(attn, residual)  # [T, H]
        if attn.shape[0] == 1 and (lib := _bf16_gemv_lib(attn, self.o_weight_t)) is not None:
            out = native.bf16_gemv(lib, attn, self.o_weight_t.t()) + residual.float()  # [1, H] fp32, rounded once
            return (out if self.o_bias is None else out + self.o_bias.float()).to(residual.dtype)
        out = split_addmm(attn, self.o_weight_t, residual)  # [T, H]
        return out if self.o_bias is None else out + self.o_bias


class MLP(nn.Module):
    """Dense SwiGLU MLP (layers a MoE model keeps dense, e.g. Qwen3-MoE's mlp_only_layers)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """The gate: a [E, H] linear (with a bias in GPT-OSS)."""

    def __init__(self, hidden: int, num_experts: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None


class SparseMoeBlock(nn.Module):
    """Router + experts through the provider. Model files never import the cache.

    The router's attribute name follows the checkpoint (`gate` in most, `router` in GPT-OSS)."""

    router_attr: ClassVar[str] = "gate"
    router_bias: ClassVar[bool] = False
    activation: ClassVar[ExpertActivation] = SWIGLU

    def __init__(self, args: BaseModelArgs, layer: int):
        super().__init__()
        setattr(self, self.router_attr, Router(args.hidden_size, args.num_experts, self.router_bias))
        self.layer = layer
        self.top_k = args.top_k
        self.renormalize = args.renormalize
        self.act = self.activation_for(args)

    @classmethod
    def activation_for(cls, args: BaseModelArgs) -> ExpertActivation:
        return cls.activation

    def finalize(self) -> None:
        router = getattr(self, self.router_attr)
        self.gate_weight = router.weight.detach()
        self.gate_bias = None if router.bias is None else router.bias.detach()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> topk_weights [T, K], topk_ids [T, K] (model files with other routing override this)."""
        if x.shape[0] == 1 and (lib := _bf16_gemv_lib(x, self.gate_weight.t())) is not None:
            # a decode token's router through native.c's bf16 GEMV, fp32 sums rounded once as F.linear's (18 against
            # 46 us for 128 x 2048 in cache, one thread: torch's one-row bf16 GEMM; per MoE layer, every token)
            if self.gate_bias is None:
                router_logits = native.bf16_gemv(lib, x, self.gate_weight, x.dtype)  # [1, E]
            else:
                router_logits = (native.bf16_gemv(lib, x, self.gate_weight) + self.gate_bias.float()).to(x.dtype)
        elif prefill.tiles_for_torch(x, self.gate_weight, lib := native.decode_library()):
            # a prompt's router where torch's bf16 GEMM is the slow fallback: the bf16 tiles (6% of an int8 model's
            # 128-token prefill on a Zen 2 went to torch's 128 x 128 x 2048 router GEMM)
            router_logits = prefill.finish(prefill.bf16(lib, x, self.gate_weight), x.dtype, self.gate_bias)  # [T, E]
        else:
            router_logits = F.linear(x, self.gate_weight, self.gate_bias)  # [T, E]
        return softmax_topk(router_logits, self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor, provider: ExpertProvider, residual: torch.Tensor) -> torch.Tensor:
        """residual + MoE(x) [T, H]."""
        topk_weights, topk_ids = self.route(x)  # [T, K], [T, K]
        provider.observe(self.layer, residual)  # the residual stream here predicts the next layers' routing
        return run_experts(x, topk_weights, topk_ids, provider, self.layer, self.act, residual)


def run_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, provider: ExpertProvider,
                layer: int, act, residual: torch.Tensor) -> torch.Tensor:
    """residual + the routed experts' weighted outputs for x [T, H], through the provider's batches.

    On a CPU every pair's output gets its own fp32 row and the rows are summed in k order at the end: the same bits
    whichever slots hold the experts, however many groups a chunk needs and whether an expert ran from a slot or in
    place on the host (cached == resident, bit for bit, in bf16 too). On CUDA a hybrid host batch starts its copy
    now and is computed after the device's launch."""
    host_jobs = []
    contrib = (torch.zeros(topk_ids.numel(), x.shape[-1], dtype=torch.float32)
               if x.device.type == "cpu" else None)
    for batch in provider.batches(layer, topk_ids):  # one batch unless the slots are too few
        if batch.on_host and x.is_cuda:
            host_jobs.append(HostJob(x, topk_weights, batch))
            continue
        if contrib is not None:
            expert_compute(x, topk_weights, batch, act=act, contrib=contrib)
        else:
            residual = expert_compute(x, topk_weights, batch, residual=residual, act=act)
    if contrib is not None:
        residual = combine(residual, contrib, topk_ids.shape[-1])
    for job in host_jobs:
        residual = job.finish(residual, act)
    return residual


class DecoderLayer(nn.Module):
    def __init__(self, args: BaseModelArgs, layer: int, moe_attr: str, qk_norm: str | None,
                 moe_block: type[SparseMoeBlock] = SparseMoeBlock, attention: type[nn.Module] = Attention):
        super().__init__()
        self.self_attn = attention(args, qk_norm, layer)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.is_moe = args.is_moe_layer(layer)
        self.mlp_attr = moe_attr if self.is_moe else "mlp"
        if self.is_moe:
            setattr(self, moe_attr, moe_block(args, layer))
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.eps = args.rms_norm_eps
        self.norm_in_fp32 = args.norm_in_fp32

    def finalize(self) -> None:
        self.self_attn.finalize()
        self.ffn = getattr(self, self.mlp_attr)
        self.attn = self.self_attn
        self.w_in = self.input_layernorm.weight.detach()
        self.w_post = self.post_attention_layernorm.weight.detach()
        self.norm = rms_norm
        if self.norm_in_fp32:
            self.w_in, self.w_post, self.norm = self.w_in.float(), self.w_post.float(), rms_norm_fp32_weight
        if self.is_moe:
            self.ffn.finalize()

    def forward(self, x, cos, sin, kv: KVCache, start: int, provider: ExpertProvider) -> torch.Tensor:
        # Sub-modules are called through .forward: nn.Module.__call__ costs microseconds per call, and a
        # decode step makes hundreds of them.
        x = self.attn.forward(self.norm(x, self.w_in, self.eps), cos, sin, kv, start, x)
        h = self.norm(x, self.w_post, self.eps)
        return self.ffn.forward(h, provider, x) if self.is_moe else x + self.ffn.forward(h)


class DecoderBody(nn.Module):
    def __init__(self, args: BaseModelArgs, moe_attr: str, qk_norm: str | None,
                 moe_block: type[SparseMoeBlock] = SparseMoeBlock, attention: type[nn.Module] = Attention):
        super().__init__()
        # Built on the meta device only: an explicit (empty) weight skips nn.Embedding's normal_() init, which on
        # meta goes through torch._refs and imports torch._dynamo (~2.4 s of `moechat run`'s start-up).
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size,
                                         _weight=torch.empty(args.vocab_size, args.hidden_size))  # [V, H]
        self.layers = nn.ModuleList(DecoderLayer(args, i, moe_attr, qk_norm, moe_block, attention)
                                    for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class MoEForCausalLM(nn.Module):
    """A decoder-only MoE language model; subclasses name the config class, MoE attribute and qk norm."""

    args_class: ClassVar[type[BaseModelArgs]] = BaseModelArgs
    moe_attr: ClassVar[str] = "mlp"
    qk_norm: ClassVar[str | None] = None
    moe_block: ClassVar[type[SparseMoeBlock]] = SparseMoeBlock
    attention: ClassVar[type[nn.Module]] = Attention
    expert_naming: ClassVar[ExpertNaming]
    # Dense tensors loaded in fp32 whatever the model's dtype (name suffixes): transformers keeps DeepSeek's
    # router and its correction bias in fp32, and the bias steers the choice by differences below bf16's step.
    fp32_weights: ClassVar[tuple[str, ...]] = ()
    embed_q = None  # the embedding table kept packed (`keep_packed`); None: embed_weight is the table

    def __init__(self, args: BaseModelArgs):
        super().__init__()
        self.args = args
        self.model = DecoderBody(args, self.moe_attr, self.qk_norm_for(args), self.moe_block, self.attention)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @classmethod
    def qk_norm_for(cls, args: BaseModelArgs) -> str | None:
        """The q/k norm kind (None, "head", "full"); a config flag in some families (GLM-4.5's use_qk_norm)."""
        return cls.qk_norm

    def finalize(self, max_positions: int) -> None:
        """After the weights are assigned: fused weights and the RoPE table for max_positions."""
        for layer in self.model.layers:
            layer.finalize()
        self.layer_list = list(self.model.layers)
        self.embed_weight = self.model.embed_tokens.weight.detach()
        self.embed_host: torch.Tensor | None = None  # `--embeddings host`: the table in RAM (embed_on_host)
        self.norm_weight = self.model.norm.weight.detach()
        self.final_norm = rms_norm
        if self.args.norm_in_fp32:
            self.norm_weight, self.final_norm = self.norm_weight.float(), rms_norm_fp32_weight
        lm_weight = (self.model.embed_tokens if self.args.tie_word_embeddings else self.lm_head).weight.detach()
        self.lm_weight_t = _in_out(lm_weight)  # [H, V] (see _in_out)
        if not self.args.tie_word_embeddings:  # the embedding table must stay [V, H] for lookups
            self.lm_head.weight.data = self.lm_weight_t.t()
        R = self.args.rotary_dim  # RoPE dims of a head (all of them unless partial rotary)
        device = self.norm_weight.device  # (a table kept packed is left on the meta device: `keep_packed`)
        dtype = self.model.embed_tokens.weight.dtype
        inv_freq, attention_factor = rope_frequencies(self.args.rope, R)  # [R/2]
        pos = torch.arange(max_positions, dtype=torch.int64).float()  # [S]
        freqs = pos[:, None] * inv_freq[None, :]  # [S, R/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [S, R]
        sign = torch.cat([-torch.ones(R // 2), torch.ones(R // 2)])  # [R]
        cos, sin = emb.cos() * attention_factor, emb.sin() * attention_factor  # [S, R] (YaRN scales both)
        self.rope_cos = cos.to(dtype).to(device)[:, None, :]  # [S, 1, R]
        self.rope_sin = (sin.to(dtype) * sign.to(dtype)).to(device)[:, None, :]  # [S, 1, R]
        self.max_positions = max_positions
        self.lm_q = None  # the LM head in int8 (`quantize_dense`), or kept packed (`keep_packed`)
        self.dense_format = "native"

    def packable_attention(self) -> list[int]:
        """The layers whose attention a GGUF may keep packed (load/gguf.py `packed_attention`): the plain `Attention`
        (MLA, the recurrent layers and every subclass keep their own layouts), in a model finalized as this one is."""
        if type(self).finalize is not MoEForCausalLM.finalize:
            return []
        return [i for i, layer in enumerate(self.model.layers) if type(layer.self_attn) is Attention]

    def keep_packed(self, embed=None, lm_head=None, attention: dict | None = None) -> None:
        """A GGUF's token_embd / output matrices kept in their quant type (quant/gguf_dense.py `GGUFMatrix`, loaded as
        meta here): `embed` gives the rows of the ids, `lm_head` (or a tied `embed`) is the LM head as `lm_q` is;
        `attention` (engine name -> GGUFMatrix) a layer's q/k/v/o projections (`Attention.keep_packed`)."""
        for i, layer in enumerate(self.model.layers):
            mats = [(attention or {}).get(f"model.layers.{i}.self_attn.{p}_proj.weight") for p in "qkvo"]
            if all(m is not None for m in mats):
                layer.self_attn.keep_packed(*mats)
        if embed is not None:
            self.embed_q, self.embed_weight = embed, None
        head = lm_head if lm_head is not None else embed if self.args.tie_word_embeddings else None
        if head is not None:
            self.lm_q, self.lm_weight_t = head, None

    def quantize_dense(self, name: str, head_cache=None) -> None:
        """`--dense-format int8|int4`: attention's projections in `name`, the LM head in int8 under either
        (quant/dense_quant.py; through `head_cache`, engine/cache/dense_cache.py, where the loader gives one: the
        previous load's codes mapped instead of quantized again). MLA attention keeps its own layout (its absorbed
        decode multiplies the latent by the weights directly)."""
        if name == "native":
            return
        from ..quant.dense_quant import LM_HEAD_FORMAT, QuantLinear

        for layer in self.layer_list:
            if isinstance(layer.self_attn, Attention):
                layer.self_attn.quantize_dense(name)
        if self.lm_weight_t is not None:  # a GGUF head kept packed (6-8 bits as its file ships it) stays so
            head = self.lm_weight_t.t()
            self.lm_q = (head_cache.get(head, LM_HEAD_FORMAT) if head_cache is not None
                         else QuantLinear(head, None, LM_HEAD_FORMAT))
            self.lm_weight_t = None
            if not self.args.tie_word_embeddings:
                del self.lm_head  # the int8 copy is the LM head now; a tied table stays for the embedding lookups
        self.dense_format = name

    def forward(self, input_ids: torch.Tensor, kv: KVCache, provider: ExpertProvider) -> torch.Tensor:
        """input_ids [T] at positions kv.length.. -> final-normed hidden states [T, H]; advances kv.length."""
        start = kv.length
        T = input_ids.shape[0]
        kv.reserve(T)
        x = self.embed(input_ids)  # [T, H]
        cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]  # [T, 1, R]
        kv.consistent = False  # until the last layer: an error between leaves rings written past kv.length
        for layer in self.layer_list:
            x = layer.forward(x, cos, sin, kv, start, provider)
        kv.length = start + T
        kv.consistent = True
        return self.final_norm(x, self.norm_weight, self.args.rms_norm_eps)

    def embed_on_host(self) -> None:
        """`--embeddings host`: the input table moves to RAM (pinned under CUDA) and its VRAM is free for slots;
        each token's row is gathered there and copied in (H x 2 bytes in bf16). A tied table is the LM head too."""
        if (self.args.tie_word_embeddings or type(self).forward is not MoEForCausalLM.forward
                or self.embed_q is not None):
            return  # tied, a model whose own forward looks rows up itself, or packed (on a CPU): the table stays
        table = self.embed_weight
        host = table.cpu()
        self.embed_host = host.pin_memory() if table.is_cuda else host  # [V, H]
        self.model.embed_tokens.weight.data = self.embed_host
        self.embed_weight = self.embed_host
        self._embed_stage, self._embed_copied = None, None  # pinned [T, H] rows, allocated once per size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> their embedding rows [T, H] on the compute device."""
        device = self.norm_weight.device
        if self.embed_q is not None:
            return self.embed_q.rows(input_ids)  # [T, H]: only these rows decoded
        if self.embed_host is None or device.type == "cpu":
            return F.embedding(input_ids, self.embed_weight)  # [T, H]
        T = input_ids.shape[0]
        stage = self._embed_stage
        if stage is None or stage.shape[0] < T:
            stage = self._embed_stage = torch.empty(max(T, 16), self.embed_host.shape[1], dtype=self.embed_host.dtype,
                                                    pin_memory=True)  # [T', H]
        elif self._embed_copied is not None:
            self._embed_copied.synchronize()  # the last copy out of the staging rows (long done by now)
        torch.index_select(self.embed_host, 0, input_ids.cpu(), out=stage[:T])  # gathered in RAM
        x = stage[:T].to(device, non_blocking=True)  # [T, H]: a few KB a token over the link
        self._embed_copied = torch.cuda.Event()
        self._embed_copied.record(torch.cuda.current_stream(device))
        return x

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.lm_q is not None:
            return self.lm_q(hidden_states, out_dtype=torch.float32)  # [T, V]
        if hidden_states.shape[0] == 1 and (lib := _bf16_gemv_lib(hidden_states, self.lm_weight_t)) is not None:
            return native.bf16_gemv(lib, hidden_states, self.lm_weight_t.t())  # [1, V] fp32 logits
        return (hidden_states @ self.lm_weight_t).float()  # [T, V]

    @classmethod
    def dense_weight_names(cls, args: BaseModelArgs) -> dict[str, tuple[int, ...]]:
        """Every dense tensor the checkpoint must have, with its shape (from a meta-device build)."""
        with torch.device("meta"):
            model = cls(args)
        return {name: tuple(t.shape) for name, t in model.state_dict().items()}

    @classmethod
    def moe_layers(cls, args: BaseModelArgs) -> list[int]:
        return [i for i in range(args.num_hidden_layers) if args.is_moe_layer(i)]
