"""Dense projections held quantized on the CPU (`--dense-format int8|int4`): attention's q/k/v and o projections in
the chosen format, the LM head in int8 either way, the embedding table in the model's dtype (it is looked up a row a
token, never read whole).

Why: with quantized experts the dense weights become most of the bytes a CPU token reads. A Qwen3-30B-A3B-shaped
model with int8 experts reads 1.24 GB a token of which 0.93 GB are bf16 attention and LM head (issue 27); int8
halves those, which at the read bandwidth is up to ~1.6x the decode rate. llama.cpp keeps every projection in its
quant type for the same reason.

The formats are the experts' own (quant/intq.py), quantized at load:
- int8: per output channel, w = q * scale (|q| <= 127, fp32 scale per row): 8 bits a weight + 32 per row.
- int4: symmetric in groups of 32 along the input, fp16 scales: 4.5 bits a weight (llama.cpp's Q4_K_M ~4.8). Only
  attention's projections: the LM head stays int8 under `--dense-format int4`, as llama.cpp keeps its output matrix
  at 6-8 bits (Q6_K under Q4_K_M and most other types, Q8_0 in a Q8_0 file) because the logits are where rounding
  shows: an int4 head would cost the most quality per byte saved.
  On the Qwen3-30B-A3B shape (48 layers) attention reads 1.81 GB a token in bf16, 0.91 GB in int8 and 0.51 GB in
  int4; the LM head 0.62 GB in bf16 and 0.31 GB in int8.

Compute: each format's own `linear`, the paths its experts take: int8 one token through the native int8 GEMV (fp32
sums), several bf16/fp16 tokens through the integer prefill kernel (x quantized to int8 per 32-element block, within
prefill.bound_q8), else torch's `_weight_int8pack_mm` where this machine's check passed (quant/torch_paths.py), else one
GEMM over the codes cast to x's dtype; int4 one token through the native int4 GEMV (codes decoded in registers; a bf16 x
summed in integers over x rounded to 16 bits per 32-element block, `native.round_x16`), several through the prefill
kernel (quant/prefill.py: each block of rows decoded once, fp32 sums; a bf16/fp16 x in groups of 32: integer dots over x
quantized to int8 blocks, within prefill.bound_q8), else the torch row-tile decoder.

Measured (one thread, 2-core AMD EPYC with AVX-512 BF16, machine loaded by other jobs; interleaved, medians): one
token through Qwen3-30B-A3B's q/k/v (5120 x 2048) takes 2.19 ms in bf16 (native GEMV), 1.45 in int8, 0.72 in int4;
its o (2048 x 4096) 2.92 / 1.02 / 0.46 ms. Many tokens go the other way: 128 through q/k/v take 28-48 ms in bf16
(MKL's bf16 GEMM; two runs) and 97-115 in int8 (the prefill kernel's fp32 FMAs); int4 took 94-96 that way and now
takes 11.7 ms through the integer prefill kernel (native_prefill_int.c, a bf16 x rounded to int8 per 32; 14.1 bf16
and 34.5 the decoded tile in the same run, CPU time, load 11-15). int8 now takes the same integer kernel: 128 tokens
through q/k/v 9.5 ms against torch's int8 GEMM's 34.4 and MKL bf16's 13.3 (one thread, quiet machine, medians of 7
interleaved), so neither quantized dense format trades prefill speed for decode speed any more. The whole decode, on the
2-layer Qwen3-shaped model with int8 experts: 7.1 / 10.7 / 11.5 tok/s native / int8 / int4 (bench/dense_format.py;
the full-vocabulary LM head dominates there, int4 changes only attention).

Quality: the weights' rounding (activations stay in the model's dtype). Against its own dequantized weight a
projection is exact up to the sums' rounding (tests/engine/quant/test_dense_quant.py); against the original weight
int8 is within scale/2 per weight and int4 within about half a group step (amax/15 of its group): ~0.6% and ~9.5%
of a Gaussian projection's output. On the demo model (trained; 16 sequences of 128 tokens it sampled itself,
teacher-forced) perplexity rises +0.03% with int8 and +0.47% with int4 dense, top-1 agreement with native 0.988 and
0.948, KL 1.7e-4 and 6.1e-3 a token (bench/dense_format.py --demo).
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError, ConfigError
from . import native
from .intq import Int4Format, Int8Format, int4_group

DENSE_FORMATS = ("native", "int8", "int4")
LM_HEAD_FORMAT = "int8"  # under every quantized dense format (see the module docstring)

_FORMATS = {"int8": Int8Format(), "int4": Int4Format()}


class QuantLinear:
    """y = x @ W^T (+ bias) (+ residual) from W [out, in] quantized in `fmt` ("int8" or "int4", quant/intq.py)."""

    __slots__ = ("fmt", "q", "scale", "bias", "_tensors")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, fmt: str = "int8"):
        if fmt not in _FORMATS:
            raise ConfigError(f"--dense-format {fmt!r}: a quantized dense format is one of {', '.join(_FORMATS)}")
        self.fmt = _FORMATS[fmt]
        w = weight.detach()
        if fmt == "int4" and w.shape[1] % 8:
            raise ConfigError(f"--dense-format int4 needs projection inputs divisible by 8 (this model has one of "
                              f"{w.shape[1]}): use --dense-format int8")
        try:
            packed = quantize_rows(self.fmt, w)
        except CheckpointError:
            raise CheckpointError(f"dense weights reach |w| = {float(w.abs().max()):.4g}, past int4's fp16 group "
                                  "scales: use --dense-format int8 (fp32 scales)") from None
        self._hold(packed["q"], packed["scale"], bias)

    def _hold(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.q = q.contiguous()  # int8 [out, in] | uint8 [out, in/2]
        self.scale = scale.contiguous()  # fp32 [out] | fp16 [out, in/group]
        self.bias = None if bias is None else bias.detach()
        self._tensors = {"w_q": self.q, "w_scale": self.scale}
        if self.bias is not None:
            self._tensors["w_bias"] = self.bias

    @classmethod
    def packed(cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, fmt: str) -> QuantLinear:
        """One already quantized in `fmt` (codes and scales as `__init__` would make them: engine/cache/dense_cache.py
        maps a previous load's)."""
        self = cls.__new__(cls)
        self.fmt = _FORMATS[fmt]
        self._hold(q, scale, bias)
        return self

    @property
    def format(self) -> str:
        return self.fmt.name

    @property
    def nbytes(self) -> int:
        """The bytes a token reads through it (codes and scales; the bias left out, as the plan leaves it)."""
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()

    def weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized weight [out, in]: the slow reference."""
        return self.fmt.weight(self._tensors, "w", dtype)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype (or fp32 for out_dtype=float32: the LM head's logits, never rounded to
        bf16), plus residual [T, out] when given: the format's own dispatch (its `linear`)."""
        if out_dtype == torch.float32 and x.dtype != torch.float32:
            if (self.fmt.name == "int8" and x.device.type == "cpu" and x.dim() == 2 and x.shape[0] == 1
                    and self.q.shape[1] % 32 == 0 and (lib := native.library()) is not None):
                # the LM head's one token: the GEMV's integer path over x rounded to 16 bits per block (native.c),
                # fp32 logits straight from its fp32 sums
                y = native.int8_gemv(lib, x, self.q, self.scale, torch.float32)
                y = y if self.bias is None else y + self.bias.float()
                return y if residual is None else residual + y
            x = x.float()  # int8: exact, its GEMV sums in fp32 either way; int4: fp32 sums over x as it is
        y = self.fmt.linear(x, self._tensors, "w")  # [T, out]
        return y if residual is None else residual + y


QUANTIZE_BLOCK_BYTES = 8 << 20  # fp32 bytes of the weight one block of rows is widened to while it is quantized


def _native_quantize(fmt, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """`fmt.quantize(w)` by native_quantize.c (a row a pass over the pool, the same bits as intq.py's torch ops), or
    None where it does not apply (no library, another dtype, a shape it does not take, a non-finite weight or an int4
    scale past fp16: the torch path then runs, and raises the typed error where there is one)."""
    lib = native.library()
    if lib is None or w.device.type != "cpu" or w.dtype not in (torch.bfloat16, torch.float32) or not w.is_contiguous():
        return None
    rows, cols = w.shape
    native._threads(lib)
    bf16 = int(w.dtype == torch.bfloat16)
    if fmt.name == "int8":
        q, scale = torch.empty(rows, cols, dtype=torch.int8), torch.empty(rows, dtype=torch.float32)
        rc = lib.moechat_quantize_int8(w.data_ptr(), bf16, rows, cols, q.data_ptr(), scale.data_ptr())
    else:
        group = int4_group(cols)
        q, scale = torch.empty(rows, cols // 2, dtype=torch.uint8), torch.empty(rows, cols // group,
                                                                                dtype=torch.float16)
        rc = lib.moechat_quantize_int4(w.data_ptr(), bf16, rows, cols, group, q.data_ptr(), scale.data_ptr())
    return {"q": q, "scale": scale} if rc == 0 else None


def quantize_rows(fmt, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """`fmt.quantize(w)`: natively where it can (`_native_quantize`), else a block of rows at a time (both formats
    quantize each row on its own: the same bits), so the fp32 temporaries stay ~8 MB, in cache, instead of several
    copies of the whole matrix: a 151,936 x 2,048 LM head widened whole took 1.2 GB per temporary and raised a load's
    peak RSS by 3.7 GB."""
    if (out := _native_quantize(fmt, w)) is not None:
        return out
    rows, cols = w.shape
    step = max(1, QUANTIZE_BLOCK_BYTES // (4 * max(cols, 1)))
    if rows <= step:
        return fmt.quantize(w)
    out: dict[str, torch.Tensor] = {}
    for r in range(0, rows, step):
        part = fmt.quantize(w[r : r + step])
        if not out:
            out = {k: torch.empty((rows, *v.shape[1:]), dtype=v.dtype) for k, v in part.items()}
        for k, v in part.items():
            out[k][r : r + step] = v
    return out


class Int8Linear(QuantLinear):
    """QuantLinear in int8 (the name `--dense-format int8` had first)."""

    __slots__ = ()

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight, bias, "int8")


def check_dense_format(name: str | None, device: torch.device) -> str:
    """'native', 'int8' or 'int4'; the quantized ones on the CPU only (their GPU kernels are not written yet)."""
    name = name or "native"
    if name not in DENSE_FORMATS:
        raise ConfigError(f"--dense-format {name!r}: use one of {', '.join(DENSE_FORMATS)}")
    if name != "native" and device.type != "cpu":
        raise ConfigError(f"--dense-format {name} runs on the CPU only for now (no GPU kernel for it yet): leave it "
                          "out on a GPU, where the dense weights stay in the model's dtype")
    return name
