"""Gemma 4's MoE (`model_type: gemma4`, the multimodal wrapper, and `gemma4_text`): Gemma-4-26B-A4B(-it).

Each layer runs a dense GeGLU MLP and a routed MoE side by side on the same residual and adds their normed outputs:
  r = x + norm(attn(norm(x)));  h1 = norm1(mlp(norm(r)));  h2 = norm2(experts(norm'(r)), routed on r)
  out = (r + norm(h1 + h2)) * layer_scalar
Attention alternates `sliding_attention` layers (head_dim 256, 8 KV heads, a `sliding_window` of 1024, RoPE
theta 1e4 on the whole head) with `full_attention` ones (`global_head_dim` 512, `num_global_key_value_heads` 2,
`attention_k_eq_v`: V is the K projection itself, "proportional" RoPE theta 1e6 on the first quarter of the
frequencies, the rest unrotated), per layer_types; q and k are RMS-normed per head, v without a scale, and the
softmax is unscaled (scale 1.0). The router RMS-norms r without a weight, scales it by `router.scale` / sqrt(H),
takes a softmax over every expert, the top-k renormalised and times `per_expert_scale`; experts are GeGLU
(gelu tanh) as fused [E, 2I, H] tensors. Embeddings are scaled by sqrt(H) (in the model's dtype), RMSNorm weights
multiply the fp32 normalised input (no 1 + w), the LM head is the tied embedding and logits are soft-capped:
cap * tanh(logits / cap). The multimodal wrapper's text model lives under `model.language_model.`; its vision
tower's tensors are in the checkpoint and never read (the model runs text-only).

KV cache: one [KVH, S, D] buffer pair per layer at that layer's own width (`kv_layer_layouts`; sliding 8 x 256,
full 2 x 512, K as V stored normed in V's buffer): 2 B x 2 x (25 x 2048 + 5 x 1024) = 220 KiB a token in bf16, 8%
under the 240 KiB of one width for all. Sliding layers hold a ring of their 1024-token window only (`kv_ring_windows`,
engine/layers/kv_cache.py): 200 MiB for the 25 of them at any context, 24.8 GiB less than the whole context at 128k.
Gemma-4-26B-A4B: 30 MoE layers x 128 experts, top-8, I = 704: one routed expert is 3 x 704 x 2816 x 2 B = 11.3 MiB
in bf16, and the 3840 of them are 42.5 GiB of its ~47 GiB of weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, UnsupportedModelError
from ..layers.kv_cache import KVCache
from ..layers.moe import GEGLU_TANH, ExpertProvider
from ..quant import native
from .base import (
    BaseModelArgs,
    ExpertNaming,
    MoEForCausalLM,
    RMSNorm,
    Router,
    SparseMoeBlock,
    _bf16_gemv_lib,
    _in_out,
    rms_norm_fp32_weight,
    rope_frequencies,
    run_experts,
)

# T = tokens, S = cached positions, H = hidden size, D = a layer's head dim, E = experts, K = top-k

log = logging.getLogger(__name__)
SLIDING, FULL = "sliding_attention", "full_attention"


def _norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4's RMSNorm: normalised in fp32, times the fp32 weight (none for v and the router), one cast."""
    xf = x.float()
    y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (y if weight is None else y * weight).to(x.dtype)


