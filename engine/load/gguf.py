"""GGUF files as moechat checkpoints: the container, the metadata as an HF-style config, the tensors by HF name.

Design: `open_gguf` reads the header(s) with the `gguf` package's `GGUFReader` (numpy memmaps: no tensor byte is
read until it is used) and returns a `GGUFCheckpoint`, a `Checkpoint` whose tensors carry the names the engine's
model classes use (`model.layers.3.self_attn.q_proj.weight`), so `loader.check_model` and `load_model` run the
same checks and the same load over it as over a safetensors folder. Dense tensors are dequantized when read
(`get`: to fp32, the loader casts to the compute dtype), with llama.cpp's conventions undone (the q/k row
permutation its converter applies to llama-type models), but for those a token reads whole: output.weight and
token_embd of a quantized type stay packed on a CPU (`packed_dense`: the LM head by the GGUF kernels, the table decoded
a row an id; a Qwen3-30B-A3B Q6_K head reads 255 MB a token where bf16 read 622 MB), and so do the q/k/v/o
projections of each plain-attention layer (`packed_attention`: quant/gguf_dense.py `GGUFProjection`; a Q4_0 file's
token then reads what llama.cpp's does, 319 MB on the 2-layer Qwen3 shape, not 373). The routed experts stay as the
file stores them: `blk.N.ffn_{gate,up,down}_exps.weight` [E, rows, row_bytes] uint8, read per expert by the disk tier
with preadv straight from the .gguf, in a `GGUFFormat` naming each projection's ggml type (quant/gguf.py). Every
problem a user can meet (a truncated or damaged file, an unknown type, an architecture moechat lacks, a missing
split) is one typed line naming the file and what to do.

gpt-oss (`gpt-oss`): the converter split HF's interleaved gate_up rows by parity into ffn_gate_exps (even) and
ffn_up_exps (odd) and their biases likewise; the format re-interleaves gate/up outputs for the clamped SwiGLU, and
the biases stay per projection ([E, rows] F32, `w1_bias`/`w3_bias`/`w2_bias`) as the disk tier reads them. Sinks,
the router's bias, post_attention_norm and o_proj's bias map by name; sliding/full alternation (even layers slide)
and YaRN come from llama.cpp's fixed conventions and the `rope.scaling.*` keys. deepseek2: recent converters split
kv_b_proj per head into attn_k_b ([nH, C, N], transposed) and attn_v_b ([nH, V, C]) and write the absorbed form's
key/value_length with the per-head sizes as `*_mla`; older ones keep attn_kv_b whole: both give the same kv_b_proj.
Sigmoid gating (expert_gating_func 2) is DeepSeek-V3's routing (groups, exp_probs_b), softmax V2's; YaRN's mscale
is the log multiplier / 0.1 (mscale == mscale_all_dim, as every release has it).

Splits: `name-00001-of-00003.gguf` and its siblings are one model; the first holds the metadata, each its own
tensors; `split.count` and `split.tensors.count` are checked against what the files hold.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError, ConfigError, UnsupportedModelError
from ..io.checkpoint import Checkpoint, TensorInfo
from ..quant.gguf import TYPES, VECDOT_TYPES, GGUFFormat, decode_rows, ggml_type
from .gguf_arches import ARCHES_2026, config_2026, tensor_2026, undo

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# the dense matrices a GGUF model may keep packed (`GGUFCheckpoint.packed_dense`); "0" in PACKED_ENV: none of them
PACKED_DENSE = ("lm_head.weight", "model.embed_tokens.weight")
PACKED_ENV = "MOECHAT_GGUF_PACKED"


def is_gguf(path: str | os.PathLike) -> bool:
    """A .gguf file, or a directory holding one model's .gguf file(s)."""
    p = Path(path)
    if p.is_file() or p.suffix == ".gguf":
        return p.suffix == ".gguf"
    return p.is_dir() and not (p / "config.json").exists() and bool(_model_files(p))


def _model_files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.glob("*.gguf") if not f.name.startswith("mmproj") and "imatrix" not in f.name)


def gguf_files(path: str | os.PathLike) -> list[Path]:
    """The file(s) of one GGUF model: a file, a split's first file (its siblings found beside it), or a directory
    holding one model (one file or one split set)."""
    p = Path(path)
    if p.is_dir():
        files = _model_files(p)
        stems = {(_SPLIT.match(f.name).group("stem") if _SPLIT.match(f.name) else f.name) for f in files}
        if not files:
            raise ConfigError(f"{p}: holds no .gguf model file")
        if len(stems) > 1:
            raise ConfigError(f"{p}: holds {len(stems)} GGUF models ({', '.join(sorted(stems))}); name the file "
                              "to run")
        p = files[0]
    if not p.is_file():
        raise CheckpointError(f"{p}: no such GGUF file", path=str(p))
    m = _SPLIT.match(p.name)
    if m is None:
        return [p]
    count = int(m.group("count"))
    if int(m.group("no")) != 1:
        raise ConfigError(f"{p}: is part {int(m.group('no'))} of a split GGUF; name its first file "
                          f"{m.group('stem')}-00001-of-{m.group('count')}.gguf")
    parts = [p.with_name(f"{m.group('stem')}-{i:05d}-of-{m.group('count')}.gguf") for i in range(1, count + 1)]
    for part in parts:
        if not part.is_file():
            raise CheckpointError(f"{part}: missing, part of the {count}-file split GGUF {p.name} (incomplete "
                                  "download? download it again)", path=str(part))
    return parts


