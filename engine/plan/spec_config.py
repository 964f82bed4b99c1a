"""`ModelSpec` estimated from `config.json` and its `quantization_config` (MXFP4, FP8 blocks, GQA/MLA/sliding-window
KV, shared experts, recurrent layers): what `moechat fit` knows before a weight is downloaded, labelled an estimate.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..io.files import read_json_object
from ..io.validate import check_common
from ..units import GB, GiB, MiB
from .spec import DEFAULT_CONTEXT, DTAG_OF_SIZE, FLOAT_SIZES, ModelSpec, TensorSpec

# -- config.json reading -----------------------------------------------------------------------------------

def _load_json(path: Path, what: str) -> dict:
    """Like checkpoint.read_json, without importing torch (so `moechat fit` on a config answers at once)."""
    return read_json_object(path, what)  # FIFOs and devices refused, size capped, every JSON failure one line


def _get(c: dict, *names, default=None):
    for n in names:
        v = c.get(n)
        if v is not None:
            return v
    return default


def _pos_int(c: dict, where: str, *names) -> int:
    v = _get(c, *names)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"{where}: needs a positive integer {names[0]} to plan (found {v!r})")
    return v


@dataclass(frozen=True)
class _Shape:
    """The architecture numbers every estimate needs, whatever the model_type calls them."""

    model_type: str
    L: int
    H: int
    V: int
    E: int
    K: int
    I: int
    dense_I: int
    n_heads: int
    n_kv: int
    head_dim: int
    moe_layers: tuple[int, ...]
    tied: bool
    float_dtype: str
    float_bytes: int
    max_context: int


def _shape(c: dict, where: str, notes: list[str]) -> _Shape:
    if isinstance(c.get("text_config"), dict) and "num_hidden_layers" not in c:
        c = {**c, **c["text_config"]}
    check_common(c, where)  # types, ranges and size caps of the common keys (engine/io/validate.py), before any loop
    kinds = _hybrid_kinds(c)
    L = len(kinds) if kinds and not c.get("num_hidden_layers") else _pos_int(c, where, "num_hidden_layers")
    if kinds and len(kinds) != L:
        raise ConfigError(f"{where}: num_hidden_layers = {L} but hybrid_override_pattern has {len(kinds)} layers")
    H = _pos_int(c, where, "hidden_size")
    V = _pos_int(c, where, "vocab_size")
    E = _get(c, "n_routed_experts", "num_local_experts", "num_experts")
    K = _get(c, "num_experts_per_tok", "experts_per_token", "moe_topk", "top_k_experts")  # the last: Gemma 4
    if not isinstance(E, int) or E <= 1 or not isinstance(K, int) or not 0 < K <= E:
        raise ConfigError(f"{where}: not a Mixture-of-Experts config (experts={E!r}, top-k={K!r}); "
                          "moechat plans MoE models only")
    I = _pos_int(c, where, "moe_intermediate_size", "intermediate_size")
    dense_I = _get(c, "intermediate_size", default=I)
    n_heads = _pos_int(c, where, "num_attention_heads")
    n_kv = _get(c, "num_key_value_heads", default=n_heads)
    head_dim = _get(c, "head_dim", default=H // n_heads)
    if kinds:  # Nemotron-H: the E layers of the pattern
        moe = [i for i, k in enumerate(kinds) if k == "moe"]
    elif "first_k_dense_replace" in c or "moe_layer_freq" in c:  # DeepSeek, GLM-4.5
        k, f = c.get("first_k_dense_replace") or 0, c.get("moe_layer_freq") or 1
        moe = [i for i in range(L) if i >= k and i % f == 0]
    elif "decoder_sparse_step" in c or "mlp_only_layers" in c:  # Qwen2/3-MoE
        step, only = c.get("decoder_sparse_step") or 1, set(c.get("mlp_only_layers") or [])
        moe = [i for i in range(L) if i not in only and (i + 1) % step == 0]
    else:
        moe = list(range(L))
    dtype = _config_dtype(c) or ""
    if dtype not in FLOAT_SIZES:
        notes.append(f"config.json names no float dtype ({dtype or 'none'}): bf16 assumed for unquantized tensors")
        dtype = "bfloat16"
    return _Shape(c.get("model_type", "?"), L, H, V, E, K, I, dense_I, n_heads, n_kv, head_dim, tuple(moe),
                  bool(c.get("tie_word_embeddings", False)), dtype, FLOAT_SIZES[dtype],
                  int(_get(c, "max_position_embeddings", default=DEFAULT_CONTEXT)))


_PATTERN_KINDS = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}
_BLOCK_KINDS = {"linear_attention": "mamba", "full_attention": "attention", "moe": "moe", "mlp": "mlp"}


def _hybrid_kinds(c: dict) -> list[str] | None:
    """Nemotron-H's layer kinds (mamba, attention, moe, mlp) from `hybrid_override_pattern` (the Hub's spelling) or
    `layers_block_type` (transformers 5's), else None."""
    if c.get("model_type") != "nemotron_h":
        return None
    pattern, blocks = c.get("hybrid_override_pattern"), c.get("layers_block_type") or c.get("layer_types")
    if isinstance(blocks, list) and all(b in _BLOCK_KINDS for b in blocks):
        return [_BLOCK_KINDS[b] for b in blocks]
    if isinstance(pattern, str) and pattern and set(pattern) <= set(_PATTERN_KINDS):
        return [_PATTERN_KINDS[ch] for ch in pattern]
    return None


def _config_dtype(c: dict) -> str | None:
    """The float dtype config.json names, as the loader reads it (`dtype`, then `torch_dtype`), or None."""
    if "text_config" in c and "num_hidden_layers" not in c:
        c = {**c, **c["text_config"]}
    name = _get(c, "dtype", "torch_dtype")
    return str(name).removeprefix("torch.") if name else None


def _layer_heads(c: dict, s: _Shape) -> list[tuple[int, int, bool]]:
    """(head_dim, KV heads, has a v_proj) per layer: Gemma 4's full-attention layers have their own global_head_dim
    and num_global_key_value_heads, K as V with attention_k_eq_v (engine/models/gemma4.py); others one for all."""
    types, uniform = c.get("layer_types"), (s.head_dim, s.n_kv, True)
    if not c.get("global_head_dim") or not isinstance(types, list) or len(types) != s.L:
        return [uniform] * s.L
    k_eq_v = bool(c.get("attention_k_eq_v"))
    n_kv = int(c.get("num_global_key_value_heads") or s.n_kv) if k_eq_v else s.n_kv
    full = (int(c["global_head_dim"]), n_kv, not k_eq_v)
    return [full if t == "full_attention" else uniform for t in types]


def _kv(c: dict, s: _Shape) -> tuple[str, int, int, int | None, str]:
    """(kind, elements per token over full layers, over windowed layers, window, one-line detail)."""
    heads = _layer_heads(c, s)
    if c.get("kv_lora_rank"):  # MLA: one latent vector + the shared RoPE key per token and layer
        rope = c.get("qk_rope_head_dim") or 0
        per = c["kv_lora_rank"] + rope
        kind, detail = "MLA latent", f"{s.L} layers x (kv_lora_rank {c['kv_lora_rank']} + rope {rope})"
        per_layer = [per] * s.L
    else:
        per = 2 * s.n_kv * s.head_dim
        per_layer = [2 * n_kv * D for D, n_kv, _ in heads]  # K as V is still cached twice (V is K normed)
        kind = "GQA"
        counts = {h[:2]: sum(x[:2] == h[:2] for x in heads) for h in heads}
        detail = " + ".join(f"{n if len(counts) > 1 else s.L} layers x 2 (K, V) x {n_kv} KV heads x {D}"
                            for (D, n_kv), n in counts.items())
    window = c.get("sliding_window")
    types = c.get("layer_types")
    kinds = _hybrid_kinds(c)
    if kinds:  # Nemotron-H: K/V in the attention layers only (Mamba, MoE and MLP layers cache none)
        n = kinds.count("attention")
        detail = detail.replace(f"{s.L} layers x", f"{n} attention layers (of {s.L}) x", 1)
        return kind, per * n, 0, None, detail
    linear = _linear_layers(c, s.L)
    if linear:  # recurrent layers keep a fixed state, no K/V (engine/layers/kv_cache.py)
        n = s.L - linear
        detail = detail.replace(f"{s.L} layers x", f"{n} attention layers (of {s.L}) x", 1)
        return kind, per * n, 0, None, detail
    if isinstance(types, list) and len(types) == s.L:
        sliding = [t == "sliding_attention" for t in types]
    elif "use_sliding_window" in c and s.model_type == "qwen2_moe":  # transformers' rule: odd layers under
        first = c.get("max_window_layers") or 0  # max_window_layers, and only when enabled
        sliding = [bool(c["use_sliding_window"]) and bool((i + 1) % 2) and i < first for i in range(s.L)]
    elif "use_sliding_window" in c:  # Qwen3: every layer, and only when enabled
        sliding = [bool(c["use_sliding_window"])] * s.L
    else:
        sliding = [s.model_type != "olmoe"] * s.L  # Mixtral-style: every layer, when a window is set
    if not window:
        sliding = [False] * s.L
    n_win = sum(sliding)
    if n_win:
        detail += f"; {n_win} of {s.L} layers attend to the last {window} tokens only"
    full = sum(p for p, w in zip(per_layer, sliding, strict=True) if not w)
    return kind, full, sum(per_layer) - full, (int(window) if n_win else None), detail


def _linear_layers(c: dict, L: int) -> int:
    """How many layers are Gated DeltaNet (Qwen3-Next, Qwen3.5/3.6: `layer_types` "linear_attention")."""
    types = c.get("layer_types")
    if isinstance(types, list) and len(types) == L:
        return sum(t == "linear_attention" for t in types)
    if c.get("linear_num_value_heads") and c.get("full_attention_interval"):
        return sum(1 for i in range(L) if (i + 1) % int(c["full_attention_interval"]))
    return 0


def _recurrent(c: dict, s: _Shape) -> tuple[int, str]:
    """The recurrent layers' state bytes (fp32 delta-rule matrices + conv windows in the float dtype), times the
    copies the sequence state keeps, and a one-line detail."""
    if isinstance(c.get("text_config"), dict) and "num_hidden_layers" not in c:
        c = {**c, **c["text_config"]}
    from ..layers.kv_cache import MAX_SNAPSHOTS

    kinds = _hybrid_kinds(c)
    if kinds:  # Nemotron-H's Mamba-2 layers: a [heads, head dim, state] fp32 SSM state + a conv window each
        m = kinds.count("mamba")
        heads, P, N = int(c.get("mamba_num_heads") or 128), int(c.get("mamba_head_dim") or 64), \
            int(c.get("ssm_state_size") or 128)
        conv_dim = heads * P + 2 * int(c.get("n_groups") or 8) * N
        width = int(c.get("conv_kernel") or 4)
        one = m * (heads * P * N * 4 + conv_dim * (width - 1) * s.float_bytes)
        copies = 1 + MAX_SNAPSHOTS
        return one * copies, (f"{m} Mamba-2 layers x ({heads} heads x {P} x {N} fp32 + a {width - 1}-step conv "
                              f"window) = {one / MiB:.1f} MiB at any context, x {copies} (the state and "
                              f"{MAX_SNAPSHOTS} prefix-reuse snapshots)")
    n = _linear_layers(c, s.L)
    if not n:
        return 0, ""

    hk, hv = int(c.get("linear_num_key_heads") or 16), int(c.get("linear_num_value_heads") or 32)
    dk, dv = int(c.get("linear_key_head_dim") or 128), int(c.get("linear_value_head_dim") or 128)
    width = int(c.get("linear_conv_kernel_dim") or 4)
    one = n * (hv * dk * dv * 4 + (2 * hk * dk + hv * dv) * (width - 1) * s.float_bytes)
    copies = 1 + MAX_SNAPSHOTS
    return one * copies, (f"{n} Gated DeltaNet layers x ({hv} heads x {dk} x {dv} fp32 + a {width - 1}-step conv "
                          f"window) = {one / MiB:.1f} MiB at any context, x {copies} (the state and "
                          f"{MAX_SNAPSHOTS} prefix-reuse snapshots)")


class _Quant:
    """How `quantization_config` stores a Linear weight [out, in]: (float elements, other bytes)."""

    def __init__(self, qc: dict | None, float_bytes: int, notes: list[str]):
        self.method = (qc or {}).get("quant_method")
        self.skip = list((qc or {}).get("modules_to_not_convert") or [])
        self.fb = float_bytes
        self.block = (qc or {}).get("weight_block_size")
        self.bits = (qc or {}).get("bits")
        self.group = (qc or {}).get("group_size") or 128
        if self.method in ("gptq", "awq") and not self.bits:
            self.bits = 4
        if self.method and self.method not in ("mxfp4", "fp8", "gptq", "awq"):
            notes.append(f"quantization_config quant_method {self.method!r} is not understood: sizes assume "
                         "unquantized weights (probably overstated)")
            self.method = None

    def applies(self, module: str) -> bool:
        return self.method is not None and not any(fnmatch.fnmatch(module, p) for p in self.skip)

    def linear(self, out: int, inp: int, module: str) -> tuple[int, int]:
        if not self.applies(module):
            return out * inp, 0
        n = out * inp
        if self.method == "mxfp4":  # 4-bit blocks of 32 + one e8m0 scale byte per block
            return 0, n // 2 + out * math.ceil(inp / 32)
        if self.method == "fp8":  # e4m3 bytes + fp32 inverse scales, per 128x128 block or per tensor
            if self.block:
                bo, bi = self.block
                return 0, n + 4 * math.ceil(out / bo) * math.ceil(inp / bi)
            return 0, n + 4
        groups = math.ceil(inp / (self.group if self.group > 0 else inp))  # GPTQ/AWQ: packed ints + fp16 scales
        return 0, n * self.bits // 8 + groups * out * (2 + self.bits / 8)

    def tensors(self, name: str, out: int, inp: int, module: str, fdtag: str) -> list[TensorSpec]:
        """One expert weight as stored, by the checkpoint's tensor names."""
        if not self.applies(module):
            return [TensorSpec(f"{name}.weight", (out, inp), fdtag, out * inp * self.fb)]
        if self.method == "mxfp4":
            return [TensorSpec(f"{name}_blocks", (out, inp // 32, 16), "U8", out * inp // 2),
                    TensorSpec(f"{name}_scales", (out, math.ceil(inp / 32)), "U8", out * math.ceil(inp / 32))]
        if self.method == "fp8":
            scale = (math.ceil(out / self.block[0]), math.ceil(inp / self.block[1])) if self.block else ()
            return [TensorSpec(f"{name}.weight", (out, inp), "F8_E4M3", out * inp),
                    TensorSpec(f"{name}.weight_scale_inv", scale, "F32", 4 * (math.prod(scale) if scale else 1))]
        fe, other = self.linear(out, inp, module)
        return [TensorSpec(f"{name}.qweight+scales", (out, inp), f"{self.bits}-bit", int(other))]

    @property
    def format(self) -> str:
        if self.method == "mxfp4":
            return "mxfp4 (4-bit blocks of 32 + e8m0 scales)"
        if self.method == "fp8":
            blocks = f"{self.block[0]}x{self.block[1]} block scales" if self.block else "per-tensor scale"
            return f"fp8 e4m3, {blocks}"
        if self.method:
            return f"{self.method} {self.bits}-bit, group {self.group}"
        return ""


def _fp32_weights(model_type: str) -> tuple[str, ...]:
    """The name endings the model's class keeps in fp32 whatever the dtype (routers: MoEForCausalLM.fp32_weights)."""
    from ..models import ARCHITECTURES

    cls = ARCHITECTURES.get(model_type)
    return tuple(cls.fp32_weights) if cls is not None else ()


def _expert_tensors(s: _Shape, q: _Quant, fdtag: str, layer: int) -> list[TensorSpec]:
    """One routed expert's tensors as the checkpoint names them (config-only estimate)."""
    H, I = s.H, s.I
    module = f"model.layers.{layer}.mlp.experts"
    if s.model_type == "nemotron_h":  # ungated relu^2 experts: up and down only
        module = f"backbone.layers.{layer}.mixer.experts"
        return q.tensors("up_proj", I, H, module, fdtag) + q.tensors("down_proj", H, I, module, fdtag)
    if s.model_type == "gpt_oss":  # fused gate_up [2I, H] + biases, as the Hub checkpoint stores them
        out = [t for t in q.tensors("gate_up_proj", 2 * I, H, module, fdtag)]
        out.append(TensorSpec("gate_up_proj_bias", (2 * I,), fdtag, 2 * I * s.float_bytes))
        out += q.tensors("down_proj", H, I, module, fdtag)
        out.append(TensorSpec("down_proj_bias", (H,), fdtag, H * s.float_bytes))
        return out
    names = ("w1", "w3", "w2") if s.model_type in ("mixtral", "minimax_m2") else ("gate_proj", "up_proj", "down_proj")
    return (q.tensors(names[0], I, H, module, fdtag) + q.tensors(names[1], I, H, module, fdtag)
            + q.tensors(names[2], H, I, module, fdtag))


def spec_from_config(config: dict, *, name: str = "", index: dict | None = None, present_bytes: int = 0,
                     where: str = "config.json") -> ModelSpec:
    """Estimate a model's sizes from config.json alone (and its safetensors index, if given)."""
    notes: list[str] = []
    s = _shape(config, where, notes)
    q = _Quant(config.get("quantization_config"), s.float_bytes, notes)
    fdtag = DTAG_OF_SIZE.get(s.float_bytes, "BF16")
    H, V, L = s.H, s.V, s.L
    mt = s.model_type
    c = config if "num_hidden_layers" in config else {**config, **config.get("text_config", {})}

    parts: dict[str, list[int]] = {}  # what -> [float elements, other bytes]

    def add(what: str, fe: float, other: float = 0) -> None:
        p = parts.setdefault(what, [0, 0])
        p[0] += int(fe)
        p[1] += int(other)

    shipped = [0, 0]  # FP8 dense weights: [bytes in the checkpoint, bytes once loaded]
    router32 = [0, 0]  # routers the engine keeps in fp32: the same
    fp32_router = bool(_fp32_weights(mt))

    def lin(what: str, out: int, inp: int, module: str, bias: bool = False) -> None:
        fe, other = q.linear(out, inp, module)
        if q.method == "fp8" and other:  # the loader dequantizes FP8 dense weights to the float dtype (loader.py)
            shipped[0] += other
            shipped[1] += out * inp * s.float_bytes
            fe, other = out * inp, 0
        add(what, fe + (out if bias else 0), other)

    add("embeddings", V * H)
    if not s.tied:
        add("lm_head", V * H)
    add("norms", H)  # final norm

    def attention(layer: int) -> None:
        m = f"model.layers.{layer}.self_attn"
        if c.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3)
            nope, rope, vd = c.get("qk_nope_head_dim") or 0, c.get("qk_rope_head_dim") or 0, c.get("v_head_dim") or 0
            qd, r, qr = s.n_heads * (nope + rope), c["kv_lora_rank"], c.get("q_lora_rank")
            if qr:
                lin("attention", qr, H, m)
                lin("attention", qd, qr, m)
                add("attention", qr)
            else:
                lin("attention", qd, H, m)
            lin("attention", r + rope, H, m)
            add("attention", r)
            lin("attention", s.n_heads * (nope + vd), r, m)
            lin("attention", H, s.n_heads * vd, m)
            return
        D, n_kv, has_v = layer_heads[layer]
        q_dim, kv_dim = s.n_heads * D, n_kv * D
        qkv_bias = mt == "qwen2_moe" or bool(c.get("attention_bias"))
        lin("attention", q_dim, H, m, qkv_bias)
        lin("attention", kv_dim, H, m, qkv_bias)
        if has_v:
            lin("attention", kv_dim, H, m, qkv_bias)
        lin("attention", H, q_dim, m, bool(c.get("attention_bias")) and mt not in ("glm4_moe", "qwen2_moe"))
        if c.get("use_qk_norm") and c.get("qk_norm_type") == "per_layer":  # MiniMax-M2: over all of q and of k
            add("attention", q_dim + kv_dim)
        elif mt in ("qwen3_moe", "gemma4", "gemma4_text") or c.get("use_qk_norm"):
            add("attention", 2 * D)
        elif mt == "olmoe":
            add("attention", q_dim + kv_dim)
        if mt == "gpt_oss":
            add("attention", s.n_heads)  # sinks

    layer_heads = _layer_heads(c, s)
    n_shared = int(_get(c, "n_shared_experts", default=0) or 0)
    shared_I = c.get("shared_expert_intermediate_size") or 0

    def ffn(layer: int, moe: bool) -> None:
        m = f"model.layers.{layer}.mlp"
        if not moe:
            for out, inp in ((s.dense_I, H), (s.dense_I, H), (H, s.dense_I)):
                lin("dense MLP layers", out, inp, m)
            return
        bias = mt in ("gpt_oss", "deepseek_v3", "glm4_moe") or c.get("topk_method") == "noaux_tc"
        n = s.E * H + (s.E if bias or c.get("use_routing_bias") else 0)
        if fp32_router:  # the engine keeps the router in fp32 (its class's fp32_weights); shipped in the float dtype
            add("routers", 0, 4 * n)
            router32[0] += n * s.float_bytes
            router32[1] += 4 * n
        else:
            add("routers", n)
        if c.get("enable_moe_block") and c.get("intermediate_size"):  # Gemma 4: a dense MLP beside the experts
            add("routers", H + s.E)  # the router's scale and per_expert_scale
            add("norms", 5 * H + 1)  # the MLP's and the experts' pre/post norms, and the layer scalar
            for out, inp in ((c["intermediate_size"], H), (c["intermediate_size"], H), (H, c["intermediate_size"])):
                lin("dense MLP layers", out, inp, m)
        if n_shared or shared_I:
            width = n_shared * s.I if n_shared else shared_I
            for out, inp in ((width, H), (width, H), (H, width)):
                lin("shared experts", out, inp, f"{m}.shared_experts")
            if shared_I:
                add("shared experts", H)  # Qwen2-MoE's shared_expert_gate [1, H]

    def nemotron_layer(layer: int, kind: str) -> None:
        """One Nemotron-H layer: its norm and its one mixer (Mamba-2, attention, MoE + relu^2 shared expert, MLP)."""
        m = f"backbone.layers.{layer}.mixer"
        add("norms", H)
        if kind == "attention":
            D = s.head_dim
            for out, inp in ((s.n_heads * D, H), (s.n_kv * D, H), (s.n_kv * D, H), (H, s.n_heads * D)):
                lin("attention", out, inp, m)
        elif kind == "mamba":
            heads, P = int(c.get("mamba_num_heads") or 128), int(c.get("mamba_head_dim") or 64)
            inner, N = heads * P, int(c.get("ssm_state_size") or 128)
            conv_dim = inner + 2 * int(c.get("n_groups") or 8) * N
            lin("Mamba-2 layers", inner + conv_dim + heads, H, m)
            add("Mamba-2 layers", conv_dim * int(c.get("conv_kernel") or 4) + conv_dim + 3 * heads + inner)
            lin("Mamba-2 layers", H, inner, m)
        elif kind == "mlp":
            lin("dense MLP layers", s.dense_I, H, m)
            lin("dense MLP layers", H, s.dense_I, m)
        else:
            n = s.E * H + s.E  # the router and its correction bias, kept in fp32
            add("routers", 0, 4 * n)
            router32[0] += n * s.float_bytes
            router32[1] += 4 * n
            width = int(c.get("moe_shared_expert_intermediate_size") or 0)
            if width:
                lin("shared experts", width, H, f"{m}.shared_experts")
                lin("shared experts", H, width, f"{m}.shared_experts")

    moe_set = set(s.moe_layers)
    kinds = _hybrid_kinds(c)
    for layer in range(L):
        if kinds:
            nemotron_layer(layer, kinds[layer])
            continue
        attention(layer)
        add("norms", 2 * H)
        ffn(layer, layer in moe_set)
    shared_total = 0
    if "shared experts" in parts:
        shared_total = parts["shared experts"][0] * s.float_bytes + parts["shared experts"][1]

    expert = _expert_tensors(s, q, fdtag, s.moe_layers[0] if s.moe_layers else 0)
    expert_params = (2 if mt == "nemotron_h" else 3) * H * s.I + (2 * s.I + H if mt == "gpt_oss" else 0)
    dense_parts = tuple((k, v[0] * s.float_bytes + v[1]) for k, v in parts.items())
    dense_bytes = sum(b for _, b in dense_parts)
    stored_dense = dense_bytes + shipped[0] - shipped[1] + router32[0] - router32[1]  # in the checkpoint
    experts_bytes = sum(t.nbytes for t in expert) * len(s.moe_layers) * s.E

    # Multi-token-prediction layers ship in the checkpoint but are not used to decode.
    mtp = int(c.get("num_nextn_predict_layers") or c.get("mtp_num_hidden_layers") or 0)  # the latter: Qwen3-Next/3.5
    unused = 0
    if not mtp and c.get("use_mtp") and c.get("num_mtp_modules"):
        # MiniMax-M2: MTP modules of mtp_transformer_layers layers each, named in config.json; its Hub checkpoint's
        # size (229 B parameters, ~230 GB) leaves no room for them, so their cost is noted, not counted
        n = int(c["num_mtp_modules"]) * int(c.get("mtp_transformer_layers") or 1)
        per_layer = (stored_dense - V * H * s.float_bytes * (1 if s.tied else 2)) / L + s.E * sum(
            t.nbytes for t in expert)
        notes.append(f"{n} multi-token-prediction layer(s) named in config.json (use_mtp) are never loaded; they "
                     f"would cost ~{n * per_layer / GiB:.1f} GiB")
    if mtp:
        per_layer_dense = (stored_dense - (V * H * s.float_bytes * (1 if s.tied else 2))) / L
        unused = mtp * (per_layer_dense + s.E * sum(t.nbytes for t in expert) + 2 * H * H * s.float_bytes
                        + (2 * V * H * s.float_bytes if mt == "deepseek_v3" else 0))
        notes.append(f"{mtp} multi-token-prediction layer(s) in the checkpoint (~{unused / GiB:.1f} GiB) are "
                     "downloaded but not loaded")
    checkpoint = int(stored_dense + experts_bytes + unused)
    if shipped[0]:
        notes.append(f"the checkpoint's FP8 dense weights ({shipped[0] / GiB:.2f} GiB with their scales) are "
                     f"dequantized to {s.float_dtype} at load: {shipped[1] / GiB:.2f} GiB in memory")
    source = "config.json"
    if index is not None:
        source = "config.json + index"
        total = (index.get("metadata") or {}).get("total_size")
        names = list((index.get("weight_map") or {}).keys())
        if isinstance(total, int) and total > 0:
            notes.append(f"index total_size {total / GB:.3f} GB; this estimate {checkpoint / GB:.3f} GB "
                         f"({(checkpoint - total) / total:+.1%})")
            checkpoint = total
        if q.method == "mxfp4" and names and not any(n.endswith("_blocks") for n in names):
            notes.append("quantization_config says mxfp4 but the index names no *_blocks tensors")
    kind, full, win, window, kv_detail = _kv(c, s)
    recurrent_bytes, recurrent_detail = _recurrent(c, s)
    fmt = q.format if q.applies("model.layers.0.mlp.experts") else s.float_dtype
    notes.insert(0, "sizes derived from config.json" + (" and its quantization_config" if q.method else "")
                 + ": estimates, not read from the weights")
    from .catalog import SUPPORTED_TYPES

    if isinstance(config.get("text_config"), dict) and config.get("vision_config") and mt in SUPPORTED_TYPES:
        notes.append(f"{config.get('model_type')} is multimodal: its vision tower's tensors are downloaded but not "
                     "loaded; moechat runs the text model only")
    if c.get("auto_map") and mt in SUPPORTED_TYPES:  # MiniMax-M2, DeepSeek-V3: code for older transformers
        notes.append(f"config.json's auto_map names custom code, but transformers has {mt} natively and moechat "
                     "runs its own implementation: no remote code is needed or run")
    return ModelSpec(
        name=name or str(c.get("_name_or_path") or mt), model_type=mt, source=source, estimated=True,
        num_layers=L, moe_layers=s.moe_layers, num_experts=s.E, top_k=s.K, hidden_size=H, num_heads=s.n_heads,
        expert_intermediate=s.I,
        expert_tensors=tuple(expert), expert_format=fmt, expert_params=expert_params, dense_parts=dense_parts,
        dense_float_elems=sum(v[0] for v in parts.values()), embedding_bytes=0 if s.tied else V * H * s.float_bytes,
        shared_experts=n_shared or (1 if shared_I else 0), shared_expert_bytes=shared_total, kv_kind=kind,
        kv_elems_full=full, kv_elems_window=win, window=window, kv_detail=kv_detail, float_bytes=s.float_bytes,
        recurrent_state_bytes=recurrent_bytes, recurrent_detail=recurrent_detail,
        float_dtype=s.float_dtype, max_context=s.max_context, checkpoint_bytes=checkpoint,
        stored_expert_bytes=sum(t.nbytes for t in expert), weights_present=False,
        present_bytes=present_bytes, unused_bytes=int(unused), notes=tuple(notes), config_dtype=_config_dtype(c),
        quant_method=_quant_method(c), remote_code=bool(c.get("auto_map")),
        prefill_kv_expanded_elems=_prefill_kv_expanded(c, s))


def _prefill_kv_expanded(c: dict, s: _Shape) -> int:
    """K/V elements per context position of one layer as the CPU prefill expands them for SDPA (the largest
    layer): every query head's own keys and values."""
    if c.get("kv_lora_rank"):  # MLA: latents -> [nH, S, nope + rope] keys and [nH, S, v] values
        nope, rope, vd = c.get("qk_nope_head_dim") or 0, c.get("qk_rope_head_dim") or 0, c.get("v_head_dim") or 0
        return s.n_heads * (nope + rope + vd)
    heads = _layer_heads(c, s)
    return max((2 * s.n_heads * D for D, n_kv, _ in heads if n_kv < s.n_heads), default=0)


def _quant_method(config: dict) -> str | None:
    qc = config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    return str(method) if method is not None else None

