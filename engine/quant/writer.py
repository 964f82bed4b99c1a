"""Writing checkpoints the way the Hub ships them: safetensors shards, an index, config.json.

Used by the tests (tiny GPT-OSS checkpoints with MXFP4 experts from the project's own writer) and the
benches (GPT-OSS-shaped models at real widths); transformers reads what this writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import mxfp4


def gpt_oss_expert_tensors(layer: int, w13: torch.Tensor, w2: torch.Tensor, w13_bias: torch.Tensor,
                           w2_bias: torch.Tensor, bias_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """One layer's experts as GPT-OSS's MXFP4 checkpoint names them.

    w13 [E, 2I, H] (rows gate/up interleaved, as the model computes them), w2 [E, H, I], biases [E, 2I] / [E, H].
    """
    p = f"model.layers.{layer}.mlp.experts."
    b13, s13 = mxfp4.quantize(w13)  # [E, 2I, H/32, 16], [E, 2I, H/32]
    b2, s2 = mxfp4.quantize(w2)  # [E, H, I/32, 16], [E, H, I/32]
    return {p + "gate_up_proj_blocks": b13, p + "gate_up_proj_scales": s13, p + "gate_up_proj_bias":
            w13_bias.to(bias_dtype).contiguous(), p + "down_proj_blocks": b2, p + "down_proj_scales": s2,
            p + "down_proj_bias": w2_bias.to(bias_dtype).contiguous()}


def save_checkpoint(path: str | Path, tensors: dict[str, torch.Tensor], config: dict, shards: int = 1) -> Path:
    """Tensors into `shards` safetensors files (with model.safetensors.index.json when > 1) and config.json."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    groups = [names[i::shards] for i in range(shards)] if shards > 1 else [names]
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        file = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in group}, str(path / file), metadata={"format": "pt"})
        for n in group:
            weight_map[n] = file
            total += tensors[n].numel() * tensors[n].element_size()
    if shards > 1:
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
