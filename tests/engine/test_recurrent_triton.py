"""The Triton decode steps (engine/quant/kernels/recurrent.py) against the torch steps: the gated delta rule, Mamba-2's
SSM update and the causal conv, at small odd shapes (one head, head dims that are no power of two and smaller than a
block, grouped heads), fp32 and bf16 inputs.

On the CPU the Triton interpreter runs them, in a subprocess (this file as a script) so TRITON_INTERPRET never reaches
the rest of the suite; on CUDA the `gpu` test runs the compiled kernels and the models' dispatch to them.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from moechat.engine.models import gated_deltanet as gd
from moechat.engine.models import mamba2

# HK, HV, Dk, Dv (the delta rule); H, G, P, N (Mamba-2); C, W (the conv)
DELTA = [(1, 1, 16, 16), (1, 3, 13, 7), (2, 4, 40, 33), (1, 2, 128, 128)]
SSD = [(1, 1, 8, 16), (3, 1, 5, 11), (4, 2, 33, 24)]
CONV = [(1, 4), (37, 4), (300, 3), (130, 2)]
DTYPES = [torch.float32, torch.bfloat16]


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def delta_case(shape, dtype, device="cpu", steps=3):
    """Three steps of the kernel and of gd.delta_rule_step from one state -> (max error / bound over outputs and
    state, for the kernel)."""
    from moechat.engine.quant.kernels import recurrent

    HK, HV, Dk, Dv = shape
    g = _g(Dk * Dv + HV)
    s_ref = (torch.randn(HV, Dk, Dv, generator=g) * 0.3).to(device)
    s_k = s_ref.clone()
    worst = 0.0
    for _ in range(steps):
        q, k = (torch.randn(1, HK, Dk, generator=g).to(device, dtype) for _ in range(2))
        v = torch.randn(1, HV, Dv, generator=g).to(device, dtype)
        decay, beta = (-torch.rand(1, HV, generator=g) * 2).to(device), torch.rand(1, HV, generator=g).to(device, dtype)
        want = gd.delta_rule_step(q, k, v, decay, beta, s_ref)
        got = gd.delta_rule_fused_step(q, k, v, decay, beta, s_k, recurrent)
        worst = max(worst, _ratio(got, want), _ratio(s_k, s_ref))
    return worst


def ssd_case(shape, dtype, device="cpu", steps=3):
    from moechat.engine.quant.kernels import recurrent

    H, G, P, N = shape
    g = _g(H * P * N)
    s_ref = (torch.randn(H, P, N, generator=g) * 0.3).to(device)
    s_k = s_ref.clone()
    A, D = (-torch.rand(H, generator=g) - 0.1).to(device), torch.randn(H, generator=g).to(device)
    worst = 0.0
    for _ in range(steps):
        x = torch.randn(1, H, P, generator=g).to(device, dtype)
        dt = mamba2.discretize(torch.randn(1, H, generator=g), torch.rand(H, generator=g), 1e-3).to(device)
        B, C = (torch.randn(1, G, N, generator=g).to(device, dtype) for _ in range(2))
        want = mamba2.ssd_step(x, dt, A, B, C, D, s_ref)
        got = mamba2.ssd_fused_step(x, dt, A, B, C, D, s_k, recurrent)
        worst = max(worst, _ratio(got, want), _ratio(s_k, s_ref))
    return worst


def conv_case(shape, dtype, bias: bool, device="cpu", steps=3):
    """The kernel's conv against causal_conv1d_reference (fp32 math, one rounding: the kernel's too)."""
    from moechat.engine.quant.kernels import recurrent

    C, W = shape
    g = _g(C * W)
    w = torch.randn(C, W, generator=g).to(device, dtype)
    b = torch.randn(C, generator=g).to(device, dtype) if bias else None
    st_ref = torch.randn(C, W - 1, generator=g).to(device, dtype)
    st_k = st_ref.clone()
    worst = 0.0
    for _ in range(steps):
        x = torch.randn(1, C, generator=g).to(device, dtype)
        want = gd.causal_conv1d_reference(x, w, st_ref, b)
        got = torch.empty_like(x)
        recurrent.conv_step(x[0], w, b, st_k, got[0])
        assert torch.equal(st_k, st_ref)  # the window is moved, never rounded
        worst = max(worst, _ratio(got, want, dtype))
    return worst


def _ratio(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """max |got - want| over the bound: fp32 1e-6 (|want| + the tensor's largest |want|: an element that cancels to ~0
    is held to the tensor's scale), a bf16 output one bf16 ulp (2^-7 |want|: the same fp32 value rounds the same)."""
    g, w = got.float(), want.float()
    bound = 1e-6 * (w.abs() + w.abs().amax()) if dtype == torch.float32 else 2**-7 * w.abs() + 1e-30
    return float(((g - w).abs() / bound).max())


def _cases():
    for s in DELTA:
        for d in DTYPES:
            yield f"delta-{'x'.join(map(str, s))}-{str(d)[6:]}", lambda s=s, d=d: delta_case(s, d)
    for s in SSD:
        for d in DTYPES:
            yield f"ssd-{'x'.join(map(str, s))}-{str(d)[6:]}", lambda s=s, d=d: ssd_case(s, d)
    for s in CONV:
        for d in DTYPES:
            for b in (False, True):
                yield f"conv-{'x'.join(map(str, s))}-{str(d)[6:]}-{'bias' if b else 'nobias'}", \
                    lambda s=s, d=d, b=b: conv_case(s, d, b)


NAMES = [name for name, _ in _cases()]


def _interpreted_main() -> None:
    for name, fn in _cases():
        print(name, fn(), flush=True)


if __name__ == "__main__":
    _interpreted_main()


@pytest.fixture(scope="module")
def interpreted() -> dict[str, float]:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return {name: float(err) for name, err in (line.split() for line in result.stdout.splitlines())}


@pytest.mark.parametrize("name", NAMES)
def test_interpreted_step_matches_the_torch_step(interpreted, name):
    assert interpreted[name] <= 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_steps_match_and_the_models_take_them(monkeypatch):
    from moechat.engine.quant.kernels import recurrent

    for s in DELTA + [(16, 32, 128, 128)]:
        assert delta_case(s, torch.bfloat16, "cuda") <= 1.0
    for s in SSD + [(64, 8, 64, 128)]:
        assert ssd_case(s, torch.bfloat16, "cuda") <= 1.0
    for s in CONV + [(8192, 4)]:
        assert conv_case(s, torch.bfloat16, True, "cuda") <= 1.0
    assert gd.fused_steps(torch.zeros(1, device="cuda")) is recurrent
