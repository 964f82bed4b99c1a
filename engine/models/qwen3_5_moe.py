"""Qwen3.5 / Qwen3.6 MoE (`model_type: qwen3_5_moe`, and `qwen3_5_moe_text` for the text model alone).

Qwen3-Next's hybrid (engine/models/qwen3_next.py: three Gated DeltaNet layers to one gated full-attention layer,
zero-centred norms, partial rotary, a gated shared expert) with the linear layers' projections stored apart
(`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`: one GEMM again after loading), every layer MoE, and the
top-k always renormalised. The Hub ships it as a vision-language model: config.json nests the text model under
`text_config` and the checkpoint holds `model.language_model.*`, a vision tower (`model.visual.*`) and an MTP layer
(`mtp.*`). moechat runs the text model and says so in one line; neither the tower nor the MTP layer is read.
Its multimodal RoPE (`mrope_section`) gives text tokens the same position on all three axes, which is plain RoPE.

Qwen3.6-35B-A3B: 40 layers (30 linear, 10 full attention), 256 experts top-8, I = 512: one expert is
3 x 512 x 2048 x 2 B = 6 MiB in bf16, 60 GiB for the 10,240; the recurrent state is 61.4 MiB at any context, the KV
cache 10 x 2 x 2 x 256 x 2 B = 20 KiB per token (80 MiB at 4096).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import ExpertNaming, MoEForCausalLM
from .qwen3_next import Qwen3NextArgs, Qwen3NextForCausalLM

WRAPPED = "model.language_model."  # where the multimodal checkpoint keeps the text model


@dataclass
class Qwen3_5MoeArgs(Qwen3NextArgs):
    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> Qwen3_5MoeArgs:
        text = d.get("text_config")
        if isinstance(text, dict):  # the multimodal wrapper: the text model's own config, under the wrapper's type
            merged = {k: v for k, v in d.items() if k not in ("text_config", "vision_config")}
            d = {**merged, **text, "model_type": d.get("model_type")}
            where = f"{where} (text_config)"
        return super().from_dict(d, where)

    @property
    def renormalize(self) -> bool:
        return True  # Qwen3.5's router always renormalises its top-k

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0


def _naming(prefix: str) -> ExpertNaming:
    return ExpertNaming(
        gate=prefix + "layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
        up=prefix + "layers.{layer}.mlp.experts.{expert}.up_proj.weight",
        down=prefix + "layers.{layer}.mlp.experts.{expert}.down_proj.weight",
        fused_gate_up=prefix + "layers.{layer}.mlp.experts.gate_up_proj",
        fused_down=prefix + "layers.{layer}.mlp.experts.down_proj",
    )


class Qwen3_5MoeTextForCausalLM(Qwen3NextForCausalLM):
    """The text model alone (`qwen3_5_moe_text`, keys `model.layers.*`)."""

    args_class = Qwen3_5MoeArgs
    delta_layout = "split"
    expert_naming = _naming("model.")

    @classmethod
    def load_notice(cls, raw: dict, checkpoint) -> str | None:
        mtp = sum(1 for name in checkpoint.tensors if name.startswith("mtp."))
        return f"the multi-token-prediction layer's {mtp} tensors are not used" if mtp else None


class Qwen3_5MoeForCausalLM(Qwen3_5MoeTextForCausalLM):
    """The Hub's multimodal checkpoint run text-only: its text model's tensors are under `model.language_model.`."""

    expert_naming = _naming(WRAPPED)

    @classmethod
    def dense_weight_names(cls, args) -> dict[str, tuple[int, ...]]:
        names = MoEForCausalLM.dense_weight_names.__func__(cls, args)
        return {(WRAPPED + n[len("model."):] if n.startswith("model.") else n): s for n, s in names.items()}

    def load_state_dict(self, state_dict, *args, **kwargs):
        state = {("model." + n[len(WRAPPED):] if n.startswith(WRAPPED) else n): t for n, t in state_dict.items()}
        return super().load_state_dict(state, *args, **kwargs)

    @classmethod
    def load_notice(cls, raw: dict, checkpoint) -> str | None:
        vision = sum(1 for name in checkpoint.tensors if name.startswith(("model.visual.", "visual.")))
        if not vision and "vision_config" not in raw:
            return super().load_notice(raw, checkpoint)
        return (f"{raw.get('model_type')} is a vision-language model: moechat runs it text-only (the vision tower's "
                f"{vision} tensors are not loaded; images are not supported)")


ARCHITECTURES = {"qwen3_5_moe": Qwen3_5MoeForCausalLM, "qwen3_5_moe_text": Qwen3_5MoeTextForCausalLM}
