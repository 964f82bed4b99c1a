"""Gated DeltaNet (Qwen3-Next, Qwen3.5/3.6-MoE): linear attention whose state is a [Dk, Dv] matrix per value head.

Per token t and value head: S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t
(q, k L2-normalised, q scaled by Dk^-1/2), after a depthwise causal conv1d (kernel 4) with SiLU over [q | k | v].
The state is constant in the context: Qwen3.6-35B-A3B keeps 32 heads x 128 x 128 fp32 = 2 MiB per layer plus a
[8192, 3] conv window, 61.4 MiB for its 30 linear layers at any length, where a full-attention layer of it holds
2 x 2 x 256 x 2 B = 2 KiB per token (2 MiB at 1024 tokens).

Three paths, all fp32 inside:
* `delta_rule_reference`: the recurrence above, token by token (the slow obvious one every other path is tested
  against);
* `delta_rule_chunked`: prefill in chunks of 64: within a chunk the T sequential updates are one triangular inverse
  (the WY form: U = (I + A)^-1 (beta V - beta gamma K S0), A[t, j] = beta_t gamma_t / gamma_j k_t . k_j for j < t),
  so a 512-token prefill is 8 steps of batched GEMMs instead of 512 rank-1 updates;
* `delta_rule_step`: decode, one token, the state updated in place (four batched GEMV-sized ops).

Decode (one token) takes a fused kernel where there is one: on CPU tensors native_recurrent.c's
`moechat_delta_rule_step` and `moechat_conv_step` (engine/quant/native.py: every value head's update and output in one
call, the heads split over native.c's pool, the same bits at any thread count, within ~1e-6 relative of the torch
step); on CUDA tensors the Triton kernels of engine/quant/kernels/recurrent.py. MOECHAT_RECURRENT_NATIVE=0 turns both
off (the torch steps above, on every device); so does a CPU without the native library (native.status() says why).
At Qwen3.6-35B-A3B's widths (32 value heads x 128 x 128, a conv over 8192 channels), one thread, bf16 inputs, the
native delta rule takes 0.10 ms against the torch step's 0.30 ms and the conv 0.07 ms against 0.14 ms (CPU time,
medians of interleaved rounds on a loaded 2-core machine; bench/recurrent_layers.py has the wall-clock table).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from ..quant import native

# T = tokens, C = conv channels, W = conv kernel width, HV = value heads, HK = key heads, Dk/Dv = head dims,
# N = chunks, L = chunk length

CHUNK = 64
ENV = "MOECHAT_RECURRENT_NATIVE"  # "0": the torch decode steps (no native, no Triton kernel)
NATIVE_MAX_D = 1024  # native_recurrent.c's REC_MAX_D: larger head dims / state sizes take the torch step on a CPU


def fused_steps(t: torch.Tensor, *dims: int):
    """The one-token kernels for tensors on t's device, as functions with native.py's wrappers' arguments less the
    library (`conv_step`, `delta_rule_step`, `ssd_step`): native_recurrent.c (CPU) or the Triton kernels (CUDA); None
    for the torch steps (MOECHAT_RECURRENT_NATIVE=0, no native library, no triton, another device, on a CPU a head
    dim in `dims` past NATIVE_MAX_D)."""
    if os.environ.get(ENV, "1") == "0":
        return None
    if t.device.type == "cpu":
        if dims and max(dims) > NATIVE_MAX_D:
            return None
        lib = native.library()
        return None if lib is None else _native_steps(lib)
    if t.is_cuda:
        from ..quant.kernels import has_triton

        if has_triton():
            from ..quant.kernels import recurrent

            return recurrent
    return None


@functools.cache
def _native_steps(lib) -> _Native:
    return _Native(lib)


class _Native:
    def __init__(self, lib):
        self.lib = lib

    def conv_step(self, *a):
        return native.conv_step(self.lib, *a)

    def delta_rule_step(self, *a):
        return native.delta_rule_step(self.lib, *a)

    def ssd_step(self, *a):
        return native.ssd_step(self.lib, *a)


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """t as the fused kernels read it: fp32 or bf16, contiguous."""
    if t.dtype in _KERNEL_DTYPES and t.is_contiguous():
        return t
    return (t if t.dtype in _KERNEL_DTYPES else t.float()).contiguous()


def _fp32_state(state: torch.Tensor) -> bool:
    return state.dtype == torch.float32 and state.is_contiguous()


def _conv_ok(x: torch.Tensor, state: torch.Tensor) -> bool:
    """The conv kernels write x's dtype and shift the window in its own (fp32 or bf16, contiguous)."""
    return (x.dtype in _KERNEL_DTYPES and state.dtype in _KERNEL_DTYPES and state.is_contiguous()
            and state.device == x.device)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# -- the short causal convolution ---------------------------------------------------------------------------------
