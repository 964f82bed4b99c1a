"""The MoE contract: routing functions, the ExpertProvider protocol, and the slow reference.

A model's MoE block does three things and knows nothing else about where experts live:

    topk_weights, topk_ids = route(router_logits)        # pure function
    batch = provider.prepare(layer, topk_ids)             # experts resident; slot ids back
    out = expert_compute(hidden_states, topk_weights, batch)   # sees slots only

`ResidentProvider` keeps every expert of every layer on the compute device and maps expert e to
slot e (zero copies). The cached provider of the expert-cache issue implements the same protocol over
a fixed pool of C slots, so model files never change when the cache does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from ..quant.base import ExpertFormat
from ..quant.dense import DENSE

# T = tokens, E = experts, K = top-k, C = slots, H = hidden size, I = expert intermediate size


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all E experts in fp32, keep the top-k, optionally renormalise them to sum to 1.

    Qwen3-MoE / OLMoE (`norm_topk_prob`) and Mixtral (always renormalised). Returns fp32 weights
    [T, K] and int64 ids [T, K]; ties go to the lower expert id, as torch.topk does in transformers.
    """
    if renormalize:
        # softmax is monotonic and renormalising the top-k probabilities is a softmax over their logits:
        # same experts, same weights (to rounding), two ops instead of four on the decode path.
        topk_logits, topk_ids = torch.topk(router_logits.float(), top_k, dim=-1)  # [T, K], [T, K]
        return torch.softmax(topk_logits, dim=-1), topk_ids
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    return torch.topk(probs, top_k, dim=-1)  # [T, K], [T, K]


@dataclass(frozen=True)
class ExpertActivation:
    """How an expert combines its gate and up projections (`w13`'s rows) into the input of `w2`.

    `swiglu`: gate rows then up rows, silu(gate) * up (Qwen3, Mixtral, OLMoE). `clamped_swiglu`: GPT-OSS's
    interleaved rows (even gate, odd up), gate.clamp(max=limit), up.clamp(-limit, limit), then
    (up + 1) * gate * sigmoid(alpha * gate). `geglu_tanh`: gate rows then up rows, gelu_tanh(gate) * up (Gemma 4).
    `relu2`: no gate, w13 is the up projection alone ([I, H], not [2I, H]): relu(up)^2 (Nemotron-H). Only the
    general per-projection path computes an ungated expert (the fused CPU decode and the Triton kernels read a
    gate; `gated` is how they tell).
    """

    kind: str = "swiglu"
    limit: float = 7.0
    alpha: float = 1.702

    @property
    def gated(self) -> bool:
        """True: w13 holds gate and up rows (2I); False: up rows only (I)."""
        return self.kind != "relu2"

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [n, 2I] (ungated: up [n, I]) -> [n, I]."""
        if self.kind == "relu2":
            return torch.relu(gate_up).square()
        if self.kind == "swiglu":
            gate, up = gate_up.chunk(2, dim=-1)  # [n, I], [n, I]
            return F.silu(gate) * up
        if self.kind == "geglu_tanh":
            gate, up = gate_up.chunk(2, dim=-1)  # [n, I], [n, I]
            return F.gelu(gate, approximate="tanh") * up
        gate = gate_up[..., ::2].clamp(max=self.limit)  # [n, I]
        up = gate_up[..., 1::2].clamp(-self.limit, self.limit)  # [n, I]
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


SWIGLU = ExpertActivation()
GEGLU_TANH = ExpertActivation("geglu_tanh")
RELU2 = ExpertActivation("relu2")


@dataclass(frozen=True)
class ExpertBatch:
    """What expert compute needs for one layer: slot buffers by tensor name, and slot ids.

    `tensors["w13"]` is [C, 2I, H] (gate rows then up rows), `tensors["w2"]` is [C, H, I]. `slot_ids`
    is shaped like topk_ids ([T, K]) and never holds -1 for a pair that is computed. `slot_ids_cpu` is
    the host copy when the provider already read the ids (the one host sync a layer may make). `pairs`
    restricts the batch to some flat (t, k) pairs: one expert-major group of a chunk that needs more
    experts than there are slots. `format` says how the slot tensors store an expert (`w13_blocks`,
    `w13_scales`, ... for MXFP4; `w13_bias`/`w2_bias` [C, 2I] / [C, H] when the model has biases).

    `host_tensors` (a CPU only) makes one batch of a step whose experts are split between the slots and the RAM
    tier: slot ids >= C index these host buffers ([N, ...] by the same names) at id - C, so every expert is
    computed in one pass wherever its bytes live (the slots and the RAM tier are both host memory there).

    `slot_map` [E] int32 (this layer's row of the pool's device map, -1: no slot) with `topk_ids` [T, K] (the
    routed expert ids, on the same device) let the fused CUDA kernels read each pair's slot themselves
    (slot_map[topk_ids[t, k]]): the provider sets them on a device batch of the whole step whose experts are all
    in slots, and skips the device gather then (`slot_ids` is the host copy). Batches that need host ids (a
    subset of pairs, host experts) leave them None.
    """

    tensors: Mapping[str, torch.Tensor]
    slot_ids: torch.Tensor  # [T, K]
    slot_ids_cpu: torch.Tensor | None = field(default=None)
    pairs: torch.Tensor | None = field(default=None)  # [P] flat (t, k) indices to compute; None = all
    format: ExpertFormat = DENSE
    on_host: bool = False  # the tensors are host (RAM-tier) buffers: compute these pairs on the CPU (hybrid)
    host_tensors: Mapping[str, torch.Tensor] | None = field(default=None)  # slot ids C.. index these (CPU)
    slot_map: torch.Tensor | None = field(default=None)  # [E] int32 the layer's device map row, with topk_ids
    topk_ids: torch.Tensor | None = field(default=None)  # [T, K] routed expert ids on slot_map's device

    def kernel_ids(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a fused kernel is given: (topk_ids, slot_map) to look the slots up itself, else (slot_ids, None)."""
        if self.slot_map is not None and self.topk_ids is not None:
            return self.topk_ids, self.slot_map
        return self.slot_ids, None


