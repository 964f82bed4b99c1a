"""Triton kernels for the recurrent layers' one-token (decode) steps on CUDA: the gated delta rule (Gated DeltaNet),
Mamba-2's SSM update and the short causal conv1d + SiLU, each state updated in place (engine/models/gated_deltanet.py
and mamba2.py call them through `gd.fused_steps` for CUDA tensors; the Triton interpreter runs them on CPU tensors in
tests/engine/test_recurrent_triton.py against the torch steps).

The arguments are native.py's wrappers' (less the library), so one call site serves both. Each program owns one head
and a block of its value columns (delta rule: [Dk, BV] of the [Dk, Dv] state; Mamba-2: [BP, N] of [P, N]): the state
is read once and written once, and no two programs touch the same state element, so there are no atomics and the
result does not depend on the grid's order. fp32 inside; q/k/v/x/B/C may be bf16 (widened on load).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# HK / HV = key / value heads, Dk / Dv = head dims; H = Mamba heads, G = groups, P = head dim, N = state size;
# C = conv channels, W = conv width


@triton.jit
def _delta_rule_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr, rep, Dk, Dv, scale,
                     BK: tl.constexpr, BV: tl.constexpr):
    h = tl.program_id(0)
    kh = h // rep
    rk = tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    mk, mv = rk < Dk, rv < Dv
    q = tl.load(q_ptr + kh * Dk + rk, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + kh * Dk + rk, mask=mk, other=0.0).to(tl.float32)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)) * scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
    decay = tl.exp(tl.load(g_ptr + h).to(tl.float32))
    beta = tl.load(beta_ptr + h).to(tl.float32)
    ptrs = s_ptr + h * Dk * Dv + rk[:, None] * Dv + rv[None, :]  # [BK, BV]
    m2 = mk[:, None] & mv[None, :]
    s = tl.load(ptrs, mask=m2, other=0.0) * decay
    mem = tl.sum(s * k[:, None], axis=0)  # [BV]: S^T k
    v = tl.load(v_ptr + h * Dv + rv, mask=mv, other=0.0).to(tl.float32)
    u = (v - mem) * beta
    s = s + k[:, None] * u[None, :]
    tl.store(ptrs, s, mask=m2)
    tl.store(o_ptr + h * Dv + rv, tl.sum(s * q[:, None], axis=0), mask=mv)


@triton.jit
def _ssd_step(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, s_ptr, y_ptr, rep, P, N,
              BP: tl.constexpr, BN: tl.constexpr):
    h = tl.program_id(0)
    g = h // rep
    rp = tl.program_id(1) * BP + tl.arange(0, BP)
    rn = tl.arange(0, BN)
    mp, mn = rp < P, rn < N
    B = tl.load(b_ptr + g * N + rn, mask=mn, other=0.0).to(tl.float32)
    C = tl.load(c_ptr + g * N + rn, mask=mn, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + h).to(tl.float32)
    da = tl.exp(dt * tl.load(a_ptr + h).to(tl.float32))
    D = tl.load(d_ptr + h).to(tl.float32)
    x = tl.load(x_ptr + h * P + rp, mask=mp, other=0.0).to(tl.float32)
    ptrs = s_ptr + h * P * N + rp[:, None] * N + rn[None, :]  # [BP, BN]
    m2 = mp[:, None] & mn[None, :]
    s = tl.load(ptrs, mask=m2, other=0.0) * da + (dt * x)[:, None] * B[None, :]
    tl.store(ptrs, s, mask=m2)
    tl.store(y_ptr + h * P + rp, tl.sum(s * C[None, :], axis=1) + D * x, mask=mp)


@triton.jit
def _conv_step(x_ptr, w_ptr, bias_ptr, s_ptr, o_ptr, Cn, W, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr,
               BC: tl.constexpr, BW: tl.constexpr):
    rc = tl.program_id(0) * BC + tl.arange(0, BC)
    rw = tl.arange(0, BW)
    mc = rc < Cn
    x = tl.load(x_ptr + rc, mask=mc, other=0.0).to(tl.float32)
    win_mask = mc[:, None] & (rw[None, :] < W - 1)
    win = tl.load(s_ptr + rc[:, None] * (W - 1) + rw[None, :], mask=win_mask, other=0.0).to(tl.float32)
    full = tl.where(rw[None, :] == W - 1, x[:, None], win)  # [BC, BW]: the window, then x
    w = tl.load(w_ptr + rc[:, None] * W + rw[None, :], mask=mc[:, None] & (rw[None, :] < W), other=0.0)
    y = tl.sum(full * w.to(tl.float32), axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rc, mask=mc, other=0.0).to(tl.float32)
    y = y / (1.0 + tl.exp(-y))
    # the window shifted by one: read (above and here) before any store
    nxt_mask = mc[:, None] & (rw[None, :] + 1 < W - 1)
    nxt = tl.load(s_ptr + rc[:, None] * (W - 1) + rw[None, :] + 1, mask=nxt_mask, other=0.0).to(tl.float32)
    nxt = tl.where(rw[None, :] + 1 == W - 1, x[:, None], nxt)
    tl.debug_barrier()
    tl.store(s_ptr + rc[:, None] * (W - 1) + rw[None, :], nxt.to(s_ptr.dtype.element_ty), mask=win_mask)
    if OUT_BF16:  # rounded to nearest even by hand: the interpreter's cast truncates, the hardware's then is exact
        bits = y.to(tl.uint32, bitcast=True)
        y = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(o_ptr + rc, y.to(o_ptr.dtype.element_ty), mask=mc)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def delta_rule_step(q, k, v, g, beta, state: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """q, k [(1,) HK, Dk], v [(1,) HV, Dv], g, beta [(1,) HV] (contiguous) -> out [(1,) HV, Dv] fp32; state
    [HV, Dk, Dv] fp32."""
    HV, Dk, Dv = state.shape
    BV = min(_pow2(Dv), 32)
    _delta_rule_step[(HV, triton.cdiv(Dv, BV))](q, k, v, g, beta, state, out, HV // q.shape[-2], Dk, Dv, Dk ** -0.5,
                                                BK=_pow2(Dk), BV=BV)
    return out


def ssd_step(x, dt, A, B, C, D, state: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x [(1,) H, P], dt [(1,) H], A, D [H], B, C [(1,) G, N] (contiguous) -> out [(1,) H, P] fp32; state [H, P, N]
    fp32."""
    H, P, N = state.shape
    BP = min(_pow2(P), 32)
    _ssd_step[(H, triton.cdiv(P, BP))](x, dt, A, B, C, D, state, out, H // B.shape[-2], P, N, BP=BP, BN=_pow2(N))
    return out


def conv_step(x, w, bias, state: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x [(1,) C], w [C, W], bias [C] or None, state [C, W-1] (shifted in place) -> out [(1,) C] = silu(conv)."""
    Cn, W = w.shape
    BC = 128
    _conv_step[(triton.cdiv(Cn, BC),)](x, w, x if bias is None else bias, state, out, Cn, W, HAS_BIAS=bias is not None,
                                       OUT_BF16=out.dtype == torch.bfloat16, BC=BC, BW=_pow2(W, 2))
    return out
