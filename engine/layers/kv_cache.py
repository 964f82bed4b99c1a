"""The sequence state: a preallocated KV cache for attention layers, a fixed-size state for recurrent layers.

One K and one V buffer per attention layer, [KVH, S, D], allocated once for the planned context S and written in
place, so decode never allocates and the memory plan can count it exactly:
bytes = 2 * L * KVH * S * D * dtype size (Qwen3-30B-A3B in bf16: 96 KiB per token, 384 MiB for 4096).
`length` is the number of committed positions; truncating it is how a conversation rewinds to a
shared prefix without touching the buffers.

Multi-head latent attention (DeepSeek-V2/V3) caches one vector per token and layer, not per head: the
kv_lora_rank latent and the shared RoPE key side by side in the K buffer ([1, S, 512 + 64] for DeepSeek-V3)
and no V buffer (the values are the latent, expanded by kv_b_proj where they are used). DeepSeek-V3 in bf16:
61 x 576 x 2 B = 68.6 KiB per token, 2.1 GiB for 32k; per-head K and V (128 heads x (192 + 128)) would be
4.8 MiB per token, 152 GiB for 32k.

Recurrent layers (Gated DeltaNet, Mamba-2) keep named state tensors instead (`state[layer]`: a conv window and an
SSM / delta-rule matrix), the same size at every length, and no K/V (their buffers hold 0 positions). A recurrent
state cannot be rewound: it is the whole prefix folded in. So the cache keeps up to `MAX_SNAPSHOTS` copies of it at
chosen positions (`snapshot()`, taken by the engine 8 tokens before the end of each prompt's prefill, where the next
turn's shared prefix ends even when the template re-renders this turn's opening), and `truncate(n)` goes
back to the latest snapshot at or before n (the fresh state at 0 if there is none) and returns where it landed:
the caller prefills from there, so a reused prefix is never a wrong continuation. Qwen3.6-35B-A3B: 61.4 MiB of
state (30 linear layers), 61.4 MiB more per snapshot, against 20 KiB of KV per token for its 10 attention layers.

Sliding-window layers of a model that reads them as rings (`args.kv_ring_windows()`: Gemma 4) hold only their
window: a ring of `window` positions, position p in slot p % window (`ring[layer]`; None for a layer that keeps the
whole context, and for every layer when the context is no longer than the window, where the ring would be the plain
buffer). K is cached after RoPE, so a slot needs no position of its own: decode reads the whole ring (every slot is
in the window once it has wrapped) and prefill reads the window's past in position order beside the new chunk.
A rewind cannot bring back positions the ring has overwritten: `truncate(n)` keeps n only where every ring still
holds the window before n (n >= length - 1 once a ring has wrapped) and otherwise goes back to 0 (the caller
recomputes the prompt): never a wrong continuation. Gemma-4-26B-A4B in bf16 at 128k: 25 sliding layers x 1024
positions x 8 KiB = 200 MiB instead of 25 GiB, 2.7 GiB of KV in all (the 5 full layers' 20 KiB a token) against 27.5;
gpt-oss-20b at 128k: 3.0 GiB against 6.0 (its 12 sliding layers' window is 128).
"""

from __future__ import annotations

import torch

from ..errors import PromptTooLongError

