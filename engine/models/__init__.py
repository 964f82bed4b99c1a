"""Model architectures, one file per Hugging Face `model_type`.

`ARCHITECTURES` maps a config's model_type to its class. Known types that moechat does not run say
why (a dense model needs no expert offloading; some MoE families are not implemented yet), so the user
gets a reason instead of "unknown model".
"""

from __future__ import annotations

from .base import MoEForCausalLM
from .gpt_oss import GptOssForCausalLM
from .mixtral import MixtralForCausalLM
from .olmoe import OlmoeForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[MoEForCausalLM]] = {
    "qwen3_moe": Qwen3MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
    "olmoe": OlmoeForCausalLM,
    "gpt_oss": GptOssForCausalLM,
}

# MoE families moechat knows of but does not implement yet.
PLANNED_MOE = {"deepseek_v2", "deepseek_v3", "qwen2_moe", "glm4_moe", "phimoe", "granitemoe",
               "jamba", "dbrx", "llama4", "qwen3_next", "ernie4_5_moe", "minimax", "hunyuan_v1_moe"}
# Dense families: nothing to offload, so nothing for moechat to do.
DENSE = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi", "phi3", "gpt2", "olmo",
         "olmo2", "falcon", "gpt_neox", "starcoder2", "cohere", "granite", "smollm3"}

__all__ = ["ARCHITECTURES", "DENSE", "PLANNED_MOE", "MoEForCausalLM"]
