"""native_gguf.c's one-token integer dots (x rounded to Q8 blocks once per call, as llama.cpp's vec_dot): equal to
their slow obvious emulation (quantize_x, then fp64), within the stated bound of the fp32 reference (the gguf
package's dequantization, then the dot), the same bits for 1, 2 and 3 threads, and what GGUFFormat.linear uses for
one token."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants  # noqa: E402

from moechat.engine.quant import native  # noqa: E402
from moechat.engine.quant.gguf import (  # noqa: E402
    TYPES,
    VECDOT_ENV,
    VECDOT_TYPES,
    GGUFFormat,
    gguf_linear,
    vecdot,
    vecdot_bound,
    vecdot_reference,
)
from tests.engine.test_gguf_quant import random_blocks  # noqa: E402

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no native kernels here ({native.status()})")
KINDS = sorted(VECDOT_TYPES)


def _case(name: str, rows: int, cols: int, seed: int, scale: float = 1.0):
    raw = torch.from_numpy(random_blocks(name, rows, cols, seed=seed))  # [rows, row_bytes]
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(seed + 100)) * scale  # [1, cols]
    return raw, x


def _fp32_reference(name: str, raw: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The independent check: the gguf package's numpy decoder, then the dot in fp64."""
    w = quants.dequantize(raw.numpy(), Q[name]).astype(np.float64)  # [rows, cols]
    return torch.from_numpy(x.double().numpy() @ w.T)  # [1, rows]


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("rows,cols", [(1, 256), (7, 512), (33, 768)])  # odd row counts
def test_vecdot_is_its_emulation_and_within_the_bound(name, rows, cols):
    """quantize_x's rounding of x, then exact integer sums: the emulation in fp64 to fp32 rounding."""
    raw, x = _case(name, rows, cols, seed=rows)
    t = TYPES[name]
    y = vecdot(x, raw, t, cols)
    assert y is not None and y.shape == (1, rows) and y.dtype == torch.float32
    # the integer sums are exact: only fp32 rounding of the per-block products and their sum remains
    scale = (x.abs().double() @ torch.from_numpy(np.abs(quants.dequantize(raw.numpy(), Q[name]))).double().t())
    torch.testing.assert_close(y.double(), vecdot_reference(x, raw, t, cols), rtol=0, atol=1e-5 * scale.max().item())
    err = (y.double() - _fp32_reference(name, raw, x)).abs()
    bound = vecdot_bound(x, raw, t, cols)
    assert torch.all(err <= bound + 1e-5 * scale), (err / bound).max()
    # the bound is a real constraint: the error is a sizeable part of it somewhere, and far from zero
    assert (err / bound).max() > 0.01


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(KINDS), rows=st.integers(1, 9), blocks=st.integers(1, 3), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-3, 1.0, 50.0]))
def test_vecdot_bound_holds_on_random_valid_blocks(name, rows, blocks, seed, scale):
    t = TYPES[name]
    cols = blocks * 256  # a multiple of every block size
    raw, x = _case(name, rows, cols, seed, scale)
    if seed % 3 == 0:
        x[0, : cols // 2] = 0  # all-zero blocks (scale 0) beside others
    y = vecdot(x, raw, t, cols)
    err = (y.double() - _fp32_reference(name, raw, x)).abs()
    scale_ = x.abs().double() @ torch.from_numpy(np.abs(quants.dequantize(raw.numpy(), Q[name]))).double().t()
    assert torch.all(err <= vecdot_bound(x, raw, t, cols) + 1e-5 * scale_ + 1e-30)


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("rows", [1001, 1003])  # 4k + 1, 4k + 3: the shares' ends cut the AVX-512 loops' row groups
def test_one_two_three_threads_write_the_same_bits(name, rows):
    cols = 2048  # >= 1.1 MB of packed rows for every type: >= 4 shares of 256 KB over the pool
    raw, x = _case(name, rows, cols, seed=5)
    t = TYPES[name]
    lib = native.library()
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            native.pin_threads(lib, n)
            outs.append(vecdot(x, raw, t, cols))
    finally:
        native.pin_threads(lib, None)
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_types_without_the_kernel_and_bad_shapes_take_the_tile_path():
    raw, x = _case("F16", 3, 256, seed=1)
    assert vecdot(x, raw, TYPES["F16"], 256) is None  # the float types: no integer dot
    raw, x = _case("Q4_K", 3, 256, seed=1)
    assert vecdot(torch.cat([x, x]), raw, TYPES["Q4_K"], 256) is None  # two tokens
    assert vecdot(x, raw[:, :144 - 1].contiguous(), TYPES["Q4_K"], 256) is None  # a row of the wrong size
    lib = native.library()
    fn = lib.moechat_gguf_vecdot  # typed by the vecdot calls above
    y = torch.empty(1, 3)
    assert fn(12, x.data_ptr(), raw.data_ptr(), 3, 255, y.data_ptr()) == -1  # not a multiple of the block
    assert fn(1, x.data_ptr(), raw.data_ptr(), 3, 256, y.data_ptr()) == -1  # F16: no kernel
    assert fn(16, x.data_ptr(), raw.data_ptr(), 3, 256, y.data_ptr()) == -1  # IQ2_XXS: a type moechat lacks


def _format_case(types, H=256, inter=512):
    fmt = GGUFFormat(*types)
    tensors = {}
    for i, (part, (shape, _)) in enumerate(fmt.layout(H, inter, torch.float32, bias=True).items()):
        if part.endswith("_bias"):
            tensors[part] = torch.randn(shape, generator=torch.Generator().manual_seed(10 + i))
        else:
            tensors[part] = torch.from_numpy(random_blocks(fmt.types[part].name, shape[0], H if part != "w2" else inter,
                                                           seed=i))
    return fmt, tensors


def _one(x, tensors, fmt, p, cols):
    """A projection's one token as gguf_linear makes it on the integer path: vecdot where the type has it."""
    t = fmt.types[p]
    y = vecdot(x, tensors[p], t, cols)
    y = gguf_linear(x.float(), tensors[p], t, cols) if y is None else y  # [1, rows] fp32
    return (y + tensors[f"{p}_bias"]).to(x.dtype)


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q8_0"), ("Q4_0", "Q5_K", "Q4_1"),
                                   ("Q2_K", "Q3_K", "IQ4_XS"), ("IQ4_NL", "MXFP4", "BF16")])