MAX_SNAPSHOTS = 2  # near the end of the last two prompts: a chat turn's reuse lands on one of them or on the end state


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_tokens: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", v_head_dim: int | None = None,
                 recurrent: dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]] | None = None,
                 layouts: list[tuple[int, int, int]] | None = None, windows: list[int | None] | None = None):
        """v_head_dim: the value dim when it is not head_dim; 0 for no V buffers (MLA's latent cache).
        recurrent: layer -> {state name: (shape, dtype)} for the layers that keep a recurrent state (no K/V).
        windows: per layer, the sliding window its attention reads as a ring of that many positions (None: all)."""
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        recurrent = recurrent or {}
        self.max_tokens = max_tokens
        # ring[i]: the ring's size (= the window) where layer i holds only its window, else None
        self.ring: list[int | None] = [w if w and w < max_tokens and i not in recurrent else None
                                       for i, w in enumerate(windows or [None] * num_layers)]
        positions = [0 if i in recurrent else (self.ring[i] or max_tokens) for i in range(num_layers)]
        # layouts: (KV heads, k dim, v dim) per layer where layers differ (Gemma 4: sliding 8 x 256, full 2 x 512)
        layouts = layouts or [(num_kv_heads, head_dim, v_head_dim)] * num_layers
        self.k = [torch.zeros(h, s, d, dtype=dtype, device=device)  # [KVH, S, D]
                  for s, (h, d, _) in zip(positions, layouts, strict=True)]
        self.v = [torch.zeros(h, s, dv, dtype=dtype, device=device)  # [KVH, S, Dv]
                  for s, (h, _, dv) in zip(positions, layouts, strict=True)] if v_head_dim else []
        self.state: list[dict[str, torch.Tensor] | None] = [
            {name: torch.zeros(shape, dtype=dt, device=device) for name, (shape, dt) in recurrent[i].items()}
            if i in recurrent else None for i in range(num_layers)]
        self.recurrent_layers = sorted(recurrent)
        self.snapshots: list[tuple[int, list[torch.Tensor]]] = []  # (position, the states' copies), oldest first
        self.length = 0
        # False while a forward pass is between its first and last layer: some states have moved and `length` has
        # not (an error there), so the states are not at `length` and only a snapshot can put them back.
        self.consistent = True

    @classmethod
    def for_model(cls, args, max_tokens: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> KVCache:
        """The cache a model's attention reads (`args.kv_cache_layout()`: GQA heads, or MLA's one latent) and, where
        the model has them, its recurrent layers' states (`args.recurrent_layout(dtype)`)."""
        heads, k_dim, v_dim = args.kv_cache_layout()
        layout = getattr(args, "recurrent_layout", None)
        recurrent = layout(dtype) if layout is not None else None
        per_layer = getattr(args, "kv_layer_layouts", None)  # layers of different widths: each its own
        rings = getattr(args, "kv_ring_windows", None)  # sliding layers whose attention reads a ring
        return cls(args.num_hidden_layers, heads, k_dim, max_tokens, dtype, device, v_head_dim=v_dim,
                   recurrent=recurrent, layouts=per_layer() if per_layer is not None else None,
                   windows=rings() if rings is not None else None)

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

    def _states(self) -> list[torch.Tensor]:
        return [t for i in self.recurrent_layers for t in self.state[i].values()]

    def snapshot(self) -> None:
        """Keep a copy of the recurrent states at `length` (the oldest copy's buffers reused past MAX_SNAPSHOTS)."""
        if not self.recurrent_layers or not self.consistent:
            return
        if self.snapshots and self.snapshots[-1][0] == self.length:
            return
        self.snapshots = [s for s in self.snapshots if s[0] != self.length]
        if len(self.snapshots) >= MAX_SNAPSHOTS:
            _, copies = self.snapshots.pop(0)
            for c, t in zip(copies, self._states(), strict=True):
                c.copy_(t)
        else:
            copies = [t.clone() for t in self._states()]
        self.snapshots.append((self.length, copies))

    def ring_holds(self, n: int) -> bool:
        """Whether every ring still holds the keys a query at position n reads (n - window + 1 .. n - 1), so that
        the cache can go back to n; always where no ring has wrapped."""
        if not self.consistent:  # a failed pass may have written past `length` into slots still in use
            return not any(self.ring)
        return all(max(0, n - w + 1) >= self.length - w for w in self.ring if w)

    def truncate(self, n: int) -> int:
        """Forget every position from n on and return how many are kept: n for attention (the buffers are reused as
        they are); with recurrent layers, the latest snapshot at or before n (0, a fresh state, if none); with
        rings, 0 where a ring has already overwritten the window before n (`ring_holds`)."""
        n = max(0, min(n, self.length))
        if not self.ring_holds(n):
            n = 0  # recomputed from the start: a ring cannot give back what it overwrote
        if self.recurrent_layers and (n < self.length or not self.consistent):
            best = max((s for s in self.snapshots if s[0] <= n), key=lambda s: s[0], default=None)
            if best is None:
                for t in self._states():
                    t.zero_()
                n = 0
            else:
                for t, c in zip(self._states(), best[1], strict=True):
                    t.copy_(c)
                n = best[0]
            self.snapshots = [s for s in self.snapshots if s[0] <= n]
            if n and not self.ring_holds(n):  # the snapshot lies before what the rings hold: from the start
                for t in self._states():
                    t.zero_()
                n, self.snapshots = 0, []
        self.consistent = True
        self.length = n
        return n

    def state_nbytes(self) -> int:
        """The recurrent states' bytes (one copy; each snapshot is as many again)."""
        return sum(t.numel() * t.element_size() for t in self._states())

    def nbytes(self) -> int:
        kv = sum(t.numel() * t.element_size() for t in self.k + self.v)
        return kv + self.state_nbytes() * (1 + len(self.snapshots))
