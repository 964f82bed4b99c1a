"""Mamba-2 (the SSM layers of Nemotron-H / Nemotron-3): a selective state space with a [P, N] state per head.

Per token t and head h (head dim P, state N, B/C shared by the heads of a group):
dt = clamp(softplus(dt_raw + dt_bias), *time_step_limit);  S <- exp(dt A) S + dt x_t B_t^T;  y_t = S C_t + D x_t,
after a depthwise causal conv1d (kernel 4, with bias) and SiLU over [x | B | C]. Nemotron-3-Nano-30B-A3B: 64 heads
x 64 x 128 fp32 = 2 MiB per layer (+ a [6144, 3] conv window), 46 MiB for its 23 Mamba layers at any context.

Three paths, fp32 inside: `ssd_reference` (token by token), `ssd_chunked` (prefill: the SSD form, within a chunk of
64 y = (C B^T * decay) (dt x) + decay_in C S0, the state carried between chunks by one GEMM per group) and `ssd_step`
(decode, the state updated in place).

Decode (one token) takes gated_deltanet's fused kernels where there are (`gd.fused_steps`): native_recurrent.c's
`moechat_ssd_step` on CPU tensors (every head's update and output in one call, the heads split over native.c's pool,
the same bits at any thread count, within ~1e-6 relative of `ssd_step`; 0.08 ms against its 0.68 ms at
Nemotron-3-Nano's 64 heads x 64 x 128, one thread), engine/quant/kernels/recurrent.py's Triton
kernel on CUDA tensors; MOECHAT_RECURRENT_NATIVE=0 turns both off (`ssd_step`, the torch step). The conv in front of
it is gated_deltanet's `causal_conv1d` (with its bias), fused the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import gated_deltanet as gd

# T = tokens, H = heads, P = head dim, G = groups, N = state size, L = chunk length

CHUNK = 64


def discretize(dt_raw: torch.Tensor, dt_bias: torch.Tensor, floor: float = 0.0,
               ceil: float = float("inf")) -> torch.Tensor:
    """dt_raw [T, H] -> the time step [T, H] fp32, clamped to [floor, ceil]."""
    return F.softplus(dt_raw.float() + dt_bias.float()).clamp(min=floor, max=ceil)


def _heads(B: torch.Tensor, H: int) -> torch.Tensor:
    """[T, G, N] -> [T, H, N]: each group's B or C for its H/G consecutive heads."""
    return B.float().repeat_interleave(H // B.shape[1], dim=1)


def ssd_reference(x, dt, A, B, C, D, state):
    """x [T, H, P], dt [T, H] (discretized), A [H] (negative), B, C [T, G, N], D [H], state [H, P, N] fp32 (updated
    in place) -> y [T, H, P] fp32, one token at a time."""
    H = x.shape[1]
    Bh, Ch, x = _heads(B, H), _heads(C, H), x.float()
    S = state.clone()
    out = []
    for t in range(x.shape[0]):
        S = S * torch.exp(dt[t] * A)[:, None, None] + (dt[t, :, None] * x[t])[:, :, None] * Bh[t][:, None, :]
        out.append((S * Ch[t][:, None, :]).sum(-1) + D[:, None] * x[t])
    state.copy_(S)
    return torch.stack(out)


def ssd_step(x, dt, A, B, C, D, state):
    """One token (shapes as `ssd_reference` with T = 1), the state updated in place."""
    H = x.shape[1]
    Bh, Ch, xf = _heads(B, H)[0], _heads(C, H)[0], x[0].float()  # [H, N], [H, N], [H, P]
    state.mul_(torch.exp(dt[0] * A)[:, None, None])
    state.baddbmm_((dt[0, :, None] * xf)[:, :, None], Bh[:, None, :])  # S += dt x B^T
    y = torch.bmm(state, Ch[:, :, None])[..., 0] + D[:, None] * xf  # [H, P]
    return y[None]


def ssd_chunked(x, dt, A, B, C, D, state, chunk: int = CHUNK):
    """The same as `ssd_reference`, chunk by chunk; state updated in place.

    B and C stay per group: C B^T is one [L, L] GEMM per group and chunk (not per head: Nemotron-3-Nano's 64 heads
    share 8 groups), scaled per head by its decay; the state is read out and updated group by group as one GEMM over
    the group's heads ([L, N] x [N, heads x P]); the elementwise steps run in place. At Nemotron-3-Nano's widths, one
    thread, 1024 bf16 tokens: 95 ms of CPU against 338 ms for the per-head form at chunks of 128 (medians of 7
    interleaved runs on a loaded 2-core machine); in the new form chunks of 32 measured 0.87x and 128 1.2x of 64's."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    hg = H // G  # heads per group
    pad = (-T) % chunk  # padded steps have dt = 0: no decay, no input
    n, L, Tp = (T + pad) // chunk, chunk, T + pad
    dtp = torch.zeros(H, Tp, dtype=torch.float32, device=x.device)  # [H, Tp]
    dtp[:, :T] = dt.t()
    xdt = gd._heads_first(x, Tp).mul_(dtp[..., None]).view(H, n, L, P)  # [H, n, L, P] dt x
    Bg, Cg = gd._heads_first(B, Tp).view(G, n, L, N), gd._heads_first(C, Tp).view(G, n, L, N)  # [G, n, L, N]
    da = dtp.mul_(A.float()[:, None]).view(H, n, L)  # [H, n, L] log decay of each step
    a = da.cumsum(-1)  # [H, n, L] from the chunk's start
    # decay[t, s] = exp(sum of da over s < k <= t), summed directly rather than as a[t] - a[s]: the cumulative sums
    # reach -100s within a chunk, and their difference would lose the small terms (5e-5 relative at L = 128)
    tril = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    seg = da[..., :, None].expand(H, n, L, L).masked_fill(~tril.tril(-1), 0.0).cumsum_(-2)  # [t, s]: k in (s, t]
    decay = seg.masked_fill_(~tril, float("-inf")).exp_()  # [H, n, L, L]
    scores = decay.view(G, hg, n, L, L).mul_((Cg @ Bg.transpose(-1, -2))[:, None]).view(H, n, L, L)
    y = scores @ xdt  # [H, n, L, P] within each chunk
    grow = a.exp()  # [H, n, L] the decay of the chunk's start state to t
    # dt x weighted by its decay to the chunk's end, chunk-major and transposed: [n, G, hg P, L] for the state GEMM
    xw = (xdt * (a[..., -1:] - a).exp_()[..., None]).permute(1, 0, 3, 2).reshape(n, G, hg * P, L)
    end = a[..., -1].exp()  # [H, n]
    S = state.clone()  # [H, P, N]
    for i in range(n):
        read = (Cg[:, i] @ S.view(G, hg * P, N).transpose(1, 2)).view(G, L, hg, P)  # [G, L, hg, P] C S^T
        y[:, i].add_(read.permute(0, 2, 1, 3).reshape(H, L, P).mul_(grow[:, i, :, None]))
        S = torch.baddbmm(S.mul_(end[:, i, None, None]).view(G, hg * P, N), xw[i], Bg[:, i]).view(H, P, N)
    state.copy_(S)
    return y.view(H, Tp, P)[:, :T].transpose(0, 1) + D[:, None] * x.float()  # [T, H, P]


def ssd_fused_step(x, dt, A, B, C, D, state, fused):
    """`ssd_step` through a fused kernel (`gd.fused_steps`): one call for every head."""
    H, P, _ = state.shape
    y = torch.empty(1, H, P, dtype=torch.float32, device=state.device)  # [1, H, P]
    f = gd._flat
    fused.ssd_step(f(x), f(dt), f(A), f(B), f(C), f(D), state, y)
    return y


def ssd(x, dt, A, B, C, D, state):
    """The fast path: the fused step (native or Triton) or the torch step for one token, chunks for more."""
    if x.shape[0] != 1:
        return ssd_chunked(x, dt, A, B, C, D, state)
    fused = gd.fused_steps(x, state.shape[2]) if gd._fp32_state(state) else None
    if fused is not None:
        return ssd_fused_step(x, dt, A, B, C, D, state, fused)
    return ssd_step(x, dt, A, B, C, D, state)
