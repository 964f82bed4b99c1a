"""A GGUF's output and embedding matrices kept in their quant type (quant/gguf_dense.py): the rows looked up bit for
bit `dequantize`, the LM head by the GGUF kernels (one token by the integer vec_dot within `vecdot_bound`, many
by the prefill kernel), whole models against transformers on the dequantized weights in fp32, and fit counting the
packed bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from moechat.engine.load.loader import load_model  # noqa: E402
from moechat.engine.quant.gguf import TYPES, dequantize, vecdot, vecdot_bound  # noqa: E402
from moechat.engine.quant.gguf_dense import GGUFMatrix  # noqa: E402
from moechat.engine.runtime.generate import Engine  # noqa: E402

from .test_gguf_load import GREEDY, _encode, _prompt, _reference, tiny_qwen3moe, write_gguf  # noqa: E402

HEAD_TYPES = ("Q6_K", "Q8_0", "Q4_K")  # what llama.cpp ships output.weight / token_embd.weight in


def _matrix(name: str, rows: int, cols: int, seed: int = 0, dtype=torch.float32) -> GGUFMatrix:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    raw = torch.from_numpy(np.ascontiguousarray(_encode(w, name, rng)).view(np.uint8).copy())  # [rows, row_bytes]
    return GGUFMatrix(raw.reshape(rows, -1), TYPES[name], cols, dtype)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_rows_are_the_dequantized_rows_bit_for_bit(name):
    m = _matrix(name, 300, 256, seed=1)
    ids = torch.tensor([0, 299, 7, 7, 150])  # repeated ids and both ends
    whole = dequantize(m.raw, m.type, m.cols)  # [300, 256] the reference
    assert torch.equal(m.rows(ids), whole[ids])
    m.dtype = torch.bfloat16  # a bf16 model: the rows a bf16 table dequantized at load would hold
    assert m.rows(ids).dtype == torch.bfloat16 and torch.equal(m.rows(ids), whole[ids].bfloat16())


@pytest.mark.parametrize("name", HEAD_TYPES)
def test_lm_head_one_token_by_vecdot_within_its_bound_and_many_by_prefill(name):
    m = _matrix(name, 512, 256, seed=2)
    w = m.weight().double()  # [512, 256]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 256, generator=g).bfloat16()
    y = m(x, out_dtype=torch.float32)  # [1, 512] fp32 logits of a bf16 hidden state
    assert y.dtype == torch.float32 and torch.equal(y, vecdot(x, m.raw, m.type, m.cols))
    exact = x.double() @ w.t()
    slack = 1e-6 * (x.double().abs() @ w.abs().t())  # the fp32 sums' own rounding, far below the bound
    assert ((y.double() - exact).abs() <= vecdot_bound(x, m.raw, m.type, m.cols) + slack).all()
    assert (y.double() - exact).abs().max() > 0  # the integer path, not an fp32 GEMM (x was rounded to int8)
    xs = torch.randn(5, 256, generator=g)  # many fp32 tokens (and one): F.linear up to the order of the fp32 sum
    for rows in (xs, xs[:1]):
        ys = m(rows, out_dtype=torch.float32)
        bound = 256 * 2.0**-24 * (rows.double().abs() @ w.abs().t()) + 1e-30
        assert ((ys.double() - rows.double() @ w.t()).abs() <= bound).all()
    res = torch.randn(5, 512, generator=g)
    assert torch.equal(m(xs, residual=res), res + m(xs))


@pytest.fixture(scope="module")
def model256():
    return tiny_qwen3moe(hidden_size=256, moe_intermediate_size=256, num_experts=4)


def _logits(loaded, ids):
    engine = Engine(loaded, None, None, {}, 512, 16)
    with torch.inference_mode():
        return engine._forward(engine.new_sequence(), ids), engine


@pytest.mark.parametrize("name", HEAD_TYPES)
def test_packed_head_and_table_match_transformers_in_fp32(tmp_path, model256, name, monkeypatch):
    path = tmp_path / f"packed-{name}.gguf"
    ref = _reference(model256, write_gguf(path, model256, ("Q8_0", "Q8_0", "Q8_0"), "F32", name))
    loaded = load_model(path, dtype="float32")
    model = loaded.model
    assert isinstance(model.lm_q, GGUFMatrix) and model.lm_q.format == name
    assert isinstance(model.embed_q, GGUFMatrix) and model.embed_q.format == name
    assert model.model.embed_tokens.weight.is_meta and model.lm_head.weight.is_meta  # no dequantized copy
    assert model.lm_q.nbytes == 256 * TYPES[name].row_bytes(256)
    for n in (1, 9):
        ids = _prompt(n, seed=n)
        ours, engine = _logits(loaded, ids)
        with torch.inference_mode():
            theirs = ref(torch.tensor([ids])).logits[0, -1].float()
        assert (ours - theirs).abs().max().item() < 1e-4
    ids = _prompt(5, seed=40)
    got = [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=8) for t in c.token_ids]
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8, min_new_tokens=0, pad_token_id=0)
    assert got == out[0, 5:].tolist() and len(got) == 8
    if name != "Q6_K":
        return
    packed = _logits(loaded, ids)[0]
    model.embed_on_host()  # --embeddings host on a CPU: the packed table already is in RAM, and stays packed
    assert model.embed_q is not None and torch.equal(_logits(loaded, ids)[0], packed)
    monkeypatch.setenv("MOECHAT_GGUF_PACKED", "0")  # both dequantized at load, as before: the same logits
    plain = load_model(path, dtype="float32")
    assert plain.model.lm_q is None and plain.model.embed_q is None
    assert (packed - _logits(plain, ids)[0]).abs().max().item() < 1e-5


def test_tied_embeddings_one_packed_table_serves_both(tmp_path, monkeypatch):
    model = tiny_qwen3moe(hidden_size=256, moe_intermediate_size=256, num_experts=4, tie_word_embeddings=True)
    add = gguf.GGUFWriter.add_tensor
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor",  # the converter writes no output.weight for a tied model
                        lambda self, name, *a, **k: None if name == "output.weight" else add(self, name, *a, **k))
    path = tmp_path / "tied.gguf"
    held = write_gguf(path, model, ("Q8_0", "Q8_0", "Q8_0"), "F32", "Q6_K")
    held["lm_head.weight"] = held["model.embed_tokens.weight"]
    monkeypatch.undo()
    ref = _reference(model, held)
    loaded = load_model(path, dtype="float32")
    assert loaded.args.tie_word_embeddings and loaded.model.lm_q is loaded.model.embed_q
    ids = _prompt(7, seed=4)
    ours, _ = _logits(loaded, ids)
    with torch.inference_mode():
        theirs = ref(torch.tensor([ids])).logits[0, -1].float()
    assert (ours - theirs).abs().max().item() < 1e-4
    from moechat.engine.plan import read_model_spec

    spec = read_model_spec(path)  # the table is the head: read whole each token, no int8 copy beside it
    table = 256 * TYPES["Q6_K"].row_bytes(256)
    assert dict(spec.dense_parts)["embeddings"] == table and "lm_head" not in dict(spec.dense_parts)
    assert spec.embedding_bytes == 0 and spec.in_dense_format("int8").dense_read_bytes < spec.dense_read_bytes
    assert "lm_head" not in dict(spec.in_dense_format("int8").dense_parts)


def test_bf16_model_one_token_head_is_vecdot_and_dense_format_keeps_it(tmp_path, model256):
    path = tmp_path / "bf16.gguf"
    ref = _reference(model256, write_gguf(path, model256, ("Q8_0", "Q8_0", "Q8_0"), "F32", "Q6_K"))
    loaded = load_model(path, dtype="bfloat16")
    head = loaded.model.lm_q
    h = torch.randn(1, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    y = loaded.model.logits(h)  # [1, V] fp32
    assert torch.equal(y, vecdot(h, head.raw, head.type, head.cols))
    exact = h.double() @ head.weight().double().t()
    assert ((y.double() - exact).abs() <= vecdot_bound(h, head.raw, head.type, head.cols) + 1e-6).all()
    assert loaded.model.embed_q.rows(torch.tensor([3])).dtype == torch.bfloat16
    int8 = load_model(path, dtype="float32", dense_format="int8")  # attention in int8; the Q6_K head stays
    assert int8.model.lm_q.__class__ is GGUFMatrix and int8.model.layer_list[0].self_attn.qkv_q is not None
    ids = _prompt(6, seed=6)
    with torch.inference_mode():
        theirs = ref(torch.tensor([ids])).logits[0, -1].float()
    assert (_logits(int8, ids)[0] - theirs).abs().max().item() < 0.05 * theirs.abs().max().item()  # int8's rounding


def test_fit_counts_the_output_and_embedding_matrices_packed(tmp_path, model256):
    from moechat.engine.plan import read_model_spec

    packed, plain = tmp_path / "q6.gguf", tmp_path / "f16.gguf"
    write_gguf(packed, model256, ("Q8_0", "Q8_0", "Q8_0"), "F32", "Q6_K")
    write_gguf(plain, model256, ("Q8_0", "Q8_0", "Q8_0"), "F32", "F16")
    a, b = read_model_spec(packed), read_model_spec(plain)
    q6 = 256 * TYPES["Q6_K"].row_bytes(256)  # 256 rows of one Q6_K block: 210 bytes for 256 values
    parts_a, parts_b = dict(a.dense_parts), dict(b.dense_parts)
    assert parts_a["lm_head"] == parts_a["embeddings"] == q6 == a.embedding_bytes
    assert parts_b["lm_head"] == parts_b["embeddings"] == 256 * 256 * 2  # F16: dequantized to bf16 at load
    assert b.dense_read_bytes - a.dense_read_bytes == 256 * 256 * 2 - q6  # a token reads the packed head
    assert any("output matrix (Q6_K)" in n for n in a.notes)
    assert dict(a.in_dense_format("int8").dense_parts)["lm_head"] == q6  # --dense-format keeps the packed head
    assert dict(b.in_dense_format("int8").dense_parts)["lm_head"] < 256 * 256 * 2  # and converts a float one
    wide = a.in_dtype(4, "float32")
    assert dict(wide.dense_parts)["lm_head"] == q6 and wide.embedding_bytes == q6
    assert dict(wide.dense_parts)["attention"] == 2 * parts_a["attention"]
    # a GPU dequantizes them at load (packing is CPU-only): its plan counts them in the compute dtype
    gpu = a.for_gpu()
    assert dict(gpu.dense_parts)["lm_head"] == dict(gpu.dense_parts)["embeddings"] == 256 * 256 * 2
    assert gpu.embedding_bytes == 256 * 256 * 2 and gpu.dense_bytes == b.dense_bytes
    assert dict(wide.for_gpu().dense_parts)["lm_head"] == 256 * 256 * 4
    from moechat.engine.plan import make_plan
    from moechat.engine.plan.hardware import DiskInfo, GiB, GpuInfo, Hardware, HostMemory

    card = GpuInfo(0, 0, "test GPU", "GPU-0", 8 * GiB, 8 * GiB, 8, 9, link_gbps=25.0, memory_gbps=500.0)
    on_gpu = make_plan(a, Hardware((card,), HostMemory(32 * GiB, 32 * GiB), DiskInfo("/m", 100 * GiB)))
    assert on_gpu.dense_bytes == make_plan(b, Hardware((card,), HostMemory(32 * GiB, 32 * GiB),
                                                        DiskInfo("/m", 100 * GiB))).dense_bytes


@pytest.mark.parametrize("name", ["Q6_K", "Q8_0"])
def test_a_nan_scale_in_the_packed_head_is_one_typed_line(tmp_path, model256, name):
    from moechat.engine.errors import CheckpointError
    from moechat.engine.load.gguf import open_gguf
    from moechat.engine.quant.gguf_dense import SCALE_OFFSETS

    path = tmp_path / "nan.gguf"
    write_gguf(path, model256, ("Q8_0", "Q8_0", "Q8_0"), "F32", name)
    info = open_gguf(path).info("lm_head.weight")
    t = TYPES[name]
    with open(path, "r+b") as f:  # the scale of block 5 of row 3: fp16 NaN
        f.seek(info.start + 3 * t.row_bytes(256) + 5 % (256 // t.block) * t.nbytes + SCALE_OFFSETS[name][0])
        f.write(np.array([np.nan], np.float16).tobytes())
    with pytest.raises(CheckpointError) as e:
        load_model(path, dtype="float32")
    assert "lm_head.weight" in str(e.value) and "NaN or Inf" in str(e.value) and "\n" not in str(e.value)


# -- attention's projections kept packed (load/gguf.py `packed_attention`, quant/gguf_dense.py `GGUFProjection`) --


@pytest.fixture(scope="module")
def heads256():
    """Attention 256 wide on both sides (4 heads of 64; k and v 2 of them): k-quant blocks of 256 in every
    projection, o's input included."""
    return tiny_qwen3moe(hidden_size=256, moe_intermediate_size=256, num_experts=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K"])
def test_packed_attention_matches_transformers_in_fp32(tmp_path, heads256, name, monkeypatch):
    from moechat.engine.quant.gguf_dense import GGUFProjection

    path = tmp_path / f"attn-{name}.gguf"
    ref = _reference(heads256, write_gguf(path, heads256, ("Q8_0", "Q8_0", "Q8_0"), name, "F32"))
    loaded = load_model(path, dtype="float32")
    for layer in loaded.model.layer_list:
        attn = layer.self_attn
        assert isinstance(attn.qkv_q, GGUFProjection) and isinstance(attn.o_q, GGUFProjection)
        assert attn.qkv_t is None and attn.o_weight_t is None  # no dequantized copy
        assert attn.qkv_q.format == name and len(attn.qkv_q.parts) == 1  # q, k, v joined: one call
    ids = _prompt(9, seed=11)
    ours, engine = _logits(loaded, ids)
    with torch.inference_mode():
        theirs = ref(torch.tensor([ids])).logits[0, -1].float()
    assert (ours - theirs).abs().max().item() < 1e-4  # fp32 tokens: the exact fp32 kernels
    got = [t for c in engine.generate(ids[:5], sampling=GREEDY, max_tokens=8) for t in c.token_ids]
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids[:5]]), do_sample=False, max_new_tokens=8, min_new_tokens=0,
                           pad_token_id=0)
    assert got == out[0, 5:].tolist()
    int8 = load_model(path, dtype="float32", dense_format="int8")  # --dense-format leaves packed attention as it is
    assert isinstance(int8.model.layer_list[0].self_attn.qkv_q, GGUFProjection)
    monkeypatch.setenv("MOECHAT_GGUF_PACKED", "0")  # dequantized at load, as before
    plain = load_model(path, dtype="float32")
    assert plain.model.layer_list[0].self_attn.qkv_q is None
    assert (ours - _logits(plain, ids)[0]).abs().max().item() < 1e-4  # fp32 sums in another order