@dataclass(frozen=True)
class GGUFTensorInfo(TensorInfo):
    """A tensor of a GGUF file under the engine's name: `ggml` its stored type, `rows x cols` its matrix (cols the
    input, ggml's ne0); start..end are the stored bytes in `file`."""

    ggml: str = "F32"
    gguf_name: str = ""
    cols: int = 0
    transform: str = ""  # "", "permute_q", "permute_k": the llama converter's q/k row order, undone on read;
    # "kv_b": deepseek2's kv_b_proj made again from the attn_k_b / attn_v_b pair recent converters split it into
    other: str = ""  # "kv_b": the attn_v_b tensor (gguf_name is attn_k_b)


def _read(path: Path):
    import gguf

    try:
        size = path.stat().st_size
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # noqa: BLE001 - the package raises ValueError, IndexError, struct/numpy errors
        text = " ".join(str(e).split()) or type(e).__name__
        raise CheckpointError(f"{path}: not a readable GGUF file ({text}); it is truncated or damaged: download it "
                              "again", path=str(path)) from None
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise CheckpointError(f"{path}: tensor {t.name!r} ends at byte {int(t.data_offset) + int(t.n_bytes)} "
                                  f"but the file has {size} bytes (truncated download? download it again)",
                                  path=str(path), tensor=t.name)
    return reader


def _value(reader, key: str, default=None):
    field = reader.get_field(key)
    if field is None:
        return default
    v = field.contents()
    return v.tolist() if isinstance(v, np.ndarray) else v


# llama.cpp's architecture name -> (HF model_type, whether its converter permutes q/k rows)
ARCHES = {"qwen3moe": ("qwen3_moe", False), "qwen2moe": ("qwen2_moe", False), "olmoe": ("olmoe", False),
          "llama": ("mixtral", True), "glm4moe": ("glm4_moe", False), "gpt-oss": ("gpt_oss", False),
          "deepseek2": ("deepseek_v2", False),  # deepseek_v3 where its gating is sigmoid (V3, R1, Kimi K2)
          **ARCHES_2026}  # the hybrids and the rest of 2026: their tables in gguf_arches.py
DENSE_ARCHES = {"qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi2", "phi3", "gpt2", "olmo", "olmo2", "falcon",
                "starcoder2", "command-r", "granite", "mistral3", "smollm3",
                "qwen35", "nemotron_h", "glm4", "gemma3n"}  # the 2026 families' dense siblings