@dataclass
class Gemma4TextArgs(BaseModelArgs):
    tie_word_embeddings: bool = True
    hidden_activation: str = "gelu_pytorch_tanh"
    intermediate_size: int = 0
    moe_intermediate_size: int = 0
    num_experts: int = 0  # a field here: Gemma's config spells it so
    top_k_experts: int = 0
    enable_moe_block: bool = True
    attention_k_eq_v: bool = False
    global_head_dim: int | None = None
    num_global_key_value_heads: int | None = None
    per_layer_config: dict | None = None
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = None
    hidden_size_per_layer_input: int = 0
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    attention_logit_softcapping: float | None = None
    use_bidirectional_attention: Any = None

    def __post_init__(self):
        rope = self.rope_parameters or {}
        super().__post_init__()
        L = self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(L)]
        if set(self.layer_types) - {SLIDING, FULL}:
            raise ConfigError(f"config.json: layer_types must be {SLIDING!r} or {FULL!r} per layer, found "
                              f"{sorted(set(self.layer_types) - {SLIDING, FULL})}")
        unsupported = [(self.hidden_activation == "gelu_pytorch_tanh", f"hidden_activation {self.hidden_activation!r}"),
                       (self.enable_moe_block, "enable_moe_block false (a dense Gemma 4: nothing to offload)"),
                       (not self.hidden_size_per_layer_input, "per-layer inputs (hidden_size_per_layer_input)"),
                       (not self.num_kv_shared_layers, "shared KV layers (num_kv_shared_layers)"),
                       (not self.attention_logit_softcapping, "attention logit soft-capping")]
        for ok, what in unsupported:
            if not ok:
                raise UnsupportedModelError(f"config.json: Gemma 4 with {what} is not supported (moechat runs "
                                            "Gemma 4's MoE, gemma-4-26B-A4B)")
        # per layer: (head_dim, KV heads), as transformers' per_layer_config (global_head_dim on full layers)
        overrides = {int(k): v for k, v in (self.per_layer_config or {}).items()}
        if not overrides:
            full = {"head_dim": self.global_head_dim or 512}
            if self.attention_k_eq_v and self.num_global_key_value_heads:
                full["num_key_value_heads"] = self.num_global_key_value_heads
            overrides = {i: full for i, t in enumerate(self.layer_types) if t == FULL}
        self.layer_heads = [(int(overrides.get(i, {}).get("head_dim", self.head_dim)),
                             int(overrides.get(i, {}).get("num_key_value_heads", self.num_key_value_heads)))
                            for i in range(L)]
        for i, (D, nKV) in enumerate(self.layer_heads):
            if D < 2 or D % 2 or nKV < 1 or self.num_attention_heads % nKV:
                raise ConfigError(f"config.json: layer {i} has head_dim {D} and {nKV} KV heads; head_dim must be even "
                                  f"and the KV heads divide num_attention_heads ({self.num_attention_heads})")
        # RoPE per layer type: {"sliding_attention": {...}, "full_attention": {...}} (transformers 5's spelling)
        self.rope_by_type = {}
        for kind in (SLIDING, FULL):
            r = dict(rope.get(kind) or {})
            r.setdefault("rope_theta", 10000.0 if kind == SLIDING else 1000000.0)
            r.setdefault("rope_type", "default" if kind == SLIDING else "proportional")
            if r["rope_type"] not in ("default", "proportional"):
                raise UnsupportedModelError(f"config.json: Gemma 4 RoPE {r['rope_type']!r} on {kind} layers is not "
                                            "supported (moechat has default and proportional)")
            self.rope_by_type[kind] = r

    @property
    def top_k(self) -> int:
        return self.top_k_experts

    @property
    def moe_intermediate(self) -> int:
        return self.moe_intermediate_size

    @property
    def renormalize(self) -> bool:
        return True

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def kv_cache_layout(self) -> tuple[int, int, int]:
        """The first layer's (KV heads, k dim, v dim); `kv_layer_layouts` gives every layer its own."""
        D, nKV = self.layer_heads[0]
        return nKV, D, D

    def kv_layer_layouts(self) -> list[tuple[int, int, int]]:
        """Each layer's own [KVH, S, D] buffers (sliding 8 x 256, full 2 x 512): the exact 220 KiB a token."""
        return [(nKV, D, D) for D, nKV in self.layer_heads]

    def kv_ring_windows(self) -> list[int | None]:
        """The sliding layers hold a ring of their window (Gemma4Attention reads it), the full layers everything."""
        return [self.layer_window(i) for i in range(self.num_hidden_layers)]


@dataclass
class Gemma4Args(Gemma4TextArgs):
    """The multimodal wrapper's config: the text model's values are in `text_config`."""

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> Gemma4Args:
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{where}: model_type gemma4 needs a text_config object (the text model's values)",
                              path=where, key="text_config")
        merged = dict(text)
        for key in ("tie_word_embeddings", "dtype", "torch_dtype"):
            if key in d and key not in merged:
                merged[key] = d[key]
        return super().from_dict(merged, f"{where} (text_config)")