def test_format_linear_one_bf16_token_uses_the_integer_dots(types, monkeypatch):
    monkeypatch.delenv(VECDOT_ENV, raising=False)
    H, inter = 256, 512
    fmt, tensors = _format_case(types, H, inter)
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = fmt.linear(x, tensors, "w13")  # [1, 2I] bf16
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.cat([_one(x, tensors, fmt, p, H) for p in ("w1", "w3")], dim=-1))
    # within the bound of dequantize + F.linear, plus the bf16 rounding of the result
    ref = F.linear(x.float(), fmt.weight(tensors, "w13", torch.float32), fmt.bias(tensors, "w13"))
    bound = torch.cat([vecdot_bound(x, tensors[p], fmt.types[p], H) if fmt.types[p].name in VECDOT_TYPES
                       else torch.zeros(1, inter, dtype=torch.float64) for p in ("w1", "w3")], dim=-1)
    assert torch.all((got.float() - ref).abs().double() <= bound + ref.abs().double() * 2**-8 + 1e-3)
    h = torch.randn(1, inter, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert torch.equal(fmt.linear(h, tensors, "w2"), _one(h, tensors, fmt, "w2", inter))


def test_fp32_tokens_keep_the_fp32_path_unless_told(monkeypatch):
    """An fp32 run is the reference-accuracy one (fp32 sums of the exact weights: the many-token kernel or the tiles):
    the integer dots only with MOECHAT_GGUF_VECDOT=1, never with 0."""
    fmt, tensors = _format_case(("Q4_K", "Q4_K", "Q6_K"))
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(3))
    tiles = F.linear(x, fmt.weight(tensors, "w13", torch.float32), fmt.bias(tensors, "w13"))
    monkeypatch.delenv(VECDOT_ENV, raising=False)
    torch.testing.assert_close(fmt.linear(x, tensors, "w13"), tiles, rtol=1e-5, atol=1e-4)
    monkeypatch.setenv(VECDOT_ENV, "1")
    fast = fmt.linear(x, tensors, "w13")
    assert torch.equal(fast, torch.cat([_one(x, tensors, fmt, p, 256) for p in ("w1", "w3")], dim=-1))
    assert not torch.allclose(fast, tiles, rtol=1e-5, atol=1e-4)  # int8 x: visibly not the tile path
    monkeypatch.setenv(VECDOT_ENV, "0")
    xb = x.bfloat16()
    want = torch.cat([gguf_linear(xb.float(), tensors[p], fmt.types[p], 256, tensors[f"{p}_bias"])
                      for p in ("w1", "w3")], dim=-1).bfloat16()
    assert torch.equal(fmt.linear(xb, tensors, "w13"), want)


_SERIAL_POOL = """#include <stdint.h>
int moechat_parallel_for(int (*fn)(void *, int64_t, int64_t), void *ctx, int64_t units, int64_t align,
                         int64_t bytes) { (void)align; (void)bytes; return fn(ctx, 0, units); }
"""


