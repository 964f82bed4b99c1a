"""Next-token selection with no host read: `Sampler`'s choices as fixed-shape tensor ops, for a captured decode step.

Design:
- The parameters live in one float32 device vector of knobs (`Knobs`), written in place by ``set_params``; a
  captured graph or a ``torch.compile``d step reads them, so a new request's temperature / top-k / top-p / min-p /
  penalty / greedy needs no recapture and no recompile. Every filter is always computed and chosen by
  ``torch.where`` on its on/off knob: masks instead of filtering, no ``.item()``, no data-dependent shape.
- Same tokens as `Sampler` (engine/runtime/sampling.py), bit for bit: the filters run the very ops `Sampler` runs on the
  same [1, V] shapes (top-k's k-th value is read from a full sort at index k-1, the same value ``torch.topk``
  returns), and the draw is the same ``exponential_`` over a [V] float32 buffer from the same seeded generator,
  then ``argmax(p / q)``. Scalars are applied the way a Python float would be: on CUDA a Python divisor is
  turned into a float32 reciprocal and multiplied (ATen's div with a CPU scalar), so the knobs carry 1/t and 1/r
  and CUDA multiplies by them; the CPU divides. The one difference: a greedy step still draws its noise (the
  mode is a knob, not a branch), which moves the generator but never changes a greedy token.
- The repetition penalty reads a [V] bool mask of seen ids (prompt marked by ``start``, each sampled id marked
  on the device by ``step``), where `Sampler` takes an id list of growing length; duplicates in that list change
  nothing, so the mask gives the same scores.
- Cost per token: two sorts of V (top-k's k-th value, top-p's tail) and ~15 elementwise passes over V; at
  V = 201k (GPT-OSS) that is a few MB of traffic, well under the per-token budget of one decode step.
- `sample_scores` is pure and compiles with ``torch.compile(fullgraph=True)``; the generator draw stays outside
  it (dynamo cannot trace an explicit ``torch.Generator``), as one eager op that a CUDA graph captures once the
  generator is registered (``graph.register_generator_state(generator)``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .sampling import SamplingParams

if TYPE_CHECKING:
    import torch


class Knobs:
    """Indices into the float32 knob vector (one H2D copy per ``set_params``)."""

    GREEDY = 0          # 1.0: argmax of the penalised logits
    INV_TEMP = 1        # float32(1) / float32(temperature): what CUDA multiplies by for `x / t`
    TEMPERATURE = 2     # the CPU divides by it, as it does by a Python float
    TOP_K = 3           # min(top_k, V), V when top-k is off; integers are exact in float32 below 2**24
    TOP_K_ON = 4
    TOP_P_CUT = 5       # float32(1 - top_p): the tail mass that may be dropped
    TOP_P_ON = 6
    MIN_P = 7
    MIN_P_ON = 8
    PENALTY = 9         # repetition penalty r: seen logits < 0 times r, others / r
    INV_PENALTY = 10    # float32(1) / float32(r), for CUDA's `x / r`
    PENALTY_ON = 11
    SIZE = 12


def knob_values(params: SamplingParams, vocab_size: int) -> list[float]:
    """The knob vector for `params` over a vocabulary of `vocab_size` (pure Python, values as float32 will hold)."""
    import torch

    def recip(x: float) -> float:  # float32(1) / float32(x), rounded as the device rounds it
        return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(x, dtype=torch.float32))

    if vocab_size >= 2**24:
        raise ValueError(f"vocab_size {vocab_size} does not fit the float32 knob vector (< 2**24)")
    k = params.top_k
    knobs = [0.0] * Knobs.SIZE
    temperature = params.temperature if params.temperature > 0 else 1.0  # 0 means greedy; never divide by it
    knobs[Knobs.GREEDY] = float(params.greedy)
    knobs[Knobs.INV_TEMP] = recip(temperature)
    knobs[Knobs.TEMPERATURE] = temperature
    knobs[Knobs.TOP_K] = float(vocab_size if k == 0 else min(k, vocab_size))
    knobs[Knobs.TOP_K_ON] = float(k != 0)
    knobs[Knobs.TOP_P_CUT] = 1.0 - params.top_p  # rounded to float32 like the Python scalar in `x <= 1 - top_p`
    knobs[Knobs.TOP_P_ON] = float(params.top_p < 1.0)
    knobs[Knobs.MIN_P] = params.min_p
    knobs[Knobs.MIN_P_ON] = float(params.min_p > 0.0)
    knobs[Knobs.PENALTY] = params.repetition_penalty
    knobs[Knobs.INV_PENALTY] = recip(params.repetition_penalty)
    knobs[Knobs.PENALTY_ON] = float(params.repetition_penalty != 1.0)
    return knobs


def _div(x: torch.Tensor, value: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    # `x / python_float` is a true division on the CPU and x * float32(1/value) on CUDA (ATen's CPU-scalar rule).
    return x * inverse if x.device.type == "cuda" else x / value


def penalised_scores(logits: torch.Tensor, seen: torch.Tensor, knobs: torch.Tensor) -> torch.Tensor:
    """float32 [V] logits with the repetition penalty applied to the ids marked in `seen` [V] bool."""
    import torch

    scores = logits.to(torch.float32)  # [V]
    penalised = torch.where(scores < 0, scores * knobs[Knobs.PENALTY],
                            _div(scores, knobs[Knobs.PENALTY], knobs[Knobs.INV_PENALTY]))  # [V]
    return torch.where(seen & (knobs[Knobs.PENALTY_ON] != 0), penalised, scores)  # [V]


def filtered_scores(scores: torch.Tensor, knobs: torch.Tensor) -> torch.Tensor:
    """The sampling branch of `Sampler.processed_logits` on penalised float32 [V] scores: temperature, top-k,
    top-p, min-p (each on when its knob says so); -inf = removed."""
    import torch

    neg_inf = torch.tensor(-math.inf, dtype=scores.dtype, device=scores.device)  # [] (a constant, not a host read)
    batch = _div(scores.unsqueeze(0), knobs[Knobs.TEMPERATURE], knobs[Knobs.INV_TEMP])  # [1, V]

    # top-k: keep every token >= the k-th largest (ties with it included), as TopKLogitsWarper does.
    k = knobs[Knobs.TOP_K].to(torch.long).reshape(1, 1)  # [1, 1]
    kth = torch.sort(batch, dim=-1, descending=True)[0].gather(-1, k - 1)  # [1, 1]
    batch = torch.where(knobs[Knobs.TOP_K_ON] != 0, torch.where(batch < kth, neg_inf, batch), batch)  # [1, V]

    # top-p: drop the low tail whose mass is <= 1 - top_p, keep the top token (TopPLogitsWarper's ops).
    sorted_logits, sorted_indices = torch.sort(batch, descending=False)  # [1, V], [1, V]
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [1, V]
    sorted_remove = cumulative <= knobs[Knobs.TOP_P_CUT]  # [1, V]
    last = torch.arange(batch.size(-1), device=batch.device) == batch.size(-1) - 1  # [V]
    sorted_remove = sorted_remove & ~last  # [1, V]
    remove = sorted_remove.scatter(1, sorted_indices, sorted_remove)  # [1, V]
    batch = torch.where((knobs[Knobs.TOP_P_ON] != 0) & remove, neg_inf, batch)  # [1, V]

    # min-p: drop tokens below min_p * (top probability), keep the top one (MinPLogitsWarper's ops).
    probs = torch.softmax(batch, dim=-1)  # [1, V]
    remove = probs < knobs[Knobs.MIN_P] * probs.amax(dim=-1, keepdim=True)  # [1, V]
    remove = remove.scatter(-1, torch.topk(probs, 1, dim=-1).indices, False)  # [1, V]
    batch = torch.where((knobs[Knobs.MIN_P_ON] != 0) & remove, neg_inf, batch)  # [1, V]
    return batch[0]  # [V]


def sample_scores(logits: torch.Tensor, seen: torch.Tensor, knobs: torch.Tensor,
                  noise: torch.Tensor) -> torch.Tensor:
    """The next token as a 0-d int64 device tensor, from [V] logits, the [V] bool seen mask, the knob vector and
    [V] float32 Exp(1) noise. Pure tensor ops with fixed shapes (compiles with fullgraph=True)."""
    import torch

    penalised = penalised_scores(logits, seen, knobs)  # [V]
    greedy = torch.argmax(penalised)  # [] first maximum, like transformers' greedy search
    probs = torch.softmax(filtered_scores(penalised, knobs), dim=-1)  # [V]
    # A zero draw would make 0/0 = nan for a removed token (argmax picks nan); clamping keeps it 0.
    drawn = torch.argmax(probs / noise.clamp_min(torch.finfo(noise.dtype).tiny))  # [] i wins with probability p[i]
    return torch.where(knobs[Knobs.GREEDY] != 0, greedy, drawn)  # []


class DeviceSampler:
    """`Sampler` for a decode step that never waits for the device: buffers at fixed addresses (knobs, seen
    mask, noise), ``step`` returns the id as a device tensor and marks it seen, the caller reads it once.

    One per engine (or per captured graph); ``set_params`` + ``start`` per generation."""

    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device | str = "cpu"):
        import torch

        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.knobs = torch.zeros(Knobs.SIZE, dtype=torch.float32, device=self.device)  # [K]
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)  # [V]
        self.noise = torch.empty(vocab_size, dtype=torch.float32, device=self.device)  # [V]
        self.generator = torch.Generator(device=self.device)
        self.set_params(params)

    def set_params(self, params: SamplingParams, seed: int | None = None) -> None:
        """New parameters and a reseeded generator, written in place (a captured graph keeps its addresses).
        The seed is `seed`, else ``params.seed``, else fresh entropy (``generator.initial_seed()`` tells which)."""
        import torch

        self.params = params
        values = torch.tensor(knob_values(params, self.vocab_size), dtype=torch.float32)  # [K]
        self.knobs.copy_(values, non_blocking=False)
        seed = params.seed if seed is None else seed
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def start(self, prompt_ids: torch.Tensor | None = None) -> None:
        """Forget the seen ids, then mark the prompt's (the repetition penalty covers the prompt, as in HF)."""
        import torch

        self.seen.zero_()
        if prompt_ids is not None and prompt_ids.numel() > 0:
            ids = prompt_ids.reshape(-1).to(device=self.device, dtype=torch.long)  # [N]
            self.seen.index_fill_(0, ids, True)

    def step(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token, a 0-d int64 tensor on the device; also marks it seen. No host read."""
        if logits.dim() != 1 or logits.size(0) != self.vocab_size:
            raise ValueError(f"logits must be [vocab={self.vocab_size}], got shape {tuple(logits.shape)}")
        self.noise.exponential_(generator=self.generator)  # [V] ~ Exp(1): Sampler's very draw
        token = sample_scores(logits, self.seen, self.knobs, self.noise)  # []
        self.seen.index_fill_(0, token.reshape(1), True)
        return token


def readout(logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """[3] float64 on the device: the token id, min and max of `logits`, for the caller's one host read per token
    (generate's NaN/Inf check rides on the same read; aminmax propagates NaN)."""
    import torch

    lo, hi = torch.aminmax(logits)  # [] []
    return torch.stack([token.to(torch.float64), lo.to(torch.float64), hi.to(torch.float64)])  # [3]
