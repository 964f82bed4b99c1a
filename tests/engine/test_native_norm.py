"""native_norm.c's RMSNorm (a decode step's rows) against the torch ops models/base.py runs for more rows: the same
order of operations (transformers'; GPT-OSS's fp32 weight before the cast), sums in double in a fixed order."""

from __future__ import annotations

import pytest
import torch

from moechat.engine.models import base
from moechat.engine.quant import native


def _torch(x, weight, eps, fp32_weight=False):
    xf = x.float()
    t = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if fp32_weight:
        return (weight * t).to(x.dtype)
    y = t.to(x.dtype)
    return y if weight is None else weight * y


def _close(got, want):
    """bf16: equal but for rare one-step flips (the variance may differ by an ulp: torch sums in fp32); fp32: within
    a few ulps."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.bfloat16:
        differ = got != want
        assert differ.float().mean() <= 0.01
        step = want.float().abs() * 2.0**-7
        assert ((got.float() - want.float()).abs() <= step)[differ].all()
    else:
        torch.testing.assert_close(got, want, atol=0, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2048), (1, 2880), (1, 7), (32, 128), (4, 64, 128)])
@pytest.mark.parametrize("weighted", [True, False])
def test_matches_the_torch_ops(lib, dtype, shape, weighted):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 4).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype) if weighted else None
    _close(base.rms_norm(x, w, 1e-6), _torch(x, w, 1e-6))


@pytest.mark.parametrize("shape", [(1, 2880), (3, 64)])
def test_gpt_oss_order_with_an_fp32_weight(lib, shape):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(*shape, generator=g) * 4).to(torch.bfloat16)
    w = torch.randn(shape[-1], generator=g)
    _close(base.rms_norm_fp32_weight(x, w, 1e-5), _torch(x, w, 1e-5, fp32_weight=True))


def test_rows_do_not_depend_on_each_other(lib):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(128, generator=g).to(torch.bfloat16)
    whole = native.rms_norm(lib, x, w, 1e-6, native.NORM_AFTER)
    rows = torch.cat([native.rms_norm(lib, x[i:i + 1].contiguous(), w, 1e-6, native.NORM_AFTER) for i in range(16)])
    assert torch.equal(whole, rows)


def test_non_finite_and_zero_rows(lib):
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    x[1, 5] = float("inf")
    x[2, 7] = float("nan")
    w = torch.ones(64, dtype=torch.bfloat16)
    got = base.rms_norm(x, w, 1e-6)
    want = _torch(x, w, 1e-6)
    assert torch.equal(got[0], want[0]) and (got[0] == 0).all()  # eps keeps a zero row zero
    assert torch.equal(got.isnan(), want.isnan())


def test_what_it_does_not_take_goes_to_torch(lib, monkeypatch):
    calls = []
    monkeypatch.setattr(native, "rms_norm", lambda *a: calls.append(1))
    x = torch.randn(1, 64).to(torch.bfloat16)
    base.rms_norm(x.float(), torch.ones(64, dtype=torch.bfloat16), 1e-6)  # a weight of another dtype
    base.rms_norm(torch.randn(200, 128), None, 1e-6)  # a prompt's rows
    base.rms_norm(torch.randn(2, 64).t(), None, 1e-6)  # not contiguous
    base.rms_norm(x.half(), None, 1e-6)  # fp16
    assert calls == []
    base.rms_norm(x, None, 1e-6)
    assert calls == [1]
