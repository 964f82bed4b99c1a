"""native_gguf.c's many-token kernel (`prefill`: W's 4-row blocks decoded once into an fp32 scratch, every token
multiplied there with fp32 FMAs): within cols 2^-24 sum |x w| of the gguf package's dequantization + the dot in
fp64 for every type, the same bits for 1, 2 and 3 threads and for a token alone or in a batch, what
GGUFFormat.linear uses for many tokens, and off with MOECHAT_GGUF_PREFILL=0."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants  # noqa: E402

from moechat.engine.quant import native  # noqa: E402
from moechat.engine.quant.gguf import (  # noqa: E402
    PREFILL_ENV,
    TILE_ROWS,
    TYPES,
    GGUFFormat,
    decode_rows,
    gguf_linear,
    prefill,
    prefill_q8,
)
from tests.engine.test_gguf_quant import random_blocks  # noqa: E402
from tests.engine.test_gguf_vecdot import _SERIAL_POOL  # noqa: E402

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no native kernels here ({native.status()})")
KINDS = sorted(TYPES)


def _package_w(name: str, raw: torch.Tensor) -> np.ndarray:
    """The independent reference: the gguf package's decoder (F32 / F16 read typed, as it wants them)."""
    a = raw.numpy()
    typed = {"F32": np.float32, "F16": np.float16}.get(name)
    return quants.dequantize(a if typed is None else a.view(typed), Q[name]).astype(np.float64)  # [rows, cols]


def _check_bound(y: torch.Tensor, x: torch.Tensor, w: np.ndarray) -> float:
    """|y - x w^T| <= cols 2^-24 sum |x w| (a sequential fp32 sum's worst case); returns the largest err / bound."""
    wt = torch.from_numpy(w)
    ref = x.double() @ wt.t()
    bound = w.shape[1] * 2.0**-24 * (x.double().abs() @ wt.abs().t())
    err = (y.double() - ref).abs()
    assert torch.all(err <= bound), (err / bound).max()
    return (err / bound).max().item()


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("rows,T", [(13, 5), (8, 1), (6, 7)])  # rows not a multiple of 4; T across token blocks
def test_prefill_is_within_the_fp32_sum_bound_of_dequantize_and_linear(name, rows, T):
    cols = 512
    raw = torch.from_numpy(random_blocks(name, rows, cols, seed=rows + T))  # [rows, row_bytes]
    x = torch.randn(T, cols, generator=torch.Generator().manual_seed(T))
    y = prefill(x, raw, TYPES[name], cols)
    assert y is not None and y.shape == (T, rows) and y.dtype == torch.float32
    assert _check_bound(y, x, _package_w(name, raw)) < 0.01  # and far inside it in practice


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "IQ4_XS"])
def test_one_two_three_threads_and_any_batch_write_the_same_bits(name):
    rows, cols, T = 515, 1024, 8  # 1M multiply-adds / 4: >= 4 shares over the pool
    raw = torch.from_numpy(random_blocks(name, rows, cols, seed=7))
    x = torch.randn(T, cols, generator=torch.Generator().manual_seed(8))
    t, lib = TYPES[name], native.library()
    outs = []
    try:
        for n in (1, 2, 3):
            native.pin_threads(lib, n)
            outs.append(prefill(x, raw, t, cols))
    finally:
        native.pin_threads(lib, None)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    # a token's outputs do not depend on the tokens beside it (the sum's order is a function of the element alone)
    assert torch.equal(prefill(x[3:4], raw, t, cols), outs[0][3:4])
    assert torch.equal(prefill(x[1:6], raw, t, cols), outs[0][1:6])


def _tiles(x: torch.Tensor, raw: torch.Tensor, name: str, cols: int) -> torch.Tensor:
    """The path `prefill` replaces: 256-row tiles decoded to fp32, torch's GEMM on each."""
    return torch.cat([x.float() @ decode_rows(raw[r:r + TILE_ROWS], TYPES[name], cols).t()
                      for r in range(0, raw.shape[0], TILE_ROWS)], dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_format_linear_many_tokens_is_prefill_and_the_switch_turns_it_off(monkeypatch, dtype):
    monkeypatch.delenv(PREFILL_ENV, raising=False)
    H, inter, T = 256, 512, 6
    fmt = GGUFFormat("Q4_K", "Q5_0", "Q6_K")
    tensors = {}
    for i, (part, (shape, _)) in enumerate(fmt.layout(H, inter, torch.float32, bias=False).items()):
        tensors[part] = torch.from_numpy(random_blocks(fmt.types[part].name, shape[0], H if part != "w2" else inter,
                                                       seed=20 + i))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4)).to(dtype)
    # bf16 tokens of the types the integer kernel reads (Q4_K here) take it (tests/engine/test_gguf_prefill_q8.py)
    many = [prefill_q8(x, tensors[p], fmt.types[p], H) for p in ("w1", "w3")]
    assert (many[0] is not None) == (dtype == torch.bfloat16) and many[1] is None  # Q5_0: the fp32 kernel
    want = torch.cat([y if y is not None else prefill(x, tensors[p], fmt.types[p], H)
                      for y, p in zip(many, ("w1", "w3"), strict=True)], dim=-1).to(dtype)
    assert torch.equal(fmt.linear(x, tensors, "w13"), want)
    monkeypatch.setenv(PREFILL_ENV, "0")
    assert prefill(x, tensors["w1"], fmt.types["w1"], H) is None
    old = torch.cat([_tiles(x, tensors[p], fmt.types[p].name, H) for p in ("w1", "w3")], dim=-1).to(dtype)
    assert torch.equal(fmt.linear(x, tensors, "w13"), old)
    h = torch.randn(T, inter, generator=torch.Generator().manual_seed(5))
    assert torch.equal(gguf_linear(h, tensors["w2"], fmt.types["w2"], inter), _tiles(h, tensors["w2"], "Q6_K", inter))


