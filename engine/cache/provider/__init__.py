"""The cached expert provider: `CachedProvider`, the ExpertProvider over a fixed slot pool, an eviction policy and a
tiered store, and `CacheConfig`, how to build one.

Parts (imports point down this list; the package re-exports what code outside it imports):
  config.py      `CacheConfig` (slots, policy, RAM budget, prefetch, on-miss mode) and `build_cached_provider`,
                 which assembles the store, the slot pool, the policy and the transfer engine from it
  core.py        `CachedProvider`: `prepare` / `batches` (the one host sync a layer makes, hits and misses, victims,
                 demand loads onto the copy stream), quiesce, warm start, live resizing and policy changes
  host.py        misses computed on the host from the RAM tier (`--on-miss host / auto`, host layers), the auto mode's
                 cost model and its host calibration, and a CPU's read-ahead into the RAM tier
  prefetching.py prefetch into the slots: the predictor's experts claimed and queued on the transfer engine
  snapshot.py    `CachedProvider.snapshot()`: the immutable `CacheSnapshot` the UI and the CLI read
"""

from .config import CacheConfig, build_cached_provider
from .core import CachedProvider

__all__ = ["CacheConfig", "CachedProvider", "build_cached_provider"]
