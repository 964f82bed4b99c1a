"""The native one-token steps (native_recurrent.c through native.py) against the torch steps and the token-by-token
references: the gated delta rule, Mamba-2's SSM update and the causal conv, at odd shapes (one head, head dims that
are no multiple of 8, grouped heads), fp32 and bf16 inputs, on the SIMD and the scalar build; the same bits at 1, 2
and 3 threads; the models' decode takes them, and MOECHAT_RECURRENT_NATIVE=0 takes the torch steps."""

from __future__ import annotations

import shutil

import pytest
import torch

from moechat.engine.models import gated_deltanet as gd
from moechat.engine.models import mamba2
from moechat.engine.quant import native

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the torch steps run (tested)")

DELTA = [(1, 1, 16, 16), (1, 3, 13, 7), (2, 4, 40, 33), (2, 2, 128, 128)]  # HK, HV, Dk, Dv
SSD = [(1, 1, 8, 16), (3, 1, 5, 11), (4, 2, 33, 24), (2, 2, 64, 128)]  # H, G, P, N
CONV = [(1, 4), (37, 4), (300, 3), (130, 2), (5, 1)]  # C, W
DTYPES = [torch.float32, torch.bfloat16]


def _ratio(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """max |got - want| over the bound: fp32 1e-6 (|want| + the tensor's largest |want|: an element that cancels to ~0
    is held to the tensor's scale), a bf16 output one bf16 ulp (2^-7 |want|: the same fp32 value rounds the same)."""
    g, w = got.float(), want.float()
    bound = 1e-6 * (w.abs() + w.abs().amax()) if dtype == torch.float32 else 2**-7 * w.abs() + 1e-30
    return float(((g - w).abs() / bound).max())


class Native:
    """gd.fused_steps' interface over one given library (the SIMD or the scalar build)."""

    def __init__(self, lib):
        self.lib = lib

    def conv_step(self, *a):
        return native.conv_step(self.lib, *a)

    def delta_rule_step(self, *a):
        return native.delta_rule_step(self.lib, *a)

    def ssd_step(self, *a):
        return native.ssd_step(self.lib, *a)


def _delta_inputs(shape, dtype, T, seed):
    HK, HV, Dk, Dv = shape
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(T, HK, Dk, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(T, HV, Dv, generator=g).to(dtype)
    decay, beta = -torch.rand(T, HV, generator=g) * 2, torch.rand(T, HV, generator=g).to(dtype)
    return q, k, v, decay, beta, torch.randn(HV, Dk, Dv, generator=g) * 0.3


def _ssd_inputs(shape, dtype, T, seed):
    H, G, P, N = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, P, generator=g).to(dtype)
    dt = mamba2.discretize(torch.randn(T, H, generator=g), torch.rand(H, generator=g), 1e-3)
    A, D = -torch.rand(H, generator=g) * 2 - 0.1, torch.randn(H, generator=g)
    B, C = (torch.randn(T, G, N, generator=g).to(dtype) for _ in range(2))
    return x, dt, A, B, C, D, torch.randn(H, P, N, generator=g) * 0.3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", DELTA, ids=str)
def test_delta_rule_step_matches_the_torch_step_and_the_reference(any_lib, shape, dtype):
    q, k, v, decay, beta, s0 = _delta_inputs(shape, dtype, 4, sum(shape))
    s_torch, s_nat, s_ref = s0.clone(), s0.clone(), s0.clone()
    o_ref = gd.delta_rule_reference(q, k, v, decay, beta, s_ref)
    for t in range(4):
        a = (q[t : t + 1], k[t : t + 1], v[t : t + 1], decay[t : t + 1], beta[t : t + 1])
        want = gd.delta_rule_step(*a, s_torch)
        got = gd.delta_rule_fused_step(*a, s_nat, Native(any_lib))
        assert got.shape == want.shape and got.dtype == torch.float32
        assert _ratio(got, want) <= 1.0 and _ratio(s_nat, s_torch) <= 1.0
        torch.testing.assert_close(got[0], o_ref[t], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_nat, s_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SSD, ids=str)
def test_ssd_step_matches_the_torch_step_and_the_reference(any_lib, shape, dtype):
    x, dt, A, B, C, D, s0 = _ssd_inputs(shape, dtype, 4, sum(shape))
    s_torch, s_nat, s_ref = s0.clone(), s0.clone(), s0.clone()
    y_ref = mamba2.ssd_reference(x, dt, A, B, C, D, s_ref)
    for t in range(4):
        a = (x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D)
        want = mamba2.ssd_step(*a, s_torch)
        got = mamba2.ssd_fused_step(*a, s_nat, Native(any_lib))
        assert got.shape == want.shape and got.dtype == torch.float32
        assert _ratio(got, want) <= 1.0 and _ratio(s_nat, s_torch) <= 1.0
        torch.testing.assert_close(got[0], y_ref[t], atol=3e-5, rtol=5e-5)
    torch.testing.assert_close(s_nat, s_ref, atol=3e-5, rtol=5e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CONV, ids=str)
def test_conv_step_matches_the_reference(any_lib, shape, dtype, bias):
    """fp32 math and one rounding, as causal_conv1d_reference: bf16 outputs are its bits but for a rare tie broken
    by the order of the sum (one ulp); the window moves exactly."""
    Cn, W = shape
    g = torch.Generator().manual_seed(Cn * W)
    w = torch.randn(Cn, W, generator=g).to(dtype)
    b = torch.randn(Cn, generator=g).to(dtype) if bias else None
    st_ref = torch.randn(Cn, W - 1, generator=g).to(dtype)
    st = st_ref.clone()
    for _ in range(W + 1):  # past the window's length: every slot of it replaced
        x = torch.randn(1, Cn, generator=g).to(dtype)
        want = gd.causal_conv1d_reference(x, w, st_ref, b)
        got = torch.empty_like(x)
        native.conv_step(any_lib, x[0], w, b, st, got[0])
        assert _ratio(got, want, dtype) <= 1.0
        assert torch.equal(st, st_ref)


@pytest.mark.parametrize("kind", ["delta", "ssd", "conv"])
def test_every_thread_count_writes_the_same_bits(lib, kind):
    """Shapes big enough for the pool to cut them (>= 3 shares of 256 KiB): outputs and states bit for bit at 1, 2, 3
    threads (a head is one thread's, whatever the split)."""
    results = []
    for n in (1, 2, 3):
        native.pin_threads(lib, n)
        try:
            if kind == "delta":
                q, k, v, decay, beta, s = _delta_inputs((4, 12, 128, 128), torch.bfloat16, 1, 5)
                out = gd.delta_rule_fused_step(q, k, v, decay, beta, s, Native(lib))
            elif kind == "ssd":
                x, dt, A, B, C, D, s = _ssd_inputs((24, 4, 64, 128), torch.bfloat16, 1, 6)
                out = mamba2.ssd_fused_step(x, dt, A, B, C, D, s, Native(lib))
            else:
                g = torch.Generator().manual_seed(7)
                w, s = torch.randn(65536, 4, generator=g), torch.randn(65536, 3, generator=g)
                out = torch.empty(65536)
                native.conv_step(lib, torch.randn(65536, generator=g), w, None, s, out)
        finally:
            native.pin_threads(lib, None)
        results.append((out, s))
    for out, s in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(s, results[0][1])


def test_the_models_decode_takes_the_native_steps_and_the_switch_turns_them_off(lib, monkeypatch):
    calls = []
    for name in ("delta_rule_step", "ssd_step", "conv_step"):
        real = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    q, k, v, decay, beta, s0 = _delta_inputs((2, 4, 16, 8), torch.float32, 1, 1)
    x, dt, A, B, C, D, m0 = _ssd_inputs((4, 2, 8, 16), torch.float32, 1, 2)
    w, c0, xc = torch.randn(12, 4), torch.randn(12, 3), torch.randn(1, 12)

    def run():
        s, m, c = s0.clone(), m0.clone(), c0.clone()
        return (gd.delta_rule(q, k, v, decay, beta, s), s, mamba2.ssd(x, dt, A, B, C, D, m), m,
                gd.causal_conv1d(xc, w, c), c)

    fast = run()
    assert calls == ["delta_rule_step", "ssd_step", "conv_step"]
    monkeypatch.setenv(gd.ENV, "0")
    assert gd.fused_steps(q) is None
    calls.clear()
    slow = run()
    assert calls == []
    for a, b in zip(fast, slow, strict=True):
        assert _ratio(a, b) <= 1.0


@pytest.mark.parametrize("T", [1, gd.CHUNK - 1, gd.CHUNK + 1])
def test_delta_rule_decode_after_an_odd_prefill_is_one_prefill(lib, T):
    """A prefill of T (chunked; T = 1 the native step) then 3 native steps == the reference over all T + 3."""
    q, k, v, decay, beta, s0 = _delta_inputs((1, 3, 13, 7), torch.float32, T + 3, T)
    s_ref, s = s0.clone(), s0.clone()
    o_ref = gd.delta_rule_reference(q, k, v, decay, beta, s_ref)
    parts = [gd.delta_rule(q[:T], k[:T], v[:T], decay[:T], beta[:T], s)]
    parts += [gd.delta_rule(q[t : t + 1], k[t : t + 1], v[t : t + 1], decay[t : t + 1], beta[t : t + 1], s)
              for t in range(T, T + 3)]
    torch.testing.assert_close(torch.cat(parts), o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s, s_ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("T", [1, mamba2.CHUNK - 1, mamba2.CHUNK + 1])
def test_ssd_decode_after_an_odd_prefill_is_one_prefill(lib, T):
    x, dt, A, B, C, D, s0 = _ssd_inputs((3, 1, 5, 11), torch.float32, T + 3, T)
    s_ref, s = s0.clone(), s0.clone()
    y_ref = mamba2.ssd_reference(x, dt, A, B, C, D, s_ref)
    parts = [mamba2.ssd(x[:T], dt[:T], A, B[:T], C[:T], D, s)]
    parts += [mamba2.ssd(x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D, s) for t in range(T, T + 3)]
    torch.testing.assert_close(torch.cat(parts), y_ref, atol=3e-5, rtol=5e-5)
    torch.testing.assert_close(s, s_ref, atol=3e-5, rtol=5e-5)


def test_shapes_the_kernels_do_not_take_are_an_error(lib):
    q = torch.zeros(3, 8)  # 3 key heads for 4 value heads
    with pytest.raises(RuntimeError, match="delta rule"):
        native.delta_rule_step(lib, q, q, torch.zeros(4, 8), torch.zeros(4), torch.zeros(4), torch.zeros(4, 8, 8),
                               torch.zeros(4, 8))


@pytest.mark.parametrize("T", [1, gd.CHUNK - 1, gd.CHUNK + 1, 9 * gd.CHUNK + 13])
@pytest.mark.parametrize("shape", [(1, 1, 5, 3), (1, 3, 13, 7), (2, 6, 8, 5)], ids=str)
def test_delta_rule_chunked_at_odd_shapes(shape, T):
    """The chunked prefill (and the fast dispatch) at one head / odd head dims / key heads shared by 3 value heads,
    against the reference, up to 9 chunks and a part."""
    q, k, v, decay, beta, s0 = _delta_inputs(shape, torch.float32, T, T + shape[3])
    s_ref, s_chunk, s_fast = s0.clone(), s0.clone(), s0.clone()
    o_ref = gd.delta_rule_reference(q, k, v, decay, beta, s_ref)
    torch.testing.assert_close(gd.delta_rule_chunked(q, k, v, decay, beta, s_chunk), o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(gd.delta_rule(q, k, v, decay, beta, s_fast), o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s_chunk, s_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s_fast, s_ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("T", [1, mamba2.CHUNK - 1, mamba2.CHUNK + 1, 9 * mamba2.CHUNK + 13])
@pytest.mark.parametrize("shape", [(1, 1, 3, 5), (3, 1, 5, 11), (6, 3, 4, 7)], ids=str)
def test_ssd_chunked_at_odd_shapes(shape, T):
    """The chunked prefill (B and C per group, the state per group of heads) at one head / one group / 3 groups of
    2 heads, against the reference, up to 9 chunks and a part."""
    x, dt, A, B, C, D, s0 = _ssd_inputs(shape, torch.float32, T, T + shape[3])
    s_ref, s_chunk, s_fast = s0.clone(), s0.clone(), s0.clone()
    y_ref = mamba2.ssd_reference(x, dt, A, B, C, D, s_ref)
    torch.testing.assert_close(mamba2.ssd_chunked(x, dt, A, B, C, D, s_chunk), y_ref, atol=3e-5, rtol=5e-5)
    torch.testing.assert_close(mamba2.ssd(x, dt, A, B, C, D, s_fast), y_ref, atol=3e-5, rtol=5e-5)
    torch.testing.assert_close(s_chunk, s_ref, atol=3e-5, rtol=5e-5)
    torch.testing.assert_close(s_fast, s_ref, atol=3e-5, rtol=5e-5)


@pytest.mark.parametrize("T", [1, 3, 9])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv_prefill_then_native_steps_is_the_reference(lib, T, dtype):
    """A prefill of T through causal_conv1d (grouped conv1d; T = 1 the native step), then native steps: the window
    continues where it left off, outputs as the reference's over the whole sequence."""
    g = torch.Generator().manual_seed(T)
    Cn, W = 11, 4
    x = torch.randn(T + 4, Cn, generator=g).to(dtype)
    w, b = torch.randn(Cn, W, generator=g).to(dtype), torch.randn(Cn, generator=g).to(dtype)
    st0 = torch.randn(Cn, W - 1, generator=g).to(dtype)
    ref_state, state = st0.clone(), st0.clone()
    want = gd.causal_conv1d_reference(x, w, ref_state, b)
    got = torch.cat([gd.causal_conv1d(x[:T], w, state, b)] + [gd.causal_conv1d(x[t : t + 1], w, state, b)
                                                              for t in range(T, T + 4)])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(state, ref_state)


def test_head_dims_past_the_kernels_limit_take_the_torch_step(lib):
    """Dk past native_recurrent.c's stack scratch: the torch step, not an error."""
    q, k, v, decay, beta, s0 = _delta_inputs((1, 1, gd.NATIVE_MAX_D + 1, 2), torch.float32, 1, 3)
    assert gd.fused_steps(q, *s0.shape[1:]) is None and gd.fused_steps(q, 8, 8) is not None
    s_ref, s = s0.clone(), s0.clone()
    torch.testing.assert_close(gd.delta_rule(q, k, v, decay, beta, s), gd.delta_rule_step(q, k, v, decay, beta, s_ref))
    torch.testing.assert_close(s, s_ref)
