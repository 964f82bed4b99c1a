"""`ModelSpec` exact from the files: safetensors headers (`spec_from_headers`), a GGUF's headers (`gguf_spec`), and
`read_model_spec`, which takes a model folder or a cached Hub repo id and reads whichever it holds.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path

from ..errors import ConfigError
from ..io.validate import check_index
from ..units import GiB
from .spec import FLOAT_DTAGS, ModelSpec, TensorSpec, gib
from .spec_config import _fp32_weights, _load_json, spec_from_config

# The decoder stack's prefix as checkpoints spell it: model. (most), model.language_model. (a multimodal wrapper's
# text model), backbone. (Nemotron-H); mtp.layers.N (a next-token-prediction head) is none of them.
_STACK = r"^(?:model\.language_model\.|model\.|backbone\.)?layers\.(\d+)\."
_PER_EXPERT = re.compile(_STACK + r"(?:.*\.)?experts\.(\d+)\.(.+)$")
_FUSED = re.compile(_STACK + r"(?:.*\.)?experts\.([A-Za-z_][\w.]*)$")
_LAYER = re.compile(_STACK)


def _numel(shape) -> int:
    return math.prod(shape) if shape else 1


def spec_from_headers(config: dict, tensors: dict, *, name: str = "", where: str = "config.json") -> ModelSpec:
    """Exact sizes from the safetensors headers (`tensors`: name -> object with .dtype, .shape, .nbytes)."""
    est = spec_from_config(config, name=name, where=where)  # architecture numbers, KV, context
    notes: list[str] = []
    E, L = est.num_experts, est.num_layers
    per_expert: dict[tuple[int, int], dict[str, TensorSpec]] = {}
    parts: dict[str, int] = {}
    float_elems = embedding = shared = unused = 0
    fp8_dense: dict[str, list[int]] = {}  # what -> [bytes in the checkpoint, elements once dequantized]
    keep32 = _fp32_weights(est.model_type)
    for tname, info in tensors.items():
        dtag, shape, nbytes = info.dtype, tuple(info.shape), int(info.nbytes)
        layer_m = _LAYER.match(tname)
        if layer_m and int(layer_m.group(1)) >= L:
            unused += nbytes  # e.g. DeepSeek-V3's multi-token-prediction layer 61
            continue
        m = _PER_EXPERT.match(tname)
        if m:
            key = (int(m.group(1)), int(m.group(2)))
            per_expert.setdefault(key, {})[m.group(3)] = TensorSpec(m.group(3), shape, dtag, nbytes)
            continue
        m = _FUSED.match(tname)
        if m and shape and shape[0] == E:
            for e in range(E):
                per_expert.setdefault((int(m.group(1)), e), {})[m.group(2)] = TensorSpec(
                    m.group(2), shape[1:], dtag, nbytes // E)
            continue
        if "embed_tokens" in tname or tname.endswith(("wte.weight", "backbone.embeddings.weight")):
            what = "embeddings"
            embedding += nbytes
        elif tname.startswith("lm_head"):
            what = "lm_head"
        elif "shared_expert" in tname:
            what = "shared experts"
            shared += nbytes
        elif ".self_attn." in tname or ".attention." in tname or ".linear_attn." in tname:
            what = "attention"  # Qwen3-Next / Qwen3.5's Gated DeltaNet layers: --dense-format packs them alike
        elif ".mixer." in tname and re.search(r"\.mixer\.[qkvo]_proj\.", tname):
            what = "attention"  # Nemotron-H's attention layers
        elif ".mixer." in tname and re.search(r"\.mixer\.(in_proj|out_proj|conv1d|A_log|D|dt_bias|norm)\b", tname):
            what = "Mamba-2 layers"
        elif re.search(r"\.mixer\.(up|down)_proj\.", tname):
            what = "dense MLP layers"  # Nemotron-H's MLP layers
        elif re.search(r"\.(gate|router)\.", tname) or "e_score_correction" in tname:
            what = "routers"
        elif "norm" in tname:
            what = "norms"
        elif ".mlp." in tname:
            what = "dense MLP layers"
        else:
            what = "other"
        if keep32 and tname.endswith(keep32):  # held in fp32 whatever the checkpoint stores it in
            nbytes = 4 * _numel(shape)
        parts[what] = parts.get(what, 0) + nbytes
        if dtag in FLOAT_DTAGS and "scale" not in tname and not (keep32 and tname.endswith(keep32)):
            float_elems += _numel(shape)
        if dtag.startswith("F8") or tname.endswith(".weight_scale_inv"):  # dequantized at load (loader.py)
            f8 = fp8_dense.setdefault(what, [0, 0])
            f8[0] += nbytes
            f8[1] += 0 if tname.endswith("_scale_inv") else _numel(shape)
    if not per_expert:
        raise ConfigError(f"{where}: no routed-expert tensors found in the safetensors headers (expected names "
                          "like model.layers.N.mlp.experts.E.* or fused model.layers.N.mlp.experts.*)")
    moe_layers = tuple(sorted({layer for layer, _ in per_expert}))
    sizes = {key: sum(t.nbytes for t in ts.values()) for key, ts in per_expert.items()}
    first = per_expert[min(per_expert)]
    if len(set(sizes.values())) > 1:
        notes.append(f"experts differ in size ({min(sizes.values())}..{max(sizes.values())} B); planning with "
                     "the largest")
        first = per_expert[max(sizes, key=sizes.get)]
    missing = len(moe_layers) * E - len(per_expert)
    if missing:
        notes.append(f"{missing} (layer, expert) pairs have no tensors in the headers")
    if moe_layers != est.moe_layers:
        notes.append(f"headers have experts on {len(moe_layers)} layers, config.json implies {len(est.moe_layers)}")
    expert = tuple(first[k] for k in sorted(first))
    dtags = {t.dtype for t in expert}
    fmt = est.expert_format if dtags - set(FLOAT_DTAGS) else "/".join(sorted(d.lower() for d in dtags))
    params = sum(_numel(t.shape) * (2 if t.dtype == "U8" and t.name.endswith("_blocks") else 1)
                 for t in expert if "scale" not in t.name)
    total = sum(int(i.nbytes) for i in tensors.values())
    float_by_size: dict[int, int] = {}
    for info in tensors.values():
        if info.dtype in FLOAT_DTAGS:
            float_by_size[FLOAT_DTAGS[info.dtype]] = float_by_size.get(FLOAT_DTAGS[info.dtype], 0) + int(info.nbytes)
    fbytes = max(float_by_size, key=float_by_size.get) if float_by_size else est.float_bytes
    fname = {4: "float32", 2: est.float_dtype if est.float_bytes == 2 else "bfloat16", 8: "float64"}[fbytes]
    if fp8_dense:
        stored = sum(b for b, _ in fp8_dense.values())
        for what, (b, n) in fp8_dense.items():
            parts[what] += n * fbytes - b
            float_elems += n
        loaded = sum(n for _, n in fp8_dense.values()) * fbytes
        notes.append(f"the checkpoint's FP8 dense weights ({stored / GiB:.2f} GiB with their scales) are "
                     f"dequantized to {fname} at load: {loaded / GiB:.2f} GiB in memory")
    notes.insert(0, "sizes read from the safetensors headers")
    return replace(
        est, source="safetensors headers", estimated=False, moe_layers=moe_layers, expert_tensors=expert,
        stored_expert_bytes=sum(t.nbytes for t in expert),
        expert_format=fmt, expert_params=params or est.expert_params, dense_parts=tuple(parts.items()),
        dense_float_elems=float_elems, embedding_bytes=embedding if "lm_head" in parts else 0,
        float_bytes=fbytes, float_dtype=fname,
        shared_expert_bytes=shared, checkpoint_bytes=total, weights_present=True, present_bytes=total,
        unused_bytes=unused, notes=tuple(notes + [n for n in est.notes if "multi-token" in n.lower()]))


def _resolve_model_dir(model: str | os.PathLike) -> Path:
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    text = str(model)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text) and not path.exists():
        try:
            from huggingface_hub import try_to_load_from_cache  # reads the local cache only, no network

            from ..paths import default_cache_dir  # HF_HOME / HF_HUB_CACHE now (huggingface_hub read them at import)

            cached = try_to_load_from_cache(text, "config.json", cache_dir=default_cache_dir())
        except Exception:  # noqa: BLE001 - a broken cache is the same as no cache here
            cached = None
        if isinstance(cached, str):
            return Path(cached).parent
        raise ConfigError(f"{text}: not a local directory, and its config.json is not in the Hugging Face cache; "
                          f"moechat fit {text} reads it from the Hub when HF_HUB_OFFLINE is not set, and moechat pull "
                          f"{text} downloads the model")
    raise ConfigError(f"{model}: no such model directory")


@dataclass(frozen=True)
class GGUFModelSpec(ModelSpec):
    """A GGUF model's spec: `packed_parts` the dense parts counted as the file packs them ("lm_head", "embeddings",
    "attention"):
    --dense-format leaves a packed head as it is (MoEForCausalLM.quantize_dense; a tied one is the table) and --dtype
    converts only the parts dequantized at load."""

    packed_parts: tuple[str, ...] = ()
    packed_elems: tuple[tuple[str, int], ...] = ()  # (part, weights): what each packed part holds once dequantized

    def for_gpu(self) -> ModelSpec:
        """On a GPU the loader dequantizes the head, the table and attention too (packing is CPU-only): their bytes in
        the compute dtype."""
        if not self.packed_parts:
            return self
        elems = dict(self.packed_elems)
        fb = self.float_bytes
        parts = tuple((w, elems[w] * fb if w in elems else b) for w, b in self.dense_parts)
        embedding = elems["embeddings"] * fb if "embeddings" in elems else self.embedding_bytes
        return replace(self, dense_parts=parts, embedding_bytes=embedding, packed_parts=(), packed_elems=(),
                       notes=self.notes + ("on a GPU the matrices a CPU keeps packed are dequantized at load: "
                                           "counted so",))

    def in_dense_format(self, name: str | None) -> ModelSpec:
        """--dense-format leaves what the file packs as it is: a packed head and packed attention keep their bytes
        (no int8 / int4 copy); a tied packed table stays the head, read whole each token."""
        out = super().in_dense_format(name)
        if out is self:
            return out
        before = dict(self.dense_parts)
        keep = {w for w in ("attention", "lm_head") if w in self.packed_parts and w in before}
        parts = tuple((w, before[w] if w in keep else b) for w, b in out.dense_parts)
        if "lm_head" not in before and "embeddings" in self.packed_parts:  # tied: no int8 copy beside the table
            return replace(out, dense_parts=tuple((w, b) for w, b in parts if w != "lm_head"),
                           embedding_bytes=self.embedding_bytes)
        return replace(out, dense_parts=parts)

    def in_dtype(self, elem_bytes: int, name: str) -> ModelSpec:
        out = super().in_dtype(elem_bytes, name)
        if out is self or not self.packed_parts:
            return out
        ratio = elem_bytes / self.float_bytes  # every other dense tensor of a GGUF is held in the compute dtype
        parts = tuple((w, b if w in self.packed_parts else int(b * ratio)) for w, b in self.dense_parts)
        embedding = self.embedding_bytes if "embeddings" in self.packed_parts else int(self.embedding_bytes * ratio)
        return replace(out, dense_parts=parts, embedding_bytes=embedding)


def gguf_spec(path: str | os.PathLike) -> ModelSpec:
    """`moechat fit FILE.gguf`: the plan's ModelSpec from the header(s) alone. The routed experts count as the file
    packs them (their ggml types' bytes, every tier); the output and embedding matrices of a quantized type too (the
    loader keeps them packed: load/gguf.py `packed_dense`), a head --dense-format leaves as it is (`GGUFModelSpec`);
    every other tensor as the loader holds it, dequantized to the compute dtype; a note gives the file's packed
    bytes per ggml type."""
    import numpy as np

    from ..io.checkpoint import TensorInfo
    from ..load.gguf import PACKED_DENSE, open_gguf
    from ..quant.gguf import VECDOT_TYPES

    ckpt = open_gguf(path)
    cfg = ckpt.config
    layers = range(int(cfg.get("num_hidden_layers") or 0))
    attention = ckpt.packable_attention(ckpt.attention_layers())  # q/k/v/o the loader keeps packed on a CPU
    fdtag, fbytes = ("F32", 4) if cfg["torch_dtype"] == "float32" else ("BF16", 2)
    held: dict[str, TensorInfo] = {}
    kept: dict[str, str] = {}  # engine name -> ggml type: the dense matrices counted packed
    by_type: dict[str, int] = {}
    parts = {"ffn_gate_exps": "gate_gguf", "ffn_up_exps": "up_gguf", "ffn_down_exps": "down_gguf",
             "ffn_gate_up_exps": "gate_up_gguf"}  # Gemma 4's fused gate and up
    for reader in ckpt.readers:  # the file's bytes per type (deepseek2's attn_k_b + attn_v_b are one kv_b_proj below)
        for t in reader.tensors:
            by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
    for name, info in ckpt.tensors.items():
        m = re.match(r"^blk\.(\d+)\.(ffn_\w+_exps)\.(weight|bias)$", name)
        if m and m.group(3) == "weight":
            hf = f"model.layers.{m.group(1)}.mlp.experts.{parts[m.group(2)]}"
            held[hf] = TensorInfo(hf, info.file, "U8", info.shape, info.start, info.end)
        elif m:  # gpt-oss's expert biases: in every tier with their expert, in the compute dtype
            hf = f"model.layers.{m.group(1)}.mlp.experts.{parts[m.group(2)]}_bias"
            held[hf] = TensorInfo(hf, info.file, fdtag, info.shape, 0, int(np.prod(info.shape)) * fbytes)
        elif (name in PACKED_DENSE and getattr(info, "ggml", "") in VECDOT_TYPES) or name in attention:
            held[name] = TensorInfo(name, info.file, "U8", info.shape, info.start, info.end)  # as the file stores it
            kept[name] = info.ggml
        else:
            n = int(np.prod(info.shape)) * fbytes
            held[name] = TensorInfo(name, info.file, fdtag, info.shape, 0, n)
    spec = spec_from_headers(cfg, held, name=Path(path).name, where=str(ckpt.files_[0]))
    packed_parts = tuple(what for what, name in (("lm_head", "lm_head.weight"), ("embeddings",
                                                                               "model.embed_tokens.weight"))
                         if name in kept)
    names = {"lm_head": "lm_head.weight", "embeddings": "model.embed_tokens.weight"}
    packed_elems = tuple((what, int(np.prod(ckpt.tensors[names[what]].shape))) for what in packed_parts)
    if attention and len(attention) == 4 * len(layers):  # every layer's: the part stays as the file packs it
        packed_parts += ("attention",)
        packed_elems += (("attention", sum(int(np.prod(i.shape)) for n, i in ckpt.tensors.items()
                                           if ".self_attn." in n)),)
    spec = GGUFModelSpec(**{f.name: getattr(spec, f.name) for f in fields(ModelSpec)}, packed_parts=packed_parts,
                         packed_elems=packed_elems)
    types = "/".join(t.name for t in ckpt.expert_format.types.values()) if ckpt.expert_format else "none"
    roles = "/".join({"w1": "gate", "w3": "up", "w13": "gate_up", "w2": "down"}[p]  # ungated, fused (Gemma 4)
                     for p in (ckpt.expert_format.types if ckpt.expert_format else ()))
    packed = ", ".join(f"{t} {gib(b)}" for t, b in sorted(by_type.items(), key=lambda kv: -kv[1]))
    size = sum(f.stat().st_size for f in ckpt.files_)
    notes = (f"GGUF file of {gib(size)}, packed per type: {packed}",
             f"experts kept packed as the file stores them ({types}, {roles}); the other tensors dequantized "
             f"at load to {cfg['torch_dtype']}" + ("; kept packed on a CPU (dequantized on a GPU): " + ", ".join(
                 [f"the {'output' if n == 'lm_head.weight' else 'embedding'} matrix ({t})" for n, t in kept.items()
                  if n in PACKED_DENSE]
                 + ([f"attention's projections ({'/'.join(sorted({attention[n].ggml for n in attention}))}, "
                     f"{len(attention) // 4} of {len(layers)} layers)"] if attention else []))
                 if kept else ""))
    spec = replace(spec, expert_format=f"GGUF {types}", checkpoint_bytes=size, present_bytes=size,
                   path=str(path), notes=tuple(n for n in spec.notes if "safetensors" not in n) + notes)
    return spec


def read_model_spec(model: str | os.PathLike) -> ModelSpec:
    """The spec of a local model directory (or a Hub id already in the local cache).

    Complete safetensors weights: exact sizes from their headers. Only config.json (plus, perhaps, the
    index or some shards): estimates from the config, checked against the index's total_size.
    """
    path = Path(model).expanduser()
    if path.suffix == ".gguf" or (path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf"))):
        return gguf_spec(path)  # a GGUF model: sizes from its header(s), experts packed as stored
    model_dir = _resolve_model_dir(model)
    cfg_path = model_dir / "config.json"
    config = _load_json(cfg_path, "model config (config.json)")
    name = model_dir.name
    index_path = model_dir / "model.safetensors.index.json"
    index = check_index(_load_json(index_path, "safetensors index"), str(index_path)) if index_path.exists() else None
    if index is not None:
        shards = sorted({v for v in (index.get("weight_map") or {}).values() if isinstance(v, str)})
    else:
        shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    present = [s for s in shards if (model_dir / s).is_file()]
    if shards and len(present) == len(shards):
        from ..io.checkpoint import Checkpoint  # torch is imported only when there are weights to read

        ckpt = Checkpoint.open(model_dir)
        spec = spec_from_headers(config, ckpt.tensors, name=name, where=str(cfg_path))
        return replace(spec, path=str(model_dir))
    present_bytes = sum((model_dir / s).stat().st_size for s in present)
    spec = spec_from_config(config, name=name, index=index, present_bytes=present_bytes, where=str(cfg_path))
    extra = []
    if present:
        extra.append(f"{len(present)} of {len(shards)} shards present: sizes estimated until the download completes")
    elif not shards and any((model_dir / n).exists() for n in ("pytorch_model.bin", "model.pt")):
        extra.append("only pickle weights here; moechat runs safetensors only")
    return replace(spec, path=str(model_dir), notes=spec.notes + tuple(extra))

