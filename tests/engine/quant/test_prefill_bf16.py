"""The bf16 many-token kernel (native_prefill_bf16.c through quant/prefill.py `bf16`): within `bound` of F.linear in
fp64 at odd shapes (rows not a multiple of its 4-row tile, token counts around its 6-token tile), the same bits at
1, 2, 3 threads and in any batch, NaN and infinity carried, the dispatch (bf16 experts' few-token products in a CPU
prefill take it, one token the bf16 GEMV, MOECHAT_PREFILL_KERNEL=0 torch's GEMM) and an engine's bf16 prefill the
same tokens through it as through torch's GEMM. Those skip where this machine takes neither of its kernels (AVX-512
BF16; the fp32 tiles where torch has no fast bf16 GEMM); the fp32 tiles are also built for AVX2 and checked on any
x86-64 CPU that runs AVX2, and a prompt's attention projections take them where torch's bf16 GEMM is slow."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from moechat.engine.quant import native, prefill

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(scope="module")
def bf16_lib(lib):
    if not prefill.has_bf16(lib):
        pytest.skip("this machine takes neither bf16 kernel (AVX-512 BF16; the fp32 tiles where torch's bf16 GEMM is "
                    "slow): torch's GEMM runs")
    return lib


def _xw(T: int, rows: int, cols: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, cols, generator=g) * torch.rand(T, 1, generator=g) * 3).bfloat16()
    w = (torch.randn(rows, cols, generator=g) / cols**0.5).bfloat16()
    return x, w


@pytest.mark.parametrize("T", [2, 5, 6, 7, 13])
@pytest.mark.parametrize("rows,cols", [(37, 64), (4, 32), (3, 96), (130, 2048)])
def test_within_the_bound_of_the_reference(bf16_lib, T, rows, cols):
    x, w = _xw(T, rows, cols, T * rows + cols)
    got = prefill.bf16(bf16_lib, x, w)
    assert got.dtype == torch.float32 and got.shape == (T, rows)
    err = (got.double() - F.linear(x.double(), w.double())).abs()
    assert bool((err <= prefill.bound(x.float(), w.float())).all())


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_same_bits_at_any_thread_count_and_in_any_batch(bf16_lib, torch_threads):
    x, w = _xw(40, 517, 512, 1)  # a ragged last row tile; enough rows for 3 threads
    outs = []
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        outs.append(prefill.bf16(bf16_lib, x, w))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    torch.set_num_threads(1)
    for t in (0, 7, 39):
        assert torch.equal(prefill.bf16(bf16_lib, x[t : t + 1].repeat(4, 1), w)[0], outs[0][t])


def test_non_finite_x_is_carried(bf16_lib):
    x, w = _xw(4, 9, 64, 2)
    x[1, 5] = float("nan")
    x[2, 40] = float("inf")
    y = prefill.bf16(bf16_lib, x, w)
    assert bool(y[1].isnan().all()) and not bool(y[2].isfinite().all())
    assert bool(y[0].isfinite().all()) and bool(y[3].isfinite().all())


def test_bad_shapes_are_refused(bf16_lib):
    x, w = _xw(3, 8, 48, 3)
    assert not prefill.bf16_path(x, w, bf16_lib)  # an input that is not a multiple of 32
    with pytest.raises(ValueError):
        prefill.bf16(bf16_lib, x, w)
    x, w = _xw(3, 8, 64, 3)
    assert not prefill.bf16_path(x.float(), w, bf16_lib)  # fp32 x: torch's exact GEMM
    assert not prefill.bf16_path(x[:1], w, bf16_lib)  # one token: the GEMV
    assert not prefill.bf16_path(x, w.t().contiguous().t(), bf16_lib)  # a strided weight


def test_the_plain_linear_takes_it(bf16_lib, monkeypatch):
    # quant.dense.bf16_linear: what bf16 experts (the dense format, layers/experts.py's SwiGLU) multiply through
    from moechat.engine.quant.dense import DENSE, bf16_linear

    x, w = _xw(6, 40, 96, 4)
    calls = []
    real = prefill.bf16
    monkeypatch.setattr(prefill, "bf16", lambda *a: calls.append(1) or real(*a))
    got = bf16_linear(x, w)
    assert calls and got.dtype == torch.bfloat16
    assert torch.equal(got, real(bf16_lib, x, w).to(torch.bfloat16))  # rounded once, as F.linear rounds
    calls.clear()
    one = bf16_linear(x[:1], w)  # one token: native.c's GEMV
    assert not calls and torch.equal(one, native.bf16_gemv(bf16_lib, x[:1], w, torch.bfloat16))
    # With a bias: the tiles add it before the one rounding; a lone token keeps F.linear (one rounding too).
    bias = torch.randn(40, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    tensors = {"w13": w, "w13_bias": bias}
    assert torch.equal(DENSE.linear(x, tensors, "w13"), prefill.finish(real(bf16_lib, x, w), x.dtype, bias))
    assert torch.equal(DENSE.linear(x[:1], tensors, "w13"), F.linear(x[:1], w, bias))
    calls.clear()
    monkeypatch.setenv(prefill.ENV, "0")  # the A/B switch: torch's GEMM
    off = bf16_linear(x, w)
    assert not calls and torch.equal(off, F.linear(x, w))


def test_a_bf16_engine_prefills_the_same_tokens_through_it(tiny_models, monkeypatch, bf16_lib):
    """A tiny qwen3_moe (hidden 64) in bf16 on the CPU: the prompt's experts take the kernel, and the greedy tokens
    equal those through torch's GEMM (fp32 sums in another order, the same tokens on this prompt)."""
    from moechat.engine.runtime.generate import Engine
    from moechat.engine.runtime.sampling import SamplingParams

    path, _ = tiny_models["qwen3_moe"]
    greedy = SamplingParams(temperature=0.0, do_sample=False)
    prompt = list(range(3, 40))
    calls = []
    real = prefill.bf16
    monkeypatch.setattr(prefill, "bf16", lambda *a: calls.append(1) or real(*a))

    def run():
        eng = Engine.load(path, dtype="bfloat16")
        try:
            chunks = eng.generate(prompt, sampling=greedy, max_tokens=6, stop_on_eos=False)
            return [t for c in chunks for t in c.token_ids]
        finally:
            eng.close()

    with_kernel = run()
    assert calls
    monkeypatch.setenv(prefill.ENV, "0")
    calls.clear()
    assert run() == with_kernel
    assert not calls