@runtime_checkable
class ExpertProvider(Protocol):
    """Makes the experts a layer needs resident and says in which slots they are."""

    num_layers: int
    num_experts: int

    def prepare(self, layer: int, topk_ids: torch.Tensor) -> ExpertBatch:
        """topk_ids [T, K] global expert ids of `layer` -> an ExpertBatch for exactly those experts."""
        ...

    def batches(self, layer: int, topk_ids: torch.Tensor) -> Iterator[ExpertBatch]:
        """Like prepare, as one or more batches whose pairs cover every (t, k) exactly once."""
        ...

    def observe(self, layer: int, hidden_states: torch.Tensor) -> None:
        """The residual stream [T, H] entering `layer`'s MoE, given before `batches(layer, ...)`.

        A provider may use it to predict and prefetch later layers' experts; it must not change them.
        """
        ...


class ResidentProvider:
    """Every expert of every MoE layer on the compute device; slot id == expert id, no copies."""

    def __init__(self, tensors: Mapping[int, Mapping[str, torch.Tensor]], num_layers: int,
                 format: ExpertFormat = DENSE):
        # tensors[layer][name] [E, ...] for the MoE layers only, as `format` stores them (w13 [E, 2I, H], ...)
        self.num_layers = num_layers
        self.format = format
        self._tensors = {layer: dict(ts) for layer, ts in tensors.items()}
        first = next(iter(next(iter(self._tensors.values())).values()))
        self.num_experts = first.shape[0]

    @classmethod
    def dense(cls, w13: Mapping[int, torch.Tensor], w2: Mapping[int, torch.Tensor], num_layers: int):
        """w13[layer] [E, 2I, H], w2[layer] [E, H, I]: full-precision experts without biases."""
        return cls({layer: {"w13": w13[layer], "w2": w2[layer]} for layer in w13}, num_layers)

    def prepare(self, layer: int, topk_ids: torch.Tensor) -> ExpertBatch:
        slot_ids_cpu = topk_ids if topk_ids.device.type == "cpu" else None
        return ExpertBatch(self._tensors[layer], topk_ids, slot_ids_cpu, format=self.format)

    def batches(self, layer: int, topk_ids: torch.Tensor) -> Iterator[ExpertBatch]:
        yield self.prepare(layer, topk_ids)

    def observe(self, layer: int, hidden_states: torch.Tensor) -> None:
        pass  # everything is resident: nothing to predict

    def expert_weights(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """One expert's tensors by name (views, no copy): what a cache tier stores per (layer, expert)."""
        return {name: t[expert] for name, t in self._tensors[layer].items()}

    @property
    def layers(self) -> list[int]:
        return sorted(self._tensors)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._tensors.values() for t in ts.values())


