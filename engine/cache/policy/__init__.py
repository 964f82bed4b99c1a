"""Eviction policies: which resident `(layer, expert)` key gives up its slot on a miss.

Parts (imports point down this list; the package re-exports what code outside it imports):
  registry.py  `make_policy` by name, `POLICIES` (the online ones), `DEFAULT_POLICY` and the measured hit rates that
               chose it
  online.py    the policies the engine runs: LRU, LFU, LFRU, LRFU, LRU-2 and ARC (each but LFRU and ARC also
               "-layered")
  offline.py   Belady's MIN, which needs the whole request sequence: replay only (bench/replay.py, the tests)
  base.py      the interface every policy implements (`EvictionPolicy`) and the shared machinery: time and
               recency, the recency list and lazy heap containers, the ranked policy with per-layer sizing
Pure Python and numpy (no torch), so the CLI lists the names at start-up and `bench/replay.py` runs these very
classes over real routing traces.
"""

from .base import EvictionPolicy
from .offline import BeladyPolicy
from .online import LFRUPolicy, LRFUPolicy
from .registry import DEFAULT_POLICY, LAYERED, POLICIES, make_policy

__all__ = ["DEFAULT_POLICY", "LAYERED", "POLICIES", "BeladyPolicy", "EvictionPolicy", "LFRUPolicy", "LRFUPolicy",
           "make_policy"]
