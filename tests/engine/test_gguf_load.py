"""GGUF files end to end: a tiny transformers model written as llama.cpp's converter writes it (experts stacked,
llama.cpp names, quantized), loaded by moechat, against transformers on the dequantized weights in fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from moechat.engine.errors import CheckpointError, UnsupportedModelError  # noqa: E402
from moechat.engine.load.gguf import open_gguf, unpermute  # noqa: E402
from moechat.engine.load.loader import load_model  # noqa: E402
from moechat.engine.quant.gguf import TYPES, dequantize  # noqa: E402
from moechat.engine.runtime.generate import Engine  # noqa: E402
from moechat.engine.runtime.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, do_sample=False)
TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
            num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            intermediate_size=96, norm_topk_prob=True, initializer_range=0.2, max_position_embeddings=512,
            rms_norm_eps=1e-6)


def _encode(w: np.ndarray, name: str, rng) -> np.ndarray:
    """w [..., cols] fp32 -> the ggml bytes of type `name` (the package's quantizer, or for k-quants random valid
    blocks whose scales keep the values near w's spread)."""
    if name in ("F32",):
        return w.astype(np.float32)
    if name in ("F16",):
        return w.astype(np.float16)
    if name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16", "MXFP4"):
        return gguf.quants.quantize(w.astype(np.float32), Q[name])
    *lead, cols = w.shape
    if name not in TYPES:  # a type moechat does not compute: any bytes of the right size
        block, size = gguf.GGML_QUANT_SIZES[Q[name]]
        return rng.integers(0, 256, size=(*lead, cols // block * size), dtype=np.uint8)
    t = TYPES[name]
    raw = rng.integers(0, 256, size=(int(np.prod(lead)) * cols // t.block, t.nbytes), dtype=np.uint8)
    half = lambda v, n=1: np.full((raw.shape[0], n), v, np.float16).view(np.uint8)  # noqa: E731
    if name in ("Q4_K", "Q5_K"):
        raw[:, 0:4] = np.concatenate([half(0.0004 if name == "Q4_K" else 0.0002), half(0.002)], axis=1)
    elif name == "Q6_K":
        raw[:, -2:] = half(0.00003)
    else:
        raise AssertionError(name)
    return raw.reshape(*lead, -1)


# transformers' model_type -> llama.cpp's architecture name (Mixtral is a llama with experts)
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "mixtral": "llama",
             "glm4_moe": "glm4moe"}
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
          "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
          "mlp.shared_experts.down_proj": "ffn_down_shexp", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: q/k rows of each head from rotate-half to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, model, types=("Q8_0", "Q8_0", "Q4_0"), dense="F32", embd="F32", seed=0, expert_ff=None,
               split_max_tensors=0, meta=None):
    """Write `model` (a transformers MoE) as convert_hf_to_gguf.py would: llama.cpp names, experts stacked
    [E, rows, cols], llama-type q/k rows permuted, dense in `dense`, experts in `types` (gate, up, down). Returns
    the state dict the file holds after quantization (HF names, dequantized, q/k in HF order): the reference's."""
    rng = np.random.default_rng(seed)
    cfg = model.config
    arch = GGUF_ARCH[cfg.model_type]
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    E = getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None) or cfg.num_local_experts
    I = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(E)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(expert_ff or I)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if getattr(cfg, "clip_qkv", None):
        w.add_clamp_kqv(cfg.clip_qkv)
    if arch == "glm4moe":  # what Glm4MoeModel.set_gguf_parameters writes
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
        w.add_rope_dimension_count(int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.5)))
    if meta is not None:
        meta(w)  # more metadata (the tokenizer)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    held = {}

    def put(gname, hfname, arr, typ, heads=None):
        if heads:
            arr = _permute(arr, heads)
        data = _encode(arr, typ, rng)
        w.add_tensor(gname, data, raw_dtype=None if typ in ("F32", "F16") else Q[typ])
        if typ not in TYPES:
            return
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).copy())
        back = dequantize(raw.reshape(-1, raw.shape[-1]) if raw.dim() > 1 else raw[None], typ, arr.shape[-1])
        back = back.reshape(arr.shape)
        held[hfname] = unpermute(back, heads) if heads else back

    put("token_embd.weight", "model.embed_tokens.weight", sd["model.embed_tokens.weight"], embd)
    put("output_norm.weight", "model.norm.weight", sd["model.norm.weight"], "F32")
    put("output.weight", "lm_head.weight", sd["lm_head.weight"], embd)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for h, g in _LAYER.items():
            for kind in ("weight", "bias"):
                if p + h + "." + kind not in sd:
                    continue
                arr = sd[p + h + "." + kind]
                typ = dense if kind == "weight" and arr.ndim == 2 and g not in ("ffn_gate_inp", "ffn_gate_inp_shexp") \
                    else "F32"
                heads = None
                if arch == "llama" and kind == "weight" and g in ("attn_q", "attn_k"):
                    heads = cfg.num_attention_heads if g == "attn_q" else cfg.num_key_value_heads
                put(f"blk.{i}.{g}.{kind}", p + h + "." + kind, arr, typ, heads)
        if p + "mlp.gate.e_score_correction_bias" in sd:
            put(f"blk.{i}.exp_probs_b.bias", p + "mlp.gate.e_score_correction_bias",
                sd[p + "mlp.gate.e_score_correction_bias"], "F32")
        if p + "mlp.experts.gate_up_proj" not in sd:
            continue  # a dense layer
        gate_up = sd[p + "mlp.experts.gate_up_proj"]  # [E, 2I, H]
        ts = types[i] if isinstance(types[0], tuple) else types  # per layer, as Q4_K_M mixes them
        put(f"blk.{i}.ffn_gate_exps.weight", p + "gate", np.ascontiguousarray(gate_up[:, :I]), ts[0])
        put(f"blk.{i}.ffn_up_exps.weight", p + "up", np.ascontiguousarray(gate_up[:, I:]), ts[1])
        put(f"blk.{i}.ffn_down_exps.weight", p + "mlp.experts.down_proj", sd[p + "mlp.experts.down_proj"], ts[2])
        if p + "gate" in held and p + "up" in held:
            held[p + "mlp.experts.gate_up_proj"] = torch.cat([held.pop(p + "gate"), held.pop(p + "up")], dim=1)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