def proportional_frequencies(rope: dict, head_dim: int) -> torch.Tensor:
    """inv_freq [D/2] of Gemma 4's proportional RoPE: the first partial_rotary_factor of the D/2 frequencies over
    the whole head dim, the rest 0 (those dim pairs pass unrotated)."""
    angles = int(float(rope.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
    return torch.cat([inv, torch.zeros(head_dim // 2 - angles)]) / float(rope.get("factor", 1.0))


class Gemma4Attention(nn.Module):
    """GQA with per-head q/k/v norms, an unscaled softmax, a window on sliding layers, K as V with attention_k_eq_v."""

    def __init__(self, args: Gemma4TextArgs, layer: int):
        super().__init__()
        H, nH = args.hidden_size, args.num_attention_heads
        D, nKV = args.layer_heads[layer]
        self.layer, self.n_heads, self.n_kv, self.head_dim = layer, nH, nKV, D
        self.kind = args.layer_types[layer]
        self.window = args.layer_window(layer)
        self.eps = args.rms_norm_eps
        self.k_eq_v = args.attention_k_eq_v and self.kind == FULL
        bias = args.attention_bias
        self.q_proj = nn.Linear(H, nH * D, bias=bias)
        self.k_proj = nn.Linear(H, nKV * D, bias=bias)
        if not self.k_eq_v:
            self.v_proj = nn.Linear(H, nKV * D, bias=bias)
        self.o_proj = nn.Linear(nH * D, H, bias=bias)
        self.q_norm = RMSNorm(D, args.rms_norm_eps)
        self.k_norm = RMSNorm(D, args.rms_norm_eps)

    def finalize(self) -> None:
        parts = [self.q_proj, self.k_proj] + ([] if self.k_eq_v else [self.v_proj])
        self.qkv_t = _in_out(torch.cat([p.weight.detach() for p in parts]))  # [H, (nH + 2 nKV) D]
        self.qkv_bias = torch.cat([p.bias.detach() for p in parts]) if self.q_proj.bias is not None else None
        self.o_weight_t = _in_out(self.o_proj.weight.detach())  # [nH*D, H]
        self.o_bias = None if self.o_proj.bias is None else self.o_proj.bias.detach()
        self.q_norm_weight = self.q_norm.weight.detach().float()
        self.k_norm_weight = self.k_norm.weight.detach().float()
        del self.q_proj, self.k_proj, self.o_proj
        if not self.k_eq_v:
            del self.v_proj
        self.qkv_q = self.o_q = None  # int8 projections (`quantize_dense`)

    def quantize_dense(self, name: str = "int8") -> None:
        """q/k/v and o in `name` (int8 or int4, quant/dense_quant.py); the full-precision copies are freed."""
        from ..quant.dense_quant import QuantLinear

        self.qkv_q = QuantLinear(self.qkv_t.t(), self.qkv_bias, name)
        self.o_q = QuantLinear(self.o_weight_t.t(), self.o_bias, name)
        self.qkv_t = self.o_weight_t = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, start: int) -> torch.Tensor:
        """attention(x) [T, H] (before its norm and the residual); x is the normed input, positions start.."""
        T = x.shape[0]
        nH, nKV, D = self.n_heads, self.n_kv, self.head_dim
        if self.qkv_q is not None:
            qkv = self.qkv_q(x)  # [T, (nH + 2 nKV) D]
        elif T == 1 and self.qkv_bias is None and (lib := _bf16_gemv_lib(x, self.qkv_t)) is not None:
            qkv = native.bf16_gemv(lib, x, self.qkv_t.t(), x.dtype)  # [1, (nH + 2 nKV) D], the native bf16 GEMV
        else:
            qkv = x @ self.qkv_t if self.qkv_bias is None else torch.addmm(self.qkv_bias, x, self.qkv_t)
        q = qkv[:, : nH * D].view(T, nH, D)
        k = qkv[:, nH * D : (nH + nKV) * D].view(T, nKV, D)
        v = k if self.k_eq_v else qkv[:, (nH + nKV) * D :].view(T, nKV, D)
        v = _norm(v, None, self.eps)  # [T, nKV, D]
        q = _norm(q, self.q_norm_weight, self.eps)
        q = q * cos + q.roll(D // 2, dims=-1) * sin  # [T, nH, D]
        k = _norm(k, self.k_norm_weight, self.eps)
        k = k * cos + k.roll(D // 2, dims=-1) * sin  # [T, nKV, D]
        end = start + T
        kc, vc = kv.k[self.layer], kv.v[self.layer]  # [nKV, S_max, D]: this layer's own width (kv_layer_layouts)
        ring = kv.ring[self.layer]  # a sliding layer's ring of `window` slots (position p in slot p % window), or None
        first = 0 if self.window is None else max(0, start - self.window + 1)  # the oldest key any query sees
        if ring is not None and end > ring:  # the ring wraps: read the window's past in order, then write the chunk
            return self._ring_forward(q, k.transpose(0, 1), v.transpose(0, 1), kc, vc, ring, start)
        kc[:, start:end], vc[:, start:end] = k.transpose(0, 1), v.transpose(0, 1)
        keys, values = kc[:, first:end], vc[:, first:end]  # [nKV, S, D]
        G = nH // nKV
        if T == 1 and q.dtype == torch.bfloat16 and q.device.type == "cpu" and (lib := native.library()) is not None:
            # native.c's decode attention (fp32, each cached row read once for the G heads sharing it), as the other
            # families' bf16 CPU decode; the matmuls below read the strided cache through a copy (3x slower at 4k)
            out = native.attn_decode(lib, q.view(nKV, G, D), kc, vc, first, end, 1.0).to(q.dtype)
            return self._out(out.view(1, nH * D))
        if T > 1:  # prefill: SDPA over K/V repeated per query head (its flash kernel; no [nH, T, S] scores in fp32)
            qpos = torch.arange(start, end, device=x.device)[:, None]  # [T, 1]
            kpos = torch.arange(first, end, device=x.device)[None, :]  # [1, S]
            mask = kpos <= qpos
            if self.window is not None:
                mask &= kpos > qpos - self.window
            S = keys.shape[1]
            kx = keys[:, None].expand(nKV, G, S, D).reshape(nH, S, D)  # [nH, S, D]
            vx = values[:, None].expand(nKV, G, S, D).reshape(nH, S, D)
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kx[None], vx[None], attn_mask=mask,
                                                 scale=1.0)[0]  # [nH, T, D]
            return self._out(out.transpose(0, 1).reshape(T, nH * D))
        # one token off the native path (fp32, other devices): written out, the GQA group as G query rows
        qh = q.view(T, nKV, G, D).permute(1, 2, 0, 3).reshape(nKV, G * T, D)  # [nKV, G*T, D]: heads of a KV group
        scores = torch.matmul(qh, keys.transpose(1, 2)).view(nKV, G, T, -1)  # [nKV, G, T, S], scale 1.0
        if T > 1 or self.window is not None:
            qpos = torch.arange(start, end, device=x.device)[:, None]  # [T, 1]
            kpos = torch.arange(first, end, device=x.device)[None, :]  # [1, S]
            mask = kpos <= qpos
            if self.window is not None:
                mask &= kpos > qpos - self.window
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # [nKV, G, T, S]
        out = torch.matmul(probs.view(nKV, G * T, -1), values).view(nKV, G, T, D)  # [nKV, G, T, D]
        return self._out(out.permute(2, 0, 1, 3).reshape(T, nH * D))  # [T, nH*D] in

    def _ring_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                      ring: int, start: int) -> torch.Tensor:
        """Attention of q [T, nH, D] at positions start.. over a sliding layer's ring kc / vc [nKV, W, D] (W = the
        window) once it wraps, with this chunk's k / v [nKV, T, D]; writes the chunk's last W positions into it.
        One token: written at slot start % W, then the whole ring is its window (softmax reads keys in any order).
        A chunk: the window's past (start - W + 1 .. start - 1) gathered in position order, the chunk after it and
        the causal window mask over both, as the buffer of the whole context would give; the ring is written after."""
        T, nH, D = q.shape
        nKV, G, end = self.n_kv, nH // self.n_kv, start + T
        if T == 1:
            slot = start % ring
            kc[:, slot], vc[:, slot] = k[:, 0], v[:, 0]
            if q.dtype == torch.bfloat16 and q.device.type == "cpu" and (lib := native.library()) is not None:
                out = native.attn_decode(lib, q.view(nKV, G, D), kc, vc, 0, ring, 1.0).to(q.dtype)
                return self._out(out.view(1, nH * D))
            scores = torch.matmul(q.view(nKV, G, D), kc.transpose(1, 2))  # [nKV, G, W], scale 1.0
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            return self._out(torch.matmul(probs, vc).view(1, nH * D))  # [nKV, G, D] -> [1, nH*D]
        first = max(0, start - self.window + 1)
        past = torch.arange(first, start, device=q.device) % ring  # the slots of the window's past, oldest first
        keys = torch.cat([kc[:, past], k], dim=1)  # [nKV, S, D], positions first..end-1
        values = torch.cat([vc[:, past], v], dim=1)
        qpos = torch.arange(start, end, device=q.device)[:, None]  # [T, 1]
        kpos = torch.arange(first, end, device=q.device)[None, :]  # [1, S]
        mask = (kpos <= qpos) & (kpos > qpos - self.window)
        S = keys.shape[1]
        kx = keys[:, None].expand(nKV, G, S, D).reshape(nH, S, D)  # [nH, S, D]
        vx = values[:, None].expand(nKV, G, S, D).reshape(nH, S, D)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kx[None], vx[None], attn_mask=mask,
                                             scale=1.0)[0]  # [nH, T, D]
        keep = torch.arange(max(start, end - ring), end, device=q.device)  # the chunk's last W positions
        kc[:, keep % ring], vc[:, keep % ring] = k[:, keep - start], v[:, keep - start]
        return self._out(out.transpose(0, 1).reshape(T, nH * D))

    def _out(self, out: torch.Tensor) -> torch.Tensor:
        """o_proj(out) [T, H]."""
        if self.o_q is not None:
            return self.o_q(out)  # [T, H]
        if out.shape[0] == 1 and self.o_bias is None and (lib := _bf16_gemv_lib(out, self.o_weight_t)) is not None:
            return native.bf16_gemv(lib, out, self.o_weight_t.t(), out.dtype)  # [1, H]
        y = out @ self.o_weight_t  # [T, H]
        return y if self.o_bias is None else y + self.o_bias


class Gemma4MLP(nn.Module):
    """The dense GeGLU MLP every layer runs beside its experts."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma4Router(Router):
    """proj [E, H] over RMSNorm(r) * scale / sqrt(H); per_expert_scale multiplies the chosen weights."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__(hidden, num_experts)
        del self.weight
        self.proj = nn.Linear(hidden, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))


class Gemma4MoeBlock(SparseMoeBlock):
    """The routed half of a Gemma 4 layer: routed on the residual r, computed on norm'(r), through the provider."""

    router_attr = "router"
    activation = GEGLU_TANH

    def __init__(self, args: Gemma4TextArgs, layer: int, router: Gemma4Router):
        nn.Module.__init__(self)
        self.router = router
        self.layer, self.top_k, self.renormalize, self.act = layer, args.top_k, True, GEGLU_TANH
        self.eps = args.rms_norm_eps

    def finalize(self) -> None:
        self.gate_weight = self.router.proj.weight.detach()  # [E, H]
        self.gate_bias = None
        # RMSNorm(r) * scale / sqrt(H) is one RMSNorm with this weight (what prefetch's router replay needs too)
        self.router_norm_weight = (self.router.scale.detach().float() * self.router.scale.shape[0] ** -0.5)
        self.per_expert_scale = self.router.per_expert_scale.detach().float()

    def route(self, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = _norm(r, None, self.eps) * self.router_norm_weight.to(r.dtype)  # [T, H]
        probs = torch.softmax(F.linear(h, self.gate_weight), dim=-1, dtype=torch.float32)  # [T, E]
        topk_weights, topk_ids = torch.topk(probs, self.top_k, dim=-1)  # [T, K]
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_weights * self.per_expert_scale[topk_ids], topk_ids

    def experts(self, r: torch.Tensor, x: torch.Tensor, provider: ExpertProvider) -> torch.Tensor:
        """MoE(x) [T, H], routed on r; the provider sees r (the residual stream) for prefetch."""
        topk_weights, topk_ids = self.route(r)  # [T, K], [T, K]
        provider.observe(self.layer, r)
        return run_experts(x, topk_weights, topk_ids, provider, self.layer, self.act, torch.zeros_like(x))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, args: Gemma4TextArgs, layer: int):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Gemma4Attention(args, layer)
        self.mlp = Gemma4MLP(H, args.intermediate_size)
        self.router = Gemma4Router(H, args.num_experts)  # `layers.N.router.*` in the checkpoint, beside the layer's MLP
        self.__dict__["moe"] = Gemma4MoeBlock(args, layer, self.router)  # not a sub-module: no second copy of names
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                     "pre_feedforward_layernorm_2"):
            setattr(self, name, RMSNorm(H, eps))
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.kind = args.layer_types[layer]
        self.is_moe = True
        self.eps = eps

    def finalize(self) -> None:
        self.self_attn.finalize()
        self.attn = self.self_attn
        self.ffn = self.moe
        self.moe.finalize()
        self.w = {name: getattr(self, name).weight.detach().float() for name in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
            "post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2")}
        self.w_post = self.moe.router_norm_weight  # what the router normalises r with (prefetch replays it)
        self.scalar = self.layer_scalar.detach()

    def forward(self, x, cos, sin, kv: KVCache, start: int, provider: ExpertProvider) -> torch.Tensor:
        w, eps = self.w, self.eps
        a = self.attn.forward(rms_norm_fp32_weight(x, w["input_layernorm"], eps), cos, sin, kv, start)
        r = x + rms_norm_fp32_weight(a, w["post_attention_layernorm"], eps)  # [T, H]
        h1 = rms_norm_fp32_weight(self.mlp.forward(rms_norm_fp32_weight(r, w["pre_feedforward_layernorm"], eps)),
                                  w["post_feedforward_layernorm_1"], eps)
        h2 = self.moe.experts(r, rms_norm_fp32_weight(r, w["pre_feedforward_layernorm_2"], eps), provider)
        h2 = rms_norm_fp32_weight(h2, w["post_feedforward_layernorm_2"], eps)
        out = r + rms_norm_fp32_weight(h1 + h2, w["post_feedforward_layernorm"], eps)
        return out * self.scalar


