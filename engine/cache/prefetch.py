"""What to load before it is asked for: cross-layer prediction, temporal reuse, routing profiles.

While layer l's experts compute, the provider asks a predictor which experts layers l+1..l+depth
will want and starts loading the ones that are not in a slot (`transfer.py` runs the loads):

* `next-layer` applies layer j's own router to the residual stream *entering layer l's MoE* (after
  l's attention), normed with layer j's post-attention norm: the residual stream changes slowly from
  layer to layer, so this is close to what layer j's router will see (the cross-layer gate of FATE
  and tinyserve; Pre-gated MoE trains for it, we use the model as it is). Costs one [T, H] x [H, E]
  matmul per predicted layer.
* `previous-token` predicts that layer j uses the experts the previous token used there (temporal
  reuse); free, and useful when the cache is too small to keep them.
* `both` takes the union, router predictions first.

The prediction never changes what is computed: a predicted expert only lands in a slot earlier, so
output is identical with prefetch on or off (tested on every architecture).

Routing profiles (warm start): per model, how often each (layer, expert) was used, saved at exit under
the XDG cache dir and used at the next start to fill the slots with the most used experts before the
first token, so a second run does not start cold. Pure numpy; a damaged profile is ignored, never fatal.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import MoechatError
from ..io.files import atomic_write, read_regular

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

# No torch at import: the CLI reads PREFETCH_MODES at start-up (torch is imported where a prediction runs).

PREFETCH_MODES = ("off", "next-layer", "previous-token", "both")
DEFAULT_PREFETCH = "next-layer"
MAX_PREFETCH_DEPTH = 4
MAX_PROFILE_ENTRIES = 1 << 24  # (layer, expert) counts in a routing profile: far past any model


def default_prefetch(device: str) -> str:
    """The mode a user gets without --prefetch: what `bench/prefetch.py` measured to be faster.

    next-layer whenever a miss crosses a link (RAM -> GPU: the copy engine does the work). On a CPU the
    loads cost CPU time: on the bundled demo model (2 cores, 24 of 96 experts in slots) next-layer
    prefetch over the lrfu-layered policy measured 0.72-0.97x the decode speed of that policy alone with
    misses read from a cold disk (four sets of 5-9 interleaved runs, 1 and 2 torch threads) and 0.93x
    with every expert in RAM, although it cut demand misses to 0.66x. So: off on a CPU.
    """
    return "off" if str(device).split(":")[0] == "cpu" else DEFAULT_PREFETCH


def check_prefetch(mode: str, depth: int) -> None:
    if mode not in PREFETCH_MODES:
        raise ValueError(f"unknown prefetch mode {mode!r}: choose one of {', '.join(PREFETCH_MODES)}")
    if not 1 <= depth <= MAX_PREFETCH_DEPTH:
        raise ValueError(f"prefetch depth must be 1..{MAX_PREFETCH_DEPTH}, got {depth}")


def nothing_to_prefetch(mode: str) -> str:
    """Why prefetch `mode` is refused on a CPU that computes misses in place with every expert in RAM: the one
    message of the provider's check at load and of the CLI's before it (app/cli/engine_args.py)."""
    return (f"--prefetch {mode} has nothing to do here: on a CPU every miss is computed in place from RAM and every "
            "expert is already in RAM; bound the RAM tier (--ram-cache-mb) to prefetch experts from disk into it, or "
            "leave --prefetch off")


@dataclass(frozen=True)
class RouterWeights:
    """What predicting a layer's routing needs: its post-attention norm and router weights."""

    norm: torch.Tensor  # [H]
    gate: torch.Tensor  # [E, H]
    eps: float
    bias: torch.Tensor | None = None  # [E] (GPT-OSS's router has one)
    # the router's own choice scores [T, E] from its fp32 logits, where a top-k of the logits is not its choice
    # (sigmoid + correction bias, grouped top-k: the MoE block's `choice_scores`; groups left out at -inf)
    choice: Callable[[torch.Tensor], torch.Tensor] | None = None


