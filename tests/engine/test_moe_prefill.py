"""A prefill chunk through a layer's experts in one native call (native_prefill_int.c moechat_moe_prefill_q8,
engine/layers/experts.py `_layer_prefill`) against the per-expert path it replaces (per expert: the format's `linear`
for gate/up through the integer kernel, the activation in torch, `linear` for down, the weighted scatter): bit for bit,
for int4, int8 and MXFP4, SwiGLU and GPT-OSS's clamped SwiGLU, with and without biases (fp32 and bf16), experts with
one token and with many, a subset of pairs, a mixed slots + host batch, and 1, 2 and 3 threads; the shapes it does not
take fall back to the per-expert path; a bad index is refused before anything is written."""

from __future__ import annotations

import shutil

import pytest
import torch

from moechat.engine.layers import experts
from moechat.engine.layers.experts import expert_compute
from moechat.engine.layers.moe import SWIGLU, ExpertActivation, ExpertBatch
from moechat.engine.quant import native

from .test_moe_decode import _experts, _same, at_thread_counts

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the torch paths run")

CLAMPED = ExpertActivation("clamped_swiglu", 7.0, 1.702)


def _batch(tensors, fmt, ids: torch.Tensor, pairs=None, host=None):
    return ExpertBatch(tensors, ids, ids, pairs, fmt, host_tensors=host)


def _routing(T: int, K: int, C: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K] slot ids (distinct per token; skewed, so some experts get one token and some many) and weights."""
    g = torch.Generator().manual_seed(seed)
    p = torch.linspace(3.0, 0.2, C)
    p[-1] = 0  # the last slot: token 0's alone
    ids = torch.stack([torch.multinomial(p, K, replacement=False, generator=g) for _ in range(T)])
    ids[0, -1] = C - 1
    return ids, torch.softmax(torch.randn(T, K, generator=g), -1)


def _run(x, weights, batch, act, layer: bool, monkeypatch) -> torch.Tensor:
    contrib = torch.zeros(weights.numel(), x.shape[1])
    if not layer:
        monkeypatch.setenv(experts.LAYER_PREFILL_ENV, "0")
    expert_compute(x, weights, batch, act=act, contrib=contrib)
    monkeypatch.delenv(experts.LAYER_PREFILL_ENV, raising=False)
    return contrib


def _spy(monkeypatch, name: str = "moe_prefill") -> list:
    """The calls of native.`name` from here on (each still made)."""
    calls = []
    real = getattr(native, name)
    monkeypatch.setattr(native, name, lambda *a: calls.append(1) or real(*a))
    return calls


# intermediate sizes a multiple of 64: torch's vectorised step for bf16 on AVX-512 (32 on AVX2), which the layer call
# needs (`test_shapes_it_does_not_take_fall_back`)
CASES = [("int4", 256, 128), ("int4", 96, 192), ("int8", 256, 128), ("int8", 64, 320), ("mxfp4", 256, 128),
         ("mxfp4", 96, 192)]


@pytest.mark.parametrize("name,H,I", CASES)
def test_one_call_is_the_per_expert_path(monkeypatch, name, H, I):
    C, T, K = 8, 13, 3
    variants = ((False, SWIGLU, None), (True, CLAMPED, torch.float32), (True, SWIGLU, torch.bfloat16))
    for bias, act, bias_dtype in variants:
        tensors, fmt = _experts(name, C, H, I, bias, bias_dtype or torch.float32, seed=H + I)
        ids, weights = _routing(T, K, C, seed=I)
        counts = torch.bincount(ids.reshape(-1), minlength=C)
        assert (counts == 1).any() and counts.max() > 4  # lone tokens and a busy expert
        x = (torch.randn(T, H, generator=torch.Generator().manual_seed(H)) * 3).bfloat16()
        batch = _batch(tensors, fmt, ids)
        want = _run(x, weights, batch, act, False, monkeypatch)
        calls = _spy(monkeypatch)
        got = _run(x, weights, batch, act, True, monkeypatch)
        assert calls, "the layer call was not taken"
        assert want.abs().sum() > 0
        _same(got, want)


def test_pairs_and_a_mixed_batch(monkeypatch):
    """Only a batch's pairs are computed (the other rows stay zero); slot ids >= C index the host buffers."""
    H, I, T, K = 128, 64, 9, 2
    slots, fmt = _experts("int4", 3, H, I, False, torch.bfloat16, seed=1)
    host, _ = _experts("int4", 4, H, I, False, torch.bfloat16, seed=2)
    ids, weights = _routing(T, K, 7, seed=4)
    x = torch.randn(T, H).bfloat16()
    pairs = torch.arange(0, T * K, 3)
    batch = _batch(slots, fmt, ids, pairs=pairs, host=host)
    got = _run(x, weights, batch, SWIGLU, True, monkeypatch)
    _same(got, _run(x, weights, batch, SWIGLU, False, monkeypatch))
    kept = torch.zeros(T * K, dtype=torch.bool)
    kept[pairs] = True
    assert got[~kept].abs().sum() == 0 and (got[kept].abs().sum(1) > 0).all()
    batch = _batch(slots, fmt, ids, host=host)
    _same(_run(x, weights, batch, SWIGLU, True, monkeypatch), _run(x, weights, batch, SWIGLU, False, monkeypatch))


