"""The expert cache: slot pool, eviction policies, tiered store, routing traces."""
