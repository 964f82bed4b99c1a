"""What every architecture's config shares: `BaseModelArgs` (config.json's fields, by the same names; `from_dict`
drops unknown keys, aliases and derived values in `__post_init__`), RoPE's frequencies (default and YaRN, transformers
4's and 5's spellings), and `ExpertNaming`, where a layer's routed experts are in the checkpoint. The blocks that
compute with them are in base.py, which re-exports these names."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

from ..errors import UnsupportedModelError
from ..io import validate


@dataclass
class BaseModelArgs:
    """Fields shared by every supported config.json; subclasses add their own, by the same names."""

    model_type: str = ""
    vocab_size: int = 0
    hidden_size: int = 0
    num_hidden_layers: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    rope_theta: float | None = None
    rope_parameters: dict | None = None
    rope_scaling: dict | None = None
    sliding_window: int | None = None
    bos_token_id: Any = None
    eos_token_id: Any = None
    dtype: str | None = None
    torch_dtype: str | None = None

    # Other spellings of a field that config.json files use (transformers' attribute_map).
    aliases: ClassVar[dict[str, str]] = {}

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> BaseModelArgs:
        """Unknown keys are dropped; an alias fills its field when the canonical key is absent. Each value is
        checked against its field's rule before the dataclass is built, the relations after (engine/io/validate.py):
        a violation is a ConfigError naming `where`, the key, the value and what is allowed."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        spelled = {}
        for alias, name in cls.aliases.items():
            if alias in d and name not in kwargs:
                kwargs[name] = d[alias]
                spelled[name] = alias
        validate.check_common(d, where, skip=names | set(cls.aliases))
        args = cls(**validate.check_fields(cls, kwargs, where, spelled))
        validate.check_relations(args, where, d)
        return args

    def __post_init__(self):
        validate.check_explicit(self)  # built in code, not from_dict: the values given, by the same rules
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"config.json: hidden_act {self.hidden_act!r} is not supported (only silu)")
        # transformers 5 writes rope_parameters; older configs (and the Hub's GPT-OSS) have rope_theta and
        # rope_scaling at the top. Both end up in one dict: self.rope.
        rope = {**(self.rope_scaling or {}), **(self.rope_parameters or {})}
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(f"config.json: RoPE scaling {rope_type!r} is not supported yet "
                                        f"(moechat has {', '.join(ROPE_TYPES)})")
        self.rope_theta = float(rope.get("rope_theta", self.rope_theta if self.rope_theta is not None else 10000.0))
        self.rope = {**rope, "rope_type": rope_type, "rope_theta": self.rope_theta}

    # Per-architecture answers, overridden by the model files.
    @property
    def num_experts(self) -> int:
        raise NotImplementedError

    @property
    def top_k(self) -> int:
        raise NotImplementedError

    @property
    def moe_intermediate(self) -> int:
        raise NotImplementedError

    @property
    def renormalize(self) -> bool:
        raise NotImplementedError

    @property
    def attention_window(self) -> int | None:
        return self.sliding_window

    def layer_window(self, layer: int) -> int | None:
        """The attention window of one layer (models that alternate sliding and full layers override it)."""
        return self.attention_window

    def kv_ring_windows(self) -> list[int | None] | None:
        """Per layer, the window `Attention` reads as a ring of that many positions (engine/layers/kv_cache.py); None
        for MLA's latent cache (no V buffers), whose attention reads every position."""
        if not self.kv_cache_layout()[2]:
            return None
        return [self.layer_window(i) for i in range(self.num_hidden_layers)]

    attention_sinks: ClassVar[bool] = False  # a learned per-head logit joined to the softmax (GPT-OSS)
    norm_in_fp32: ClassVar[bool] = False  # RMSNorm weights kept and applied in fp32 (GPT-OSS), one rounding
    expert_bias: ClassVar[bool] = False  # biases on both expert projections (GPT-OSS)
    gated_experts: ClassVar[bool] = True  # w13 = [gate; up] (2I rows); False: up alone (Nemotron-H's relu^2 experts)

    def is_moe_layer(self, layer: int) -> bool:
        return True

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of a head RoPE rotates (fewer with GLM-4.5's partial rotary)."""
        return self.head_dim

    @property
    def attention_qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def attention_out_bias(self) -> bool:
        return self.attention_bias  # Qwen2-MoE and GLM-4.5 have biases on q/k/v only

    def kv_cache_layout(self) -> tuple[int, int, int]:
        """(heads, key dim, value dim) cached per token and layer (value dim 0: MLA reads values from its latent)."""
        return self.num_key_value_heads, self.head_dim, self.head_dim

    @property
    def checkpoint_dtype(self) -> str | None:
        return self.dtype or self.torch_dtype

    def check_moe(self, where: str = "config.json") -> None:
        validate.check_relations(self, where)


ROPE_TYPES = ("default", "yarn")


def rope_frequencies(rope: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """inv_freq [D/2] and the factor cos/sin are scaled by, as transformers computes them.

    YaRN (GPT-OSS, DeepSeek-V3): frequencies below the correction range are interpolated by `factor`,
    those above kept, a linear ramp between; the attention factor is 0.1 ln(factor) + 1 unless given.
    """
    D, base = head_dim, rope["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))  # [D/2]
    if rope["rope_type"] == "default":
        return inv_freq, 1.0
    factor = float(rope["factor"])
    original = rope["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return D * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(D // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [D/2]
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(attention_factor)


@dataclass(frozen=True)
class ExpertNaming:
    """Where a layer's routed experts are in the checkpoint.

    Per-expert: format strings with {layer} and {expert} for gate, up and down (HF's usual layout).
    Fused: one [E, 2I, H] gate_up and one [E, H, I] down tensor per layer (transformers 5's layout).
    Packed: per expert format, each stored tensor of the format's layout (`w13_blocks`, `w13_bias`, ...)
    from one fused [E, ...] checkpoint tensor per layer (GPT-OSS's MXFP4 `gate_up_proj_blocks`, ...).
    """

    gate: str = ""
    up: str = ""
    down: str = ""
    fused_gate_up: str = ""
    fused_down: str = ""
    packed: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