class Gemma4Body(nn.Module):
    def __init__(self, args: Gemma4TextArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size,
                                         _weight=torch.empty(args.vocab_size, args.hidden_size))  # [V, H]
        self.layers = nn.ModuleList(Gemma4DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


def _experts(prefix: str) -> ExpertNaming:
    p = prefix + "layers.{layer}.experts."
    return ExpertNaming(gate=p + "{expert}.gate_proj.weight", up=p + "{expert}.up_proj.weight",
                        down=p + "{expert}.down_proj.weight", fused_gate_up=p + "gate_up_proj",
                        fused_down=p + "down_proj")


class Gemma4TextForCausalLM(MoEForCausalLM):
    """`gemma4_text`: the text model at `model.`."""

    args_class = Gemma4TextArgs
    moe_attr = "moe"
    expert_naming = _experts("model.")
    fp32_weights = ()
    text_only_note: ClassVar[str | None] = None

    def __init__(self, args: Gemma4TextArgs):
        nn.Module.__init__(self)
        self.args = args
        self.model = Gemma4Body(args)

    @property
    def body(self) -> Gemma4Body:
        return self.model

    def finalize(self, max_positions: int) -> None:
        if self.text_only_note:
            log.warning(self.text_only_note)
        body = self.body
        for layer in body.layers:
            layer.finalize()
        self.layer_list = list(body.layers)
        self.embed_weight = body.embed_tokens.weight.detach()
        self.norm_weight = body.norm.weight.detach().float()
        self.lm_weight_t = _in_out(self.embed_weight)  # [H, V]: the tied embedding
        self.embed_scale = torch.tensor(self.args.hidden_size**0.5).to(self.embed_weight.dtype)  # bf16: 53.0, not 53.07
        device, dtype = self.embed_weight.device, self.embed_weight.dtype
        pos = torch.arange(max_positions, dtype=torch.int64).float()[:, None]  # [S, 1]
        self.rope = {}
        for kind, rope in self.args.rope_by_type.items():
            heads = zip(self.args.layer_heads, self.args.layer_types, strict=True)
            D = next((d for (d, _), t in heads if t == kind), None)
            if D is None:
                continue
            if rope["rope_type"] == "proportional":
                inv = proportional_frequencies(rope, D)  # [D/2]
            else:
                inv = rope_frequencies({**rope, "rope_type": "default"}, D)[0]  # [D/2]
            emb = torch.cat([pos * inv, pos * inv], dim=-1)  # [S, D]
            sign = torch.cat([-torch.ones(D // 2), torch.ones(D // 2)])  # rotate_half's sign, folded into sin
            self.rope[kind] = (emb.cos().to(dtype).to(device)[:, None, :],
                               (emb.sin().to(dtype) * sign.to(dtype)).to(device)[:, None, :])  # [S, 1, D]
        self.max_positions = max_positions
        self.lm_q = None
        self.dense_format = "native"

    def quantize_dense(self, name: str) -> None:
        """`--dense-format int8|int4`: attention's projections in `name`, the LM head in int8 under either; the tied
        table stays for lookups."""
        if name == "native":
            return
        from ..quant.dense_quant import LM_HEAD_FORMAT, QuantLinear

        for layer in self.layer_list:
            layer.self_attn.quantize_dense(name)
        self.lm_q = QuantLinear(self.lm_weight_t.t(), None, LM_HEAD_FORMAT)
        self.lm_weight_t = None
        self.dense_format = name

    def forward(self, input_ids: torch.Tensor, kv: KVCache, provider: ExpertProvider) -> torch.Tensor:
        start, T = kv.length, input_ids.shape[0]
        kv.reserve(T)
        x = F.embedding(input_ids, self.embed_weight) * self.embed_scale  # [T, H]
        tables = {kind: (cos[start : start + T], sin[start : start + T]) for kind, (cos, sin) in self.rope.items()}
        kv.consistent = False  # until the last layer: an error between leaves rings written past kv.length
        for layer in self.layer_list:
            x = layer.forward(x, *tables[layer.kind], kv, start, provider)
        kv.length = start + T
        kv.consistent = True
        return rms_norm_fp32_weight(x, self.norm_weight, self.args.rms_norm_eps)

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.lm_q is not None:
            logits = self.lm_q(hidden_states, out_dtype=torch.float32)  # [T, V]
        else:
            logits = (hidden_states @ self.lm_weight_t).float()  # [T, V]
        cap = self.args.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    @classmethod
    def moe_layers(cls, args: Gemma4TextArgs) -> list[int]:
        return list(range(args.num_hidden_layers))


class _Wrapper(nn.Module):
    def __init__(self, args: Gemma4TextArgs):
        super().__init__()
        self.language_model = Gemma4Body(args)


class Gemma4ForConditionalGeneration(Gemma4TextForCausalLM):
    """`gemma4`: the multimodal wrapper; the text model at `model.language_model.`, the vision tower never read."""

    args_class = Gemma4Args
    expert_naming = _experts("model.language_model.")
    text_only_note = "Gemma 4: the checkpoint's vision tower is not loaded; the model runs text-only"

    def __init__(self, args: Gemma4TextArgs):
        nn.Module.__init__(self)
        self.args = args
        self.model = _Wrapper(args)

    @property
    def body(self) -> Gemma4Body:
        return self.model.language_model


ARCHITECTURES = {"gemma4": Gemma4ForConditionalGeneration, "gemma4_text": Gemma4TextForCausalLM}