def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, C], weight [C, W], state [C, W-1] (the previous W-1 inputs, oldest first; updated in place), bias [C]
    (Mamba-2 has one) -> silu(conv) [T, C], one position at a time."""
    T = x.shape[0]
    window = state.to(torch.float32).clone()  # [C, W-1]
    out = []
    for t in range(T):
        full = torch.cat([window, x[t].float()[:, None]], dim=1)  # [C, W]
        out.append((full * weight.float()).sum(-1) + (0 if bias is None else bias.float()))
        window = full[:, 1:]
    state.copy_(window)
    return F.silu(torch.stack(out)).to(x.dtype)  # [T, C]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same as `causal_conv1d_reference`: one grouped conv1d over [state | x] (prefill) or a multiply-add over
    the window (decode)."""
    T, W = x.shape[0], weight.shape[1]
    fused = fused_steps(x) if T == 1 and _conv_ok(x, state) else None
    if fused is not None:  # silu(conv) in fp32, one rounding to x's dtype (the reference's math)
        out = torch.empty(1, x.shape[1], dtype=x.dtype, device=x.device)  # [1, C]
        fused.conv_step(_flat(x), _flat(weight), None if bias is None else _flat(bias), state, out)
        return out
    if T == 1:
        full = torch.cat([state, x.t()], dim=1)  # [C, W]
        y = (full.to(weight.dtype) * weight).sum(-1, keepdim=True).t()  # [1, C]
        if bias is not None:
            y = y + bias
        state.copy_(full[:, 1:])
        return F.silu(y).to(x.dtype)
    full = torch.cat([state, x.t().to(state.dtype)], dim=1)  # [C, W-1+T]
    y = F.conv1d(full[None].to(weight.dtype), weight[:, None, :], bias, groups=weight.shape[0])[0]  # [C, T]
    state.copy_(full[:, -(W - 1):])
    return F.silu(y).t().to(x.dtype)  # [T, C]


