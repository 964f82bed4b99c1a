"""The integer (Q8 activation) prefill kernels for int4, MXFP4 and int8 (native_prefill_int.c through quant/prefill.py):
within `bound_q8` of F.linear(x, weight()) in fp64 at T = 1, 5, 17, 64 on odd row counts and inputs that are not a
multiple of the row group, on the AVX-512 (where the CPU has it), AVX2 and scalar builds; within fp32 rounding of the
product over `round_x8(x)` (so the error is x's rounding alone; blocks too small for fp32's 127 / m), and exact to fp32
sums when x is on the int8 grid; every build the same bits; the same bits at 1, 2, 3 threads and in any batch;
non-finite and zero blocks; the dispatch (bf16/fp16 x takes it, fp32 x and MOECHAT_PREFILL_INT=0 the decoded tile, int4
groups of 16 the decoded tile)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moechat.engine.quant import get_format, mxfp4, native, prefill

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the decode-then-GEMM path runs")

AVX2_FLAGS = ("-O3", "-march=x86-64-v3", "-shared", "-fPIC", "-fno-math-errno")  # AVX2 + FMA + F16C, no AVX-512


def _has_avx2() -> bool:
    try:
        return " avx2 " in f" {Path('/proc/cpuinfo').read_text()} ".replace("\n", " ")
    except OSError:
        return False


@pytest.fixture(scope="module")
def avx2_lib():
    """The kernels as an AVX2-only x86-64 CPU builds them (vpmaddubsw), cached on disk like the default build."""
    if not _has_avx2():
        pytest.skip("this CPU has no AVX2")
    lib = native.build_and_load(AVX2_FLAGS)
    assert prefill.integer_isa(lib) == "AVX2"
    return lib


@pytest.fixture(params=["lib", "avx2_lib", "scalar_lib"])
def build(request):
    return request.getfixturevalue(request.param)


def _w(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) / cols**0.5


def _x(T: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, cols, generator=g) * torch.rand(T, 1, generator=g) * 4  # rows of different magnitudes


def _packed(name: str, rows: int, cols: int, seed: int):
    """(weight() fp32, the integer kernel's call x -> y fp32) for one projection."""
    w = _w(rows, cols, seed)
    if name == "mxfp4":
        b, s = mxfp4.quantize(w)
        return mxfp4.dequantize_reference(b, s), lambda lib, x: prefill.mxfp4_q8(lib, x, b, s)
    if name == "int8":
        t = get_format("int8").quantize(w)
        t["q"][0, :3] = torch.tensor([-128, 127, -127], dtype=torch.int8)  # the extremes, -128 included
        return (t["q"].float() * t["scale"][:, None],
                lambda lib, x: prefill.int8_q8(lib, x, t["q"], t["scale"]))
    fmt = get_format("int4")
    t = fmt.quantize(w)
    return (fmt.weight({"w2_q": t["q"], "w2_scale": t["scale"]}, "w2", torch.float32),
            lambda lib, x: prefill.int4_q8(lib, x, t["q"], t["scale"]))


SHAPES = [(37, 96), (16, 64), (9, 32), (23, 480)]  # rows: odd, one AVX-512 group, under one; 15 blocks


@pytest.mark.parametrize("T", [1, 5, 17, 64])
@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("name", ["int4", "mxfp4", "int8"])
def test_within_the_bound_of_the_reference(build, name, rows, cols, T):
    w, run = _packed(name, rows, cols, rows * cols + T)
    x = _x(T, cols, T)
    x[-1, :32] *= 1e-36  # a block under 2^-100: rounded in fp64 (127 / m would overflow fp32)
    got = run(build, x).double()
    err = (got - F.linear(x.double(), w.double())).abs()
    assert bool((err <= prefill.bound_q8(x, w)).all())
    # x's rounding alone: against the product over the rounded x, only the fp32 sums' rounding is left
    G = cols // 32
    near = F.linear(prefill.round_x8(x), w.double())
    assert bool(((got - near).abs() <= (G + 1) * 2.0**-24 * (prefill.round_x8(x).abs() @ w.double().abs().t())
                 + 2.0**-126 * G).all())


@settings(max_examples=30, deadline=2000, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["int4", "mxfp4", "int8"]), rows=st.integers(1, 40), blocks=st.integers(1, 20),
       T=st.integers(1, 20), seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 300.0]))
