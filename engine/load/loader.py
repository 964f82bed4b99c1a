"""Loading a model directory: config -> architecture -> validated checkpoint -> weights + experts.

The model is built on the meta device, so nothing is allocated until a tensor is assigned. Every
tensor the architecture needs is checked against the safetensors headers first (name, shape, float
dtype); a mismatch is a `CheckpointError` naming the file and the tensor, raised before any weight is
read. Dense weights are then assigned from the memory-mapped shards (`load_state_dict(assign=True)`,
strict), and the routed experts are stacked per layer into `w13 [E, 2I, H]` / `w2 [E, H, I]` for the
`ResidentProvider`, whatever the checkpoint's per-expert naming.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cache import hostmem
from ..cache.repacked import RepackedStore
from ..cache.store import DiskStore, expert_tensor_names, fill, populate, scan_finite
from ..errors import CheckpointError, ConfigError, UnsupportedModelError
from ..io.checkpoint import Checkpoint, read_json
from ..io.validate import check_layers, show
from ..layers.moe import ResidentProvider
from ..models import ARCHITECTURES, DENSE, PLANNED_MOE, MoEForCausalLM
from ..models.base import BaseModelArgs
from ..quant import ExpertFormat, native_format
from ..quant.dense import DENSE as DENSE_FORMAT
from ..quant.registry import target_format

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_model_config(model_dir: str | os.PathLike) -> tuple[type[MoEForCausalLM], BaseModelArgs, dict]:
    """config.json -> (architecture class, parsed args, raw dict), or a typed error saying why not."""
    model_dir = Path(model_dir)
    from .gguf import is_gguf, open_gguf

    if is_gguf(model_dir):  # a .gguf file (or a split's first, or a folder holding one): its metadata is the config
        return model_config(open_gguf(model_dir).config, model_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"{model_dir}: no such model directory")
    return model_config(read_json(model_dir / "config.json", "model config (config.json)"), model_dir)


def model_config(raw: dict, model_dir: str | os.PathLike) -> tuple[type[MoEForCausalLM], BaseModelArgs, dict]:
    """A config.json's dict (read from `model_dir`, or fetched from the Hub for that repo) -> (architecture class,
    parsed args, raw dict), or a typed error saying why not."""
    model_dir = Path(model_dir)
    where = str(model_dir / "config.json")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(f"{where}: model_type = {show(model_type)} is not allowed: must be a string naming "
                          "the architecture (e.g. \"qwen3_moe\")", path=where, key="model_type")
    if model_type not in ARCHITECTURES:
        if raw.get("auto_map") and model_type not in PLANNED_MOE | DENSE:
            raise UnsupportedModelError(
                f"{model_dir}: model_type {model_type!r} needs trust_remote_code (custom Python code shipped "
                "with the model); moechat never runs code from a checkpoint")
        if model_type in DENSE:
            raise UnsupportedModelError(f"{model_dir}: {model_type!r} is a dense model, not a Mixture-of-Experts; "
                                        f"moechat runs {', '.join(sorted(ARCHITECTURES))}")
        what = "not supported yet" if model_type in PLANNED_MOE else "unknown"
        raise UnsupportedModelError(f"{model_dir}: model_type {model_type!r} is {what}; moechat runs "
                                    f"{', '.join(sorted(ARCHITECTURES))}")
    cls = ARCHITECTURES[model_type]
    try:
        args = cls.args_class.from_dict(raw, where)  # every value by its rule, then the relations (validate.py)
    except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError) as e:  # a rule not declared yet
        raise ConfigError(f"{where}: cannot use its values ({type(e).__name__}: {e})", path=where) from None
    return cls, args, raw


def _head_cache(ckpt, args, model_dir, repack_dir):
    """Where the int8 LM head of this checkpoint is kept between loads (engine/cache/dense_cache.py): beside the
    repacked experts (--repack-dir, else under $XDG_CACHE_HOME/moechat/repacked), keyed by the file it comes from."""
    from ..cache.dense_cache import HeadCache
    from ..cache.repacked import default_repack_dir

    name = "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"
    try:
        source = ckpt.info(name).file
    except (CheckpointError, AttributeError):  # a head the loader made another way: quantized at each load
        return None
    return HeadCache(Path(repack_dir) if repack_dir else default_repack_dir(model_dir, "dense"), source)


def resolve_device(name: str | torch.device) -> torch.device:
    """A device moechat can compute on, or a ConfigError saying why not (a typo, no CUDA, no such GPU)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"device {str(name)!r} is not a device: use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {str(name)!r}: CUDA is not available here (a CPU-only torch build, or no GPU "
                              "driver); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {str(name)!r}: there are {torch.cuda.device_count()} CUDA devices (cuda:0.."
                              f"cuda:{torch.cuda.device_count() - 1})")
    elif device.type != "cpu":
        raise ConfigError(f"device {str(name)!r}: moechat computes on cpu or cuda")
    return device


