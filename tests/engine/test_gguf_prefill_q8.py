"""GGUF Q8_0, Q4_0, MXFP4, Q4_K, Q5_K and Q6_K rows through the integer prefill kernel as the file stores them
(native_prefill_int.c `moechat_prefill_q8_gguf`, quant/gguf.py `prefill_q8`): within quant/prefill.py's `bound_q8` of
x @ W^T with W the gguf package's own dequantization, on odd row counts (a ragged last row group); the scalar, AVX2
and this machine's builds write the same bits; the same bits at 1, 2 and 3 threads and whatever other tokens share
the batch; what `gguf_linear` takes for many bf16 / fp16 tokens, while fp32 tokens, MOECHAT_PREFILL_INT=0 and
MOECHAT_GGUF_PREFILL=0 keep the fp32 paths; shapes it does not take are refused."""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants  # noqa: E402

from moechat.engine.quant import native, prefill  # noqa: E402
from moechat.engine.quant.gguf import PREFILL_ENV, TYPES, gguf_linear, prefill_q8  # noqa: E402
from moechat.engine.quant.gguf import prefill as fp32_prefill  # noqa: E402
from tests.engine.quant.test_prefill_int import avx2_lib  # noqa: E402, F401 - a fixture
from tests.engine.test_gguf_quant import random_blocks  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the fp32 paths run")
NAMES = ["Q8_0", "Q4_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K"]
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # super-blocks of 256


def _c(name: str, cols: int) -> int:
    """A width for the type: a k-quant's rows are super-blocks of 256 (8 blocks of 32 a step of cols)."""
    return cols * 8 if name in K_QUANTS else cols


def _call(lib, name: str, x: torch.Tensor, raw: torch.Tensor, cols: int) -> torch.Tensor:
    fn = lib.moechat_prefill_q8_gguf
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ctypes.c_int, p, i64, p, i64, i64, i64, p, i64]
    fn.restype = ctypes.c_int
    xf = x.float().contiguous()
    y = torch.empty(x.shape[0], raw.shape[0])
    assert fn(TYPES[name].id, xf.data_ptr(), x.shape[0], raw.data_ptr(), raw.shape[0], cols, raw.shape[1],
              y.data_ptr(), raw.shape[0]) == 0
    return y


def _w(name: str, raw: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw.numpy(), Q[name]).astype(np.float32))


def _x(T: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, cols, generator=g) * torch.rand(T, 1, generator=g) * 4).bfloat16()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rows,cols,T", [(37, 96, 2), (16, 64, 5), (23, 480, 17), (9, 256, 64)])
def test_within_the_bound_of_the_package_dequantization(lib, name, rows, cols, T):
    cols = _c(name, cols)
    raw = torch.from_numpy(random_blocks(name, rows, cols, seed=rows + T))
    w, x = _w(name, raw), _x(T, cols, seed=cols)
    got = prefill_q8(x, raw, TYPES[name], cols)
    assert got is not None and torch.equal(got, _call(lib, name, x, raw, cols))
    err = (got.double() - x.double() @ w.double().t()).abs()
    ratio = err / prefill.bound_q8(x.float(), w)
    assert bool((ratio <= 1).all()), float(ratio.max())
    assert float(ratio.max()) > 1e-3  # x's rounding shows: this is the integer path, not the fp32 one


@pytest.mark.parametrize("name", NAMES)
def test_every_build_writes_the_same_bits(lib, scalar_lib, avx2_lib, name):  # noqa: F811 - the fixture
    cols = _c(name, 320)
    raw = torch.from_numpy(random_blocks(name, 45, cols, seed=3))
    x = _x(13, cols, 4)
    want = _call(scalar_lib, name, x, raw, cols)
    assert torch.equal(_call(lib, name, x, raw, cols), want)
    assert torch.equal(_call(avx2_lib, name, x, raw, cols), want)


@pytest.mark.parametrize("name", NAMES)
def test_same_bits_at_any_thread_count_and_in_any_batch(lib, name):
    cols = 512 if name not in K_QUANTS else 1024
    raw = torch.from_numpy(random_blocks(name, 517, cols, seed=7))
    x = _x(64, cols, 2)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(_call(lib, name, x, raw, cols))
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        torch.set_num_threads(1)
        alone = torch.cat([_call(lib, name, x[i : i + 1].repeat(2, 1), raw, cols)[:1] for i in range(0, 64, 9)])
        assert torch.equal(alone, outs[0][0:64:9])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", NAMES)
def test_gguf_linear_takes_it_for_bf16_tokens_only(monkeypatch, name):
    for env in (PREFILL_ENV, prefill.INT_ENV):
        monkeypatch.delenv(env, raising=False)
    c = _c(name, 128)
    raw = torch.from_numpy(random_blocks(name, 40, c, seed=5))
    x = _x(6, c, 6)
    t = TYPES[name]
    assert torch.equal(gguf_linear(x, raw, t, c), prefill_q8(x, raw, t, c).bfloat16())
    assert torch.equal(gguf_linear(x.float(), raw, t, c), fp32_prefill(x.float(), raw, t, c))  # fp32: exact
    assert prefill_q8(x.float(), raw, t, c) is None and prefill_q8(x[:1], raw, t, c) is None
    monkeypatch.setenv(prefill.INT_ENV, "0")
    assert prefill_q8(x, raw, t, c) is None
    assert torch.equal(gguf_linear(x, raw, t, c), fp32_prefill(x, raw, t, c).bfloat16())
    monkeypatch.delenv(prefill.INT_ENV)
    monkeypatch.setenv(PREFILL_ENV, "0")
    assert prefill_q8(x, raw, t, c) is None


def test_shapes_it_does_not_take_are_refused(lib):
    raw = torch.from_numpy(random_blocks("Q8_0", 4, 64, seed=1))
    x = torch.randn(3, 64)
    y = torch.empty(3, 4)
    fn = lib.moechat_prefill_q8_gguf
    _call(lib, "Q8_0", x, raw, 64)  # typed
    assert fn(10, x.data_ptr(), 3, raw.data_ptr(), 4, 256, 84, y.data_ptr(), 4) == -1  # Q2_K: not this kernel's
    assert fn(12, x.data_ptr(), 3, raw.data_ptr(), 4, 64, 36, y.data_ptr(), 4) == -1  # Q4_K: not whole super-blocks
    assert fn(14, x.data_ptr(), 3, raw.data_ptr(), 4, 64, 68, y.data_ptr(), 4) == -1  # Q6_K: not whole super-blocks
    assert fn(8, x.data_ptr(), 3, raw.data_ptr(), 4, 64, 67, y.data_ptr(), 4) == -1  # a row of the wrong size
    assert fn(8, x.data_ptr(), 3, raw.data_ptr(), 4, 48, 51, y.data_ptr(), 4) == -1  # not whole blocks
    assert prefill_q8(x.bfloat16(), raw[:, :60].contiguous(), TYPES["Q8_0"], 64) is None
    assert prefill_q8(x.bfloat16(), raw, TYPES["Q2_K"], 64) is None
    assert native.library() is not None
