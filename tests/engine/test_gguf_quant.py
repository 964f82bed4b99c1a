"""GGUF quant types: moechat's torch decoders against the gguf package's numpy ones, and the format's compute
paths against dequantize + F.linear."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants  # noqa: E402

from moechat.engine.errors import CheckpointError  # noqa: E402
from moechat.engine.quant.gguf import NATIVE_TYPES, TYPES, GGUFFormat, decode_rows, dequantize, ggml_type  # noqa: E402

QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4", "BF16", "F16", "F32")


def random_blocks(name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, row_bytes] uint8 of valid blocks: the package's quantizer where it has one, else random bytes with
    sane fp16 scales (k-quants and IQ types)."""
    rng = np.random.default_rng(seed)
    t = TYPES[name]
    if name in QUANTIZABLE:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        if name == "F32":
            return w.view(np.uint8)
        return np.ascontiguousarray(quants.quantize(w, Q[name])).view(np.uint8).reshape(rows, -1)
    raw = rng.integers(0, 256, size=(rows * cols // t.block, t.nbytes), dtype=np.uint8)
    half = lambda n: rng.uniform(0.001, 0.05, size=(raw.shape[0], n)).astype(np.float16).view(np.uint8)  # noqa: E731
    if name in ("Q4_K", "Q5_K"):
        raw[:, 0:4] = half(2)
    elif name == "Q2_K":
        raw[:, 80:84] = half(2)
    elif name in ("Q3_K", "Q6_K"):
        raw[:, -2:] = half(1)
    elif name in ("IQ4_XS", "IQ4_NL"):
        raw[:, 0:2] = half(1)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("name", sorted(TYPES))
def test_dequantize_matches_the_gguf_package(name):
    rows, cols = 6, 512
    raw = random_blocks(name, rows, cols)
    typed = {"F32": np.float32, "F16": np.float16}.get(name)  # the package reads these typed, not as bytes
    want = quants.dequantize(raw if typed is None else raw.view(typed), Q[name]).astype(np.float32)  # [rows, cols]
    got = dequantize(torch.from_numpy(raw), name, cols)
    assert got.shape == (rows, cols)
    np.testing.assert_array_equal(got.numpy(), want)  # bit for bit: both decode exactly in fp32


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q8_0"), ("Q2_K", "Q3_K", "Q5_K"),
                                   ("IQ4_XS", "IQ4_NL", "MXFP4"), ("Q4_0", "Q5_1", "BF16")])
@pytest.mark.parametrize("tokens", [2, 5])  # one token (integer dots): tests/engine/test_gguf_vecdot.py
def test_format_linear_matches_dequantize_and_linear(types, tokens):
    H, inter = 256, 512
    fmt = GGUFFormat(*types)
    layout = fmt.layout(H, inter, torch.float32, bias=False)
    tensors = {}
    for i, (part, (shape, dt)) in enumerate(layout.items()):
        cols = H if part != "w2" else inter
        raw = torch.from_numpy(random_blocks(fmt.types[part].name, shape[0], cols, seed=i))
        assert raw.shape == shape and raw.dtype == dt
        tensors[part] = raw
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(1))
    w13 = fmt.weight(tensors, "w13", torch.float32)  # [2I, H]
    ref = torch.cat([dequantize(tensors["w1"], types[0], H), dequantize(tensors["w3"], types[1], H)])
    assert torch.equal(w13, ref)
    _assert_within_fp32_sum(fmt.linear(x, tensors, "w13"), x, w13)
    h = torch.randn(tokens, inter, generator=torch.Generator().manual_seed(2))
    w2 = fmt.weight(tensors, "w2", torch.float32)
    _assert_within_fp32_sum(fmt.linear(h, tensors, "w2"), h, w2)


def _assert_within_fp32_sum(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y within cols 2^-24 sum |x w| of x @ w^T in fp64 (any order of an fp32 sum of exact products), and nowhere
    near that loose in practice (a hundredth of it)."""
    ref = x.double() @ w.double().t()
    bound = w.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    err = (y.double() - ref).abs()
    assert torch.all(err <= bound), (err / bound).max()
    assert (err / bound).max() < 0.01


def test_a_type_moechat_cannot_compute_is_one_line_naming_the_tensor():
    with pytest.raises(CheckpointError, match=r"'blk.0.ffn_up_exps.weight' is stored as IQ2_XXS") as e:
        ggml_type(int(Q.IQ2_XXS), "blk.0.ffn_up_exps.weight")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", sorted(NATIVE_TYPES))
def test_native_tile_decoder_is_the_reference_bit_for_bit(name):
    from moechat.engine.quant import native

    if native.library() is None:
        pytest.skip(f"no native kernels here ({native.status()})")
    raw = torch.from_numpy(random_blocks(name, 40, 768, seed=5))
    got = decode_rows(raw, TYPES[name], 768)
    assert torch.equal(got, dequantize(raw, name, 768))
    assert torch.equal(decode_rows(raw[8:24], TYPES[name], 768), got[8:24])  # a tile of rows


# the package's reference overflows to inf at the top exponents, as ours does (the comparison covers that)
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
def test_mxfp4_every_exponent_matches_the_package_and_the_native_decoder():
    from moechat.engine.quant import native

    raw = np.random.default_rng(2).integers(0, 256, size=(256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256)  # E8M0 from 2^-127 to 2^128 (the extremes: subnormal halves, infinities)
    raw = raw.reshape(8, -1)
    want = quants.dequantize(raw, Q.MXFP4).astype(np.float32)
    got = dequantize(torch.from_numpy(raw), "MXFP4", 32 * 32)
    np.testing.assert_array_equal(got.numpy(), want)
    if native.library() is not None:
        np.testing.assert_array_equal(decode_rows(torch.from_numpy(raw), TYPES["MXFP4"], 32 * 32).numpy(), want)