def test_projection_joins_same_type_blocks_and_is_each_matrix_bit_for_bit():
    """Q4_K q and k joined into one matrix, a Q6_K v apart: the outputs are each matrix's own (rows are independent,
    x is rounded once per call either way), + bias in fp32, rounded once; one bf16 token within vec_dot's bound of
    the exact product, many within bound_q8."""
    from moechat.engine.quant import prefill
    from moechat.engine.quant.gguf import gguf_linear
    from moechat.engine.quant.gguf_dense import GGUFProjection

    q, k, v = _matrix("Q4_K", 64, 256, seed=1), _matrix("Q4_K", 32, 256, seed=2), _matrix("Q6_K", 32, 256, seed=3)
    bias = torch.randn(128, generator=torch.Generator().manual_seed(4))
    p = GGUFProjection([q, k, v], bias)
    assert [m.type.name for m in p.parts] == ["Q4_K", "Q6_K"] and p.shape == (128, 256)
    assert p.nbytes == q.nbytes + k.nbytes + v.nbytes and torch.equal(p.weight(), torch.cat([m.weight() for m in
                                                                                            (q, k, v)]))
    g = torch.Generator().manual_seed(5)
    w = p.weight().double()
    for T in (1, 6):
        x = torch.randn(T, 256, generator=g).bfloat16()
        each = torch.cat([gguf_linear(x, m.raw, m.type, m.cols, out_dtype=torch.float32) for m in (q, k, v)], dim=-1)
        y = p(x, out_dtype=torch.float32)
        assert torch.equal(y, each + bias)
        assert torch.equal(p(x), (each + bias).bfloat16())
        res = torch.randn(T, 128, generator=g).bfloat16()
        assert torch.equal(p(x, residual=res), res + p(x))
        exact = x.double() @ w.t()
        if T == 1:
            bound = torch.cat([vecdot_bound(x, m.raw, m.type, m.cols) for m in (q, k, v)], dim=-1) + 1e-6
        else:
            bound = prefill.bound_q8(x.float(), p.weight())
        assert ((y.double() - bias.double() - exact).abs() <= bound).all()