_SERIAL_POOL = """#include <stdint.h>
int moechat_parallel_for(int (*fn)(void *, int64_t, int64_t), void *ctx, int64_t units, int64_t align,
                         int64_t bytes) { (void)bytes; int64_t h = units / 2 / align * align;
                         int rc = fn(ctx, h, units); return rc ? rc : fn(ctx, 0, h); }
"""


@pytest.fixture(scope="module")
def avx2_tiles(tmp_path_factory):
    """native_prefill_bf16.c built for AVX2 (x86-64-v3: its fp32 tiles, whatever this CPU's own build takes), beside a
    pool that runs a call's rows as two shares, the second half first."""
    import ctypes
    import subprocess

    if "avx2" not in native._cpu_flags().split() or "fma" not in native._cpu_flags().split():
        pytest.skip("an AVX2 build does not run on this CPU")
    d = tmp_path_factory.mktemp("bf16_tiles")
    (d / "pool.c").write_text(_SERIAL_POOL)
    so = d / "tiles.so"
    subprocess.run(["cc", "-O2", "-march=x86-64-v3", "-shared", "-fPIC", "-fno-math-errno", "-o", str(so),
                    str(native.SOURCE.with_name("native_prefill_bf16.c")), str(d / "pool.c")], check=True,
                   capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(so))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.moechat_prefill_bf16.argtypes = [p, i64, p, i64, i64, p, i64]
    lib.moechat_prefill_bf16.restype = ctypes.c_int
    assert lib.moechat_prefill_bf16_isa() == 2
    return lib