write_qwen3moe_gguf = write_gguf


def tiny_qwen3moe(**overrides):
    import transformers

    config = transformers.AutoConfig.for_model("qwen3_moe", **{**TINY, **overrides})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def qwen3moe():
    return tiny_qwen3moe()


@pytest.fixture(scope="module")
def qwen3moe_256():
    """Wide enough for 256-value k-quant blocks along both inputs (hidden and the expert width)."""
    return tiny_qwen3moe(hidden_size=256, moe_intermediate_size=256, num_experts=4)


def _reference(model, held):
    import copy

    ref = copy.deepcopy(model)
    ref.load_state_dict(held, strict=True)
    return ref


def _prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("types,dense,embd", [(("Q8_0", "Q8_0", "Q4_0"), "F32", "F32"),
                                              (("Q4_K", "Q4_K", "Q6_K"), "Q8_0", "F16"),
                                              (("Q5_1", "Q5_0", "Q5_K"), "F16", "Q8_0"),
                                              ((("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q4_K", "Q4_K")), "Q8_0", "Q8_0")])
def test_qwen3moe_gguf_matches_transformers_on_the_dequantized_weights(tmp_path, request, types, dense, embd):
    kquant = any(t.endswith("_K") for t in np.ravel(types))
    qwen3moe = request.getfixturevalue("qwen3moe_256" if kquant else "qwen3moe")
    path = tmp_path / "tiny-qwen3moe.gguf"
    ref = _reference(qwen3moe, write_qwen3moe_gguf(path, qwen3moe, types, dense, embd))
    loaded = load_model(path, dtype="float32")
    if isinstance(types[0], str):
        assert loaded.expert_format.name == "gguf-" + "-".join(dict.fromkeys(types))
    engine = Engine(loaded, None, None, {}, 512, 16)
    for n in (1, 23):
        ids = _prompt(n, seed=n)
        seq = engine.new_sequence()
        with torch.inference_mode():
            ours = engine._forward(seq, ids)
            theirs = ref(torch.tensor([ids])).logits[0, -1].float()
        assert (ours - theirs).abs().max().item() < 1e-4
    ids = _prompt(6, seed=50)
    got = [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=16) for t in c.token_ids]
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16, min_new_tokens=0, pad_token_id=0)
    assert got == out[0, 6:].tolist()[:len(got)] and len(got) == 16


