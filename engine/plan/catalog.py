"""The curated catalog of MoE models: what moechat runs today, and the popular ones it does not run yet, with why.

Pure data and no imports beyond the standard library, so the CLI and the setup wizard can list it at once.
Each entry names the Hub repo, its `model_type` (the family, one file in engine/models/ when supported),
its size in parameters (total and active per token), how its experts are stored, and the engine features
it needs. What changes on the Hub (the commit, gated or not, file sizes) is refreshed by
`engine/plan/hub/` (`Hub.catalog`); the revision is pinned to the commit at download time.

`SUPPORTED_TYPES` is the set of `engine/models.ARCHITECTURES` keys, read from that module's source (and from each
family module's own `ARCHITECTURES` literal, which the package merges) rather than imported: importing it imports
torch (2-3 s), and the CLI and the wizard list the catalog at once. So a model_type becomes runnable everywhere
(catalog, Hub search, `moechat fit`) the moment it is registered there.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path


def _literal_keys(source: str) -> list[str] | None:
    """The keys of a module-level `ARCHITECTURES = {...}` in this source: [] when it has none, None when it is not
    a dict literal of strings (then only importing the package can tell)."""
    for node in ast.parse(source).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign)
                                                                      else None)
        if isinstance(target, ast.Name) and target.id == "ARCHITECTURES":
            if not isinstance(node.value, ast.Dict):
                return None
            keys = [k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            return keys if len(keys) == len(node.value.keys) else None
    return []


def _registered_types() -> frozenset[str]:
    """The keys of `ARCHITECTURES = {...}` in engine/models/__init__.py and in every family module that registers
    itself (its own `ARCHITECTURES` literal, which the package merges), read without executing any of them."""
    spec = importlib.util.find_spec("moechat.engine.models")  # imports moechat.engine only (torch-free)
    source = spec.loader.get_source(spec.name) if spec and spec.loader else None
    keys = _literal_keys(source) if source else None
    folders = (spec.submodule_search_locations or []) if keys and spec else []
    for file in sorted(f for folder in folders for f in Path(folder).glob("*.py") if f.name != "__init__.py"):
        own = _literal_keys(file.read_text(encoding="utf-8"))
        if own is None:
            keys = None
            break
        keys += own
    if keys:
        return frozenset(keys)
    from ..models import ARCHITECTURES  # not plain literals (or no source): ask the package, at torch's cost

    return frozenset(ARCHITECTURES)


SUPPORTED_TYPES = _registered_types()

# model_type -> what the engine lacks for it (shown next to the entry, and for Hub search results).
MISSING_FEATURES: dict[str, str] = {
    "phimoe": "needs SparseMixer routing",
    "granitemoe": "needs Granite's scaled residuals and routing",
    "llama4": "needs interleaved dense/MoE layers with a shared expert, chunked attention and NoPE layers",
    "jamba": "needs Mamba layers",
    "dbrx": "needs DBRX's fused expert layout and clipped attention",
    "ernie4_5_moe": "needs ERNIE's shared experts and routing",
    "minimax": "needs lightning (linear) attention",
    "hunyuan_v1_moe": "needs shared experts and cross-layer attention",
}


# quantization_config.quant_method values the loader reads (engine/quant/registry.py QUANT_METHODS; a test keeps the
# two equal); no quantization_config at all is a full-precision checkpoint.
LOADABLE_QUANT_METHODS = ("mxfp4", "fp8")


def why_not_runnable(model_type: str, quant_method: str | None = None, remote_code: bool = False) -> str | None:
    """Why `moechat run` would refuse a checkpoint with this config, in the loader's terms (None: it loads it).
    Torch-free, so `moechat fit` and the wizard never call "runs" what the engine cannot load."""
    if model_type not in SUPPORTED_TYPES:
        if remote_code and model_type not in MISSING_FEATURES:
            return (f"model_type {model_type!r} needs trust_remote_code (custom Python code shipped with the model), "
                    "and moechat never runs code from a checkpoint")
        why = MISSING_FEATURES.get(model_type)
        return (f"model_type {model_type!r} is not supported yet ({why})" if why else
                f"model_type {model_type!r} is not a Mixture-of-Experts architecture moechat knows") + \
            f"; moechat runs {', '.join(sorted(SUPPORTED_TYPES))}"
    if quant_method is not None and quant_method not in LOADABLE_QUANT_METHODS:
        return (f"its weights are quantized with {quant_method!r}, which moechat does not read; it reads MXFP4 and FP8 "
                "checkpoints and full-precision ones (bf16/fp16/fp32, which --expert-format int8|int4 converts): use "
                "the model's original or FP8 checkpoint")
    return None


@dataclass(frozen=True)
class CatalogEntry:
    """One curated model. Parameter counts in billions; `features` are the engine features it needs."""

    repo_id: str
    family: str  # the HF model_type
    total_params_b: float
    active_params_b: float
    format: str  # how the experts are stored: bf16, mxfp4, fp8 (block scales)
    features: tuple[str, ...] = ()
    gated: bool = False  # gated on the Hub: the licence must be accepted and HF_TOKEN set
    note: str = ""

    @property
    def supported(self) -> bool:
        return self.family in SUPPORTED_TYPES

    @property
    def why_unsupported(self) -> str | None:
        if self.supported:
            return None
        return MISSING_FEATURES.get(self.family, f"model_type {self.family} is not implemented")

    def to_json(self) -> dict:
        return {"repo_id": self.repo_id, "family": self.family, "total_params_b": self.total_params_b,
                "active_params_b": self.active_params_b, "format": self.format, "features": list(self.features),
                "gated": self.gated, "supported": self.supported, "why_unsupported": self.why_unsupported,
                "note": self.note}


_SOFTMAX = "softmax top-k routing"
_OSS_ROUTING = "top-k then softmax routing, router bias"
_GROUPED = "sigmoid group-limited routing + bias"
CATALOG: tuple[CatalogEntry, ...] = (
    # -- runs today ---------------------------------------------------------------------------------------
    CatalogEntry("allenai/OLMoE-1B-7B-0125-Instruct", "olmoe", 6.9, 1.3, "bf16",
                 (_SOFTMAX, "64 experts top-8", "q/k norm"), note="small: fits most machines"),
    CatalogEntry("allenai/OLMoE-1B-7B-0924-Instruct", "olmoe", 6.9, 1.3, "bf16",
                 (_SOFTMAX, "64 experts top-8", "q/k norm", "clip_qkv")),
    CatalogEntry("Qwen/Qwen3-30B-A3B-Instruct-2507", "qwen3_moe", 30.5, 3.3, "bf16",
                 (_SOFTMAX, "128 experts top-8", "per-head q/k norm", "GQA")),
    CatalogEntry("Qwen/Qwen3-30B-A3B", "qwen3_moe", 30.5, 3.3, "bf16",
                 (_SOFTMAX, "128 experts top-8", "per-head q/k norm", "GQA"), note="thinking and non-thinking"),
    CatalogEntry("Qwen/Qwen3-Coder-30B-A3B-Instruct", "qwen3_moe", 30.5, 3.3, "bf16",
                 (_SOFTMAX, "128 experts top-8", "per-head q/k norm", "GQA")),
    CatalogEntry("Qwen/Qwen3-235B-A22B-Instruct-2507", "qwen3_moe", 235.1, 22.2, "bf16",
                 (_SOFTMAX, "128 experts top-8", "per-head q/k norm", "GQA"), note="needs ~470 GB of RAM + disk"),
    CatalogEntry("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral", 46.7, 12.9, "bf16",
                 (_SOFTMAX, "8 experts top-2", "GQA")),
    CatalogEntry("mistralai/Mixtral-8x22B-Instruct-v0.1", "mixtral", 140.6, 39.1, "bf16",
                 (_SOFTMAX, "8 experts top-2", "GQA")),
    CatalogEntry("openai/gpt-oss-20b", "gpt_oss", 20.9, 3.6, "mxfp4",
                 (_OSS_ROUTING, "32 experts top-4", "MXFP4 experts", "attention sinks", "alternating sliding window",
                  "clamped SwiGLU"),
                 note="MXFP4 experts, 12.6 MiB each (bf16 would be 47.5 MiB)"),
    CatalogEntry("openai/gpt-oss-120b", "gpt_oss", 116.8, 5.1, "mxfp4",
                 (_OSS_ROUTING, "128 experts top-4", "MXFP4 experts", "attention sinks", "alternating sliding window",
                  "clamped SwiGLU"),
                 note="MXFP4 experts, 56.8 GiB in all (bf16 would be 213.6 GiB)"),
    CatalogEntry("deepseek-ai/DeepSeek-V2-Lite-Chat", "deepseek_v2", 15.7, 2.4, "bf16",
                 (_SOFTMAX, "64 experts top-6", "2 shared experts", "MLA (latent KV cache)"),
                 note="small: KV 30 KiB a token"),
    CatalogEntry("Qwen/Qwen1.5-MoE-A2.7B-Chat", "qwen2_moe", 14.3, 2.7, "bf16",
                 (_SOFTMAX, "60 experts top-4", "gated shared expert")),
    CatalogEntry("zai-org/GLM-4.5-Air", "glm4_moe", 106.9, 12.0, "bf16",
                 (_GROUPED, "128 experts top-8", "shared expert", "partial rotary", "GQA")),
    CatalogEntry("deepseek-ai/DeepSeek-V3-0324", "deepseek_v3", 671.0, 37.0, "fp8 (128x128 block scales)",
                 (_GROUPED, "256 experts top-8", "shared expert", "MLA (latent KV cache)", "FP8 experts"),
                 note="FP8 experts, 609 GiB in all; KV 69 KiB a token"),
    CatalogEntry("deepseek-ai/DeepSeek-R1-0528", "deepseek_v3", 671.0, 37.0, "fp8 (128x128 block scales)",
                 (_GROUPED, "256 experts top-8", "shared expert", "MLA (latent KV cache)", "FP8 experts"),
                 note="reasoning; FP8 experts, 609 GiB in all"),
    CatalogEntry("zai-org/GLM-4.7-Flash", "glm4_moe_lite", 29.9, 3.6, "bf16",
                 (_GROUPED, "64 experts top-4", "shared expert", "MLA (latent KV cache)"),
                 note="30B-A3B; KV 52.9 KiB a token; its MTP layer (1.2 GiB) is not loaded"),
    CatalogEntry("MiniMaxAI/MiniMax-M2.5", "minimax_m2", 228.7, 10.4, "fp8 (128x128 block scales)",
                 ("sigmoid top-k routing + bias", "256 experts top-8", "q/k norm", "partial rotary", "GQA",
                  "FP8 experts"),
                 note="FP8 experts, 13.5 MiB each, 209 GiB in all; KV 248 KiB a token"),
    CatalogEntry("google/gemma-4-26B-A4B-it", "gemma4", 25.2, 3.8, "bf16",
                 (_SOFTMAX, "128 experts top-8", "dense MLP beside the experts", "sliding/global attention",
                  "logit soft-capping", "multimodal wrapper (runs text-only)"),
                 note="KV 240 KiB a token; the vision tower is not loaded"),
    # Gated DeltaNet hybrids: sizes from their config.json (a meta-device build: the text model, LM head included)
    CatalogEntry("Qwen/Qwen3.6-35B-A3B", "qwen3_5_moe", 34.7, 2.9, "bf16",
                 (_SOFTMAX, "256 experts top-8", "Gated DeltaNet (30 of 40 layers)", "gated attention",
                  "gated shared expert", "partial rotary", "multimodal wrapper (runs text-only)"),
                 note="KV 20 KiB a token + 61 MiB of recurrent state; the vision tower and MTP layer are not loaded"),
    CatalogEntry("Qwen/Qwen3-Next-80B-A3B-Instruct", "qwen3_next", 79.7, 3.6, "bf16",
                 (_SOFTMAX, "512 experts top-10", "Gated DeltaNet (36 of 48 layers)", "gated attention",
                  "gated shared expert", "partial rotary"),
                 note="KV 24 KiB a token + 74 MiB of recurrent state; its MTP layer is not loaded"),
    # Mamba-2 hybrid: 23 Mamba-2, 6 attention (no positional encoding) and 23 MoE layers
    CatalogEntry("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B", "nemotron_h", 31.6, 3.2, "bf16",
                 ("Mamba-2 (23 of 52 layers)", "sigmoid top-k routing + bias", "128 experts top-6", "shared expert",
                  "relu^2 experts (no gate projection)", "NoPE attention"),
                 note="KV 6 KiB a token + 46 MiB of Mamba state; a bf16 expert is 19 MiB (up + down only)"),
    # -- popular, not yet ---------------------------------------------------------------------------------
    CatalogEntry("microsoft/Phi-3.5-MoE-instruct", "phimoe", 41.9, 6.6, "bf16", ("SparseMixer routing",)),
    CatalogEntry("meta-llama/Llama-4-Scout-17B-16E-Instruct", "llama4", 109.0, 17.0, "bf16",
                 ("shared expert", "chunked attention", "multimodal"), gated=True),
)


def find(repo_id: str) -> CatalogEntry | None:
    """The catalog entry of a repo id (case-insensitive, as the Hub resolves names)."""
    low = repo_id.lower()
    return next((e for e in CATALOG if e.repo_id.lower() == low), None)