class GGUFCheckpoint(Checkpoint):
    """The tensors of a GGUF model under the engine's names; `config` the HF-style config.json dict its metadata
    gives, `expert_format` how its routed experts are stored."""

    def __init__(self, files: list[Path], readers: list, tensors: dict[str, GGUFTensorInfo], config: dict,
                 expert_format: GGUFFormat | None, metadata_reader):
        super().__init__(files[0], tensors)
        self.files_ = files
        self.readers = readers
        self.config = config
        self.expert_format = expert_format
        self.reader = metadata_reader  # the first file's reader: tokenizer.* and the rest of the metadata
        self.layer_formats: dict[int, GGUFFormat] | None = None  # set when the expert types change by layer
        self._data = {t.name: t for r in readers for t in r.tensors}

    def get(self, name: str) -> torch.Tensor:
        """A dense tensor dequantized to fp32 in the engine's shape, or an expert tensor's raw bytes."""
        info = self.info(name)
        if not isinstance(info, GGUFTensorInfo) or info.dtype == "U8":
            return self._raw(info.gguf_name if isinstance(info, GGUFTensorInfo) else name).reshape(info.shape)
        if info.transform == "kv_b":  # k_b [nH, C, N] (transposed by the converter), v_b [nH, V, C]
            k, v = self._decode(info.gguf_name), self._decode(info.other)
            return torch.cat([k.transpose(1, 2), v], dim=1).reshape(info.shape)  # [nH * (N + V), C]
        if info.transform and not info.transform.startswith("permute"):  # a convention of gguf_arches.py's
            other = self._decode(info.other) if info.other else None
            return undo(info.transform, self._decode(info.gguf_name), self.config, other).reshape(info.shape)
        w = self._decode(info.gguf_name).reshape(info.shape)
        if info.transform:
            n_head = self.config["num_attention_heads" if info.transform == "permute_q" else "num_key_value_heads"]
            w = unpermute(w, n_head)
        return w

    def _raw(self, gguf_name: str) -> torch.Tensor:
        data = self._data[gguf_name].data
        with warnings.catch_warnings():  # a read-only memmap: nothing below writes to it
            warnings.simplefilter("ignore")
            return torch.from_numpy(np.ascontiguousarray(data).view(np.uint8))

    def _decode(self, gguf_name: str) -> torch.Tensor:
        """One stored tensor dequantized to fp32, in its file shape (ggml's ne reversed)."""
        t = self._data[gguf_name]
        ne = [int(d) for d in t.shape]
        raw = self._raw(gguf_name)
        rows = raw.reshape(-1, raw.shape[-1]) if raw.dim() > 1 else raw[None]  # [rows, row_bytes]
        typ = TYPES[t.tensor_type.name]
        w = torch.empty(rows.shape[0], ne[0], dtype=torch.float32)  # [rows, cols]
        for r in range(0, rows.shape[0], 4096):  # chunks: the torch decoder's integer temporaries stay small
            w[r:r + 4096] = decode_rows(rows[r:r + 4096], typ, ne[0])
        return w.reshape(tuple(reversed(ne)))

    def files(self) -> list[Path]:
        return list(self.files_)

    def attention_layers(self) -> list[int]:
        """The layers whose attention is the plain `Attention` (MoEForCausalLM.packable_attention) in the model this
        file's config makes, built on the meta device (no weight read): what `fit` counts packed from the header."""
        from ..errors import MoechatError
        from ..models import ARCHITECTURES

        cls = ARCHITECTURES.get(self.config.get("model_type"))
        try:
            args = cls.args_class.from_dict(self.config, str(self.files_[0]))
            with torch.device("meta"):
                model = cls(args)
        except (MoechatError, TypeError, ValueError, ArithmeticError, LookupError, AttributeError):  # the load says
            return []  # why; fit counts them dequantized
        return model.packable_attention() if hasattr(model, "packable_attention") else []

    def packable_attention(self, layers) -> dict[str, GGUFTensorInfo]:
        """Of `layers`, the q/k/v/o projection weights (engine name -> info) of each layer whose four are all of a
        quantized type with no row transform (llama-type q/k permutations are undone on dequantized rows instead)."""
        out = {}
        for i in layers:
            names = [f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"]
            infos = [self.tensors.get(n) for n in names]
            if all(isinstance(info, GGUFTensorInfo) and info.ggml in VECDOT_TYPES and not info.transform
                   and len(info.shape) == 2 for info in infos):
                out.update(zip(names, infos, strict=True))
        return out

    def packed_attention(self, layers: list[int], device: torch.device, dtype: torch.dtype) -> dict:
        """The attention projections kept in their quant type, as `packed_dense` keeps the head: engine name
        (`model.layers.N.self_attn.{q,k,v,o}_proj.weight`) -> `GGUFMatrix`, for each of `layers` (those whose
        attention is the plain `Attention`: MoEForCausalLM.packable_attention) whose four are all of a quantized
        type with no row transform (llama-type q/k permutations are undone on the dequantized rows instead), on a
        CPU, unless MOECHAT_GGUF_PACKED=0. A Qwen3-30B-A3B Q4_K_M file's attention then reads ~0.52 GB a token
        instead of bf16's 1.81."""
        if device.type != "cpu" or os.environ.get(PACKED_ENV) == "0":
            return {}
        return {name: self._matrix(info, dtype) for name, info in self.packable_attention(layers).items()}

    def _matrix(self, info: GGUFTensorInfo, dtype: torch.dtype):
        """A 2-D quantized tensor as a `GGUFMatrix` over the file's memory map (pages read as its rows are used)."""
        from ..quant.gguf_dense import GGUFMatrix

        typ = TYPES[info.ggml]
        raw = self._raw(info.gguf_name)
        rows = info.shape[0]
        if len(info.shape) != 2 or raw.numel() != rows * typ.row_bytes(info.cols):
            raise CheckpointError(f"{info.file}: tensor {info.gguf_name!r} holds {raw.numel()} bytes; a "
                                  f"{info.ggml} matrix of {list(info.shape)} needs {rows * typ.row_bytes(info.cols)}",
                                  path=str(info.file), tensor=info.gguf_name)
        return GGUFMatrix(raw.reshape(rows, typ.row_bytes(info.cols)), typ, info.cols, dtype)

    def packed_dense(self, cls, device: torch.device, dtype: torch.dtype) -> dict:
        """The dense matrices kept in their quant type instead of dequantized at load: `lm_head.weight` (the file's
        output.weight) and `model.embed_tokens.weight` (token_embd; a tied model's LM head too), engine name ->
        `GGUFMatrix` (quant/gguf_dense.py) over the file's memory map. Where that saves bytes per token and the
        GGUF kernels run: a quantized type (F32/F16/BF16 are dequantized to the compute dtype as before), on a CPU,
        in a model whose `finalize` takes them (MoEForCausalLM's); MOECHAT_GGUF_PACKED=0 dequantizes them all."""
        from ..models.base import MoEForCausalLM

        if (device.type != "cpu" or os.environ.get(PACKED_ENV) == "0"
                or getattr(cls, "finalize", None) is not MoEForCausalLM.finalize):
            return {}
        out = {}
        for name in PACKED_DENSE:
            info = self.tensors.get(name)
            if not isinstance(info, GGUFTensorInfo) or info.ggml not in VECDOT_TYPES or info.transform:
                continue
            out[name] = self._matrix(info, dtype)
        return out


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute (rows of each head from rotate-half to interleaved pairs):
    [out, in] -> the HF checkpoint's row order."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _layer_map(arch: str, cfg: dict) -> dict[str, str]:
    """llama.cpp's per-layer tensor name (blk.{i}.X) -> the engine's (model.layers.{i}.Y)."""
    attn = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
            "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    moe = {"llama": "block_sparse_moe"}.get(arch, "mlp")
    out = {f"{k}.weight": f"{v}.weight" for k, v in attn.items()}
    out.update({f"{k}.bias": f"{v}.bias" for k, v in attn.items() if k in ("attn_q", "attn_k", "attn_v")})
    out["ffn_gate_inp.weight"] = f"{moe}.gate.weight"
    if arch == "gpt-oss":  # o_proj's bias, the sinks, the router (with a bias), the norm before the experts
        out.update({"attn_output.bias": "self_attn.o_proj.bias", "attn_sinks.weight": "self_attn.sinks",
                    "attn_sinks": "self_attn.sinks", "post_attention_norm.weight": "post_attention_layernorm.weight",
                    "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias"})
    if arch == "qwen2moe":  # the shared expert and its sigmoid gate
        out.update({"ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
                    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"})
    if arch == "deepseek2":  # MLA (attn_kv_b whole in older files; attn_k_b / attn_v_b are joined in open_gguf)
        out.update({"attn_q_a.weight": "self_attn.q_a_proj.weight",
                    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
                    "attn_q_b.weight": "self_attn.q_b_proj.weight",
                    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
                    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
                    "attn_kv_b.weight": "self_attn.kv_b_proj.weight"})
    if arch in ("glm4moe", "deepseek2"):  # always-on shared experts (one dense MLP of n_shared x I), correction bias
        out.update({"ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
                    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
                    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
                    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias"})
    # dense-MLP layers (a model's first layers, or mlp_only_layers)
    out.update({"ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
                "ffn_down.weight": "mlp.down_proj.weight"})
    return out


def _config(reader, arch: str, tensors: dict, where: str) -> dict:
    """The GGUF metadata as the config.json the engine's model class reads."""
    model_type, _ = ARCHES[arch]

    def key(k, default=None):
        return _value(reader, f"{arch}.{k}", default)

    def need(k):
        v = key(k)
        if v is None:
            raise CheckpointError(f"{where}: metadata key {arch}.{k} is missing; the file is not a complete "
                                  "llama.cpp model: download it again", path=where)
        return v

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    heads_kv = key("attention.head_count_kv", heads)
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise CheckpointError(f"{where}: tensor 'token_embd.weight' is missing from the GGUF file", path=where,
                              tensor="token_embd.weight")
    cfg = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(heads_kv if not isinstance(heads_kv, list) else heads_kv[0]),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "vocab_size": int(embd.shape[1]),
        "max_position_embeddings": int(key("context_length", 4096)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "num_experts_per_tok": int(need("expert_used_count")),
        "torch_dtype": "float32" if embd.tensor_type.name == "F32" else "bfloat16",
    }
    if (clamp := key("attention.clamp_kqv")) is not None:
        cfg["clip_qkv"] = float(clamp)
    if arch in ARCHES_2026:
        return config_2026(arch, cfg, key, need, tensors, where)
    experts = int(need("expert_count"))
    ff = key("feed_forward_length", 0)
    ff = int(ff[0] if isinstance(ff, list) else ff)
    if model_type == "qwen3_moe":
        cfg.update(num_experts=experts, moe_intermediate_size=int(key("expert_feed_forward_length", ff)),
                   intermediate_size=ff or int(key("expert_feed_forward_length", 0)),
                   norm_topk_prob=bool(key("expert_weights_norm", True)))  # llama.cpp renormalises Qwen3's top-k
    elif model_type == "qwen2_moe":
        cfg.update(num_experts=experts, moe_intermediate_size=int(need("expert_feed_forward_length")),
                   shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length", ff)),
                   intermediate_size=ff, norm_topk_prob=False)
    elif model_type == "olmoe":
        cfg.update(num_experts=experts, intermediate_size=int(key("expert_feed_forward_length", ff)),
                   norm_topk_prob=False)
    elif model_type == "glm4_moe":
        nextn = int(key("nextn_predict_layers", 0))
        cfg.update(n_routed_experts=experts, moe_intermediate_size=int(need("expert_feed_forward_length")),
                   intermediate_size=ff, n_shared_experts=int(key("expert_shared_count", 1)),
                   first_k_dense_replace=int(key("leading_dense_block_count", 0)),
                   routed_scaling_factor=float(key("expert_weights_scale", 1.0)),
                   norm_topk_prob=bool(key("expert_weights_norm", True)), n_group=int(key("expert_group_count", 1)),
                   topk_group=int(key("expert_group_used_count", 1)),
                   num_hidden_layers=cfg["num_hidden_layers"] - nextn,  # the MTP layers count in block_count
                   use_qk_norm="blk.0.attn_q_norm.weight" in tensors,
                   attention_bias="blk.0.attn_q.bias" in tensors,
                   partial_rotary_factor=int(key("rope.dimension_count", cfg["head_dim"] // 2)) / cfg["head_dim"])
        if int(key("expert_gating_func", 2)) != 2:
            raise UnsupportedModelError(f"{where}: glm4moe.expert_gating_func {key('expert_gating_func')} is not "
                                        "the sigmoid GLM-4.5 routes with; the file is not a GLM-4.5-family model")
    elif model_type == "gpt_oss":  # what GptOssModel.set_gguf_parameters writes; llama.cpp fixes the rest
        layers = cfg["num_hidden_layers"]
        rope = {"rope_type": "yarn", "factor": float(key("rope.scaling.factor", 32.0)),
                "original_max_position_embeddings": int(key("rope.scaling.original_context_length", 4096)),
                "beta_fast": float(key("rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(key("rope.scaling.yarn_beta_slow", 1.0)), "truncate": False,
                "rope_theta": cfg["rope_theta"]}
        if str(key("rope.scaling.type", "yarn")) != "yarn":
            raise UnsupportedModelError(f"{where}: gpt-oss.rope.scaling.type {key('rope.scaling.type')!r} is not the "
                                        "YaRN gpt-oss is trained with; the file is not a gpt-oss model")
        cfg.update(num_local_experts=experts, intermediate_size=int(key("expert_feed_forward_length", ff)),
                   sliding_window=int(key("attention.sliding_window", 128)), rope_parameters=rope,
                   # llama.cpp's gpt-oss: even layers slide, odd ones see everything (HF's layer_types)
                   layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
    elif model_type == "deepseek_v2":  # what DeepseekV2Model.set_gguf_parameters writes
        nextn = int(key("nextn_predict_layers", 0))
        gating = key("expert_gating_func")  # 1 softmax (V2), 2 sigmoid (V3, R1, Kimi K2, GLM-4.7-Flash)
        # GLM-4.7-Flash (glm4_moe_lite, written as deepseek2) files carry no gating key; llama.cpp's loader takes
        # sigmoid for them (47 or 48 blocks and GLM's 154,880-token vocabulary), softmax for DeepSeek-V2's older files
        glm = _value(reader, "tokenizer.ggml.pre") == "glm4" or (
            int(need("block_count")) in (47, 48) and cfg["vocab_size"] == 154880)
        gating = int(gating if gating is not None else 2 if glm else 1)
        if gating not in (1, 2):
            raise UnsupportedModelError(f"{where}: deepseek2.expert_gating_func {gating} is neither the softmax of "
                                        "DeepSeek-V2 nor the sigmoid of DeepSeek-V3; moechat cannot route this file")
        rope_dim = int(need("rope.dimension_count"))
        # recent converters (MLA absorbed) write key/value_length as the latent's and the per-head sizes as *_mla
        qk = int(key("attention.key_length_mla", 0) or need("attention.key_length"))
        v_dim = int(key("attention.value_length_mla", 0) or need("attention.value_length"))
        n_group = int(key("expert_group_count", 1) or 1)
        family = ("glm4_moe_lite" if glm else "deepseek_v3") if gating == 2 else "deepseek_v2"
        cfg.update(model_type=family, n_routed_experts=experts,
                   num_key_value_heads=heads, moe_intermediate_size=int(need("expert_feed_forward_length")),
                   intermediate_size=ff, n_shared_experts=int(key("expert_shared_count", 0)),
                   first_k_dense_replace=int(key("leading_dense_block_count", 0)),
                   routed_scaling_factor=float(key("expert_weights_scale", 1.0)),
                   norm_topk_prob=bool(key("expert_weights_norm", False)), n_group=n_group,
                   topk_group=int(key("expert_group_used_count", 1) or 1),
                   kv_lora_rank=int(need("attention.kv_lora_rank")),
                   q_lora_rank=int(key("attention.q_lora_rank", 0)) or None, qk_rope_head_dim=rope_dim,
                   qk_nope_head_dim=qk - rope_dim, v_head_dim=v_dim, head_dim=rope_dim,
                   num_hidden_layers=cfg["num_hidden_layers"] - nextn)
        if gating == 2:
            cfg.update(topk_method="noaux_tc", scoring_func="sigmoid", rope_interleave=True,
                       num_nextn_predict_layers=nextn)
        else:
            cfg.update(topk_method="group_limited_greedy" if n_group > 1 else "greedy", scoring_func="softmax")
        if str(key("rope.scaling.type", "none")) == "yarn":  # mscale == mscale_all_dim: the log multiplier / 0.1
            mscale = float(key("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
            orig = int(need("rope.scaling.original_context_length"))
            cfg["rope_parameters"] = {"rope_type": "yarn", "factor": float(need("rope.scaling.factor")),
                                      "original_max_position_embeddings": orig,
                                      "beta_fast": float(key("rope.scaling.yarn_beta_fast", 32.0)),
                                      "beta_slow": float(key("rope.scaling.yarn_beta_slow", 1.0)),
                                      "mscale": mscale, "mscale_all_dim": mscale, "rope_theta": cfg["rope_theta"]}
    else:  # mixtral
        cfg.update(num_local_experts=experts, intermediate_size=int(key("expert_feed_forward_length", ff)))
    return cfg


def open_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Read a GGUF model's header(s): its config, its tensors under the engine's names, its expert format."""
    files = gguf_files(path)
    readers = [_read(f) for f in files]
    first, where = readers[0], str(files[0])
    count = _value(first, "split.count", 1)
    if len(files) > 1 and count != len(files):
        raise CheckpointError(f"{where}: says the model is split in {count} files, found {len(files)}",
                              path=where)
    raw: dict[str, tuple] = {}  # gguf name -> (reader tensor, file)
    for reader, f in zip(readers, files, strict=True):
        for t in reader.tensors:
            if t.name in raw:
                raise CheckpointError(f"{f}: tensor {t.name!r} also appears in {raw[t.name][1].name}", path=str(f),
                                      tensor=t.name)
            raw[t.name] = (t, f)
    want = _value(first, "split.tensors.count")
    if want is not None and want != len(raw):
        raise CheckpointError(f"{where}: the split says {want} tensors, its files hold {len(raw)} (a part is from "
                              "another download? download them again)", path=where)
    arch = _value(first, "general.architecture")
    if not isinstance(arch, str):
        raise CheckpointError(f"{where}: no general.architecture in the metadata; not a llama.cpp model file",
                              path=where)
    tensors_by_gguf = {name: t for name, (t, _) in raw.items()}
    if arch == "llama" and _value(first, "llama.expert_count", 0) in (0, None):
        arch = "llama-dense"
    if arch not in ARCHES:
        runs = "qwen3moe, qwen2moe, olmoe, glm4moe, gpt-oss, deepseek2, llama (Mixtral), " + ", ".join(ARCHES_2026)
        if arch in DENSE_ARCHES or arch == "llama-dense":
            raise UnsupportedModelError(f"{where}: architecture {arch.replace('-dense', '')!r} is a dense model, not "
                                        f"a Mixture-of-Experts; moechat runs GGUF files of {runs}")
        raise UnsupportedModelError(f"{where}: GGUF architecture {arch!r} is not supported; moechat runs GGUF files "
                                    f"of {runs}")
    cfg = _config(first, arch, tensors_by_gguf, where)
    permute = ARCHES[arch][1]
    layer_map = _layer_map(arch, cfg)
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    tensors: dict[str, GGUFTensorInfo] = {}
    expert_types: dict[str, set[str]] = {"w1": set(), "w3": set(), "w2": set(), "w13": set()}
    parts = {"ffn_gate_exps.weight": "w1", "ffn_up_exps.weight": "w3", "ffn_down_exps.weight": "w2",
             "ffn_gate_up_exps.weight": "w13"}  # Gemma 4's converter keeps HF's gate_up fused
    biases = ("ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias")  # gpt-oss: [E, rows] per projection
    for name, (t, f) in raw.items():
        typ = ggml_type(int(t.tensor_type), name)  # a type moechat cannot compute: one line naming the tensor
        ne = [int(d) for d in t.shape]  # ggml order: ne0 (the input) first
        shape = tuple(reversed(ne))
        start, end = int(t.data_offset), int(t.data_offset) + int(t.n_bytes)
        m = re.match(r"^blk\.(\d+)\.(.+)$", name)
        if m and m.group(2) in parts:
            if len(ne) != 3:
                raise CheckpointError(f"{f}: tensor {name!r} has shape {list(shape)}; stacked experts need 3 "
                                      "dimensions [experts, rows, columns]", path=str(f), tensor=name)
            expert_types[parts[m.group(2)]].add(typ.name)
            tensors[name] = GGUFTensorInfo(name, f, "U8", (ne[2], ne[1], typ.row_bytes(ne[0])), start, end,
                                           typ.name, name, ne[0])
            continue
        if m and m.group(2) in biases:  # read by the disk tier as they lie in the file: a float type, [E, rows]
            if typ.name not in ("F32", "F16", "BF16") or len(ne) != 2:
                raise CheckpointError(f"{f}: tensor {name!r} is {typ.name} {list(reversed(ne))}; expert biases "
                                      "need F32, F16 or BF16 [experts, rows]", path=str(f), tensor=name)
            tensors[name] = GGUFTensorInfo(name, f, typ.name, (ne[1], ne[0]), start, end, typ.name, name, ne[0])
            continue
        if arch in ARCHES_2026:  # names, shapes and conventions from gguf_arches.py's tables
            spec = tensor_2026(arch, cfg, name, shape, raw, str(f))
            if spec is not None:
                hf, shape, transform, other = spec
                tensors[hf] = GGUFTensorInfo(hf, f, "F32", shape, start, end, typ.name, name, ne[0], transform, other)
            continue
        if m and arch == "deepseek2" and m.group(2) in ("attn_k_b.weight", "attn_v_b.weight"):
            if m.group(2) == "attn_v_b.weight":
                continue  # joined with attn_k_b
            v_name = f"blk.{m.group(1)}.attn_v_b.weight"
            v = raw.get(v_name)
            if v is None or len(ne) != 3 or len(v[0].shape) != 3:
                raise CheckpointError(f"{f}: tensor {name!r} needs its pair {v_name!r}, both [heads, ., .] (a "
                                      "damaged conversion? convert or download it again)", path=str(f), tensor=name)
            ggml_type(int(v[0].tensor_type), v_name)
            vne = [int(d) for d in v[0].shape]  # k_b ne [N, C, nH], v_b ne [C, V, nH]
            hf = f"model.layers.{m.group(1)}.self_attn.kv_b_proj.weight"
            tensors[hf] = GGUFTensorInfo(hf, f, "F32", (ne[2] * (ne[0] + vne[1]), ne[1]), start, end, typ.name, name,
                                         ne[1], "kv_b", v_name)
            continue
        if m:
            hf = layer_map.get(m.group(2))
            if hf is None:
                continue  # a tensor this architecture's engine does not read (e.g. a rope_freqs table)
            hf = f"model.layers.{m.group(1)}.{hf}"
        else:
            hf = top.get(name)
            if hf is None:
                continue
        transform = ""
        if permute and m and m.group(2) in ("attn_q.weight", "attn_k.weight"):
            transform = "permute_q" if m.group(2).startswith("attn_q") else "permute_k"
        if hf.endswith("shared_expert_gate.weight") and len(shape) == 1:
            shape = (1, shape[0])  # a converter may write HF's [1, H] gate as the 1-D [H] llama.cpp reads
        tensors[hf] = GGUFTensorInfo(hf, f, "F32", shape, start, end, typ.name, name, ne[0], transform)
    fmt, layer_formats = None, None
    if any(expert_types.values()):
        per_layer: dict[int, tuple[str | None, str, str]] = {}
        ungated = not expert_types["w1"]  # Nemotron-H's relu^2 experts: ffn_up_exps and ffn_down_exps only
        fused = bool(expert_types["w13"])
        for layer in range(cfg["num_hidden_layers"]):
            gate, up, down, gate_up = [f"blk.{layer}.{p}" for p in parts]
            if fused and gate_up in tensors and down in tensors:
                per_layer[layer] = (tensors[gate_up].ggml, tensors[gate_up].ggml, tensors[down].ggml)
            elif not fused and up in tensors and down in tensors and (ungated or gate in tensors):
                per_layer[layer] = (None if ungated else tensors[gate].ggml, tensors[up].ggml, tensors[down].ggml)
        combos = list(dict.fromkeys(per_layer.values()))
        # Q4_K_M and the UD mixes change ffn_down_exps' type from layer to layer: one format per layer (resident)
        common = max(combos, key=list(per_layer.values()).count)
        interleaved = arch == "gpt-oss"  # its clamped SwiGLU reads gate/up rows interleaved
        fmt = GGUFFormat(*common, interleaved=interleaved, fused=fused)
        if len(combos) > 1:
            layer_formats = {layer: GGUFFormat(*ts, interleaved=interleaved, fused=fused)
                             for layer, ts in per_layer.items()}
    ckpt = GGUFCheckpoint(files, readers, tensors, cfg, fmt, first)
    ckpt.layer_formats = layer_formats
    return ckpt


def gguf_text(path: str | os.PathLike):
    """(generation_config, tokenizer or None, ChatTemplate or None) from a GGUF model's tokenizer.* metadata
    (engine/text/gguf_tokenizer.py); a file without a vocabulary runs on token ids alone."""
    from ..errors import TokenizerError
    from ..text.chat_template import ChatTemplate
    from ..text.gguf_tokenizer import tokenizer_from_gguf

    files = gguf_files(path)
    reader = _read(files[0])
    if reader.get_field("tokenizer.ggml.model") is None and reader.get_field("tokenizer.huggingface.json") is None:
        return {}, None, None
    try:
        text = tokenizer_from_gguf(reader, where=str(files[0]))
    except TokenizerError:
        raise
    generation_config = {"eos_token_id": list(text.eos_token_ids)} if text.eos_token_ids else {}
    template = (ChatTemplate.from_string(text.chat_template, text.tokenizer.special_tokens)
                if text.chat_template else None)
    return generation_config, text.tokenizer, template


class MixedExpertStore:
    """The experts of a GGUF whose types change from layer to layer (Q4_K_M's ffn_down_exps: Q6_K in some layers,
    Q4_K in the rest): each layer checked against its own `GGUFFormat`'s layout (a typed error naming the tensor)
    and read per expert with preadv straight from the file, as the disk tier reads uniform ones; gpt-oss's expert
    biases (float [E, rows], wherever the file has them) converted to the slot's dtype on the way."""

    def __init__(self, ckpt: GGUFCheckpoint, layers: list[int], hidden: int, inter: int, dtype: torch.dtype):
        self.formats = ckpt.layer_formats
        self.ckpt = ckpt
        self.shapes: dict[int, dict] = {}
        self._infos: dict[int, dict[str, TensorInfo]] = {}
        for layer in layers:
            fmt = self.formats.get(layer)
            if fmt is None:
                raise CheckpointError(f"{ckpt.model_dir}: layer {layer} has no ffn_{{gate,up,down}}_exps tensors",
                                      path=str(ckpt.model_dir))
            shapes = fmt.layout(hidden, inter, dtype, bias=f"blk.{layer}.ffn_down_exps.bias" in ckpt.tensors)
            self.shapes[layer] = shapes
            self._infos[layer] = {}
            for part, (shape, _) in shapes.items():
                info = ckpt.info(fmt.tensor_names[part].format(layer=layer))
                E = info.shape[0]
                if info.shape[1:] != tuple(shape):
                    raise CheckpointError(f"{info.file}: tensor {info.name!r} has shape {list(info.shape)}, the "
                                          f"config and its {info.ggml} type imply {[E, *shape]}", path=str(info.file),
                                          tensor=info.name)
                self._infos[layer][part] = info
        self._fds: dict[Path, int] = {}

    def read_into(self, layer: int, expert: int, dst) -> None:
        for part, info in self._infos[layer].items():
            if part.endswith("_bias"):  # a few KB: from the memmap, converted to the slot's dtype
                stored = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[info.ggml]
                dst[part].copy_(self.ckpt._raw(info.gguf_name).view(stored).reshape(info.shape)[expert])
                continue
            per = info.nbytes // info.shape[0]
            fd = self._fds.get(info.file)
            if fd is None:
                fd = self._fds[info.file] = os.open(info.file, os.O_RDONLY)
            view = memoryview(dst[part].view(torch.uint8).numpy()).cast("B")
            done = 0
            while done < per:
                n = os.preadv(fd, [view[done:]], info.start + expert * per + done)
                if n <= 0:
                    raise CheckpointError(f"{info.file}: ended while reading expert {expert} of layer {layer} "
                                          "(was the file replaced while moechat ran?)", path=str(info.file))
                done += n

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def resident_mixed_provider(ckpt: GGUFCheckpoint, cls, args, dtype: torch.dtype, device: torch.device):
    """Every expert of a mixed-type GGUF resident, packed, each layer computed in its own format."""
    from ..cache import hostmem
    from ..layers.moe import ExpertBatch, ResidentProvider

    class LayerFormatProvider(ResidentProvider):
        def __init__(self, tensors, num_layers, formats):
            super().__init__(tensors, num_layers, next(iter(formats.values())))
            self.formats = formats

        def prepare(self, layer: int, topk_ids: torch.Tensor) -> ExpertBatch:
            batch = super().prepare(layer, topk_ids)
            return replace(batch, format=self.formats[layer])

    from dataclasses import replace

    layers = cls.moe_layers(args)
    store = MixedExpertStore(ckpt, layers, args.hidden_size, args.moe_intermediate, dtype)
    E = args.num_experts
    tensors = {}
    try:
        for layer in layers:
            tensors[layer] = {name: hostmem.empty((E, *shape), dt, torch.device("cpu"))
                              for name, (shape, dt) in store.shapes[layer].items()}
            for e in range(E):
                store.read_into(layer, e, {name: t[e] for name, t in tensors[layer].items()})
    finally:
        store.close()
    if device.type != "cpu":
        tensors = {layer: {n: t.to(device) for n, t in ts.items()} for layer, ts in tensors.items()}
    return LayerFormatProvider(tensors, args.num_hidden_layers, {layer: store.formats[layer] for layer in layers})