def _one_line(e):
    assert "\n" not in str(e.value)
    return str(e.value)


def test_split_files_and_a_folder_holding_one_give_the_same_model(tmp_path, qwen3moe):
    one = tmp_path / "one" / "tiny.gguf"
    one.parent.mkdir()
    write_qwen3moe_gguf(one, qwen3moe)
    split = tmp_path / "split" / "tiny.gguf"
    split.parent.mkdir()
    write_qwen3moe_gguf(split, qwen3moe, split_max_tensors=10)
    parts = sorted(split.parent.glob("*.gguf"))
    assert len(parts) > 2 and parts[0].name == f"tiny-00001-of-{len(parts):05d}.gguf"
    ids = _prompt(9, seed=3)
    logits = []
    for where in (one, parts[0], split.parent):
        engine = Engine(load_model(where, dtype="float32"), None, None, {}, 512, 16)
        with torch.inference_mode():
            logits.append(engine._forward(engine.new_sequence(), ids))
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    parts[-1].unlink()
    with pytest.raises(CheckpointError, match="missing, part of the") as e:
        open_gguf(parts[0])
    _one_line(e)


@pytest.fixture(scope="module")
def good_file(tmp_path_factory, qwen3moe):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_qwen3moe_gguf(path, qwen3moe)
    return path


def test_a_truncated_file_is_one_typed_line(tmp_path, good_file):
    data = good_file.read_bytes()
    for keep in (len(data) - 100, 200, 10):
        bad = tmp_path / f"cut{keep}.gguf"
        bad.write_bytes(data[:keep])
        with pytest.raises(CheckpointError, match="download it again") as e:
            load_model(bad, dtype="float32")
        _one_line(e)


def test_a_wrong_tensor_count_is_one_typed_line(tmp_path, good_file):
    data = bytearray(good_file.read_bytes())
    n = int.from_bytes(data[8:16], "little")  # magic, version, then the tensor count
    for count in (n + 1, n - 1):
        data[8:16] = count.to_bytes(8, "little")
        bad = tmp_path / f"count{count}.gguf"
        bad.write_bytes(bytes(data))
        with pytest.raises(CheckpointError) as e:
            load_model(bad, dtype="float32")
        _one_line(e)


def test_an_unknown_type_and_a_type_moechat_cannot_compute(tmp_path, good_file, qwen3moe):
    data = bytearray(good_file.read_bytes())
    name = b"token_embd.weight"
    at = data.index(name) + len(name)  # tensor info: name, n_dims u32, dims u64 x n, type u32, offset u64
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at:type_at + 4], "little") == 0  # F32
    data[type_at:type_at + 4] = (77).to_bytes(4, "little")
    bad = tmp_path / "unknown.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="not a readable GGUF file") as e:
        load_model(bad, dtype="float32")
    _one_line(e)
    iq = tmp_path / "iq2.gguf"
    write_qwen3moe_gguf(iq, qwen3moe, types=("Q8_0", "IQ2_XXS", "Q8_0"), dense="F32")
    with pytest.raises(CheckpointError, match=r"'blk.0.ffn_up_exps.weight' is stored as IQ2_XXS") as e:
        load_model(iq, dtype="float32")
    _one_line(e)


def test_an_architecture_moechat_lacks_is_one_typed_line(tmp_path):
    for arch, words in (("mamba", "not supported"), ("qwen3", "dense model")):
        path = tmp_path / f"{arch}.gguf"
        w = gguf.GGUFWriter(str(path), arch)
        w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(UnsupportedModelError, match=words) as e:
            load_model(path, dtype="float32")
        _one_line(e)


