"""`--dense-format int8|int4` on the hybrid models (Qwen3-Next, Qwen3.5/3.6): the gated attention's [q | gate | k | v]
and o projections and the Gated DeltaNet layers' fused in-projection and out_proj in the format, the LM head in
int8 (quant/dense_quant.py). Against the slow obvious reference, the same model with those weights replaced by
their dequantized values (fp32 logits to 1e-4, prefill and decode). Against the native model the error is the
weights' rounding: on a tiny Qwen3-Next whose router weighs every expert (init range 0.05, seeds 3-5, fp32 and bf16)
int8 moved the logits by 0.028-0.062 of their norm and int4 by 0.39-0.96, past the 0.05 / 0.4 that
tests/engine/quant/test_dense_quant.py measured for plain attention: at widths of 64 with 8-dim linear heads each
int4 projection is ~9.5% off and the hybrid layers round three more of them (the delta rule's q/k/v, z, b, a) than
attention does. Keeping b and a (the write strength and decay) native changed none of those figures. The bounds
tested are those measurements' (int8 < 0.1, int4 < 1.2), and int4 coarser than int8."""

from __future__ import annotations

import pytest
import torch

from moechat.engine.runtime.generate import Engine

from .test_qwen3_next import TINY, VARIANTS, build_variant

pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"{request.param}_dense")
    build_variant(path, request.param, seed=7)
    return path


def _logits(engine, ids, steps) -> torch.Tensor:
    """The prompt's last logits, then each forced decode step's: [1 + len(steps), V]."""
    seq = engine.new_sequence()
    with torch.inference_mode():
        out = [engine._forward(seq, ids)]
        out += [engine._forward(seq, [t]) for t in steps]
    return torch.stack(out)


def _dequantized(path, quant: Engine) -> Engine:
    """The native model with every projection `quant` holds quantized replaced by its dequantized weight."""
    ref = Engine.load(path, dtype="float32")
    for mine, theirs in zip(ref.model.layer_list, quant.model.layer_list, strict=True):
        a, q = mine.attn, theirs.attn
        if mine.linear:
            a.in_t, a.out_t = q.in_q.weight().t().contiguous(), q.out_q.weight().t().contiguous()
        else:
            a.in_t, a.o_weight_t = q.in_q.weight().t().contiguous(), q.o_q.weight().t().contiguous()
    ref.model.lm_weight_t = quant.model.lm_q.weight().t().contiguous()
    return ref


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_projections_equal_their_dequantized_weights(model, fmt):
    engine = Engine.load(model, dtype="float32", dense_format=fmt, prefill_chunk=16)
    assert engine.model.dense_format == fmt and engine.model.lm_q.format == "int8"
    kinds = {layer.linear for layer in engine.model.layer_list}
    assert kinds == {True, False}  # both layer kinds quantized
    for layer in engine.model.layer_list:
        a = layer.attn
        assert a.in_q.format == fmt and (a.out_q if layer.linear else a.o_q).format == fmt and a.in_t is None
    ids, steps = list(range(3, 40)), [5, 77, 200, 9]
    got, want = _logits(engine, ids, steps), _logits(_dequantized(model, engine), ids, steps)
    assert (got - want).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def smooth(tmp_path_factory):
    """Qwen3-Next whose router weighs every expert (top-8 of 8) at a small init: no expert choice flips, so the
    logits move smoothly with the weights, as test_dense_quant.py's bound was measured."""
    import transformers

    path = tmp_path_factory.mktemp("qwen3_next_smooth")
    config = transformers.AutoConfig.for_model("qwen3_next", **{**TINY, **VARIANTS["qwen3_next"][1],
                                                               "num_experts_per_tok": 8, "initializer_range": 0.05})
    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_and_int4_stay_within_their_bounds_of_native(smooth, dtype):
    model = smooth
    ids, steps = list(range(5, 25)), [17, 3, 101, 42]
    want = _logits(Engine.load(model, dtype=dtype), ids, steps).float()
    err = {}
    for fmt in ("int8", "int4"):
        got = _logits(Engine.load(model, dtype=dtype, dense_format=fmt), ids, steps).float()
        err[fmt] = float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max())
    assert err["int8"] < 0.1 and err["int4"] < 1.2, err  # measured 0.028-0.062 and 0.39-0.96 (module docstring)
    assert err["int4"] > 2 * err["int8"] > 0, err