@pytest.mark.parametrize("name", ["int4", "int8", "mxfp4"])
def test_threads_change_nothing(monkeypatch, name):
    """The passes split their units over 1, 2 and 3 threads: the same bits (shapes the pool splits)."""
    H, I, T, K = 1024, 384, 24, 4
    tensors, fmt = _experts(name, 6, H, I, False, torch.bfloat16, seed=3)
    ids, weights = _routing(T, K, 6, seed=5)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).bfloat16()
    batch = _batch(tensors, fmt, ids)
    at_thread_counts(lambda: _run(x, weights, batch, SWIGLU, False, monkeypatch),
                     lambda: _run(x, weights, batch, SWIGLU, True, monkeypatch))


def test_shapes_it_does_not_take_fall_back(monkeypatch):
    """An intermediate size past torch's vectorised steps (the activation's split would differ), fp32 tokens (the
    exact decoded-tile kernels) and FP8 (no integer kernel) take the per-expert path: no call, the same result."""
    vec = native.vector_step(torch.bfloat16)
    cases = [("int8", 64, 96 + (32 if vec and 96 % vec == 0 else 0), torch.bfloat16), ("int8", 64, 96, torch.float32),
             ("fp8", 256, 128, torch.bfloat16)]
    for name, H, I, dtype in cases:
        if name == "int8" and dtype == torch.bfloat16 and not (vec and I % vec):
            continue  # no vectorised exp here: every width is taken
        tensors, fmt = _experts(name, 4, H, I, False, torch.bfloat16, seed=7)
        ids, weights = _routing(6, 2, 4, seed=8)
        x = torch.randn(6, H).to(dtype)
        batch = _batch(tensors, fmt, ids)
        calls = _spy(monkeypatch)
        got = _run(x, weights, batch, SWIGLU, True, monkeypatch)
        assert not calls, (name, I, dtype)
        _same(got, _run(x, weights, batch, SWIGLU, False, monkeypatch))
        monkeypatch.undo()


def test_a_bad_index_is_refused_before_any_write():
    lib = native.library()
    tensors, fmt = _experts("int8", 2, 64, 32, False, torch.bfloat16, seed=0)
    ptrs = torch.tensor([[tensors["w13_q"][e].data_ptr(), tensors["w13_scale"][e].data_ptr(),
                          tensors["w2_q"][e].data_ptr(), tensors["w2_scale"][e].data_ptr(), 0, 0] for e in range(2)])
    x = torch.randn(3, 64).bfloat16()
    start = torch.tensor([0, 2, 3])
    wt = torch.ones(3)
    out = torch.zeros(6, 64)
    for tok, dst in (([0, 1, 3], [0, 1, 2]), ([0, 1, 2], [0, 6, 2]), ([0, -1, 2], [0, 1, 2])):
        with pytest.raises(RuntimeError, match="expert layer prefill"):
            native.moe_prefill(lib, native.MOE_KINDS["int8"], x, ptrs, start, torch.tensor(tok), torch.tensor(dst), wt,
                               32, 0, 0, 7.0, 1.702, out)
        assert out.abs().sum() == 0
    native.moe_prefill(lib, native.MOE_KINDS["int8"], x, ptrs, start, torch.tensor([0, 1, 2]), torch.tensor([5, 0, 3]),
                       wt, 32, 0, 0, 7.0, 1.702, out)
    assert (out[[5, 0, 3]].abs().sum(1) > 0).all() and out[[1, 2, 4]].abs().sum() == 0