def test_a_tensor_of_the_wrong_shape_is_one_typed_line(tmp_path, qwen3moe):
    path = tmp_path / "shape.gguf"
    write_qwen3moe_gguf(path, qwen3moe, expert_ff=64)  # the metadata says 64, the experts are 32 wide
    with pytest.raises(CheckpointError, match="ffn_gate_exps.weight' has shape") as e:
        load_model(path, dtype="float32")
    _one_line(e)


@pytest.mark.parametrize("slots,ram", [(3, 0)])
def test_cached_gguf_experts_give_the_resident_tokens(good_file, slots, ram):
    """Experts packed in their ggml types through the slots, the RAM tier and preadv from the .gguf: the same
    greedy tokens as every expert resident; Engine.load takes the file as run does."""
    from moechat.engine.cache.provider import CacheConfig

    resident = Engine.load(good_file, dtype="float32")
    cached = Engine.load(good_file, dtype="float32", cache=CacheConfig(expert_slots=slots, ram_cache_bytes=ram))
    ids = _prompt(11, seed=8)
    want = [t for c in resident.generate(ids, sampling=GREEDY, max_tokens=10) for t in c.token_ids]
    got = [t for c in cached.generate(ids, sampling=GREEDY, max_tokens=10) for t in c.token_ids]
    assert got == want and len(want) == 10
    snap = cached.cache_snapshot()
    assert sum(snap.misses) > 0
    cached.close()


def test_moechat_run_on_a_gguf_file_gives_transformers_greedy_tokens(good_file, qwen3moe, tmp_path, capsys):
    """`moechat run FILE.gguf` (and the folder holding it) end to end: greedy tokens == transformers on the
    dequantized weights in fp32."""
    import json

    from moechat.app.cli import main as cli

    ref = _reference(qwen3moe, write_qwen3moe_gguf(tmp_path / "again.gguf", qwen3moe))  # the same bytes as good_file
    ids = _prompt(5, seed=21)
    with torch.inference_mode():
        want = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8, min_new_tokens=0,
                            pad_token_id=0)[0, 5:].tolist()
    for model in (good_file, good_file.parent):
        code = cli.main(["run", str(model), "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "8",
                         "--temperature", "0", "--dtype", "float32", "--json"])
        out = capsys.readouterr().out
        assert code == 0, out
        assert json.loads(out)["token_ids"] == want


def test_fit_counts_the_experts_packed_bytes_per_ggml_type(tmp_path):
    from moechat.engine.plan import read_model_spec

    model = tiny_qwen3moe(hidden_size=256, moe_intermediate_size=256, num_experts=4)
    path = tmp_path / "k.gguf"
    write_qwen3moe_gguf(path, model, ("Q4_K", "Q4_K", "Q6_K"), "Q8_0", "Q8_0")
    spec = read_model_spec(path)
    assert spec.expert_bytes == 2 * 256 * 144 + 256 * 210  # gate, up: 256 rows of one Q4_K block; down: Q6_K
    assert spec.expert_format == "GGUF Q4_K/Q4_K/Q6_K" and spec.num_experts == 4 and spec.num_moe_layers == 2
    assert spec.checkpoint_bytes == path.stat().st_size
    assert any("packed per type: Q4_K" in n for n in spec.notes)


OTHERS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, rope_theta=1e6,
                    eos_token_id=None, bos_token_id=None),
    "olmoe": dict(num_experts=6, num_experts_per_tok=3, intermediate_size=32, norm_topk_prob=False, clip_qkv=0.5,
                  eos_token_id=None, pad_token_id=None),
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
                     first_k_dense_replace=1, n_shared_experts=1, use_qk_norm=True, attention_bias=True,
                     routed_scaling_factor=1.5, n_group=2, topk_group=1, norm_topk_prob=True, eos_token_id=None,
                     pad_token_id=None),
    "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
                      shared_expert_intermediate_size=64, norm_topk_prob=False, eos_token_id=None),
}


