"""Preallocated KV cache.

One K and one V buffer per layer, [KVH, S, D], allocated once for the planned context S and written in
place, so decode never allocates and the memory plan can count it exactly:
bytes = 2 * L * KVH * S * D * dtype size (Qwen3-30B-A3B in bf16: 96 KiB per token, 384 MiB for 4096).
`length` is the number of committed positions; truncating it is how a conversation rewinds to a
shared prefix without touching the buffers.

Multi-head latent attention (DeepSeek-V2/V3) caches one vector per token and layer, not per head: the
kv_lora_rank latent and the shared RoPE key side by side in the K buffer ([1, S, 512 + 64] for DeepSeek-V3)
and no V buffer (the values are the latent, expanded by kv_b_proj where they are used). DeepSeek-V3 in bf16:
61 x 576 x 2 B = 68.6 KiB per token, 2.1 GiB for 32k; per-head K and V (128 heads x (192 + 128)) would be
4.8 MiB per token, 152 GiB for 32k.
"""

from __future__ import annotations

import torch

from .errors import PromptTooLongError


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_tokens: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", v_head_dim: int | None = None):
        """v_head_dim: the value dim when it is not head_dim; 0 for no V buffers (MLA's latent cache)."""
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.max_tokens = max_tokens
        self.k = [torch.zeros(num_kv_heads, max_tokens, head_dim, dtype=dtype, device=device)  # [KVH, S, D]
                  for _ in range(num_layers)]
        self.v = [torch.zeros(num_kv_heads, max_tokens, v_head_dim, dtype=dtype, device=device)  # [KVH, S, Dv]
                  for _ in range(num_layers)] if v_head_dim else []
        self.length = 0

    @classmethod
    def for_model(cls, args, max_tokens: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> KVCache:
        """The cache a model's attention reads (`args.kv_cache_layout()`: GQA heads, or MLA's one latent)."""
        heads, k_dim, v_dim = args.kv_cache_layout()
        return cls(args.num_hidden_layers, heads, k_dim, max_tokens, dtype, device, v_head_dim=v_dim)

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
