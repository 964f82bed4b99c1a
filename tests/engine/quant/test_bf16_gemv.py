"""native.c's bf16 GEMV (one bf16 token through a bf16 model's dense projections and LM head on a CPU) against the
fp32 product of the same bf16 values: fp32 sums in a fixed order, so any thread count gives the same bits."""

from __future__ import annotations

import pytest
import torch

from moechat.engine.layers.kv_cache import KVCache
from moechat.engine.quant import native
from moechat.engine.runtime.generate import Engine


@pytest.fixture(scope="module")
def lib():
    lib = native.library()
    if lib is None:
        pytest.skip(f"no native kernels here ({native.status()})")
    return lib


@pytest.mark.parametrize("cols", [32, 40, 2048, 7])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_against_the_fp32_product(lib, cols, x_dtype):
    g = torch.Generator().manual_seed(cols)
    w = torch.randn(97, cols, generator=g).to(torch.bfloat16)  # [out, in]; 97 rows: not a multiple of the split
    x = torch.randn(1, cols, generator=g).to(x_dtype)
    want = x.float() @ w.float().T  # [1, out]
    bound = 1e-5 * (x.float().abs() @ w.float().abs().T) + 1e-7
    got = native.bf16_gemv(lib, x, w)
    assert got.dtype == torch.float32 and ((got - want).abs() <= bound).all()
    rounded = native.bf16_gemv(lib, x, w, torch.bfloat16)
    assert torch.equal(rounded, got.to(torch.bfloat16))  # bf16 output: the fp32 result rounded once


def test_the_same_bits_at_any_thread_count(lib):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4099, 512, generator=g).to(torch.bfloat16)  # > 256 KB: the rows are split over the pool
    x = torch.randn(1, 512, generator=g).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(native.bf16_gemv(lib, x, w))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_refuses_what_it_cannot_read(lib):
    with pytest.raises(ValueError, match="contiguous bf16"):
        native.bf16_gemv(lib, torch.randn(1, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="contiguous bf16"):
        native.bf16_gemv(lib, torch.randn(1, 8), torch.randn(8, 4).to(torch.bfloat16).t())


def test_a_bf16_model_decodes_through_it_and_stays_close_to_torch(lib, tiny_models, monkeypatch):
    """One decode step of a bf16 model: the native GEMV's logits (fp32, no bf16 rounding) within bf16's error of
    torch's path (MOECHAT_NATIVE=0)."""
    path, _ = tiny_models["qwen3_moe"]

    def step_logits():
        engine = Engine.load(path, dtype="bfloat16")
        kv = KVCache.for_model(engine.args, 8, engine.loaded.dtype, engine.loaded.device)
        with torch.inference_mode():
            engine.model(torch.tensor([3, 4, 5]), kv, engine.provider)
            hidden = engine.model(torch.tensor([6]), kv, engine.provider)  # one token: the GEMV paths
            return engine.model.logits(hidden)

    native.reset()
    got = step_logits()
    monkeypatch.setenv(native.ENV, "0")
    native.reset()
    want = step_logits()
    native.reset()
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got - want).abs().max() <= 0.02 * want.abs().max() + 1e-3


@pytest.fixture(scope="module")
def pair_builds(tmp_path_factory):
    """native.c built for AVX2 (x86-64-v3) with the two-row loop on and off (BF16_PAIRS), and for scalar C."""
    import ctypes
    import shutil
    import subprocess

    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    if "avx2" not in native._cpu_flags().split():
        pytest.skip("an AVX2 build does not run on this CPU")
    d = tmp_path_factory.mktemp("bf16_builds")
    out = {}
    for name, flags in (("pairs", ["-march=x86-64-v3", "-DBF16_PAIRS=1"]),
                        ("rows", ["-march=x86-64-v3", "-DBF16_PAIRS=0"]), ("scalar", ["-DMOECHAT_SCALAR"])):
        so = d / f"{name}.so"
        subprocess.run([cc, "-O2", *flags, "-shared", "-fPIC", "-fno-math-errno", "-o", str(so), str(native.SOURCE),
                        "-lm", "-lpthread"], check=True, capture_output=True, timeout=120)
        fn = ctypes.CDLL(str(so)).moechat_bf16_gemv
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        out[name] = fn
    return out


@pytest.mark.parametrize("rows,cols", [(1, 64), (2, 40), (3, 2048), (97, 7), (98, 96), (4099, 512)])
def test_two_rows_a_step_write_each_rows_bits(pair_builds, rows, cols):
    """The two-row loop keeps each row's one-row sums (the same four accumulators over the same elements), so it
    writes the one-row loop's bits at odd and even row counts, with and without a tail of columns; the scalar build
    sums in another order and stays within fp32 rounding of both."""
    g = torch.Generator().manual_seed(rows * 7 + cols)
    w = torch.randn(rows, cols, generator=g).to(torch.bfloat16)  # [out, in]
    x = torch.randn(1, cols, generator=g).to(torch.bfloat16)
    got = {}
    for name, fn in pair_builds.items():
        y = torch.empty(1, rows)
        assert fn(x.data_ptr(), 1, w.data_ptr(), rows, cols, y.data_ptr()) == 0
        got[name] = y
    assert torch.equal(got["pairs"], got["rows"])
    want = x.float() @ w.float().T
    bound = 1e-5 * (x.float().abs() @ w.float().abs().T) + 1e-7
    assert ((got["pairs"] - want).abs() <= bound).all() and ((got["scalar"] - want).abs() <= bound).all()