# -- the gated delta rule -----------------------------------------------------------------------------------------
def _prepare(q, k, v, g, beta):
    """Inputs as contiguous [HV, T, D] fp32 with q/k normalised (once per key head, then shared by its HV/HK value
    heads) and q scaled; g, beta as [HV, T]."""
    HK, HV = q.shape[1], v.shape[1]
    q = (l2norm(q.float()) * q.shape[-1] ** -0.5).transpose(0, 1)  # [HK, T, Dk]
    k = l2norm(k.float()).transpose(0, 1)
    if HK != HV:  # each key head serves HV/HK consecutive value heads
        q, k = q.repeat_interleave(HV // HK, dim=0), k.repeat_interleave(HV // HK, dim=0)  # [HV, T, Dk]
    return (q.contiguous(), k.contiguous(), v.float().transpose(0, 1).contiguous(), g.float().t().contiguous(),
            beta.float().t().contiguous())


def delta_rule_reference(q, k, v, g, beta, state):
    """q, k [T, HK, Dk], v [T, HV, Dv], g (log decay, <= 0), beta [T, HV], state [HV, Dk, Dv] fp32 (updated in place)
    -> o [T, HV, Dv] fp32, one token at a time."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    S = state.clone()
    out = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[:, None, None]
        kv_mem = (S * k[:, t, :, None]).sum(1)  # [HV, Dv]
        u = (v[:, t] - kv_mem) * beta[:, t, None]
        S = S + k[:, t, :, None] * u[:, None, :]
        out.append((S * q[:, t, :, None]).sum(1))
    state.copy_(S)
    return torch.stack(out)  # [T, HV, Dv]


def delta_rule_step(q, k, v, g, beta, state):
    """One token: q, k [1, HK, Dk], v [1, HV, Dv], g, beta [1, HV]; state updated in place -> o [1, HV, Dv] fp32."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # [HV, 1, D]
    state.mul_(g.exp()[:, :, None])  # [HV, Dk, Dv] * [HV, 1, 1]
    u = (v - torch.bmm(k, state)) * beta[:, :, None]  # [HV, 1, Dv]
    state.baddbmm_(k.transpose(1, 2), u)  # S += k u^T
    return torch.bmm(q, state).transpose(0, 1)  # [1, HV, Dv]


def _heads_first(x: torch.Tensor, T_pad: int) -> torch.Tensor:
    """x [T, H, D] (any float dtype) -> [H, T_pad, D] fp32, the padded rows zero: the cast and the transpose in one
    copy."""
    T, H, D = x.shape
    out = torch.empty(H, T_pad, D, dtype=torch.float32, device=x.device)
    out[:, :T].copy_(x.transpose(0, 1))
    out[:, T:].zero_()
    return out


def _l2norm_(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x.mul_(torch.rsqrt((x * x).sum(-1, keepdim=True) + eps))


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same as `delta_rule_reference`, chunk by chunk (see the module docstring); state updated in place.

    Per chunk the WY form's (I + A)^-1 is solved against the identity ([L, L], not the [L, Dv + Dk] right-hand side)
    and then multiplied in by GEMMs, beta and gamma folded into its columns; q k^T and k k^T are taken once per key
    head and shared by its value heads; the elementwise steps run in place. At Qwen3.6-35B-A3B's widths (16 key,
    32 value heads of 128), one thread, 1024 bf16 tokens: 132 ms of CPU against 210 ms for the WY solve over the whole
    right-hand side with per-value-head products (medians of 7 interleaved runs on a loaded 2-core machine)."""
    T, HK, Dk = q.shape
    HV, Dv = v.shape[1], v.shape[2]
    r = HV // HK  # value heads per key head
    pad = (-T) % chunk  # padded positions: beta = 0, g = 0, k = 0, they change neither the state nor the outputs
    N, L, Tp = (T + pad) // chunk, chunk, T + pad
    qf, kf = _heads_first(q, Tp), _heads_first(k, Tp)  # [HK, Tp, Dk]
    _l2norm_(qf).mul_(Dk ** -0.5)
    _l2norm_(kf)
    vf = _heads_first(v, Tp).view(HV, N, L, Dv)  # [HV, N, L, Dv]
    gb = torch.zeros(2, HV, Tp, dtype=torch.float32, device=q.device)  # log decay and beta, [HV, Tp] each
    gb[0, :, :T], gb[1, :, :T] = g.t(), beta.t()
    G = gb[0].view(HV, N, L).cumsum(-1)  # [HV, N, L]: log gamma_t, the decay from the chunk's start to t
    bt = gb[1].view(HV, N, L)
    qf, kf = qf.view(HK, N, L, Dk), kf.view(HK, N, L, Dk)
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()  # [L, L] j <= t
    decay = (G[..., :, None] - G[..., None, :]).masked_fill_(~causal, float("-inf")).exp_()  # [HV, N, L, L]
    per_key = (HK, r, N, L, L)  # a value head's [L, L] beside its key head's
    A = (decay.view(per_key) * (kf @ kf.transpose(-1, -2))[:, None]).view(HV, N, L, L).mul_(bt[..., :, None])
    A.diagonal(dim1=-2, dim2=-1).fill_(1.0)  # I + A, A[t, j] = beta_t gamma_t / gamma_j k_t . k_j for j < t
    eye = torch.eye(L, dtype=torch.float32, device=q.device).expand(HV, N, L, L)
    inv = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)  # (I + A)^-1 [HV, N, L, L]
    attn = decay.view(per_key).mul_((qf @ kf.transpose(-1, -2))[:, None]).view(HV, N, L, L)  # incl. the diagonal
    if r > 1:  # each key head serves r consecutive value heads
        qf, kf = qf.repeat_interleave(r, dim=0), kf.repeat_interleave(r, dim=0)  # [HV, N, L, Dk]
    # U = (I + A)^-1 (beta V) - (I + A)^-1 (beta gamma K) S0
    u0 = (inv * bt[..., None, :]) @ vf  # [HV, N, L, Dv]
    w = inv.mul_((bt * G.exp())[..., None, :]) @ kf  # [HV, N, L, Dk]
    q_g = qf.mul_(G.exp()[..., None])  # [HV, N, L, Dk]
    k_end = kf.mul_((G[..., -1:] - G).exp_()[..., None])  # [HV, N, L, Dk]: decay from j to the chunk's end
    end = G[..., -1].exp()  # [HV, N]
    S = state.clone()
    out = torch.empty(HV, N, L, Dv, dtype=torch.float32, device=q.device)
    for n in range(N):
        u = torch.baddbmm(u0[:, n], w[:, n], S, alpha=-1)  # [HV, L, Dv]
        out[:, n] = torch.baddbmm(q_g[:, n] @ S, attn[:, n], u)
        S = torch.baddbmm(S.mul_(end[:, n, None, None]), k_end[:, n].transpose(-1, -2), u)
    state.copy_(S)
    return out.view(HV, Tp, Dv)[:, :T].transpose(0, 1)  # [T, HV, Dv]


def delta_rule_fused_step(q, k, v, g, beta, state, fused):
    """`delta_rule_step` through a fused kernel (`fused_steps`): one call for every value head."""
    HV, _, Dv = state.shape
    out = torch.empty(1, HV, Dv, dtype=torch.float32, device=state.device)  # [1, HV, Dv]
    fused.delta_rule_step(_flat(q), _flat(k), _flat(v), _flat(g), _flat(beta), state, out)
    return out


def delta_rule(q, k, v, g, beta, state):
    """The fast path: the fused step (native or Triton) or the torch step for one token, chunks for more."""
    if q.shape[0] == 1:
        fused = fused_steps(q, *state.shape[1:]) if _fp32_state(state) else None
        if fused is not None:
            return delta_rule_fused_step(q, k, v, g, beta, state, fused)
        return delta_rule_step(q, k, v, g, beta, state)
    return delta_rule_chunked(q, k, v, g, beta, state)