def test_shapes_it_does_not_take_go_to_the_tile_path():
    raw = torch.from_numpy(random_blocks("Q4_K", 4, 256, seed=1))
    x = torch.randn(3, 256)
    t = TYPES["Q4_K"]
    assert prefill(x[:, :255], raw, t, 255) is None  # cols not the row's
    assert prefill(x, raw[:, :143].contiguous(), t, 256) is None  # a row of the wrong size
    assert prefill(x, raw.t(), t, 256) is None  # not contiguous
    fn = native.library().moechat_gguf_prefill  # typed by the calls above
    y = torch.empty(3, 4)
    assert fn(12, x.data_ptr(), 3, raw.data_ptr(), 4, 255, y.data_ptr(), 4) == -1  # not a multiple of the block
    assert fn(16, x.data_ptr(), 3, raw.data_ptr(), 4, 256, y.data_ptr(), 4) == -1  # IQ2_XXS: not decoded here
    assert fn(12, x.data_ptr(), 3, raw.data_ptr(), 4, 256, y.data_ptr(), 3) == -1  # ldy < rows
    assert fn(12, x.data_ptr(), 0, raw.data_ptr(), 4, 256, y.data_ptr(), 4) == 0  # no tokens: nothing to do


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """native_gguf.c alone (a serial pool beside it) built as AVX2 (8 lanes, 3 tokens a block) and as scalar C."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("gguf_prefill_builds")
    (d / "pool.c").write_text(_SERIAL_POOL)
    src = str(native.SOURCE.with_name("native_gguf.c"))
    out = {}
    for name, flags in (("avx2", ["-mavx2", "-mfma", "-mf16c"]), ("scalar", ["-DMOECHAT_SCALAR"])):
        so = d / f"{name}.so"
        subprocess.run([cc, "-O2", *flags, "-shared", "-fPIC", "-fno-math-errno", "-o", str(so), src,
                        str(d / "pool.c"), "-lm"], check=True, capture_output=True, timeout=60)
        lib = ctypes.CDLL(str(so))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.moechat_gguf_prefill.argtypes = [ctypes.c_int, p, i64, p, i64, i64, p, i64]
        lib.moechat_gguf_dequant.argtypes = [ctypes.c_int, p, i64, p]
        for f in (lib.moechat_gguf_prefill, lib.moechat_gguf_dequant):
            f.restype = ctypes.c_int
        out[name] = lib
    return out


@pytest.mark.parametrize("name", KINDS)
def test_every_build_decodes_bit_for_bit(builds, name):
    """The tile decoders' SIMD forms (AVX2 here, AVX-512 where the machine's build targets it) and the scalar C: each
    the torch reference bit for bit (itself the gguf package's: tests/engine/test_gguf_quant.py)."""
    from moechat.engine.quant.gguf import dequantize

    raw = torch.from_numpy(random_blocks(name, 5, 512, seed=13))
    want = dequantize(raw, name, 512)
    for build, lib in builds.items():
        y = torch.empty(5, 512)
        assert lib.moechat_gguf_dequant(TYPES[name].id, raw.data_ptr(), raw.numel() // TYPES[name].nbytes,
                                        y.data_ptr()) == 0, build
        assert torch.equal(y, want), build


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q5_1", "MXFP4", "BF16"])
def test_every_build_is_within_the_bound(builds, name):
    """The AVX2 and scalar builds sum in other orders than this machine's (their lane counts differ): each within the
    bound; the float types with a cols (516) that leaves a tail past the last vector of 8 or 16."""
    rows, cols, T = 9, 516 if TYPES[name].block == 1 else 512, 7
    raw = torch.from_numpy(random_blocks(name, rows, cols, seed=3))
    x = torch.randn(T, cols, generator=torch.Generator().manual_seed(9))
    w = _package_w(name, raw)
    for build, lib in builds.items():
        y = torch.empty(T, rows)
        rc = lib.moechat_gguf_prefill(TYPES[name].id, x.data_ptr(), T, raw.data_ptr(), rows, cols, y.data_ptr(), rows)
        assert rc == 0, build
        assert _check_bound(y, x, w) < 0.01, build