def moe_reference(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor, *, act: ExpertActivation = SWIGLU,
                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Slow obvious MoE: for every token, for every chosen expert, run its MLP and weight it.

    hidden_states [T, H], topk_weights [T, K], topk_ids [T, K], w13 [E, 2I, H] ([E, I, H] ungated), w2 [E, H, I]
    (dense; a packed
    format's `weight()` gives them), optional biases [E, 2I] / [E, H] -> [T, H]. Used only by tests, as the
    oracle for every fast path.
    """
    T, K = topk_ids.shape
    out = torch.zeros_like(hidden_states, dtype=torch.float32)  # [T, H]
    for t in range(T):
        for k in range(K):
            e = int(topk_ids[t, k])
            x = hidden_states[t].float()
            gate_up = w13[e].float() @ x  # [2I]
            if w13_bias is not None:
                gate_up = gate_up + w13_bias[e].float()
            y = w2[e].float() @ act(gate_up[None])[0]  # [H]
            if w2_bias is not None:
                y = y + w2_bias[e].float()
            out[t] += topk_weights[t, k].float() * y
    return out.to(hidden_states.dtype)


def grouped_topk(router_logits: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1, *,
                 scoring: str = "sigmoid", correction_bias: torch.Tensor | None = None, renormalize: bool = True,
                 routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k (DeepSeek-V2/V3, GLM-4.5): the same ops, in the same order, as transformers' routers.

    scores = sigmoid (V3, GLM) or softmax (V2) of the fp32 logits [T, E]. Experts are chosen on scores +
    `correction_bias` (V3's aux-loss-free balancing bias: it steers the choice only, never the weights), within
    the `topk_group` best of `n_group` equal groups; a group scores the sum of its two best experts when there is
    a bias (V3's `noaux_tc`), else its best expert (V2's `group_limited_greedy`). Weights are the chosen experts'
    scores, optionally renormalised to sum to 1, times `routed_scaling_factor`. n_group = 1 is plain top-k on the
    scores (V2's `greedy`, GLM-4.5-Air). Returns fp32 weights [T, K] and int64 ids [T, K] (in topk's unsorted
    order, as transformers); ties resolve as there, since the calls are the same.
    """
    scores, choice = grouped_choice(router_logits, n_group, topk_group, scoring=scoring,
                                    correction_bias=correction_bias)  # [T, E], [T, E]
    topk_ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]  # [T, K]
    topk_weights = (scores if correction_bias is not None else choice).gather(1, topk_ids)  # [T, K]
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids


def grouped_choice(router_logits: torch.Tensor, n_group: int = 1, topk_group: int = 1, *, scoring: str = "sigmoid",
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`grouped_topk`'s scores and what its top-k is taken over: (scores [T, E], choice [T, E]), the experts outside
    the `topk_group` best groups masked. A MoE block's `choice_scores` returns the choice, so that the prefetcher
    ranks what the router ranks (a top-k of the logits is not the router's choice once a bias or groups enter)."""
    scores = router_logits.float().sigmoid() if scoring == "sigmoid" else torch.softmax(
        router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()  # [T, E]
    if n_group > 1 and topk_group < n_group:
        T, E = choice.shape
        grouped = choice.view(T, n_group, E // n_group)  # [T, G, E/G]
        if correction_bias is not None:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        else:
            group_scores = grouped.max(dim=-1).values  # [T, G]
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [T, G]
        keep = group_mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E).bool()  # [T, E]
        # transformers' V2 masks with 0 (softmax scores are positive), V3/GLM with -inf; kept as each does, so a
        # tie resolves identically
        choice = choice.masked_fill(~keep, float("-inf") if correction_bias is not None else 0.0)
    return scores, choice


def combine(residual: torch.Tensor, contrib: torch.Tensor, top_k: int) -> torch.Tensor:
    """residual + the sum over k, in k order and in fp32, of the pairs' rows in `contrib` [T*K, H]; one rounding
    to the residual's dtype."""
    T, H = residual.shape
    if T == 1:
        return residual.float().add_(contrib.sum(0)).to(residual.dtype)
    return contrib.view(T, top_k, H).sum(1).add_(residual).to(residual.dtype)
