"""Qwen3-Next (`model_type: qwen3_next`): Qwen3-Next-80B-A3B, the first hybrid of Gated DeltaNet and gated attention.

Three of every four layers are linear attention (Gated DeltaNet, engine/models/gated_deltanet.py: a recurrent
state in the sequence state instead of K/V), the fourth full attention with an output gate (q_proj is twice as
wide: per head the query and a sigmoid gate on the attention output), per-head q/k norms and partial rotary
(`partial_rotary_factor` 0.25: 64 of 256 dims). Every RMSNorm but the delta rule's gated one is zero-centred
(y * (1 + w), in fp32). Each MoE layer has a shared expert behind a sigmoid gate (as Qwen2-MoE). The checkpoint's
multi-token-prediction layer (`mtp.*`, `mtp_num_hidden_layers`) is not used and not loaded.

Qwen3-Next-80B-A3B: 48 layers (36 linear), 512 experts top-10, I = 512: one expert is 3 x 512 x 2048 x 2 B = 6 MiB
in bf16; its recurrent state is 36 x 32 x 128 x 128 x 4 B = 72 MiB (+ 36 x 12,288 x 3 x 2 B of conv windows) at any
context, where its 12 attention layers cache 12 x 2 x 2 x 256 x 2 B = 24 KiB per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedModelError
from ..layers.kv_cache import KVCache
from ..layers.moe import ExpertProvider
from ..quant import native
from . import gated_deltanet as gd
from .base import MLP, ExpertNaming, MoEForCausalLM, _bf16_gemv_lib, _in_out, apply_rope
from .qwen2_moe import Qwen2MoeBlock
from .qwen3_moe import Qwen3MoeArgs

# T = tokens, S = cached positions, H = hidden, D = head dim, HK/HV = linear key/value heads, C = conv channels


@dataclass
class Qwen3NextArgs(Qwen3MoeArgs):
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    layer_types: list | None = None
    full_attention_interval: int = 4
    partial_rotary_factor: float | None = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    mtp_num_hidden_layers: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.layer_types is None:  # transformers' Qwen3NextConfig rule
            n = self.full_attention_interval or 4
            self.layer_types = ["linear_attention" if (i + 1) % n else "full_attention"
                                for i in range(self.num_hidden_layers)]
        kinds = set(self.layer_types) - {"linear_attention", "full_attention"}
        if kinds:
            raise UnsupportedModelError(f"config.json: layer_types has {sorted(kinds)[0]!r}; {self.model_type} layers "
                                        "are linear_attention or full_attention")
        factor = self.rope.get("partial_rotary_factor", self.partial_rotary_factor)
        self.partial_rotary_factor = 0.25 if factor is None else float(factor)
        if self.linear_num_key_heads and self.linear_num_value_heads % self.linear_num_key_heads:
            raise UnsupportedModelError(f"config.json: linear_num_value_heads {self.linear_num_value_heads} is not a "
                                        f"multiple of linear_num_key_heads {self.linear_num_key_heads}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"

    def kv_ring_windows(self) -> None:
        """No rings: GatedAttention reads every cached position (it has no window)."""
        return None

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    def recurrent_layout(self, dtype: torch.dtype) -> dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
        """The sequence state of each linear layer: the conv window (model dtype) and the delta-rule matrix (fp32)."""
        conv = ((self.conv_dim, self.linear_conv_kernel_dim - 1), dtype)
        ssm = ((self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim), torch.float32)
        return {i: {"conv": conv, "ssm": ssm} for i in range(self.num_hidden_layers) if self.is_linear(i)}


def offset_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm as transformers computes it: fp32 x / rms * (1 + w) (weight given as 1 + w, fp32), one
    rounding."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def _project(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ w_t [in, out]; one bf16 token on a CPU through native.c's bf16 GEMV (1.8x torch's one-row GEMM)."""
    if x.shape[0] == 1 and (lib := _bf16_gemv_lib(x, w_t)) is not None:
        return native.bf16_gemv(lib, x, w_t.t(), x.dtype)
    return x @ w_t