def test_any_shape_within_the_bound_and_as_the_scalar_build(lib, scalar_lib, name, rows, blocks, T, seed, scale):
    w, run = _packed(name, rows, 32 * blocks, seed)
    x = _x(T, 32 * blocks, seed) * scale
    got = run(lib, x)
    assert torch.equal(got, run(scalar_lib, x))
    assert bool(((got.double() - F.linear(x.double(), w.double())).abs() <= prefill.bound_q8(x, w)).all())


@pytest.mark.parametrize("name", ["int4", "mxfp4", "int8"])
def test_exact_sums_when_x_is_on_the_int8_grid(lib, name):
    """x = q 2^-3 with q in -127..127 and each block holding a +-127: the rounding is the identity, so the kernel is
    the fp64 product up to fp32 sums (far tighter than bound_q8)."""
    w, run = _packed(name, 29, 256, 5)
    g = torch.Generator().manual_seed(9)
    q = torch.randint(-127, 128, (11, 256), generator=g).float()
    q[:, ::32] = 127 * torch.sign(torch.randn(11, 8, generator=g))  # every block's max |q| = 127
    x = q / 8
    assert torch.equal(prefill.round_x8(x), x.double())
    got = run(lib, x).double()
    want = F.linear(x.double(), w.double())
    assert bool(((got - want).abs() <= 9 * 2.0**-24 * (x.double().abs() @ w.double().abs().t())).all())


@pytest.mark.parametrize("name", ["int4", "mxfp4", "int8"])
def test_every_build_writes_the_same_bits(lib, scalar_lib, avx2_lib, name):
    w, run = _packed(name, 45, 320, 3)
    x = _x(13, 320, 4)
    want = run(scalar_lib, x)
    assert torch.equal(run(lib, x), want)
    assert torch.equal(run(avx2_lib, x), want)


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["int4", "mxfp4", "int8"])
def test_same_bits_at_any_thread_count_and_in_any_batch(lib, torch_threads, name):
    _, run = _packed(name, 517, 512, 7)  # 517 rows: a ragged last row group; 64 tokens: work for 3 threads
    x = _x(64, 512, 2)
    outs = []
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        outs.append(run(lib, x))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    torch.set_num_threads(1)
    alone = torch.cat([run(lib, x[i : i + 1].repeat(3, 1))[:1] for i in range(0, 64, 9)])  # each in a batch of 3
    assert torch.equal(alone, outs[0][0:64:9])


@pytest.mark.parametrize("name", ["int4", "mxfp4", "int8"])
def test_zero_and_non_finite_blocks(any_lib, name):
    w, run = _packed(name, 20, 64, 1)
    x = _x(4, 64, 1)
    x[1] = 0.0
    x[2, 40] = float("inf")
    x[3, 3] = float("nan")
    y = run(any_lib, x)
    assert torch.equal(y[1], torch.zeros(20))
    assert bool(y[2:].isnan().all())
    assert bool(y[0].isfinite().all())


def _tensors(name: str, rows: int, cols: int):
    w = _w(rows, cols, 11)
    if name == "mxfp4":
        b, s = mxfp4.quantize(w)
        return get_format("mxfp4"), {"w13_blocks": b, "w13_scales": s}
    fmt = get_format(name)
    return fmt, {f"w13_{k}": v for k, v in fmt.quantize(w).items()}


