"""Mamba-2 (the SSM layers of Nemotron-H / Nemotron-3): a selective state space with a [P, N] state per head.

Per token t and head h (head dim P, state N, B/C shared by the heads of a group):
dt = clamp(softplus(dt_raw + dt_bias), time_step_min);  S <- exp(dt A) S + dt x_t B_t^T;  y_t = S C_t + D x_t,
after a depthwise causal conv1d (kernel 4, with bias) and SiLU over [x | B | C]. Nemotron-3-Nano-30B-A3B: 64 heads
x 64 x 128 fp32 = 2 MiB per layer (+ a [6144, 3] conv window), 46 MiB for its 23 Mamba layers at any context.

Three paths, fp32 inside: `ssd_reference` (token by token), `ssd_chunked` (prefill: the SSD form, within a chunk
y = (C B^T * decay) (dt x) + decay_in C S0, the state carried between chunks by one GEMM each) and `ssd_step`
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

CHUNK = 128


def discretize(dt_raw: torch.Tensor, dt_bias: torch.Tensor, floor: float = 0.0) -> torch.Tensor:
    """dt_raw [T, H] -> the time step [T, H] fp32."""
    return F.softplus(dt_raw.float() + dt_bias.float()).clamp(min=floor)


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
    """The same as `ssd_reference`, chunk by chunk; state updated in place."""
    T, H, P = x.shape
    Bh, Ch, xf = _heads(B, H), _heads(C, H), x.float()
    pad = (-T) % chunk
    if pad:  # padded steps have dt = 0: no decay, no input
        xf, Bh, Ch = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xf, Bh, Ch))
        dt = F.pad(dt, (0, 0, 0, pad))
    n, L = (T + pad) // chunk, chunk
    xdt = (xf * dt[..., None]).reshape(n, L, H, P).permute(2, 0, 1, 3)  # [H, n, L, P]
    Bc = Bh.reshape(n, L, H, -1).permute(2, 0, 1, 3)  # [H, n, L, N]
    Cc = Ch.reshape(n, L, H, -1).permute(2, 0, 1, 3)
    da = (dt * A).reshape(n, L, H).permute(2, 0, 1)  # [H, n, L] log decay of each step
    a = da.cumsum(-1)  # [H, n, L] from the chunk's start
    # decay[t, s] = exp(sum of da over s < k <= t), summed directly rather than as a[t] - a[s]: the cumulative sums
    # reach -100s within a chunk, and their difference would lose the small terms (5e-5 relative at L = 128)
    tril = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    seg = da[..., :, None].expand(H, n, L, L).masked_fill(~tril.tril(-1), 0.0).cumsum(-2)  # [t, s]: k in (s, t]
    decay = seg.masked_fill(~tril, float("-inf")).exp()  # [H, n, L, L]
    y_in = (Cc @ Bc.transpose(-1, -2) * decay) @ xdt  # [H, n, L, P]
    c_in = Cc * a.exp()[..., None]  # [H, n, L, N]
    b_end = Bc * (a[..., -1:] - a).exp()[..., None]  # [H, n, L, N]
    end = a[..., -1].exp()  # [H, n]
    S = state.clone()  # [H, P, N]
    out = torch.empty(H, n, L, P, dtype=torch.float32, device=x.device)
    for i in range(n):
        out[:, i] = y_in[:, i] + c_in[:, i] @ S.transpose(1, 2)
        S = S * end[:, i, None, None] + xdt[:, i].transpose(1, 2) @ b_end[:, i]
    state.copy_(S)
    y = out.reshape(H, n * L, P)[:, :T].transpose(0, 1)  # [T, H, P]
    return y + D[:, None] * x.float()


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
