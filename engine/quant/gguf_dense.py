"""A GGUF file's output and embedding matrices kept in their quant type: the LM head and the token lookup.

Why: llama.cpp ships `output.weight` at 6-8 bits (Q6_K under Q4_K_M and most k-quant mixes, Q8_0 in a Q8_0 file) and
often `token_embd.weight` too. Dequantized at load to bf16, a 151,936 x 2048 Q6_K head (Qwen3-30B-A3B) grows from
255 MB to 622 MB, 2.4x the bytes every decode token reads through it; in fp32 4.9x. Kept packed, the head is read as
the file stores it by the GGUF kernels (quant/gguf.py over native_gguf.c), and the table costs nothing but the T rows
a forward looks up.

`GGUFMatrix` holds one such matrix ([rows, row_bytes] uint8, usually a view of the file's memory map):
- as the LM head (`__call__`, QuantLinear's call, so `MoEForCausalLM.logits` takes it as `lm_q`): one token by the
  integer vec_dot (`gguf.vecdot`, x rounded to Q8 blocks once: within `vecdot_bound` of x @ W^T) for bf16 / fp16
  activations, else the many-token kernel (`gguf.prefill`: F.linear(x, dequantize(W)) up to the order of the fp32
  sum), else W decoded a tile of rows at a time (another device, or no kernel library). Logits come back in fp32.
- as the embedding table (`rows`, llama.cpp's get_rows): only the rows of the input ids decoded, by native_gguf.c's
  row decoder or the torch reference, bit for bit `dequantize`, then cast to the compute dtype as a dequantized-at-load
  table would have been (so the hidden states are the same bits either way).
A tied model (no output.weight) uses the one packed token_embd for both.
"""

from __future__ import annotations

import torch

from .gguf import GGMLType, decode_rows, dequantize, gguf_linear

# T = tokens, R = rows (vocabulary), C = cols (hidden), RB = bytes per row

# Each block's fp16 scale(s), by byte offset (ggml-common.h): a block's values are these times small integers, so
# they are finite exactly where the scales are (MXFP4's E8M0 exponent is decoded instead)
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,),
                 "IQ4_XS": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,)}


class GGUFMatrix:
    """W [rows, cols] as a GGUF file stores it: `raw` [rows, row_bytes] uint8 in ggml type `type`."""

    __slots__ = ("raw", "type", "cols", "dtype")

    def __init__(self, raw: torch.Tensor, t: GGMLType, cols: int, dtype: torch.dtype = torch.float32):
        if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != t.row_bytes(cols) or cols % t.block:
            raise ValueError(f"a {t.name} matrix of {cols} columns is [rows, {t.row_bytes(cols)}] uint8, got "
                             f"{list(raw.shape)} {raw.dtype}")
        self.raw = raw  # [R, RB]
        self.type = t
        self.cols = cols
        self.dtype = dtype  # the compute dtype: what `rows` gives (the logits are fp32 whatever it is)

    @property
    def format(self) -> str:
        return self.type.name

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.cols

    @property
    def nbytes(self) -> int:
        """The bytes a token reads through it as the LM head: the packed rows, as stored."""
        return self.raw.numel()

    def weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized W [rows, cols]: the slow reference (quant/gguf.py `dequantize`)."""
        return dequantize(self.raw, self.type, self.cols).to(dtype)

    def check_finite(self, name: str, file) -> None:
        """CheckpointError naming the tensor where a block's scale is NaN or Inf (the values it scales would be):
        the fp16 scales read alone (1/128 of the bytes), or for MXFP4 the rows decoded a chunk at a time."""
        from ..io.checkpoint import check_finite

        offsets = SCALE_OFFSETS.get(self.type.name)
        blocks = self.raw.reshape(-1, self.type.nbytes)  # [blocks, block bytes]
        if offsets is None:
            for r in range(0, self.raw.shape[0], 4096):
                check_finite(decode_rows(self.raw[r:r + 4096], self.type, self.cols), name, file)
            return
        for at in offsets:
            check_finite(blocks[:, at:at + 2].contiguous().view(torch.float16), name, file, " (a block's scale)")

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> W[ids] [T, cols] in the compute dtype: those rows alone decoded (get_rows), bit for bit
        `dequantize` of the whole matrix indexed by ids."""
        picked = self.raw.index_select(0, ids.to(self.raw.device))  # [T, RB], contiguous
        return decode_rows(picked, self.type, self.cols).to(self.dtype)  # [T, C]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [T, cols] -> x @ W^T [T, rows] in x's dtype, or fp32 for out_dtype=float32 (the logits), plus residual
        when given: QuantLinear's call (quant/dense_quant.py), so the model holds either as its LM head."""
        y = gguf_linear(x, self.raw, self.type, self.cols, out_dtype=out_dtype)  # [T, R]
        return y if residual is None else residual + y

    def __repr__(self) -> str:
        return f"GGUFMatrix({self.type.name}, {self.raw.shape[0]} x {self.cols})"


class GGUFProjection:
    """An attention projection kept in the file's quant types: y = x @ [W_1; W_2; ...]^T (+ bias) (+ residual), the
    row blocks W_i (q, k, v: one fused projection, as the dequantized path fuses them) each a `GGUFMatrix`; blocks of
    the same type side by side are joined into one matrix at load (one kernel call for Q4_K q and k, another for a
    Q6_K v). QuantLinear's call, so `Attention` holds either as `qkv_q` / `o_q`: one token by the integer vec_dot,
    bf16 / fp16 tokens by the integer prefill kernel, fp32 ones by the exact fp32 kernel (quant/gguf.py
    `gguf_linear`), the blocks' fp32 outputs joined, + bias in fp32, rounded once."""

    __slots__ = ("parts", "bias")

    def __init__(self, mats: list[GGUFMatrix], bias: torch.Tensor | None = None):
        parts: list[GGUFMatrix] = []
        for m in mats:
            if parts and parts[-1].type is m.type and parts[-1].cols == m.cols:
                last = parts.pop()
                m = GGUFMatrix(torch.cat([last.raw, m.raw]), m.type, m.cols, m.dtype)  # a copy of the two
            parts.append(m)
        self.parts = parts
        self.bias = None if bias is None else bias.detach()

    @property
    def format(self) -> str:
        return "/".join(p.type.name for p in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].cols

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized W [rows, cols]: the slow reference."""
        return torch.cat([p.weight(dtype) for p in self.parts])

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        ys = [gguf_linear(x, p.raw, p.type, p.cols, out_dtype=torch.float32) for p in self.parts]  # [T, rows_i] fp32
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        if self.bias is not None:
            y = y + self.bias.float()
        y = y.to(out_dtype or x.dtype)
        return y if residual is None else residual + y

    def __repr__(self) -> str:
        return f"GGUFProjection({self.format}, {self.shape[0]} x {self.shape[1]})"