@pytest.mark.parametrize("name", ["int4", "mxfp4", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_many_token_linear_takes_it_for_bf16_and_fp16_only(lib, name, dtype, monkeypatch):
    fmt, t = _tensors(name, 40, 96)
    t["w13_bias"] = torch.randn(40)
    x = _x(6, 96, 3).to(dtype)
    fn = f"{name}_q8"
    calls = []
    real = getattr(prefill, fn)
    monkeypatch.setattr(prefill, fn, lambda *a, **k: calls.append(1) or real(*a, **k))
    got = fmt.linear(x, t, "w13")
    assert got.dtype == dtype
    assert bool(calls) == (dtype != torch.float32)
    if dtype != torch.float32:
        assert torch.equal(got, (real(lib, x, *list(t.values())[:2]) + t["w13_bias"]).to(dtype))  # bias, rounded once
    calls.clear()
    monkeypatch.setenv(prefill.INT_ENV, "0")  # the A/B switch: the decoded tile, fp32 sums over the same x
    w = fmt.weight(t, "w13", torch.float32)
    off = fmt.linear(x, t, "w13")
    assert not calls
    ref = F.linear(x.float(), w, t["w13_bias"])
    if name == "int8":  # torch's int8 GEMM (the row scale in bf16, quant/torch_paths.py), tested there
        assert float((off.float() - ref).abs().max()) <= 2.0**-5 * float(ref.abs().max())
        return
    assert bool(((off.float() - ref).abs()
                 <= prefill.bound(x.float(), w) + (off.float().abs() * 2.0**-7 if dtype != torch.float32 else 0)).all())


def test_int4_groups_of_16_keep_the_decoded_tile(lib, monkeypatch):
    fmt = get_format("int4")
    t = {f"w2_{k}": v for k, v in fmt.quantize(_w(24, 48, 2)).items()}  # 48 inputs: groups of 16
    assert t["w2_scale"].shape[1] == 3
    calls = []
    monkeypatch.setattr(prefill, "int4_q8", lambda *a, **k: calls.append(1))
    x = _x(5, 48, 1).to(torch.bfloat16)
    y = prefill.int4(lib, x, t["w2_q"], t["w2_scale"])
    assert not calls
    w = fmt.weight(t, "w2", torch.float32)
    assert bool(((y - F.linear(x.float(), w)).abs() <= prefill.bound(x.float(), w)).all())


def test_bad_shapes_are_refused(lib):
    t = get_format("int4").quantize(_w(8, 48, 1))  # groups of 16
    with pytest.raises(ValueError):
        prefill.int4_q8(lib, _x(3, 48, 0), t["q"], t["scale"])
    t8 = get_format("int8").quantize(_w(8, 48, 1))
    with pytest.raises(ValueError):  # an input that is not a multiple of 32
        prefill.int8_q8(lib, _x(3, 48, 0), t8["q"], t8["scale"])
    assert not prefill.int8_integer(_x(3, 48, 0).bfloat16(), t8["q"], lib)  # so the linear keeps torch's path
    with pytest.raises(RuntimeError):  # an input that is not a multiple of 32
        prefill._call(lib, lib.moechat_prefill_q8_mxfp4, "mxfp4 integer", 0, 1, 0, 0, 8, 48, 0, 8)


def test_the_avx_vnni_variant_compiles(tmp_path):
    """The ymm vpdpbusd build (Intel Alder Lake+, Zen 5) is not run on a CPU without AVX-VNNI; it must compile."""
    src = Path(native.__file__).with_name("native_prefill_int.c")
    cc = shutil.which("cc")
    out = subprocess.run([cc, "-O3", "-march=x86-64-v3", "-mavxvnni", "-fPIC", "-c", "-o", str(tmp_path / "v.o"),
                          str(src)], capture_output=True, text=True, timeout=120)
    if out.returncode and "avxvnni" in out.stderr:
        pytest.skip(f"this compiler has no -mavxvnni ({out.stderr.strip()[:80]})")
    assert out.returncode == 0, out.stderr