@pytest.mark.parametrize("model_type", sorted(OTHERS))
def test_other_architectures_match_transformers(tmp_path, model_type):
    """Mixtral (llama.cpp's llama with experts: q/k rows permuted by the converter, undone at load), OLMoE (full-width
    q/k norms, clamp_kqv), Qwen2-MoE (qkv biases, a gated shared expert): fp32 logits and greedy tokens."""
    import copy

    import transformers

    base = {k: v for k, v in TINY.items() if k not in ("num_experts", "moe_intermediate_size", "norm_topk_prob",
                                                       "intermediate_size", "num_experts_per_tok")}
    config = transformers.AutoConfig.for_model(model_type, **{**base, **OTHERS[model_type]})
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path / f"{model_type}.gguf"
    held = write_gguf(path, model, ("Q8_0", "Q8_0", "Q5_0"), "Q8_0", "F16")
    ref = copy.deepcopy(model)
    ref.load_state_dict(held, strict=True)
    engine = Engine(load_model(path, dtype="float32"), None, None, {}, 512, 16)
    assert engine.args.model_type == model_type
    ids = _prompt(13, seed=4)
    with torch.inference_mode():
        ours = engine._forward(engine.new_sequence(), ids)
        theirs = ref(torch.tensor([ids])).logits[0, -1].float()
    assert (ours - theirs).abs().max().item() < 1e-4
    got = [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=8) for t in c.token_ids]
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8, min_new_tokens=0, pad_token_id=0)
    assert got == out[0, 13:].tolist()


def test_experts_whose_type_changes_by_layer_run_resident_and_refuse_a_cache(tmp_path, qwen3moe_256):
    from moechat.engine.cache.provider import CacheConfig
    from moechat.engine.errors import ConfigError

    path = tmp_path / "q4_k_m.gguf"
    write_gguf(path, qwen3moe_256, (("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q4_K", "Q4_K")), "Q8_0", "Q8_0")
    loaded = load_model(path, dtype="float32")
    assert [loaded.provider.prepare(layer, torch.zeros(1, 2, dtype=torch.long)).format.types["w2"].name
            for layer in (0, 1)] == ["Q6_K", "Q4_K"]
    with pytest.raises(ConfigError, match="change type from layer to layer") as e:
        Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=2))
    _one_line(e)


def test_a_gguf_with_its_tokenizer_chats_as_the_safetensors_folder_does(tiny_chat_model, tmp_path, capsys):
    """Text in, text out: the file's tokenizer and chat template (text/gguf_tokenizer.py) through `moechat run`, the
    same tokens and text as the model's safetensors folder (fp32 weights in both)."""
    import json

    from moechat.app.cli import main as cli

    folder, model, fast = tiny_chat_model

    def meta(w):
        w.add_string("tokenizer.huggingface.json", (folder / "tokenizer.json").read_text())
        w.add_chat_template(fast.chat_template)

    path = tmp_path / "chat.gguf"
    write_gguf(path, model, ("F32", "F32", "F32"), "F32", "F32", meta=meta)
    out = []
    for where in (folder, path):
        code = cli.main(["run", str(where), "--prompt", "Hello world, experts?", "--max-tokens", "6",
                         "--temperature", "0", "--dtype", "float32", "--json"])
        text, err = capsys.readouterr()
        assert code == 0, (where, err)
        out.append(json.loads(text))
    assert out[1]["token_ids"] == out[0]["token_ids"] and out[1]["text"] == out[0]["text"]


def test_gguf_experts_convert_to_int8_through_the_repacked_store(good_file, tmp_path):
    """--expert-format int8 from a GGUF: every expert dequantized from its ggml type (the format's weight()) and
    requantized once into the repacked file; logits within int8's error of the packed GGUF's own."""
    from moechat.engine.cache.provider import CacheConfig

    native = Engine.load(good_file, dtype="float32")
    int8 = Engine.load(good_file, dtype="float32", expert_format="int8",
                       cache=CacheConfig(expert_slots=4, repack_dir=str(tmp_path / "repacked")))
    assert int8.loaded.expert_format.name == "int8" and native.loaded.expert_format.name.startswith("gguf-")
    ids = _prompt(9, seed=1)
    with torch.inference_mode():
        a = native._forward(native.new_sequence(), ids)
        b = int8._forward(int8.new_sequence(), ids)
    assert 0 < (a - b).abs().max().item() < 0.05 * a.abs().max().item()
    int8.close()