# every build of native_gguf.c the tests compare: AVX2 without VNNI (two ways), AVX-512 without VNNI (its 512-bit
# k-quant loops, not the 32-value types' VNNI ones), this machine's (AVX-512 VNNI here), scalar C
BUILDS = (("avx2", ["-mavx2", "-mfma", "-mf16c"]), ("x86-64-v3", ["-march=x86-64-v3"]),
          ("avx512", ["-march=skylake-avx512"]), ("native", ["-march=native"]), ("scalar", ["-DMOECHAT_SCALAR"]))


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """native_gguf.c alone (a serial pool beside it) built as each of BUILDS (those this CPU runs)."""
    import ctypes
    import shutil
    import subprocess

    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("gguf_builds")
    (d / "pool.c").write_text(_SERIAL_POOL)
    src = str(native.SOURCE.with_name("native_gguf.c"))
    out = {}
    cpu = native._cpu_flags()
    for name, flags in BUILDS:
        if name == "avx512" and "avx512bw" not in cpu:
            continue
        so = d / f"{name}.so"
        try:
            subprocess.run([cc, "-O2", *flags, "-shared", "-fPIC", "-fno-math-errno", "-o", str(so), src,
                            str(d / "pool.c"), "-lm"], check=True, capture_output=True, timeout=60)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            pytest.fail(f"native_gguf.c does not build with {flags}: {e}")
        fn = ctypes.CDLL(str(so)).moechat_gguf_vecdot
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        out[name] = fn
    return out


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("rows,cols", [(9, 768), (1, 256), (2, 512), (3, 1280), (6, 2048), (7, 1024), (13, 256)])
def test_every_build_writes_the_same_bits(builds, name, rows, cols):
    """The integer sums are exact and the float steps the same operations in the same order, so AVX2, AVX-512,
    scalar C and this machine's build (VNNI where it has it) agree bit for bit: for row counts off the AVX-512 loops'
    groups of 4 and 2, and super-block counts off their groups of 4 (1, 2, 3, 4, 5, 8)."""
    raw, x = _case(name, rows, cols, seed=11 + rows)
    t = TYPES[name]
    want = vecdot(x, raw, t, cols)
    for build, fn in builds.items():
        y = torch.empty(1, rows)
        assert fn(t.id, x.data_ptr(), raw.data_ptr(), rows, cols, y.data_ptr()) == 0
        assert torch.equal(y, want), build


def test_mxfp4_scales_subnormal_to_large_write_the_same_bits(builds):
    """MXFP4's E8M0 scales over their range (0 and 1: the subnormal forms of gv_e8m0, 2 the first normal) in every
    build, and as the emulation."""
    rows, cols = 11, 512
    raw, x = _case("MXFP4", rows, cols, seed=7)
    e = torch.tensor([0, 1, 2, 3, 60, 127, 128, 200, 0, 1, 2], dtype=torch.uint8)  # one a row: no row's sum hides it
    raw.view(rows, cols // 32, 17)[:, :, 0] = e[:, None]
    t = TYPES["MXFP4"]
    want = vecdot(x, raw, t, cols)
    scale = x.abs().double() @ torch.from_numpy(np.abs(quants.dequantize(raw.numpy(), Q["MXFP4"]))).double().t()
    err = (want.double() - vecdot_reference(x, raw, t, cols)).abs()
    assert torch.all(err <= 1e-5 * scale + 1e-40)  # fp32 rounding, and subnormal results' absolute steps
    for build, fn in builds.items():
        y = torch.empty(1, rows)
        assert fn(t.id, x.data_ptr(), raw.data_ptr(), rows, cols, y.data_ptr()) == 0
        assert torch.equal(y, want), build


@pytest.mark.parametrize("name", KINDS)
def test_each_row_is_the_same_alone_as_in_a_group(name):
    """A row's bits do not depend on the rows beside it (the AVX-512 loops take 4 or 2 at a time, the rest alone)."""
    rows, cols = 11, 1280
    raw, x = _case(name, rows, cols, seed=3)
    t = TYPES[name]
    want = vecdot(x, raw, t, cols)
    for r in range(rows):
        assert torch.equal(vecdot(x, raw[r:r + 1].contiguous(), t, cols)[0, 0], want[0, r]), r
        assert torch.equal(vecdot(x, raw[r:r + 3].contiguous(), t, cols)[0, 0], want[0, r]), r


def test_a_bf16_gguf_model_decodes_through_the_integer_dots_as_transformers_does(tmp_path, monkeypatch):
    """End to end: a tiny Qwen3-MoE GGUF (Q4_K gate/up, Q6_K down) run in bf16 decodes every token's experts
    through `vecdot`, and its 16 greedy tokens are transformers' on the dequantized weights in fp32."""
    import moechat.engine.quant.gguf as G
    from moechat.engine.load.loader import load_model
    from moechat.engine.runtime.generate import Engine
    from tests.engine.test_gguf_load import GREEDY, _prompt, _reference, tiny_qwen3moe, write_qwen3moe_gguf

    monkeypatch.delenv(VECDOT_ENV, raising=False)
    calls = []
    monkeypatch.setattr(G, "vecdot", lambda *a: calls.append(y := vecdot(*a)) or y)
    model = tiny_qwen3moe(hidden_size=256, moe_intermediate_size=256, num_experts=4)
    path = tmp_path / "tiny-qwen3moe.gguf"
    ref = _reference(model, write_qwen3moe_gguf(path, model, ("Q4_K", "Q4_K", "Q6_K"), "F32", "F32"))
    engine = Engine(load_model(path, dtype="bfloat16"), None, None, {}, 512, 16)
    ids = _prompt(6, seed=50)
    got = [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=16) for t in c.token_ids]
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16, min_new_tokens=0, pad_token_id=0)
    assert got == out[0, 6:].tolist()
    assert len(calls) >= 15 * 3 and all(y is not None for y in calls)  # every decoded token's w1, w3, w2
