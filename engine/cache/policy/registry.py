"""Policies by name: `make_policy`, `POLICIES` (the online ones), `DEFAULT_POLICY`, and why it is the default.

| name         | evicts                                                           | victim()        |
|--------------|------------------------------------------------------------------|-----------------|
| lru          | least recently used                                              | O(1)            |
| lfu          | fewest accesses since start, ties least recent                   | O(log n) heap   |
| lfru         | lowest freq / age (the vLLM RFC's and tinyserve's LFRU)          | O(n) numpy scan |
| lrfu         | lowest decayed count, sum of 2^-(age / h), h = 4 x C (Lee 2001)  | O(log n) heap   |
| lru2         | oldest second-to-last access (LRU-K, O'Neil 1993)                | O(log n) heap   |
| arc          | LRU of the recency or frequency list, adaptive split (ARC 2003)  | O(1)            |
| X-layered    | X, within the missing layer's equal share of a global pool       | + O(L) rarely   |
| belady       | next use furthest in the future (offline optimum, MIN)           | O(log n) heap   |

Hit rate as a fraction of Belady's, measured by bench/replay.py on the full traces of ../shared/traces
(DeepSeek-V2-Lite prefill, 22,287 tokens; Mixtral-8x7B decode, 585 tokens): per-layer caches of C
experts / one global pool of C x layers. At C = top-k all per-layer policies tie (= Belady).

  C per layer     DeepSeek 25%  DeepSeek 50%  DeepSeek 75%  Mixtral 50%  Mixtral 75%
  lru              .710/.626     .814/.786     .931/.926     .828/.685    .905/.860
  lfu              .678/.483     .781/.683     .899/.853     .850/.714    .923/.876
  lfru             .684/.420     .785/.672     .910/.861     .843/.666    .920/.875
  lrfu             .750/.646     .850/.814     .940/.932     .848/.727    .922/.887
  lru2             .720/.607     .835/.798     .935/.926     .832/.690    .910/.862
  arc              .710/.626     .814/.786     .931/.926     .827/.685    .905/.860
  lru-layered          /.663         /.799         /.925         /.756        /.880
  lrfu-layered         /.701         /.835         /.934         /.775        /.897

DEFAULT_POLICY = "lrfu-layered": in a global pool (the engine's) the best online policy in every cell,
except at C = top-k where it ties LRU (.561 / .623 of Belady, 1 hit in 10^4 apart) while plain LRFU
falls to .464 / .492 and LFRU to .025 / .097; per layer it is within .002 of the best. h = 4 x C was
tuned on a 1,500-token prefix of the DeepSeek trace and on Mixtral (2 x C and 8 x C are within 1%).
The RFC's LFRU loses to LRU on the prefill trace. Every online policy stays well below Belady: the
room left is in prediction (prefetch), not in eviction.
"""

from __future__ import annotations

from .base import EvictionPolicy
from .offline import BeladyPolicy
from .online import ARCPolicy, LFRUPolicy, LFUPolicy, LRFUPolicy, LRUKPolicy, LRUPolicy

_ONLINE: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, LFUPolicy, LFRUPolicy, LRFUPolicy, LRUKPolicy, ARCPolicy)
}
LAYERED = "-layered"  # suffix: the policy with per-layer sizing (policies with supports_layered)
POLICIES: tuple[str, ...] = (*_ONLINE, "lru-layered", "lrfu-layered")  # usable online; Belady needs the future
DEFAULT_POLICY: str = "lrfu-layered"


def make_policy(name: str, **kwargs) -> EvictionPolicy:
    """A policy by name: one of POLICIES (any "<name>-layered" whose class supports it), or "belady"
    with `future=` the whole request sequence. `capacity=` (the pool's slots) is accepted by all."""
    if name == "belady":
        if "future" not in kwargs:
            raise ValueError("the belady policy is offline: pass future=<the whole list of (layer, expert) requests>")
        return BeladyPolicy(**kwargs)
    base = name.removesuffix(LAYERED)
    cls = _ONLINE.get(base)
    if cls is None or (base != name and not getattr(cls, "supports_layered", False)):
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)} (or belady, offline)")
    if base != name:
        kwargs["layered"] = True
    return cls(**kwargs)
