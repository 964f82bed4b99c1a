"""Preallocated KV cache.

One K and one V buffer per layer, [KVH, S, D], allocated once for the planned context S and written in
place, so decode never allocates and the memory plan can count it exactly:
bytes = 2 * L * KVH * S * D * dtype size (Qwen3-30B-A3B in bf16: 96 KiB per token, 384 MiB for 4096).
`length` is the number of committed positions; truncating it is how a conversation rewinds to a
shared prefix without touching the buffers.
"""

from __future__ import annotations

import torch

from .errors import PromptTooLongError


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_tokens: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.max_tokens = max_tokens
        self.k = [torch.zeros(num_kv_heads, max_tokens, head_dim, dtype=dtype, device=device)  # [KVH, S, D]
                  for _ in range(num_layers)]
        self.v = [torch.zeros(num_kv_heads, max_tokens, head_dim, dtype=dtype, device=device)  # [KVH, S, D]
                  for _ in range(num_layers)]
        self.length = 0

    @property
    def free(self) -> int:
        return self.max_tokens - self.length

    def reserve(self, n: int) -> None:
        """Raise PromptTooLongError unless n more positions fit."""
        if n > self.free:
            raise PromptTooLongError(
                f"{self.length + n} tokens do not fit the context of {self.max_tokens} "
                f"({self.length} already in the conversation, {n} new): shorten the prompt, start a new "
                f"chat, or raise --context")

    def truncate(self, n: int) -> None:
        """Forget every position from n on (the buffers are reused as they are)."""
        self.length = max(0, min(n, self.length))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
