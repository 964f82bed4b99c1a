"""Mamba-2's SSD: the chunked prefill and the decode step against the token-by-token reference and against
transformers' torch scan (Nemotron-H's), at odd lengths; a decode after a prefill == one prefill of it all."""

import pytest
import torch
from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

from moechat.engine.models import gated_deltanet as gd
from moechat.engine.models import mamba2

H, P, G, N = 4, 8, 2, 16
FLOOR = 1e-3


def _inputs(T, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, P, generator=g)
    dt_raw, dt_bias = torch.randn(T, H, generator=g), torch.rand(H, generator=g)
    A = -torch.rand(H, generator=g) * 2 - 0.1
    B, C = torch.randn(T, G, N, generator=g), torch.randn(T, G, N, generator=g)
    D = torch.randn(H, generator=g)
    state = torch.randn(H, P, N, generator=g) * 0.3
    return x, dt_raw, dt_bias, A, B, C, D, state


def _close(a, b):
    torch.testing.assert_close(a, b, atol=3e-5, rtol=5e-5)  # values reach ~80: fp32 sums of 300 terms


@pytest.mark.parametrize("T", [1, mamba2.CHUNK - 1, mamba2.CHUNK, mamba2.CHUNK + 1, 2 * mamba2.CHUNK + 45])
def test_chunked_matches_reference_and_transformers(T):
    x, dt_raw, dt_bias, A, B, C, D, s0 = _inputs(T, T)
    dt = mamba2.discretize(dt_raw, dt_bias, FLOOR)
    s_ref, s_fast = s0.clone(), s0.clone()
    y_ref = mamba2.ssd_reference(x, dt, A, B, C, D, s_ref)
    y_fast = mamba2.ssd_chunked(x, dt, A, B, C, D, s_fast)
    _close(y_fast, y_ref)
    _close(s_fast, s_ref)
    y_hf, s_hf = mamba2_chunk_scan(x[None], dt_raw[None], A, B[None], C[None], mamba2.CHUNK, D=D, dt_bias=dt_bias,
                                   initial_states=s0[None].clone(), dt_softplus=True, dt_limit=(FLOOR, float("inf")),
                                   return_final_states=True)
    _close(y_ref, y_hf[0])
    _close(s_ref, s_hf[0])


def test_decode_after_prefill_is_one_prefill():
    T = 150
    x, dt_raw, dt_bias, A, B, C, D, s0 = _inputs(T, 9)
    dt = mamba2.discretize(dt_raw, dt_bias, FLOOR)
    s_all = s0.clone()
    y_all = mamba2.ssd(x, dt, A, B, C, D, s_all)
    s = s0.clone()
    parts = [mamba2.ssd(x[:100], dt[:100], A, B[:100], C[:100], D, s)]
    for t in range(100, 104):
        parts.append(mamba2.ssd(x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D, s))
    parts.append(mamba2.ssd(x[104:], dt[104:], A, B[104:], C[104:], D, s))
    _close(torch.cat(parts), y_all)
    _close(s, s_all)


def test_conv_with_bias_fast_matches_reference():
    g = torch.Generator().manual_seed(3)
    C_, W = 10, 4
    x, w, bias = torch.randn(7, C_, generator=g), torch.randn(C_, W, generator=g), torch.randn(C_, generator=g)
    st = torch.randn(C_, W - 1, generator=g)
    a, b = st.clone(), st.clone()
    _close(gd.causal_conv1d(x[:5], w, b, bias), gd.causal_conv1d_reference(x[:5], w, a, bias))
    _close(torch.cat([gd.causal_conv1d(x[t : t + 1], w, b, bias) for t in (5, 6)]),
           gd.causal_conv1d_reference(x[5:], w, a, bias))
    _close(a, b)
