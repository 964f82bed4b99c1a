"""Nemotron-H (`model_type: nemotron_h`): NVIDIA Nemotron-3-Nano-30B-A3B, a hybrid of Mamba-2, attention and MoE.

Each layer is one mixer behind one RMSNorm and a residual, its kind a letter of `hybrid_override_pattern` (or an
entry of transformers 5's `layers_block_type`): `M` Mamba-2 (engine/models/mamba2.py: a [heads, P, N] fp32 state and
a conv window in the sequence state, no K/V), `*` attention (GQA without any positional encoding: NoPE, so the
shared Attention runs with rotary_dim 0), `E` MoE, `-` a dense MLP. The experts are ungated: relu(up x)^2 then down,
so an expert's w13 is the up projection alone ([I, H]; `gated_experts = False`, `RELU2`), and only the general
per-projection expert path computes them (the fused CPU decode and the Triton kernels read a gate). Routing is
DeepSeek-V3's: sigmoid scores in fp32, `e_score_correction_bias` for the choice only, the top-k within `topk_group`
of `n_group` groups, renormalised, times `routed_scaling_factor` (2.5); a shared expert (relu^2 too) beside them.

Nemotron-3-Nano-30B-A3B: 52 layers = 23 Mamba-2 + 6 attention + 23 MoE; 128 experts top-6, I = 1856: one expert is
2 x 1856 x 2688 x 2 B = 19 MiB in bf16 (a gated one would be 29 MiB). Its Mamba state is 23 x 64 heads x 64 x 128 x
4 B = 46 MiB (+ 23 x 6144 x 3 x 2 B of conv windows) at any context; its 6 attention layers cache 6 x 2 x 2 x 128 x
2 B = 6 KiB per token (a 52-layer transformer of these heads would cache 52 KiB).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, UnsupportedModelError
from ..layers.kv_cache import KVCache
from ..layers.moe import RELU2, ExpertProvider, grouped_choice, grouped_topk
from ..quant import native
from . import gated_deltanet as gd
from . import mamba2
from .base import (
    Attention,
    BaseModelArgs,
    ExpertNaming,
    MoEForCausalLM,
    RMSNorm,
    Router,
    _bf16_gemv_lib,
    _in_out,
    rms_norm_fp32_weight,
    run_experts,
)
from .qwen3_next import _project, _project_add

# T = tokens, H = hidden, nH = Mamba heads, P = head dim, G = groups, N = state size, Im = nH x P, C = conv channels

KINDS = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}
# transformers 5's layers_block_type spelling of the same kinds
BLOCK_TYPES = {"linear_attention": "mamba", "full_attention": "attention", "moe": "moe", "mlp": "mlp"}


@dataclass
class NemotronHArgs(BaseModelArgs):
    aliases: ClassVar[dict[str, str]] = {"layer_norm_epsilon": "rms_norm_eps", "layer_types": "layers_block_type",
                                         "num_local_experts": "n_routed_experts"}
    hybrid_override_pattern: str | None = None
    layers_block_type: list | None = None
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    n_shared_experts: int = 1
    intermediate_size: int = 0
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    moe_latent_size: int | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False
    mamba_hidden_act: str = "silu"
    time_step_min: float = 0.001  # the dt initialisation's range (training only)
    # dt = clamp(softplus(dt_raw + dt_bias), *time_step_limit), as transformers >= 5.25 reads it (5.24 and older
    # clamped at time_step_min); the Hub's config has no such key: [0, inf), no clamp. hi may be Infinity (json)
    time_step_limit: list | None = None
    residual_in_fp32: bool = False
    num_nextn_predict_layers: int = 0  # MTP layers (`mtp.*`): in some checkpoints, never loaded

    gated_experts: ClassVar[bool] = False

    def __post_init__(self):
        if self.layers_block_type is not None:
            unknown = [t for t in self.layers_block_type if t not in BLOCK_TYPES]
            if unknown:
                raise UnsupportedModelError(f"config.json: layers_block_type has {unknown[0]!r}; nemotron_h layers are "
                                            f"{', '.join(BLOCK_TYPES)}")
            self.kinds = [BLOCK_TYPES[t] for t in self.layers_block_type]
        elif self.hybrid_override_pattern:
            unknown = sorted(set(self.hybrid_override_pattern) - set(KINDS))
            if unknown:
                raise UnsupportedModelError(f"config.json: hybrid_override_pattern has {unknown[0]!r}; nemotron_h "
                                            "layers are M (Mamba-2), * (attention), E (MoE) and - (MLP)")
            self.kinds = [KINDS[c] for c in self.hybrid_override_pattern]
        else:
            raise ConfigError("config.json: nemotron_h needs hybrid_override_pattern (or layers_block_type): the kind "
                              "of each layer", key="hybrid_override_pattern")
        if self.num_hidden_layers and self.num_hidden_layers != len(self.kinds):
            raise ConfigError(f"config.json: num_hidden_layers = {self.num_hidden_layers} is not allowed: "
                              f"hybrid_override_pattern has {len(self.kinds)} layers", key="num_hidden_layers")
        self.num_hidden_layers = len(self.kinds)
        super().__post_init__()
        for key, value, want in (("mlp_hidden_act", self.mlp_hidden_act, "relu2"),
                                 ("mamba_hidden_act", self.mamba_hidden_act, "silu")):
            if value != want:
                raise UnsupportedModelError(f"config.json: {key} {value!r} is not supported (nemotron_h: {want})")
        if self.moe_latent_size is not None:
            raise UnsupportedModelError("config.json: moe_latent_size (experts in a latent space) is not supported "
                                        "yet; moechat runs nemotron_h models whose experts take the hidden state")
        if self.residual_in_fp32:
            raise UnsupportedModelError("config.json: residual_in_fp32 true is not supported yet (nemotron_h)")
        limit = self.time_step_limit if self.time_step_limit is not None else (0.0, float("inf"))
        if (not isinstance(limit, (list, tuple)) or len(limit) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in limit)
                or not 0 <= limit[0] < limit[1] or limit[0] == float("inf")):
            raise ConfigError(f"config.json: time_step_limit = {self.time_step_limit!r} is not allowed: two numbers "
                              "[lo, hi] with 0 <= lo < hi (hi may be Infinity)", key="time_step_limit")
        self.time_step_limit = (float(limit[0]), float(limit[1]))
        if self.mamba_num_heads % self.n_groups:
            raise ConfigError(f"config.json: mamba_num_heads {self.mamba_num_heads} is not a multiple of n_groups "
                              f"{self.n_groups}", key="n_groups")

    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    @property
    def top_k(self) -> int:
        return self.num_experts_per_tok

    @property
    def moe_intermediate(self) -> int:
        return self.moe_intermediate_size

    @property
    def renormalize(self) -> bool:
        return bool(self.norm_topk_prob)

    @property
    def rotary_dim(self) -> int:
        return 0  # NoPE: the attention layers rotate nothing

    @property
    def attention_qkv_bias(self) -> bool:
        return False  # transformers' NemotronHAttention has no biases whatever attention_bias says

    @property
    def attention_out_bias(self) -> bool:
        return False

    def is_moe_layer(self, layer: int) -> bool:
        return self.kinds[layer] == "moe"

    @property
    def mamba_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_inner + 2 * self.n_groups * self.ssm_state_size

    def kv_layer_layouts(self) -> list[tuple[int, int, int]]:
        """K/V only where the layer is attention: MoE and MLP layers hold none (0 heads), Mamba layers a state."""
        D = self.head_dim
        return [(self.num_key_value_heads if k == "attention" else 0, D, D) for k in self.kinds]

    def recurrent_layout(self, dtype: torch.dtype) -> dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
        """Each Mamba layer's sequence state: the conv window (model dtype) and the SSM state (fp32)."""
        conv = ((self.conv_dim, self.conv_kernel - 1), dtype)
        ssm = ((self.mamba_num_heads, self.mamba_head_dim, self.ssm_state_size), torch.float32)
        return {i: {"conv": conv, "ssm": ssm} for i, k in enumerate(self.kinds) if k == "mamba"}


class GatedGroupNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Mamba2Mixer(nn.Module):
    """in_proj -> [z | x B C | dt]; causal conv (with bias) and SiLU over x B C; the SSD scan; y * silu(z) normed per
    group; out_proj."""

    reference = False  # True: the token-by-token conv and scan (tests)

    def __init__(self, args: NemotronHArgs, layer: int):
        super().__init__()
        H = args.hidden_size
        self.nH, self.P, self.G, self.N = args.mamba_num_heads, args.mamba_head_dim, args.n_groups, args.ssm_state_size
        self.inner, self.conv_dim, self.layer = args.mamba_inner, args.conv_dim, layer
        self.in_proj = nn.Linear(H, self.inner + self.conv_dim + self.nH, bias=args.use_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, args.conv_kernel, groups=self.conv_dim,
                                bias=args.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.nH))
        self.A_log = nn.Parameter(torch.zeros(self.nH))
        self.D = nn.Parameter(torch.ones(self.nH))
        self.norm = GatedGroupNorm(self.inner)
        self.out_proj = nn.Linear(self.inner, H, bias=args.use_bias)
        self.eps = args.rms_norm_eps
        # time_step_limit, which transformers applies in its chunked scan and its one-token step skips (the same
        # with the default [0, inf): softplus is never below 0): here every token is clamped alike
        self.floor, self.ceil = args.time_step_limit

    def finalize(self) -> None:
        self.in_t = _in_out(self.in_proj.weight.detach())  # [H, Im + C + nH]
        self.in_bias = None if self.in_proj.bias is None else self.in_proj.bias.detach()
        self.out_t = _in_out(self.out_proj.weight.detach())  # [Im, H]
        self.out_bias = None if self.out_proj.bias is None else self.out_proj.bias.detach()
        del self.in_proj, self.out_proj
        self.conv_w = self.conv1d.weight.detach()[:, 0]  # [C, W]
        self.conv_b = None if self.conv1d.bias is None else self.conv1d.bias.detach()
        self.A = -self.A_log.detach().float().exp()  # [nH]
        self.dt = self.dt_bias.detach().float()
        self.Dskip = self.D.detach().float()
        self.norm_w = self.norm.weight.detach()
        self.in_q = self.out_q = None  # int8 / int4 projections (`quantize_dense`)

    def quantize_dense(self, name: str) -> None:
        """in_proj [z | x B C | dt] and out_proj in `name` (int8 or int4, quant/dense_quant.py), their biases kept
        beside; the conv, A, D, dt_bias and the norm stay as they are (small, read in fp32)."""
        from ..quant.dense_quant import QuantLinear

        self.in_q = QuantLinear(self.in_t.t(), self.in_bias, name)
        self.out_q = QuantLinear(self.out_t.t(), self.out_bias, name)
        self.in_t = self.out_t = None

    def forward(self, x: torch.Tensor, kv: KVCache, residual: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        state = kv.state[self.layer]
        if self.in_q is not None:
            proj = self.in_q(x)  # [T, Im + C + nH]
        else:
            proj = _project(x, self.in_t) if self.in_bias is None else torch.addmm(self.in_bias, x, self.in_t)
        z, xbc, dt_raw = proj.split([self.inner, self.conv_dim, self.nH], dim=-1)  # [T, Im], [T, C], [T, nH]
        conv = gd.causal_conv1d_reference if self.reference else gd.causal_conv1d
        xbc = conv(xbc, self.conv_w, state["conv"], self.conv_b)  # [T, C], silu(conv) as transformers
        xs, B, C = xbc.split([self.inner, self.G * self.N, self.G * self.N], dim=-1)
        dt = mamba2.discretize(dt_raw, self.dt, self.floor, self.ceil)  # [T, nH] fp32
        scan = mamba2.ssd_reference if self.reference else mamba2.ssd
        y = scan(xs.reshape(T, self.nH, self.P), dt, self.A, B.reshape(T, self.G, self.N),
                 C.reshape(T, self.G, self.N), self.Dskip, state["ssm"])  # [T, nH, P] fp32
        # the gated RMSNorm of transformers' prefill: y * silu(z) in fp32, normed per group, times w, one rounding
        g = (y.reshape(T, self.inner) * F.silu(z.float())).view(T, self.G, -1)  # [T, G, Im/G]
        g = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).view(T, self.inner)
        y = (self.norm_w * g).to(x.dtype)  # [T, Im]
        if self.out_q is not None:
            return self.out_q(y, residual)  # [T, H]
        if self.out_bias is not None:
            return torch.addmm(residual, y, self.out_t) + self.out_bias
        return _project_add(residual, y, self.out_t)  # [T, H]


