"""Dense projections held in int8 on the CPU (`--dense-format int8`): attention's q/k/v and o projections and the
LM head, quantized at load per output channel as the int8 experts are (quant/intq.py: w = q * scale, |q| <= 127).

Why: with quantized experts the dense weights become most of the bytes a CPU token reads. A Qwen3-30B-A3B-shaped
model with int8 experts reads 1.24 GB a token of which 0.93 GB are bf16 attention and LM head (issue 27); int8
halves those, which at the read bandwidth is up to ~1.6x the decode rate. llama.cpp keeps every projection in its
quant type for the same reason.

Compute: one token runs the native int8 GEMV (quant/native.py: fp32 sums, scales after; a bf16 x is read as is);
several tokens run torch's `_weight_int8pack_mm` where this machine's check passed (quant/torch_paths.py), else one
GEMM over the codes cast to x's dtype (exact: |q| <= 127 fits bf16). The embedding table (also the LM head when
tied) stays in the model's dtype for lookups; the LM head gets its own int8 copy.

Quality: the weights' rounding only (activations stay in the model's dtype), bounded per output by
scale/2 * sum|x| (tests/engine/quant/test_dense_int8.py); perplexity per choice in bench/expert_formats.py.
"""

from __future__ import annotations

import torch

from .intq import Int8Format

_INT8 = Int8Format()

DENSE_FORMATS = ("native", "int8")


class Int8Linear:
    """y = x @ (q * scale)^T (+ bias) (+ residual) from int8 codes q [out, in] and fp32 scales [out]."""

    __slots__ = ("q", "scale", "bias", "_tensors")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        packed = Int8Format.quantize(weight.detach())
        self.q = packed["q"].contiguous()  # [out, in] int8
        self.scale = packed["scale"].contiguous()  # [out] fp32
        self.bias = None if bias is None else bias.detach()
        self._tensors = {"w_q": self.q, "w_scale": self.scale}
        if self.bias is not None:
            self._tensors["w_bias"] = self.bias

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel()

    def weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized weight [out, in]: the slow reference."""
        return (self.q.float() * self.scale[:, None]).to(dtype)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype (or fp32 for out_dtype=float32: the LM head's logits, never rounded to
        bf16), plus residual [T, out] when given. The int8 experts' own dispatch (Int8Format.linear): the native GEMV
        for one token, torch's checked kernel or the cast fallback for more."""
        if out_dtype == torch.float32 and x.dtype != torch.float32:
            x = x.float()  # exact: the GEMV sums in fp32 either way
        y = _INT8.linear(x, self._tensors, "w")  # [T, out]
        return y if residual is None else residual + y


def check_dense_format(name: str | None, device: torch.device) -> str:
    """'native' or 'int8'; int8 on the CPU only (its GPU kernels are not written yet)."""
    from ..errors import ConfigError

    name = name or "native"
    if name not in DENSE_FORMATS:
        raise ConfigError(f"--dense-format {name!r}: use one of {', '.join(DENSE_FORMATS)}")
    if name == "int8" and device.type != "cpu":
        raise ConfigError("--dense-format int8 runs on the CPU only for now (no GPU kernel for it yet): leave it "
                          "out on a GPU, where the dense weights stay in the model's dtype")
    return name