def resolve_dtype(name: str | None, args: BaseModelArgs) -> torch.dtype:
    """--dtype if given, else the checkpoint's own dtype, else float32."""
    name = name or args.checkpoint_dtype or "float32"
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def validate(cls: type[MoEForCausalLM], args: BaseModelArgs, ckpt: Checkpoint,
             fmt: ExpertFormat = DENSE_FORMAT) -> dict[str, tuple[int, ...]]:
    """Check every dense tensor the model needs; return their names and shapes. (The experts are checked
    against their format's layout when their `DiskStore` is built.) In an FP8 checkpoint a dense weight may
    be FP8 with its block scale beside it; it is dequantized at load."""
    dense = cls.dense_weight_names(args)
    suffix = getattr(fmt, "scale_suffix", None)
    for name, shape in dense.items():
        if suffix is not None and ckpt.info(name).dtype.startswith("F8"):
            info = ckpt.check(name, shape, floating=False)
            scale = ckpt.info(name + suffix)  # a missing scale is a typed error naming it
            b0, b1 = fmt.block
            want = (-(-shape[0] // b0), -(-shape[1] // b1))
            if info.dtype != "F8_E4M3" or len(shape) != 2 or scale.shape != want:
                raise CheckpointError(f"{info.file}: {name!r} is {info.dtype} with a scale of shape "
                                      f"{list(scale.shape)}; FP8 weights must be F8_E4M3 with a {list(want)} block "
                                      "scale", path=str(info.file), tensor=name)
            continue
        ckpt.check(name, shape)
    return dense


def _dense_tensor(ckpt: Checkpoint, name: str, fmt: ExpertFormat) -> torch.Tensor:
    """A dense weight as the model computes with it, checked for NaN/Inf as it is read (a typed error naming it):
    memory-mapped by safetensors, so a weight already in the compute dtype is used in place (`.to` returns it), its
    pages mapped from the page cache by the scan itself (no copy; 1.3 GB of Qwen3-30B-A3B's embedding and head)."""
    t = ckpt.get(name)
    if t.dtype == torch.float8_e4m3fn:
        from ..quant.fp8 import dequantize_blocks

        t = dequantize_blocks(t, ckpt.get(name + fmt.scale_suffix), fmt.block)
    scan_finite(t, name, ckpt.info(name).file)
    return t


def mapped_experts(ckpt, disk, layer: int, device: torch.device) -> dict[str, torch.Tensor] | None:
    """A layer's resident experts as memory-mapped views, no copy, on the CPU: of the repacked file
    (`--expert-format`; `RepackedStore.mapped_layer`, CRCs checked), or of the shard where the checkpoint stores a
    packed format's tensors as the format does, fused [E, ...] (GPT-OSS's MXFP4; `DiskStore.mapped_names`), float
    tensors (the biases) scanned for NaN/Inf per expert as `read_into` would; every page mapped now
    (MADV_POPULATE_READ, as llama.cpp's MAP_POPULATE). None: the experts are read into fresh buffers. Mapped pages
    are the page cache's: 4 KB pages where hostmem's buffers ask for huge ones, and the kernel may drop them under
    memory pressure and read them again when used, as llama.cpp's mapping does."""
    if device.type != "cpu":
        return None
    if type(disk) is RepackedStore:  # --expert-format's file: each expert's tensors back to back, CRC'd
        return disk.mapped_layer(layer) if disk.format.packed else None
    # full-width experts stay copied into aligned buffers: torch's GEMMs may sum in another order at another
    # address (transformers 5's fused bf16/fp32 layout gave logits a bit apart); packed ones run moechat's kernels
    if type(disk) is not DiskStore or type(ckpt) is not Checkpoint or not disk.format.packed:
        return None
    names = disk.mapped_names(layer)
    if names is None:
        return None
    out = {}
    for name, tensor in names.items():
        t = ckpt.get(tensor)  # [E, ...], a view of the shard's mapping
        shape, dtype = disk.shapes[name]
        if t.shape != (disk.args.num_experts, *shape) or t.dtype != dtype or not t.is_contiguous():
            return None
        out[name] = t
    for tensor, t in zip(names.values(), out.values(), strict=True):
        populate(t)
        if t.is_floating_point():
            for e in range(t.shape[0]):
                scan_finite(t[e], tensor, ckpt.info(tensor).file, f" (expert {e} of layer {layer})")
    return out


def checkpoint_format(raw_config: dict, model_dir: Path | None = None) -> ExpertFormat:
    """The format the checkpoint ships its experts in, from config.json's quantization_config."""
    where = f"{model_dir / 'config.json'}" if model_dir is not None else "config.json"
    return native_format(raw_config, where)


def read_expert(cls: type[MoEForCausalLM], args: BaseModelArgs, ckpt: Checkpoint, layer: int,
                expert: int) -> dict[str, torch.Tensor]:
    """One expert's tensors (w13 [2I, H], w2 [H, I]) through safetensors' mmap: the path bench/offload.py
    compares with DiskStore's preadv (which loading and the cache use)."""
    fused = expert_tensor_names(cls, args, ckpt, layer)
    if fused:
        return {"w13": ckpt.get(fused[0])[expert], "w2": ckpt.get(fused[1])[expert]}
    n = cls.expert_naming
    gate = ckpt.get(n.gate.format(layer=layer, expert=expert))  # [I, H]
    up = ckpt.get(n.up.format(layer=layer, expert=expert))  # [I, H]
    return {"w13": torch.cat([gate, up]), "w2": ckpt.get(n.down.format(layer=layer, expert=expert))}


@dataclass
class CheckedModel:
    """A model directory that passed every check `load_model` makes before it reads a weight."""

    cls: type[MoEForCausalLM]
    args: BaseModelArgs
    raw: dict
    format: ExpertFormat  # how the checkpoint ships its experts
    checkpoint: Checkpoint
    dense: dict[str, tuple[int, ...]]  # every dense tensor the model needs -> its shape
    disk: object  # the DiskStore over the experts (its segments checked; close it when done)
    dtype: torch.dtype


def check_model(model_dir: str | os.PathLike, *, dtype: str | None = None, raw_config: dict | None = None,
                tensors: dict | None = None) -> CheckedModel:
    """Every check `load_model` makes before it reads a weight, and the same ones for `moechat fit` (its verdict is
    run's): config.json by its rules and relations, the architecture, the checkpoint's expert format, the dtype,
    the safetensors index and headers (pickle-only weights, a FIFO, a device or a folder as a shard, an index
    escaping the folder), the layers present, and every dense and expert tensor's name, shape and dtype. Headers
    only: no weight byte is read. With `raw_config` and `tensors` (name -> TensorInfo: a Hub repo's config.json and
    its fetched safetensors headers) the same checks run over those, and no file is opened. A typed error on the
    first problem."""
    model_dir = Path(model_dir)
    from .gguf import is_gguf, open_gguf

    if raw_config is None and is_gguf(model_dir):  # GGUF: config from the metadata, experts in their ggml types
        ckpt = open_gguf(model_dir)
        cls, args, raw = model_config(ckpt.config, model_dir)
        fmt = ckpt.expert_format or DENSE_FORMAT
    else:
        if raw_config is None:
            cls, args, raw = read_model_config(model_dir)
        else:
            cls, args, raw = model_config(raw_config, model_dir)
        fmt = checkpoint_format(raw, model_dir)
        ckpt = Checkpoint.open(model_dir) if tensors is None else Checkpoint(model_dir, tensors)
    torch_dtype = resolve_dtype(dtype, args)
    check_layers(args.num_hidden_layers, ckpt.tensors, str(model_dir / "config.json"))
    dense = validate(cls, args, ckpt, fmt)
    from ..cache.store import DiskStore  # the one reader of experts, whatever the checkpoint's naming

    if getattr(ckpt, "layer_formats", None):  # a GGUF whose expert types change by layer: each checked in its own
        from .gguf import MixedExpertStore

        disk = MixedExpertStore(ckpt, cls.moe_layers(args), args.hidden_size, args.moe_intermediate, torch_dtype)
        return CheckedModel(cls, args, raw, fmt, ckpt, dense, disk, torch_dtype)
    disk = DiskStore(cls, args, ckpt, torch_dtype, fmt)  # checks every expert tensor before any weight is read
    return CheckedModel(cls, args, raw, fmt, ckpt, dense, disk, torch_dtype)


@dataclass
class LoadedModel:
    model_dir: Path
    model: MoEForCausalLM
    args: BaseModelArgs
    raw_config: dict
    checkpoint: Checkpoint
    provider: ResidentProvider | None  # None when the experts are left to a cache
    dtype: torch.dtype
    device: torch.device
    cls: type[MoEForCausalLM] | None = None
    expert_format: ExpertFormat = DENSE_FORMAT  # how the experts are held (every tier)
    native_format: ExpertFormat | None = None  # how the checkpoint ships them (None: the same)


def load_model(model_dir: str | os.PathLike, *, dtype: str | None = None, device: str | torch.device = "cpu",
               max_positions: int | None = None, resident_experts: bool = True, expert_format: str | None = None,
               repack_dir: str | os.PathLike | None = None, dense_format: str | None = None) -> LoadedModel:
    """Load and validate a model; with resident_experts=False the experts are left on disk for a cache.

    `expert_format` int8/int4 holds the experts in that form (converted once into a repacked file in
    `repack_dir`, default under $XDG_CACHE_HOME/moechat/repacked); None/`native` keeps the checkpoint's."""
    model_dir = Path(model_dir)
    device = resolve_device(device)
    from ..quant.dense_int8 import check_dense_format

    dense_format = check_dense_format(dense_format, device)
    checked = check_model(model_dir, dtype=dtype)  # every check, before any weight is read
    cls, args, raw, fmt, ckpt, dense, disk = (checked.cls, checked.args, checked.raw, checked.format,
                                              checked.checkpoint, checked.dense, checked.disk)
    torch_dtype = checked.dtype
    target = target_format(expert_format, fmt)  # the DiskStore has opened no file yet
    with torch.device("meta"):
        model = cls(args)
    # GGUF: output/embedding matrices kept in their quant type (load/gguf.py), meta in the state until keep_packed
    packed = ckpt.packed_dense(cls, device, torch_dtype) if hasattr(ckpt, "packed_dense") else {}
    if hasattr(ckpt, "packed_attention") and hasattr(model, "packable_attention"):  # and attention's projections
        packed.update(ckpt.packed_attention(model.packable_attention(), device, torch_dtype))
    for name, matrix in packed.items():
        matrix.check_finite(name, ckpt.info(name).file)  # as each dequantized weight is checked
    state = {name: torch.empty(dense[name], dtype=torch_dtype, device="meta") if name in packed else
             _dense_tensor(ckpt, name, fmt).to(device=device, dtype=torch.float32 if name.endswith(
                 cls.fp32_weights) else torch_dtype) for name in dense}
    model.load_state_dict(state, assign=True, strict=True)
    # The RoPE table and any KV cache built on this model cover at most the model's own context.
    model.finalize(min(max_positions or args.max_position_embeddings, args.max_position_embeddings))
    if packed:
        model.keep_packed(packed.get("model.embed_tokens.weight"), packed.get("lm_head.weight"), packed)
    if dense_format != "native" and type(model).quantize_dense is MoEForCausalLM.quantize_dense:
        model.quantize_dense(dense_format, head_cache=_head_cache(ckpt, args, model_dir, repack_dir))
    else:
        model.quantize_dense(dense_format)  # int8 attention projections and LM head, or nothing
    model.eval()
    if getattr(ckpt, "layer_formats", None):  # GGUF, expert types by layer (Q4_K_M): resident, a format per layer
        disk.close()
        types = sorted({f.name for f in ckpt.layer_formats.values()})
        if not resident_experts or target is not fmt:
            raise ConfigError(f"{model_dir}: its experts change type from layer to layer ({', '.join(types)}); "
                              "moechat runs such a file with every expert resident, in its own types: run it without "
                              "--expert-slots/--ram-cache-mb/--expert-format, or use a quant with one type per "
                              "projection (Q8_0, Q6_K, Q4_0)")
        from .gguf import resident_mixed_provider

        provider = resident_mixed_provider(ckpt, cls, args, torch_dtype, device)
        return LoadedModel(model_dir, model, args, raw, ckpt, provider, torch_dtype, device, cls, fmt, fmt)
    if not resident_experts:
        disk.close()
        return LoadedModel(model_dir, model, args, raw, ckpt, None, torch_dtype, device, cls, target, fmt)
    E = args.num_experts
    if target is not fmt:
        from ..cache.repacked import default_repack_dir

        disk = RepackedStore(disk, cls.moe_layers(args), E, Path(repack_dir or default_repack_dir(model_dir,
                                                                                                  target.name)), target)
    tensors = {}
    for layer in cls.moe_layers(args):
        mapped = mapped_experts(ckpt, disk, layer, device)  # fused in the shard as the format stores them: no copy
        if mapped is not None:
            tensors[layer] = mapped
            continue
        # [E, ...] per stored tensor (w13 [E, 2I, H] at full width; packed formats stay packed)
        tensors[layer] = {name: hostmem.empty((E, *shape), dt, device)
                          for name, (shape, dt) in disk.shapes.items()}
        # each segment read once into its final rows, checked as it lands; experts read side by side
        fill(disk, [(layer, e, {name: t[e] for name, t in tensors[layer].items()}) for e in range(E)])
    disk.close()
    provider = ResidentProvider(tensors, args.num_hidden_layers, target)
    return LoadedModel(model_dir, model, args, raw, ckpt, provider, torch_dtype, device, cls, target, fmt)
