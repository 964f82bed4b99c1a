"""Next-token selection: the logits processors of transformers' ``generate``, on one sequence.

Design:
- `SamplingParams` is an immutable, validated value; ``from_generation_config`` fills absent keys with
  transformers 5.24's global defaults (do_sample False, temperature 1.0, top_k 50, top_p 1.0), so a model
  samples the way ``model.generate()`` would.
- `Sampler` applies, in transformers' order: repetition penalty (also when greedy), then only when
  sampling temperature, top-k, top-p, min-p (min_tokens_to_keep=1). The filters run on a [1, V] view with
  the very ops transformers uses, so the kept set (ties included) is the same.
- Sampling draws ``argmax(p / q)`` with ``q ~ Exp(1)`` from the sampler's own seeded ``torch.Generator``:
  an exact draw from ``p`` (the trick ``torch.multinomial`` uses internally) without its host syncs, so
  the caller decides when to read the token.
- The value rules (`problem`) are pure Python, and torch is imported where a token is picked: the CLI's
  argparse types check --temperature, --top-p ... with these very rules at start-up, before torch loads.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    import torch

# transformers 5.24 GenerationConfig._get_default_generation_params(), for the keys used here.
_HF_DEFAULTS: dict[str, Any] = {
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "min_p": 0.0,  # None in transformers: no MinPLogitsWarper, which 0.0 is equivalent to
    "repetition_penalty": 1.0,
}
_FROM_CONFIG = tuple(_HF_DEFAULTS)
MIN_TEMPERATURE = 1e-3  # a logit gap of 0.1 is already 1e-43 of probability at this temperature


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def problem(name: str, value: Any) -> str | None:
    """What `value` must be for the parameter `name` (a SamplingParams field), or None when it is valid: the one
    rule the engine, the CLI's argparse types and the app share."""
    if name == "do_sample":
        return None if isinstance(value, bool) else "true or false"
    if name == "seed":
        ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64)
        return None if ok else "an integer in [0, 2**64) or null"
    if name == "top_k":
        ok = _is_number(value) and math.isfinite(value) and float(value).is_integer() and value >= 0
        return None if ok else "an integer >= 0 (0 turns top-k off)"
    if not _is_number(value) or not math.isfinite(value):
        return "a finite number"
    if name == "temperature" and value < 0:
        return ">= 0 (0 means greedy)"
    if name == "temperature" and 0 < value < MIN_TEMPERATURE:
        # logits / 1e-45 overflow to inf, softmax turns them to NaN and argmax returns token 0
        return f"0 (greedy) or at least {MIN_TEMPERATURE:g}; below that sampling is greedy anyway"
    if name in ("top_p", "min_p") and not 0.0 <= value <= 1.0:
        return "in [0, 1]"
    if name == "repetition_penalty" and value <= 0:
        return "> 0 (1.0 turns it off)"
    return None


def _check(name: str, value: Any, where: str) -> Any:
    """Validate one parameter; returns it normalised (floats as float, top_k as int)."""
    rule = problem(name, value)
    if rule is not None:
        raise ConfigError(f"{where}: {name} = {value!r} is invalid; {name} must be {rule}")
    if name == "top_k":
        return int(value)
    if name in ("do_sample", "seed"):
        return value
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """How each next token is chosen. The defaults are plain sampling; a model's own defaults come from
    ``from_generation_config``. Values are checked on construction (ConfigError)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    do_sample: bool = True

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _check(f.name, getattr(self, f.name), "sampling parameters"))

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @classmethod
    def from_generation_config(cls, generation_config: dict | None, **overrides: Any) -> SamplingParams:
        """Params from a model's generation_config.json (a dict), then ``overrides`` (None ones ignored).

        Absent keys get transformers' defaults, so a config without ``do_sample`` is greedy, as in
        ``generate()``, and ``top_k`` is 50 unless set. An explicit ``temperature`` override > 0 turns
        sampling on and 0 turns it off, unless ``do_sample`` is overridden too.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"unknown sampling parameter(s): {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(names))}")
        if generation_config is None:
            generation_config = {}
        if not isinstance(generation_config, dict):
            raise ConfigError("generation_config.json: expected a JSON object, got "
                              f"{type(generation_config).__name__}")

        values: dict[str, Any] = {}
        for name in _FROM_CONFIG:
            value = generation_config.get(name)
            # null in the file means "unset" for transformers too.
            value = _HF_DEFAULTS[name] if value is None else value
            values[name] = _check(name, value, "generation_config.json")

        given = {k: v for k, v in overrides.items() if v is not None}
        for name, value in given.items():
            values[name] = _check(name, value, "sampling override")
        if "temperature" in given and "do_sample" not in given:
            values["do_sample"] = values["temperature"] > 0
        return cls(**values)