def test_fit_counts_packed_attention(tmp_path, model256):
    from moechat.engine.plan import read_model_spec

    packed, plain = tmp_path / "q8.gguf", tmp_path / "f32.gguf"
    write_gguf(packed, model256, ("Q8_0", "Q8_0", "Q8_0"), "Q8_0", "F32")
    write_gguf(plain, model256, ("Q8_0", "Q8_0", "Q8_0"), "F32", "F32")
    a, b = read_model_spec(packed), read_model_spec(plain)
    assert "attention" in a.packed_parts and "attention" not in getattr(b, "packed_parts", ())
    loaded = load_model(packed, dtype="float32")  # the file's config says float32: the spec's dtype
    held = sum(layer.self_attn.qkv_q.nbytes + layer.self_attn.o_q.nbytes for layer in loaded.model.layer_list)
    norms = sum(t.numel() * t.element_size() for n, t in loaded.model.named_parameters()
                if ".self_attn." in n and not t.is_meta)
    assert dict(a.dense_parts)["attention"] == held + norms  # the packed q/k/v/o + the norms as held
    assert dict(a.in_dense_format("int8").dense_parts)["attention"] == held + norms  # --dense-format keeps them
    assert dict(a.for_gpu().dense_parts)["attention"] == dict(b.dense_parts)["attention"]  # dequantized on a GPU
    assert any("attention's projections (Q8_0" in n for n in a.notes)
