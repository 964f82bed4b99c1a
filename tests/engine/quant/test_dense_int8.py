"""`--dense-format int8` (quant/dense_int8.py): attention's projections and the LM head in int8 on the CPU.

Each fast path against the slow obvious one: `Int8Linear` against x @ dequantized(W)^T (one token through the native
GEMV, several through torch's kernel or the cast fallback); a whole int8-dense engine against the same model with
its dense weights replaced by their dequantized values, fp32 logits to 1e-4, on every tiny architecture; the
weight rounding itself bounded against the original weights."""

from __future__ import annotations

import pytest
import torch

from moechat.engine.errors import ConfigError
from moechat.engine.layers.kv_cache import KVCache
from moechat.engine.models.base import Attention
from moechat.engine.quant import native
from moechat.engine.quant.dense_int8 import Int8Linear, check_dense_format
from moechat.engine.runtime.generate import Engine


def _case(rows, cols, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 0.2  # [out, in]
    b = torch.randn(rows, generator=g) if bias else None
    return w, b, g


@pytest.mark.parametrize("native_kernels", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cols", [64, 40])  # 40: torch's kernel is refused there (quant/torch_paths.py)
def test_int8_linear_against_its_dequantized_weight(monkeypatch, native_kernels, dtype, T, bias, cols):
    if not native_kernels:
        monkeypatch.setenv(native.ENV, "0")
    elif native.library() is None:
        pytest.skip(f"no native kernels here ({native.status()})")
    w, b, g = _case(96, cols, seed=T * 7 + cols, bias=bias)
    lin = Int8Linear(w, b)
    x = torch.randn(T, cols, generator=g).to(dtype)
    residual = torch.randn(T, 96, generator=g).to(dtype)
    deq = lin.weight()  # [out, in] fp32
    want = x.float() @ deq.T + (0 if b is None else b)  # [T, out]
    sums = x.float().abs() @ deq.abs().T + (0 if b is None else b.abs())  # what the rounding is relative to
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7  # fp32 sums; bf16: the output (and x's cast) rounded
    got = lin(x)
    assert got.dtype == dtype and got.shape == (T, 96)
    assert ((got.float() - want).abs() <= tol * sums + 1e-6).all()
    got_r = lin(x, residual)
    assert ((got_r.float() - (want + residual.float())).abs() <= tol * (sums + residual.float().abs()) + 1e-6).all()
    logits = lin(x, out_dtype=torch.float32)
    assert logits.dtype == torch.float32 and ((logits - want).abs() <= tol * sums + 1e-6).all()


def test_the_weight_rounding_is_half_a_step_per_weight():
    w, _, _ = _case(80, 128, seed=3)
    lin = Int8Linear(w)
    assert lin.q.dtype == torch.int8 and lin.q.abs().max() <= 127
    assert ((lin.weight() - w).abs() <= lin.scale[:, None] / 2 + 1e-7).all()
    assert lin.nbytes == 80 * 128 + 4 * 80  # a bf16 copy would be 2 x 80 x 128


def _reference_engine(path):
    """The native fp32 engine with every weight `quantize_dense` touches replaced by its dequantized int8 value."""
    engine = Engine.load(path, dtype="float32")
    model = engine.model
    for layer in model.layer_list:
        attn = layer.self_attn
        if isinstance(attn, Attention):
            attn.qkv_t = Int8Linear(attn.qkv_t.t()).weight().t().contiguous()
            attn.o_weight_t = Int8Linear(attn.o_weight_t.t()).weight().t().contiguous()
    model.lm_weight_t = Int8Linear(model.lm_weight_t.t()).weight().t().contiguous()
    return engine


def _logits(engine, ids):
    kv = KVCache.for_model(engine.args, len(ids) + 4, engine.loaded.dtype, engine.loaded.device)
    out = []
    with torch.inference_mode():
        hidden = engine.model(torch.tensor(ids), kv, engine.provider)  # prefill [T, H]
        out.append(engine.model.logits(hidden))
        for _ in range(3):  # one-token steps: the native GEMV
            step = engine.model(out[-1][-1:].argmax(-1), kv, engine.provider)
            out.append(engine.model.logits(step))
    return torch.cat(out)


def test_an_int8_dense_engine_is_its_dequantized_reference(tiny_models, tiny_name):
    path, _ = tiny_models[tiny_name]
    ids = torch.randint(0, 200, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = Engine.load(path, dtype="float32", dense_format="int8")
    assert engine.model.dense_format == "int8" and engine.model.lm_q is not None
    quantized = [layer.self_attn for layer in engine.model.layer_list if isinstance(layer.self_attn, Attention)]
    assert all(a.qkv_q is not None and a.qkv_t is None for a in quantized)  # the fp32 copies are gone
    got, want = _logits(engine, ids), _logits(_reference_engine(path), ids)
    assert torch.allclose(got, want, atol=1e-4, rtol=0), float((got - want).abs().max())
    native_logits = _logits(Engine.load(path, dtype="float32"), ids)
    assert not torch.equal(got, native_logits)  # it is quantized: not the native engine in disguise


def test_bf16_int8_dense_greedy_decode_runs_and_stays_close(tiny_models):
    path, _ = tiny_models["qwen3_moe"]
    ids = list(range(3, 12))
    got = _logits(Engine.load(path, dtype="bfloat16", dense_format="int8"), ids)
    want = _logits(_reference_engine(path), ids)
    assert torch.isfinite(got).all()
    assert (got[0] - want[0]).abs().max() < 0.05 * want[0].abs().max()  # the prompt's logits, bf16 activations


def test_the_dense_format_is_checked():
    assert check_dense_format(None, torch.device("cpu")) == "native"
    with pytest.raises(ConfigError, match="use one of native, int8"):
        check_dense_format("int3", torch.device("cpu"))
    with pytest.raises(ConfigError, match="CPU only"):
        check_dense_format("int8", torch.device("cuda"))


def test_run_and_chat_take_the_flag(tiny_models, capsys):
    import json

    from moechat.app.cli.main import build_parser, main
    from moechat.app.tui.launch import options_from_args

    path, _ = tiny_models["qwen3_moe"]
    argv = ["run", str(path), "--prompt-ids", "1,2,3", "--max-tokens", "3", "--temperature", "0", "--json"]
    assert main(argv + ["--dense-format", "int8"]) == 0
    int8 = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    native_out = json.loads(capsys.readouterr().out)
    assert int8["generated_tokens"] == native_out["generated_tokens"] == 3
    args = build_parser().parse_args(["chat", str(path), "--dense-format", "int8"])
    assert options_from_args(args).dense_format == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", str(path), "--dense-format", "int3"])