def _project_add(residual: torch.Tensor, x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """residual + x @ w_t, rounded once (the native GEMV's fp32 sums plus the residual) for one bf16 CPU token."""
    if x.shape[0] == 1 and (lib := _bf16_gemv_lib(x, w_t)) is not None:
        return (native.bf16_gemv(lib, x, w_t.t()) + residual.float()).to(residual.dtype)
    return torch.addmm(residual, x, w_t)


class ZeroCentredNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate, per-head zero-centred q/k norms and partial RoPE."""

    def __init__(self, args: Qwen3NextArgs, layer: int):
        super().__init__()
        H, D = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv = args.num_attention_heads, args.num_key_value_heads
        self.head_dim, self.layer = D, layer
        self.q_proj = nn.Linear(H, self.n_heads * D * 2, bias=args.attention_bias)
        self.k_proj = nn.Linear(H, self.n_kv * D, bias=args.attention_bias)
        self.v_proj = nn.Linear(H, self.n_kv * D, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=args.attention_bias)
        self.q_norm = ZeroCentredNorm(D, args.rms_norm_eps)
        self.k_norm = ZeroCentredNorm(D, args.rms_norm_eps)
        self.rotary_dim = args.rotary_dim
        self.eps = args.rms_norm_eps
        self.scale = D ** -0.5

    def finalize(self) -> None:
        nH, D = self.n_heads, self.head_dim
        # q_proj's rows are per head [query D | gate D]: regrouped so one GEMM gives [queries | gates | k | v]
        qg = self.q_proj.weight.view(nH, 2, D, -1)
        w = torch.cat([qg[:, 0].reshape(nH * D, -1), qg[:, 1].reshape(nH * D, -1), self.k_proj.weight,
                       self.v_proj.weight])  # [(2nH + 2nKV) D, H]
        self.in_t = _in_out(w.detach())
        self.in_bias = None
        if self.q_proj.bias is not None:
            qb = self.q_proj.bias.view(nH, 2, D)
            self.in_bias = torch.cat([qb[:, 0].reshape(-1), qb[:, 1].reshape(-1), self.k_proj.bias,
                                      self.v_proj.bias]).detach()
        del self.q_proj, self.k_proj, self.v_proj
        self.o_weight_t = _in_out(self.o_proj.weight.detach())  # [nH D, H]
        self.o_bias = None if self.o_proj.bias is None else self.o_proj.bias.detach()
        del self.o_proj
        self.qk_norm_weight = torch.cat([(1 + self.q_norm.weight.float()).expand(nH, -1),
                                         (1 + self.k_norm.weight.float()).expand(self.n_kv, -1)])  # [nH+nKV, D]
        self.in_q = self.o_q = None  # int8 / int4 projections (`quantize_dense`)

    def quantize_dense(self, name: str) -> None:
        """[q | gate | k | v] and o in `name` (int8 or int4, quant/dense_quant.py); the full-precision copies freed."""
        from ..quant.dense_quant import QuantLinear

        self.in_q = QuantLinear(self.in_t.t(), self.in_bias, name)
        self.o_q = QuantLinear(self.o_weight_t.t(), self.o_bias, name)
        self.in_t = self.o_weight_t = None

    def forward(self, x, cos, sin, kv: KVCache, start: int, residual: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        nH, nKV, D = self.n_heads, self.n_kv, self.head_dim
        if self.in_q is not None:
            proj = self.in_q(x)  # [T, out]
        else:
            proj = _project(x, self.in_t) if self.in_bias is None else torch.addmm(self.in_bias, x, self.in_t)
        q, gate, k, v = proj.split([nH * D, nH * D, nKV * D, nKV * D], dim=-1)
        qk = torch.cat([q, k], dim=-1).view(T, nH + nKV, D)  # [T, nH+nKV, D]
        qk = offset_norm(qk, self.qk_norm_weight, self.eps)
        qk = apply_rope(qk, cos, sin, self.rotary_dim)
        end = start + T
        kc, vc = kv.k[self.layer], kv.v[self.layer]  # [nKV, S, D]
        kc[:, start:end] = qk[:, nH:].transpose(0, 1)
        vc[:, start:end] = v.view(T, nKV, D).transpose(0, 1)
        G = nH // nKV
        if T == 1:  # the G query heads of a KV head as G query positions: no repeat of K/V
            qh = qk[0, :nH].view(nKV, G, D)  # [nKV, G, D]
            out = F.scaled_dot_product_attention(qh[None], kc[None, :, :end], vc[None, :, :end], scale=self.scale)[0]
        else:
            keys = kc[:, :end, None].expand(nKV, end, G, D).transpose(1, 2).reshape(nH, end, D)  # [nH, S, D]
            values = vc[:, :end, None].expand(nKV, end, G, D).transpose(1, 2).reshape(nH, end, D)
            qh = qk[:, :nH].transpose(0, 1)  # [nH, T, D]
            mask = torch.arange(end, device=x.device)[None, :] <= torch.arange(start, end, device=x.device)[:, None]
            out = F.scaled_dot_product_attention(qh[None], keys[None], values[None], attn_mask=mask,
                                                 scale=self.scale)[0]  # [nH, T, D]
            out = out.transpose(0, 1)
        attn = out.reshape(T, nH * D) * torch.sigmoid(gate)  # [T, nH D]
        if self.o_q is not None:
            return self.o_q(attn, residual)  # [T, H]
        if self.o_bias is not None:
            return torch.addmm(residual, attn, self.o_weight_t) + self.o_bias
        return _project_add(residual, attn, self.o_weight_t)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class GatedDeltaNet(nn.Module):
    """Linear attention: in-projections, causal conv over [q | k | v], the gated delta rule, a gated RMSNorm, out_proj.

    `layout` "qkvz" is Qwen3-Next's (in_proj_qkvz and in_proj_ba, grouped per key head), "split" Qwen3.5's
    (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a); both become one [H -> qkv | z | b | a] GEMM at finalize."""

    reference = False  # True: the token-by-token conv and delta rule (tests)

    def __init__(self, args: Qwen3NextArgs, layer: int, layout: str = "qkvz"):
        super().__init__()
        H = args.hidden_size
        self.HK, self.HV = args.linear_num_key_heads, args.linear_num_value_heads
        self.Dk, self.Dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.key_dim, self.value_dim = self.HK * self.Dk, self.HV * self.Dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.layer, self.layout = layer, layout
        if layout == "qkvz":
            self.in_proj_qkvz = nn.Linear(H, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(H, 2 * self.HV, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(H, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(H, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(H, self.HV, bias=False)
            self.in_proj_a = nn.Linear(H, self.HV, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, args.linear_conv_kernel_dim, groups=self.conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.HV))
        self.A_log = nn.Parameter(torch.zeros(self.HV))
        self.norm = GatedRMSNorm(self.Dv, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, H, bias=False)
        self.eps = args.rms_norm_eps

    def finalize(self) -> None:
        if self.layout == "qkvz":
            r = self.HV // self.HK
            w = self.in_proj_qkvz.weight.view(self.HK, 2 * self.Dk + 2 * r * self.Dv, -1)
            parts = w.split([self.Dk, self.Dk, r * self.Dv, r * self.Dv], dim=1)
            ba = self.in_proj_ba.weight.view(self.HK, 2 * r, -1).split([r, r], dim=1)
            rows = [p.reshape(-1, w.shape[-1]) for p in (*parts, *ba)]  # q | k | v | z | b | a, head-major each
            del self.in_proj_qkvz, self.in_proj_ba
        else:
            rows = [self.in_proj_qkv.weight, self.in_proj_z.weight, self.in_proj_b.weight, self.in_proj_a.weight]
            del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a
        self.in_t = _in_out(torch.cat(rows).detach())  # [H, C + Vd + 2 HV]
        self.conv_w = self.conv1d.weight.detach()[:, 0]  # [C, W]
        self.neg_A = -self.A_log.detach().float().exp()  # [HV]
        self.dt = self.dt_bias.detach().float()
        self.norm_w = self.norm.weight.detach()
        self.out_t = _in_out(self.out_proj.weight.detach())  # [Vd, H]
        del self.out_proj
        self.in_q = self.out_q = None  # int8 / int4 projections (`quantize_dense`)

    def quantize_dense(self, name: str) -> None:
        """The fused in-projection [qkv | z | b | a] and out_proj in `name` (int8 or int4); the conv, the decay
        parameters and the norm stay as they are (small, and read in fp32)."""
        from ..quant.dense_quant import QuantLinear

        self.in_q = QuantLinear(self.in_t.t(), None, name)
        self.out_q = QuantLinear(self.out_t.t(), None, name)
        self.in_t = self.out_t = None

    def forward(self, x: torch.Tensor, kv: KVCache, residual: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        state = kv.state[self.layer]
        proj = self.in_q(x) if self.in_q is not None else _project(x, self.in_t)  # [T, C + Vd + 2 HV]
        qkv, z, b, a = proj.split([self.conv_dim, self.value_dim, self.HV, self.HV], dim=-1)
        conv = gd.causal_conv1d_reference if self.reference else gd.causal_conv1d
        qkv = conv(qkv, self.conv_w, state["conv"])  # [T, C]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = torch.sigmoid(b)  # [T, HV]
        g = self.neg_A * F.softplus(a.float() + self.dt)  # [T, HV] log decay
        rule = gd.delta_rule_reference if self.reference else gd.delta_rule
        o = rule(q.view(T, self.HK, self.Dk), k.view(T, self.HK, self.Dk), v.reshape(T, self.HV, self.Dv), g, beta,
                 state["ssm"]).to(x.dtype)  # [T, HV, Dv]
        # the gated RMSNorm per value head: w * norm(o) (rounded), times silu(z) in fp32
        of = o.float()
        o = self.norm_w * (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        o = (o * F.silu(z.view(T, self.HV, self.Dv).float())).to(x.dtype)
        if self.out_q is not None:
            return self.out_q(o.reshape(T, self.value_dim), residual)  # [T, H]
        return _project_add(residual, o.reshape(T, self.value_dim), self.out_t)  # [T, H]


class HybridLayer(nn.Module):
    """One decoder layer: zero-centred norms around linear or gated full attention, then the MoE (or dense) MLP."""

    def __init__(self, args: Qwen3NextArgs, layer: int, layout: str):
        super().__init__()
        self.linear = args.is_linear(layer)
        if self.linear:
            self.linear_attn = GatedDeltaNet(args, layer, layout)
        else:
            self.self_attn = GatedAttention(args, layer)
        self.is_moe = args.is_moe_layer(layer)
        self.mlp = Qwen2MoeBlock(args, layer) if self.is_moe else MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = ZeroCentredNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredNorm(args.hidden_size, args.rms_norm_eps)
        self.eps = args.rms_norm_eps

    def finalize(self) -> None:
        self.attn = self.linear_attn if self.linear else self.self_attn
        self.attn.finalize()
        self.ffn = self.mlp
        if self.is_moe:
            self.ffn.finalize()
        self.w_in = 1 + self.input_layernorm.weight.detach().float()  # [H] fp32
        self.w_post32 = 1 + self.post_attention_layernorm.weight.detach().float()
        self.w_post = self.w_post32.to(self.input_layernorm.weight.dtype)  # the prefetcher's router input norm

    def forward(self, x, cos, sin, kv: KVCache, start: int, provider: ExpertProvider) -> torch.Tensor:
        h = offset_norm(x, self.w_in, self.eps)
        x = self.attn.forward(h, kv, x) if self.linear else self.attn.forward(h, cos, sin, kv, start, x)
        h = offset_norm(x, self.w_post32, self.eps)
        return self.ffn.forward(h, provider, x) if self.is_moe else x + self.ffn.forward(h)


class HybridBody(nn.Module):
    def __init__(self, args: Qwen3NextArgs, layout: str):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size,
                                         _weight=torch.empty(args.vocab_size, args.hidden_size))  # [V, H]
        self.layers = nn.ModuleList(HybridLayer(args, i, layout) for i in range(args.num_hidden_layers))
        self.norm = ZeroCentredNorm(args.hidden_size, args.rms_norm_eps)


class Qwen3NextForCausalLM(MoEForCausalLM):
    args_class = Qwen3NextArgs
    delta_layout: ClassVar[str] = "qkvz"
    expert_naming = ExpertNaming(
        gate="model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
        up="model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
        down="model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",
        fused_gate_up="model.layers.{layer}.mlp.experts.gate_up_proj",
        fused_down="model.layers.{layer}.mlp.experts.down_proj",
    )

    def __init__(self, args: Qwen3NextArgs):
        nn.Module.__init__(self)
        self.args = args
        self.model = HybridBody(args, self.delta_layout)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def finalize(self, max_positions: int) -> None:
        super().finalize(max_positions)  # layers, embeddings, LM head, the (partial) RoPE table
        self.norm_weight = 1 + self.model.norm.weight.detach().float()
        self.final_norm = offset_norm

    def quantize_dense(self, name: str) -> None:
        """`--dense-format int8|int4`: the gated attention's and the Gated DeltaNet layers' projections in `name`,
        the LM head in int8 under either (quant/dense_quant.py); the tied table stays for lookups."""
        if name == "native":
            return
        from ..quant.dense_quant import LM_HEAD_FORMAT, QuantLinear

        for layer in self.layer_list:
            layer.attn.quantize_dense(name)
        self.lm_q = QuantLinear(self.lm_weight_t.t(), None, LM_HEAD_FORMAT)
        self.lm_weight_t = None
        if not self.args.tie_word_embeddings:
            del self.lm_head
        self.dense_format = name


ARCHITECTURES = {"qwen3_next": Qwen3NextForCausalLM}