def _gguf_experts(types: tuple[str, str, str], C: int, H: int, I: int, seed: int, interleaved: bool = False):
    pytest.importorskip("gguf")
    from moechat.engine.quant.gguf import GGUFFormat
    from tests.engine.test_gguf_quant import random_blocks

    fmt = GGUFFormat(*types, interleaved=interleaved)
    per = {p: torch.stack([torch.from_numpy(random_blocks(fmt.types[p].name, rows, cols, seed=seed + 7 * e + i))
                           for e in range(C)])
           for i, (p, (rows, cols)) in enumerate((("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))))}
    return per, fmt


@pytest.mark.parametrize("types", [("Q8_0", "Q8_0", "Q8_0"), ("Q4_0", "Q4_0", "Q8_0"), ("MXFP4", "MXFP4", "Q4_0"),
                                   ("Q4_K", "Q4_K", "Q8_0"), ("Q4_K", "Q4_K", "Q6_K"), ("Q6_K", "Q6_K", "Q4_0"),
                                   ("Q5_K", "Q5_K", "Q6_K")])
def test_gguf_experts_one_call_is_the_per_expert_path(monkeypatch, types):
    """GGUF experts as the file stores them (gate and up apart): the same bits as gguf_linear per projection."""
    C, T, K, H = 6, 11, 2, 256
    I = 256 if types[2] in ("Q4_K", "Q6_K") else 128  # a k-quant down projection's rows: super-blocks of 256
    tensors, fmt = _gguf_experts(types, C, H, I, seed=3)
    ids, weights = _routing(T, K, C, seed=9)
    x = (torch.randn(T, H, generator=torch.Generator().manual_seed(2)) * 2).bfloat16()
    batch = _batch(tensors, fmt, ids)
    want = _run(x, weights, batch, SWIGLU, False, monkeypatch)
    calls = _spy(monkeypatch, "moe_prefill_gguf")
    got = _run(x, weights, batch, SWIGLU, True, monkeypatch)
    assert calls and want.abs().sum() > 0
    _same(got, want)
    monkeypatch.undo()
    at_thread_counts(lambda: want, lambda: _run(x, weights, batch, SWIGLU, True, monkeypatch), counts=(2, 3))


def test_gguf_experts_it_does_not_take_fall_back(monkeypatch):
    """Interleaved gate/up (gpt-oss's GGUF), a k-quant, the clamped activation: the per-expert path, no call."""
    H, I = 256, 256
    cases = [(("Q8_0", "Q8_0", "Q8_0"), True, SWIGLU), (("Q4_K", "Q4_K", "Q3_K"), False, SWIGLU),
             (("Q2_K", "Q2_K", "Q8_0"), False, SWIGLU),
             (("MXFP4", "MXFP4", "MXFP4"), False, CLAMPED)]
    for types, interleaved, act in cases:
        tensors, fmt = _gguf_experts(types, 3, H, I, seed=1, interleaved=interleaved)
        ids, weights = _routing(5, 2, 3, seed=2)
        x = torch.randn(5, H).bfloat16()
        calls = _spy(monkeypatch, "moe_prefill_gguf")
        got = _run(x, weights, _batch(tensors, fmt, ids), act, True, monkeypatch)
        assert not calls, types
        _same(got, _run(x, weights, _batch(tensors, fmt, ids), act, False, monkeypatch))
        monkeypatch.undo()
