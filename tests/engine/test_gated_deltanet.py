"""Gated DeltaNet: the chunked prefill and the decode step against the token-by-token reference and against
transformers' own torch functions, at odd lengths; a decode after a prefill == one prefill of it all."""

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

from moechat.engine.models import gated_deltanet as gd

HK, HV, DK, DV = 2, 4, 16, 8


def _inputs(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, HK, DK, generator=g), torch.randn(T, HK, DK, generator=g)
    v = torch.randn(T, HV, DV, generator=g)
    decay = -torch.rand(T, HV, generator=g) * 3  # log decay <= 0
    beta = torch.rand(T, HV, generator=g)
    state = torch.randn(HV, DK, DV, generator=g) * 0.3
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("T", [1, gd.CHUNK - 1, gd.CHUNK, gd.CHUNK + 1, 3 * gd.CHUNK + 7])
def test_chunked_matches_reference_and_transformers(T):
    q, k, v, decay, beta, s0 = _inputs(T, T)
    s_ref, s_fast = s0.clone(), s0.clone()
    o_ref = gd.delta_rule_reference(q, k, v, decay, beta, s_ref)
    o_fast = gd.delta_rule_chunked(q, k, v, decay, beta, s_fast)
    torch.testing.assert_close(o_fast, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s_fast, s_ref, atol=2e-5, rtol=1e-4)
    o_hf, s_hf = torch_chunk_gated_delta_rule(q[None], k[None], v[None], decay[None], beta[None],
                                              initial_state=s0[None].clone(), output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o_ref, o_hf[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s_ref, s_hf[0], atol=2e-5, rtol=1e-4)


def test_step_matches_reference():
    q, k, v, decay, beta, s0 = _inputs(5, 3)
    s_ref, s_step = s0.clone(), s0.clone()
    o_ref = gd.delta_rule_reference(q, k, v, decay, beta, s_ref)
    for t in range(5):
        o = gd.delta_rule_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], decay[t : t + 1], beta[t : t + 1], s_step)
        torch.testing.assert_close(o[0], o_ref[t], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_step, s_ref, atol=1e-5, rtol=1e-5)


def test_decode_after_prefill_is_one_prefill():
    """A prefill of 70 then 3 decode steps then a chunk of 65 == one chunked pass over all 138 from the same state."""
    q, k, v, decay, beta, s0 = _inputs(138, 7)
    s_all = s0.clone()
    o_all = gd.delta_rule(q, k, v, decay, beta, s_all)
    s = s0.clone()
    parts = [gd.delta_rule(q[:70], k[:70], v[:70], decay[:70], beta[:70], s)]
    for t in range(70, 73):
        parts.append(gd.delta_rule(q[t : t + 1], k[t : t + 1], v[t : t + 1], decay[t : t + 1], beta[t : t + 1], s))
    parts.append(gd.delta_rule(q[73:], k[73:], v[73:], decay[73:], beta[73:], s))
    torch.testing.assert_close(torch.cat(parts), o_all, atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(s, s_all, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("T", [1, 2, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_fast_matches_reference_and_splits(T, dtype):
    g = torch.Generator().manual_seed(T)
    C, W = 12, 4
    x = torch.randn(T + 3, C, generator=g).to(dtype)
    w = torch.randn(C, W, generator=g).to(dtype)
    st0 = torch.randn(C, W - 1, generator=g).to(dtype)
    a, b = st0.clone(), st0.clone()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gd.causal_conv1d(x[:T], w, b), gd.causal_conv1d_reference(x[:T], w, a), **tol)
    torch.testing.assert_close(a, b)
    # the rest one token at a time continues exactly where the window left off
    ref = gd.causal_conv1d_reference(x[T:], w, a)
    fast = torch.cat([gd.causal_conv1d(x[t : t + 1], w, b) for t in range(T, T + 3)])
    torch.testing.assert_close(fast, ref, **tol)
    torch.testing.assert_close(a, b)