def _tiles(lib, x, w):
    y = torch.full((x.shape[0], w.shape[0]), float("nan"))
    assert lib.moechat_prefill_bf16(x.data_ptr(), x.shape[0], w.data_ptr(), w.shape[0], w.shape[1], y.data_ptr(),
                                    y.stride(0)) == 0
    return y


@pytest.mark.parametrize("T", [2, 3, 4, 7, 13])
@pytest.mark.parametrize("rows,cols", [(37, 64), (4, 32), (3, 96), (131, 2048)])
def test_the_fp32_tiles_are_within_the_bound_and_batch_free(avx2_tiles, T, rows, cols):
    """The AVX2 tiles (3 rows x 4 tokens): within `bound` of the fp64 product at rows and tokens off the tile, every
    output written, and each token's row the same bits alone as in the batch (the order is a function of (t, r))."""
    x, w = _xw(T, rows, cols, T * rows + cols + 1)
    got = _tiles(avx2_tiles, x, w)
    err = (got.double() - F.linear(x.double(), w.double())).abs()
    assert (err <= prefill.bound(x, w).double()).all()
    for t in (0, T - 1):
        assert torch.equal(_tiles(avx2_tiles, x[t : t + 1], w)[0], got[t])
    assert avx2_tiles.moechat_prefill_bf16(x.data_ptr(), T, w.data_ptr(), rows, 33, got.data_ptr(), rows) == -1


def test_a_prompts_attention_projection_takes_the_tiles_where_torchs_bf16_gemm_is_slow(lib, monkeypatch):
    """quant/cpu.py split_addmm: with prefill.slow_torch_bf16() the bf16 x of a prompt goes through the kernel, the
    bias or residual added to the fp32 sums and rounded once; otherwise torch's addmm (the split halves)."""
    from moechat.engine.quant import cpu

    if lib.moechat_prefill_bf16_isa() == 0:
        pytest.skip("this build has no bf16 kernel")
    x, w = _xw(20, 1024, 64, 9)
    w_t = w.t()  # [in, out], a view, as the attention keeps it
    residual = torch.randn(20, 1024, generator=torch.Generator().manual_seed(1)).bfloat16()
    calls = []
    real = prefill.bf16
    monkeypatch.setattr(prefill, "bf16", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(prefill, "slow_torch_bf16", lambda: True)
    got = cpu.split_addmm(x, w_t, residual)
    assert calls and torch.equal(got, (real(lib, x, w) + residual.float()).to(torch.bfloat16))
    calls.clear()
    monkeypatch.setattr(prefill, "slow_torch_bf16", lambda: False)
    cpu.split_addmm(x, w_t, residual)
    assert not calls


def test_the_tiles_switch_and_where_they_apply(lib, monkeypatch):
    """The fp32 tiles are taken only where torch's bf16 GEMM is the slow fallback (an x86 CPU without AVX-512
    BW/VL/DQ), and MOECHAT_BF16_TILES=0 turns them off there (the bench's A/B); AVX-512 BF16's kernel is not
    affected."""
    import platform

    flags = set(native._cpu_flags().split())
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    assert prefill.slow_torch_bf16() == (x86 and not {"avx512bw", "avx512vl", "avx512dq"} <= flags)
    isa = lib.moechat_prefill_bf16_isa()
    monkeypatch.setattr(prefill, "slow_torch_bf16", lambda: True)
    assert prefill.has_bf16(lib) == (isa != 0)
    monkeypatch.setenv(prefill.TILES_ENV, "0")
    assert prefill.has_bf16(lib) == (isa == 1)
    monkeypatch.delenv(prefill.TILES_ENV)
    monkeypatch.setattr(prefill, "slow_torch_bf16", lambda: False)
    assert prefill.has_bf16(lib) == (isa == 1)
