"""Model architectures, one file per Hugging Face `model_type`.

`ARCHITECTURES` maps a config's model_type to its class: the families below, and every module of this package that
defines its own `ARCHITECTURES` dict (a new family registers itself in its own file, nothing to edit here). Known
types that moechat does not run say why (a dense model needs no expert offloading; some MoE families are not
implemented yet), so the user gets a reason instead of "unknown model".
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import MoEForCausalLM
from .deepseek_v2 import DeepseekV2ForCausalLM
from .deepseek_v3 import DeepseekV3ForCausalLM
from .glm4_moe import Glm4MoeForCausalLM
from .gpt_oss import GptOssForCausalLM
from .mixtral import MixtralForCausalLM
from .olmoe import OlmoeForCausalLM
from .qwen2_moe import Qwen2MoeForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[MoEForCausalLM]] = {
    "qwen3_moe": Qwen3MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
    "olmoe": OlmoeForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "deepseek_v2": DeepseekV2ForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
}

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    _own = getattr(importlib.import_module(f"{__name__}.{_info.name}"), "ARCHITECTURES", None)
    if isinstance(_own, dict):
        ARCHITECTURES.update(_own)

# MoE families moechat knows of but does not implement yet.
PLANNED_MOE = {"phimoe", "granitemoe", "jamba", "dbrx", "llama4", "qwen3_next", "ernie4_5_moe", "minimax",
               "hunyuan_v1_moe", "nemotron_h"} - ARCHITECTURES.keys()
# Dense families: nothing to offload, so nothing for moechat to do.
DENSE = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi", "phi3", "gpt2", "olmo",
         "olmo2", "falcon", "gpt_neox", "starcoder2", "cohere", "granite", "smollm3"}

__all__ = ["ARCHITECTURES", "DENSE", "PLANNED_MOE", "MoEForCausalLM"]