class Predictor:
    """Names the experts layers after l will use, from the residual stream at layer l's MoE."""

    def __init__(self, routers: dict[int, RouterWeights], top_k: int, num_layers: int):
        self.routers = routers  # MoE layer -> weights
        self.moe_layers = sorted(routers)
        self.top_k = top_k
        self.num_layers = num_layers
        self.last_ids: dict[int, list[int]] = {}  # layer -> experts the previous step used there
        self._folded: dict[int, torch.Tensor] = {}  # layer -> (gate * norm)^T [H, E]

    @classmethod
    def from_model(cls, model) -> Predictor:
        """Read the routers and norms of a finalized `MoEForCausalLM` (no copies)."""
        routers = {}
        for i, layer in enumerate(model.layer_list):
            if layer.is_moe:
                routers[i] = RouterWeights(layer.w_post, layer.ffn.gate_weight, layer.eps, layer.ffn.gate_bias,
                                           getattr(layer.ffn, "choice_scores", None))
        return cls(routers, model.args.top_k, model.args.num_hidden_layers)

    def targets(self, layer: int, depth: int) -> list[int]:
        """The next `depth` MoE layers after `layer`."""
        out = [j for j in self.moe_layers if j > layer]
        return out[:depth]

    def predict(self, mode: str, target: int, hidden_states: torch.Tensor, budget: int) -> list[int]:
        """At most `budget` experts of layer `target`, most likely first.

        hidden_states [T, H] is the residual stream entering the current layer's MoE. For T > 1 (a
        prefill chunk) experts are ranked by how many of the T tokens would pick them.
        """
        import torch

        out: list[int] = []
        runners_up: list[int] = []
        if mode in ("next-layer", "both"):
            # Layer `target` computes gate @ (norm * x / rms(x)). 1/rms(x) is one positive number per token, so
            # it never changes a token's ranking of experts: one matmul with the norm folded into the gate.
            r = self.routers[target]
            folded = self._folded.get(target)
            if folded is None:
                folded = (r.gate * r.norm[None, :]).t().to(hidden_states.dtype).contiguous()  # [H, E]
                self._folded[target] = folded
            logits = hidden_states @ folded  # [T, E], each row a positive multiple of layer target's logits
            if r.bias is not None or r.choice is not None:  # a bias, a sigmoid: neither scales with 1/rms(x)
                xf = hidden_states.float()
                inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + r.eps)  # [T, 1]
                logits = logits.float() * inv_rms  # [T, E] layer target's logits
                logits = logits if r.bias is None else logits + r.bias.float()
                logits = logits if r.choice is None else r.choice(logits)  # [T, E] what its router ranks
            if logits.shape[0] == 1:  # a decode step: its top-k, then the runners-up if the budget allows more
                n = min(logits.shape[-1], max(budget, self.top_k))
                if r.choice is not None:  # never a masked group's expert (a read only where groups can mask)
                    n = min(n, int(torch.isfinite(logits[0]).sum()))
                ranked = torch.topk(logits[0].float(), n).indices.tolist()
                out, runners_up = ranked[: self.top_k], ranked[self.top_k :]
            else:
                ids = torch.topk(logits.float(), self.top_k, dim=-1).indices  # [T, K]
                votes = torch.bincount(ids.reshape(-1), minlength=logits.shape[-1])  # [E]
                order = torch.argsort(votes, descending=True, stable=True)
                out = [int(e) for e in order[: int((votes > 0).sum())].tolist()]
        if mode in ("previous-token", "both"):
            for e in self.last_ids.get(target, ()):
                if e not in out:
                    out.append(e)
        out.extend(e for e in runners_up if e not in out)  # the router's next choices last
        return out[:budget]

    def observe_routing(self, layer: int, experts: list[int]) -> None:
        """The experts `layer` used in this step (for previous-token prediction)."""
        self.last_ids[layer] = experts


# -- routing profiles --------------------------------------------------------------------------------


def profile_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moechat" / "profiles"


def profile_key(model_dir: str | os.PathLike) -> str:
    """A model's profile name: its resolved path and config.json bytes (a changed model gets a new one)."""
    model_dir = Path(model_dir).resolve()
    h = hashlib.sha256(str(model_dir).encode())
    try:
        h.update((model_dir / "config.json").read_bytes())
    except OSError:
        pass
    return h.hexdigest()[:24]


def profile_path(model_dir: str | os.PathLike, directory: str | os.PathLike | None = None) -> Path:
    return Path(directory or profile_dir()) / f"{profile_key(model_dir)}.json"


def load_profile(path: Path, num_layers: int, num_experts: int) -> np.ndarray | None:
    """Saved usage counts [L, E], or None when there is none or it does not match the model. Anything damaged
    (bad JSON, nested 200k deep, a FIFO, a 1 GB file, wrong shapes) is ignored, never fatal: the next save
    replaces it."""
    if num_layers * num_experts > MAX_PROFILE_ENTRIES:
        return None
    try:
        raw = read_regular(path, "routing profile", max_bytes=64 * num_layers * num_experts + 4096)
        data = json.loads(raw)
        counts = np.asarray(data["counts"], dtype=np.float64)
    except (OSError, ValueError, KeyError, TypeError, RecursionError, MoechatError):
        return None
    if counts.shape != (num_layers, num_experts) or not np.isfinite(counts).all() or (counts < 0).any():
        return None
    return counts


def save_profile(path: Path, counts: np.ndarray, *, decay: float = 0.5) -> None:
    """Merge this run's usage counts into the saved profile (older runs weigh `decay` each run).

    Written to a temporary file and renamed, so a crash mid-write leaves the previous profile.
    """
    counts = counts.astype(np.float64)
    old = load_profile(path, *counts.shape)
    if old is not None:
        counts = counts + decay * old
    # all or nothing: a full disk, a read-only dir or a kill leaves the previous profile and no temporary file
    atomic_write(path, json.dumps({"format": 1, "counts": np.round(counts, 3).tolist()}), fsync=False)