class ReluSquaredMLP(nn.Module):
    """down(relu(up x)^2): the dense '-' layers and the MoE's shared expert."""

    def __init__(self, hidden: int, inter: int, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def finalize(self) -> None:
        self.up_w, self.down_w = self.up_proj.weight.detach(), self.down_proj.weight.detach()
        self.up_b = None if self.up_proj.bias is None else self.up_proj.bias.detach()
        self.down_b = None if self.down_proj.bias is None else self.down_proj.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and self.up_b is None and self.down_b is None and \
                (lib := _bf16_gemv_lib(x, self.up_w.t())) is not None:
            # one bf16 CPU token: native.c's GEMV, each product rounded to bf16 as F.linear's (~1.7x its speed)
            h = torch.relu(native.bf16_gemv(lib, x, self.up_w, x.dtype)).square()  # [1, I]
            return native.bf16_gemv(lib, h, self.down_w, x.dtype)  # [1, H]
        return F.linear(torch.relu(F.linear(x, self.up_w, self.up_b)).square(), self.down_w, self.down_b)


class NemotronHMoE(nn.Module):
    """The sigmoid grouped router with its correction bias, the ungated routed experts, the shared expert."""

    def __init__(self, args: NemotronHArgs, layer: int):
        super().__init__()
        self.gate = Router(args.hidden_size, args.num_experts)
        self.gate.e_score_correction_bias = nn.Parameter(torch.empty(args.num_experts))
        self.shared_experts = ReluSquaredMLP(args.hidden_size, args.moe_shared_expert_intermediate_size,
                                             args.mlp_bias)
        self.layer, self.top_k = layer, args.top_k
        self.n_group, self.topk_group = args.n_group, args.topk_group
        self.renormalize, self.scaling = args.renormalize, float(args.routed_scaling_factor)

    def finalize(self) -> None:
        self.gate_weight = self.gate.weight.detach()  # [E, H] fp32 (fp32_weights)
        self.gate_bias = None  # no router bias: the correction bias steers the choice only
        self.correction_bias = self.gate.e_score_correction_bias.detach()  # [E] fp32
        self.shared_experts.finalize()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.gate_weight)  # [T, E] in fp32, as transformers
        return grouped_topk(logits, self.top_k, self.n_group, self.topk_group, scoring="sigmoid",
                            correction_bias=self.correction_bias, renormalize=self.renormalize,
                            routed_scaling_factor=self.scaling)

    def choice_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The router's fp32 logits [T, E] -> what its top-k picks from [T, E]: sigmoid + correction bias, the experts
        outside the `topk_group` best groups at -inf (`grouped_topk`'s choice); the prefetcher ranks these, so a
        prediction from the layer's own input is the layer's own choice."""
        return grouped_choice(logits, self.n_group, self.topk_group, scoring="sigmoid",
                              correction_bias=self.correction_bias)[1]

    def forward(self, x: torch.Tensor, provider: ExpertProvider, residual: torch.Tensor) -> torch.Tensor:
        """residual + routed(x) + shared(x) [T, H]; x is the normed input."""
        topk_weights, topk_ids = self.route(x)  # [T, K], [T, K]
        provider.observe(self.layer, residual)
        out = run_experts(x, topk_weights, topk_ids, provider, self.layer, RELU2, residual)
        return out + self.shared_experts.forward(x)


class NemotronHBlock(nn.Module):
    """norm -> one mixer (Mamba-2, attention, MoE or MLP) -> + residual."""

    def __init__(self, args: NemotronHArgs, layer: int):
        super().__init__()
        self.kind = args.kinds[layer]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if self.kind == "mamba":
            self.mixer = Mamba2Mixer(args, layer)
        elif self.kind == "attention":
            self.mixer = Attention(args, None, layer)
        elif self.kind == "moe":
            self.mixer = NemotronHMoE(args, layer)
        else:
            self.mixer = ReluSquaredMLP(args.hidden_size, args.intermediate_size, args.mlp_bias)
        self.is_moe = self.kind == "moe"
        self.eps = args.rms_norm_eps

    def finalize(self) -> None:
        self.mixer.finalize()
        self.w_post = self.norm.weight.detach().float()  # the norm before the MoE: what the prefetcher folds in
        self.ffn = self.mixer  # the MoE block, by the name the cache's predictor reads

    def forward(self, x, cos, sin, kv: KVCache, start: int, provider: ExpertProvider) -> torch.Tensor:
        h = rms_norm_fp32_weight(x, self.w_post, self.eps)
        if self.kind == "mamba":
            return self.mixer.forward(h, kv, x)
        if self.kind == "attention":
            return self.mixer.forward(h, cos, sin, kv, start, x)
        if self.kind == "moe":
            return self.mixer.forward(h, provider, x)
        return x + self.mixer.forward(h)


class NemotronHBody(nn.Module):
    def __init__(self, args: NemotronHArgs):
        super().__init__()
        self.embeddings = nn.Embedding(args.vocab_size, args.hidden_size,
                                       _weight=torch.empty(args.vocab_size, args.hidden_size))  # [V, H]
        self.layers = nn.ModuleList(NemotronHBlock(args, i) for i in range(args.num_hidden_layers))
        self.norm_f = RMSNorm(args.hidden_size, args.rms_norm_eps)


_EXPERTS = "backbone.layers.{layer}.mixer.experts."


class NemotronHForCausalLM(MoEForCausalLM):
    args_class = NemotronHArgs
    expert_naming = ExpertNaming(up=_EXPERTS + "{expert}.up_proj.weight", down=_EXPERTS + "{expert}.down_proj.weight",
                                 fused_gate_up=_EXPERTS + "up_proj", fused_down=_EXPERTS + "down_proj")
    fp32_weights = (".mixer.gate.weight", ".mixer.gate.e_score_correction_bias")

    def __init__(self, args: NemotronHArgs):
        nn.Module.__init__(self)
        self.args = args
        self.backbone = NemotronHBody(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def finalize(self, max_positions: int) -> None:
        for layer in self.backbone.layers:
            layer.finalize()
        self.layer_list = list(self.backbone.layers)
        self.embed_weight = self.backbone.embeddings.weight.detach()
        self.embed_host = None  # the table stays on the compute device (embed_on_host is not offered here)
        self.norm_weight = self.backbone.norm_f.weight.detach().float()
        self.final_norm = rms_norm_fp32_weight
        lm = (self.backbone.embeddings if self.args.tie_word_embeddings else self.lm_head).weight.detach()
        self.lm_weight_t = _in_out(lm)  # [H, V]
        if not self.args.tie_word_embeddings:
            self.lm_head.weight.data = self.lm_weight_t.t()
        device, dtype = self.embed_weight.device, self.embed_weight.dtype
        self.rope_cos = self.rope_sin = torch.empty(max_positions, 1, 0, dtype=dtype, device=device)  # NoPE
        self.max_positions = max_positions
        self.lm_q = None
        self.dense_format = "native"

    def quantize_dense(self, name: str) -> None:
        """`--dense-format int8|int4`: the attention layers' q/k/v and o and the Mamba-2 layers' in_proj and out_proj
        in `name`, the LM head in int8 under either (quant/dense_quant.py); the relu^2 MLPs (the '-' layers and the
        shared experts) stay native, as every family's dense MLPs do, and a tied table stays for lookups."""
        if name == "native":
            return
        from ..quant.dense_quant import LM_HEAD_FORMAT, QuantLinear

        for layer in self.layer_list:
            if layer.kind in ("mamba", "attention"):
                layer.mixer.quantize_dense(name)
        self.lm_q = QuantLinear(self.lm_weight_t.t(), None, LM_HEAD_FORMAT)
        self.lm_weight_t = None
        if not self.args.tie_word_embeddings:
            del self.lm_head
        self.dense_format = name

    def embed_on_host(self) -> None:
        return  # --embeddings host: the table stays where it is (this model's forward reads it on the device)


ARCHITECTURES = {"nemotron_h": NemotronHForCausalLM}
