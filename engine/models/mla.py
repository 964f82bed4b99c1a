"""Multi-head latent attention (MLA), DeepSeek-V2/V3's attention, with the compressed latent as the KV cache.

Per token, kv_a_proj_with_mqa makes one kv_lora_rank latent c (RMS-normed) and one RoPE key k_pe shared by
every head; kv_b_proj expands c into each head's no-RoPE key and its value. The cache keeps [c | k_pe]
(DeepSeek-V3: 512 + 64 values per token and layer, 68.6 KiB per token for 61 layers in bf16, 2.1 GiB for a
32k context) instead of the expanded keys and values (128 heads x (192 + 128) values: 4.8 MiB per token,
152 GiB for 32k).

* Prefill (T > 1) expands the cached latents of every position into per-head K/V and runs SDPA: compute-bound,
  and the expansion is reused by all T queries.
* Decode (T == 1) uses the absorbed form: W_UK (kv_b_proj's key rows) is folded into the query,
  q_lat[h] = q_nope[h] @ W_UK[h] [nH, kv_lora], so scores = [q_lat | q_pe] @ [c | k_pe]^T reads each cached
  latent once for all heads; the output o_lat[h] = probs[h] @ c goes through W_UV[h] (kv_b_proj's value rows)
  before o_proj. Exact algebra; equal to the expanded form to fp32 rounding (tests/engine/test_mla_models.py).

RoPE touches only the qk_rope_head_dim part. DeepSeek's checkpoints lay those dims out as interleaved pairs
(x0, x1), (x2, x3), ... (`rope_interleave`, and always in V2's complex-number form); the rows of the projections
that make them are permuted once at load into rotate-half order (even dims, then odd dims), which gives the same
q.k products with the usual RoPE table.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.kv_cache import KVCache
from .base import RMSNorm, _in_out, apply_rope, rms_norm

# T = tokens, S = cached positions, H = hidden size, nH = heads, C = kv_lora_rank, R = qk_rope_head_dim,
# N = qk_nope_head_dim, V = v_head_dim

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm use RMSNorm's default eps, not the config's


def yarn_softmax_scale(rope: dict, qk_head_dim: int) -> float:
    """DeepSeek's softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (the cos/sin
    table carries mscale / mscale_all_dim, so with both equal the whole YaRN correction lands here)."""
    scale = qk_head_dim**-0.5
    m_all = rope.get("mscale_all_dim") or 0
    if rope["rope_type"] != "default" and m_all:
        factor = float(rope["factor"])
        m = 1.0 if factor <= 1 else 0.1 * m_all * math.log(factor) + 1.0
        scale = scale * m * m
    return scale


def interleaved_to_halves(n: int) -> torch.Tensor:
    """The permutation taking interleaved RoPE pairs to rotate-half order: [0, 2, 4, ..., 1, 3, 5, ...]."""
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


class MLAttention(nn.Module):
    """MLA with an optional low-rank query (q_lora_rank; DeepSeek-V2-Lite has none). Names follow the checkpoint."""

    def __init__(self, args, qk_norm: str | None, layer: int):
        super().__init__()
        H, nH = args.hidden_size, args.num_attention_heads
        self.layer = layer
        self.n_heads = nH
        self.nope, self.rope, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora, self.q_lora = args.kv_lora_rank, args.q_lora_rank
        self.interleaved = args.rope_interleaved
        qk = self.nope + self.rope
        self.scale = yarn_softmax_scale(args.rope, qk)
        if self.q_lora:
            self.q_a_proj = nn.Linear(H, self.q_lora, bias=args.attention_bias)
            self.q_a_layernorm = RMSNorm(self.q_lora, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora, nH * qk, bias=False)
        else:
            self.q_proj = nn.Linear(H, nH * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, self.kv_lora + self.rope, bias=args.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora, nH * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(nH * self.v_dim, H, bias=args.attention_bias)

    def _rope_rows(self, weight: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
        """weight [heads * head_dim, in] with each head's last R rows (its RoPE part) put in rotate-half order."""
        if not self.interleaved:
            return weight
        w = weight.view(heads, head_dim, -1)  # [heads, head_dim, in]
        rope = w[:, head_dim - self.rope :].index_select(1, interleaved_to_halves(self.rope).to(w.device))
        return torch.cat([w[:, : head_dim - self.rope], rope], dim=1).reshape(weight.shape)

    def finalize(self) -> None:
        """One GEMM for everything x feeds (q_a or q, and kv_a); RoPE rows reordered; kv_b split for absorption."""
        nH, C, R, N, V = self.n_heads, self.kv_lora, self.rope, self.nope, self.v_dim
        kv_a_w = self._rope_rows(self.kv_a_proj_with_mqa.weight.detach(), 1, C + R)  # [C+R, H]
        kv_a_b = self.kv_a_proj_with_mqa.bias
        if self.q_lora:
            q_in_w, q_in_b = self.q_a_proj.weight.detach(), self.q_a_proj.bias  # [q_lora, H]
            self.q_norm_weight = self.q_a_layernorm.weight.detach()
            self.q_b_t = _in_out(self._rope_rows(self.q_b_proj.weight.detach(), nH, N + R))  # [q_lora, nH*(N+R)]
            del self.q_b_proj
        else:
            q_in_w, q_in_b = self._rope_rows(self.q_proj.weight.detach(), nH, N + R), None  # [nH*(N+R), H]
        self.q_width = q_in_w.shape[0]
        self.in_t = _in_out(torch.cat([q_in_w, kv_a_w]))  # [H, q_width + C + R]
        self.in_bias = None
        if kv_a_b is not None:  # attention_bias: q_a and kv_a have biases (q_proj never has)
            q_b = q_in_b.detach() if q_in_b is not None else kv_a_b.new_zeros(self.q_width)
            self.in_bias = torch.cat([q_b, self._rope_rows(kv_a_b.detach()[:, None], 1, C + R)[:, 0]])
        self.kv_norm_weight = self.kv_a_layernorm.weight.detach()
        kv_b = self.kv_b_proj.weight.detach()  # [nH*(N+V), C]
        self.kv_b_t = _in_out(kv_b)  # [C, nH*(N+V)], to expand latents for prefill
        per_head = kv_b.view(nH, N + V, C)
        self.w_uk = per_head[:, :N].contiguous()  # [nH, N, C]: q_nope[h] @ w_uk[h] is q in latent space
        self.w_uv_t = per_head[:, N:].transpose(1, 2).contiguous()  # [nH, C, V]: o_lat[h] @ w_uv_t[h], head h's out
        self.o_weight_t = _in_out(self.o_proj.weight.detach())  # [nH*V, H]
        self.o_proj.weight.data = self.o_weight_t.t()  # one copy of the weights, not two
        self.o_bias = None if self.o_proj.bias is None else self.o_proj.bias.detach()
        del self.kv_a_proj_with_mqa, self.kv_b_proj
        if self.q_lora:
            del self.q_a_proj
        else:
            del self.q_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, start: int,
                residual: torch.Tensor, absorbed: bool | None = None) -> torch.Tensor:
        """residual + attention(x) [T, H] at positions start..start+T-1; the latents go into kv.k[layer].

        `absorbed` picks the decode form (default: absorbed for one token, expanded for more); tests compare both.
        """
        T = x.shape[0]
        nH, C, R, N = self.n_heads, self.kv_lora, self.rope, self.nope
        a = x @ self.in_t if self.in_bias is None else torch.addmm(self.in_bias, x, self.in_t)  # [T, q_width+C+R]
        q = a[:, : self.q_width]
        if self.q_lora:
            q = rms_norm(q, self.q_norm_weight, LATENT_NORM_EPS) @ self.q_b_t  # [T, nH*(N+R)]
        q = q.view(T, nH, N + R)
        q_pe = apply_rope(q[..., N:], cos, sin, R)  # [T, nH, R]
        c = rms_norm(a[:, self.q_width : self.q_width + C], self.kv_norm_weight, LATENT_NORM_EPS)  # [T, C]
        k_pe = apply_rope(a[:, None, self.q_width + C :], cos, sin, R)[:, 0]  # [T, R]
        end = start + T
        cache = kv.k[self.layer][0]  # [S_max, C+R]
        cache[start:end, :C] = c
        cache[start:end, C:] = k_pe
        latents = cache[:end]  # [S, C+R]
        if absorbed if absorbed is not None else T == 1:
            out = self._absorbed(q[..., :N], q_pe, latents, start)  # [T, nH*V]
        else:
            out = self._expanded(q[..., :N], q_pe, latents, start)  # [T, nH*V]
        out = torch.addmm(residual, out, self.o_weight_t)  # [T, H]
        return out if self.o_bias is None else out + self.o_bias

    def _expanded(self, q_nope, q_pe, latents, start: int) -> torch.Tensor:
        """Per-head K [nH, S, N+R] and V [nH, S, V] from the latents, then causal SDPA."""
        T, nH, N = q_nope.shape
        S, C, R, V = latents.shape[0], self.kv_lora, self.rope, self.v_dim
        kvb = (latents[:, :C] @ self.kv_b_t).view(S, nH, N + V)  # [S, nH, N+V]
        keys = torch.cat([kvb[..., :N], latents[:, None, C:].expand(S, nH, R)], dim=-1).transpose(0, 1)  # [nH, S, N+R]
        values = kvb[..., N:].transpose(0, 1)  # [nH, S, V]
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [nH, T, N+R]
        if start == 0:
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None], is_causal=True, scale=self.scale)[0]
        else:
            qpos = torch.arange(start, start + T, device=q.device)[:, None]  # [T, 1]
            mask = torch.arange(S, device=q.device)[None, :] <= qpos  # [T, S]
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask,
                                                 scale=self.scale)[0]
        return out.transpose(0, 1).reshape(T, nH * V)  # [T, nH*V]

    def _absorbed(self, q_nope, q_pe, latents, start: int) -> torch.Tensor:
        """Attention in latent space: W_UK folded into the query, W_UV applied after the weighted sum."""
        T, nH, N = q_nope.shape
        C = self.kv_lora
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk)  # [nH, T, C]
        q_all = torch.cat([q_lat, q_pe.transpose(0, 1)], dim=-1)  # [nH, T, C+R]
        scores = torch.matmul(q_all, latents.t()) * self.scale  # [nH, T, S]
        if T > 1:
            S = latents.shape[0]
            qpos = torch.arange(start, start + T, device=q_all.device)[:, None]  # [T, 1]
            scores = scores.masked_fill(torch.arange(S, device=q_all.device)[None, :] > qpos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [nH, T, S]
        o_lat = torch.matmul(probs, latents[:, :C])  # [nH, T, C]
        out = torch.bmm(o_lat, self.w_uv_t)  # [nH, T, V]
        return out.transpose(0, 1).reshape(T, nH * self.v_dim)  # [T, nH*V]