def _filter_top_k(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    import torch

    # transformers' TopKLogitsWarper: keeps every token tied with the k-th.
    k = min(top_k, scores.size(-1))
    kth = torch.topk(scores, k)[0][..., -1, None]  # [1, 1]
    return scores.masked_fill(scores < kth, -math.inf)  # [1, V]


def _filter_top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    import torch

    # transformers' TopPLogitsWarper: drop the low tail whose mass is <= 1 - top_p, keep at least one.
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)  # [1, V], [1, V]
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [1, V]
    sorted_remove = cumulative <= (1 - top_p)  # [1, V]
    sorted_remove[..., -1:] = 0
    remove = sorted_remove.scatter(1, sorted_indices, sorted_remove)  # [1, V]
    return scores.masked_fill(remove, -math.inf)  # [1, V]


def _filter_min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    import torch

    # transformers' MinPLogitsWarper: drop tokens below min_p * (top probability), keep the top one.
    probs = torch.softmax(scores, dim=-1)  # [1, V]
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)  # [1, V]
    remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
    return scores.masked_fill(remove, -math.inf)  # [1, V]


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)


class Sampler:
    """Picks the next token from a [V] logits vector; one per generation (it owns the RNG state)."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        import torch

        self.params = params
        self.generator = self._new_generator(torch.device(device))

    def _new_generator(self, device: torch.device, seed: int | None = None) -> torch.Generator:
        import torch

        generator = torch.Generator(device=device)
        seed = self.params.seed if seed is None else seed
        if seed is None:
            generator.seed()  # fresh entropy; initial_seed() still tells which
        else:
            generator.manual_seed(seed)
        return generator

    def processed_logits(self, logits: torch.Tensor,
                         generated_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The logits after penalty, then (when sampling) temperature/top-k/top-p/min-p; -inf = removed."""
        import torch

        p = self.params
        if logits.dim() != 1:
            raise ValueError(f"logits must be 1-D [vocab], got shape {tuple(logits.shape)}")
        # transformers samples from float32 logits whatever the model's dtype; never modify the input.
        scores = logits.to(torch.float32)  # [V]
        if p.repetition_penalty != 1.0 and generated_ids is not None and generated_ids.numel() > 0:
            ids = generated_ids.reshape(-1).to(device=scores.device, dtype=torch.long)  # [N]
            seen = scores.gather(0, ids)  # [N]
            # HF's rule: shrink a seen token's logit toward 0 on either side.
            seen = torch.where(seen < 0, seen * p.repetition_penalty, seen / p.repetition_penalty)  # [N]
            scores = scores.scatter(0, ids, seen)  # [V]
        if p.greedy:
            return scores
        batch = scores.unsqueeze(0)  # [1, V]: same shapes as transformers so ties resolve the same way
        if p.temperature != 1.0:
            batch = batch / p.temperature  # [1, V]
        if p.top_k != 0:
            batch = _filter_top_k(batch, p.top_k)
        if p.top_p < 1.0:
            batch = _filter_top_p(batch, p.top_p)
        if p.min_p > 0.0:
            batch = _filter_min_p(batch, p.min_p)
        return batch[0]  # [V]

    def __call__(self, logits: torch.Tensor, generated_ids: torch.Tensor | None = None) -> torch.Tensor:
        """A 0-d int64 tensor on the logits' device; nothing here waits for the device."""
        import torch

        scores = self.processed_logits(logits, generated_ids)  # [V]
        if self.params.greedy:
            return torch.argmax(scores)  # [] first maximum, like transformers' greedy search
        if not _same_device(self.generator.device, scores.device):
            # Created for another device: continue on this one from the same seed.
            self.generator = self._new_generator(scores.device, self.generator.initial_seed())
        probs = torch.softmax(scores, dim=-1)  # [V]
        noise = torch.empty_like(probs).exponential_(generator=self.generator)  # [V] ~ Exp(1)
        # A zero draw would make 0/0 = nan for a removed token (argmax picks nan); clamping keeps it 0.
        noise = noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # [V]
        return torch.argmax(probs / noise)  # [] index i wins with probability probs[i]
