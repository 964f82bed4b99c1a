"""The GGUF Triton kernel (kernels/gguf_matmul.py) under the Triton interpreter, for every ggml type moechat computes:
its in-register decoding bit for bit quant/gguf.py's dequantize (itself the gguf package's:
tests/engine/test_gguf_quant.py), and x @ W^T within cols 2^-24 sum |x w| of dequantize + the dot in fp64, with
partial token and row tiles.

TRITON_INTERPRET is read when a kernel is decorated, so the cases run in a subprocess (this file as a script) and the
flag never reaches the rest of the suite.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moechat.engine.quant.gguf import TYPES, dequantize

KINDS = sorted(TYPES)
# (rows, cols, tokens): one tile each way; rows and tokens past a tile (32 rows, 16 tokens), 1-8 blocks a row
SHAPES = ((5, 256, 3), (37, 256, 19))


def _cases():
    from tests.engine.test_gguf_quant import random_blocks  # here: the script run cannot import the tests package

    for name in KINDS:
        for rows, cols, T in SHAPES:
            raw = torch.from_numpy(random_blocks(name, rows, cols, seed=rows + T))  # [rows, row_bytes]
            x = torch.randn(T, cols, generator=torch.Generator().manual_seed(T))  # [T, cols]
            yield f"{name}-{rows}x{cols}-T{T}", name, raw, x


def _interpreted_main(path: str) -> None:
    """Run as a script under TRITON_INTERPRET=1 on the cases the test wrote to `path`: per case, whether the decode
    is exact and the largest err / bound."""
    from moechat.engine.quant.kernels.gguf_matmul import gguf_decode, gguf_matmul

    assert os.environ.get("TRITON_INTERPRET") == "1"
    for case, name, raw, x in torch.load(path):
        cols = x.shape[1]
        w = dequantize(raw, name, cols).double()  # [rows, cols]
        exact = torch.equal(gguf_decode(raw, name, cols).double(), w)
        y = gguf_matmul(x.bfloat16() if name == "Q4_K" else x, raw, name, cols)  # a bf16 x, widened to fp32
        xd = x.bfloat16().double() if name == "Q4_K" else x.double()
        bound = cols * 2.0**-24 * (xd.abs() @ w.abs().t())
        excess = ((y.double() - xd @ w.t()).abs() / bound).max().item()
        print(case, int(exact), excess, flush=True)


def _wired_main() -> None:
    """Under TRITON_INTERPRET=1 and MOECHAT_GGUF_TRITON=1: a Q4_K_M expert (gate/up Q4_K, down Q6_K) and a gpt-oss
    MXFP4 one with biases through GGUFFormat.linear, the path CUDA takes: the kernel runs (counted), and each output
    is within cols 2^-24 sum |x w| of the fp64 reference. Prints one line per expert: calls, largest err / bound."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: the tests' block writer
    import moechat.engine.quant.kernels.gguf_matmul as kernel
    from moechat.engine.quant.gguf import GGUFFormat
    from tests.engine.test_gguf_quant import random_blocks

    calls = []
    real = kernel.gguf_matmul
    kernel.gguf_matmul = lambda *a, **k: calls.append(a[2]) or real(*a, **k)
    H, inter, T = 256, 64, 5
    for fmt in (GGUFFormat("Q4_K", "Q4_K", "Q6_K"), GGUFFormat("MXFP4", "MXFP4", "MXFP4", interleaved=True)):
        g = torch.Generator().manual_seed(3)
        tensors = {"w1": torch.from_numpy(random_blocks(fmt.types["w1"].name, inter, H, seed=1)),
                   "w3": torch.from_numpy(random_blocks(fmt.types["w3"].name, inter, H, seed=2)),
                   "w2": torch.from_numpy(random_blocks(fmt.types["w2"].name, H, 256, seed=3))}  # down from 256
        if fmt.interleaved:
            tensors.update(w1_bias=torch.randn(inter, generator=g), w3_bias=torch.randn(inter, generator=g),
                           w2_bias=torch.randn(H, generator=g))
        x = torch.randn(T, H, generator=g)
        worst = 0.0
        for which, xin in (("w13", x), ("w2", torch.randn(T, 256, generator=g))):
            calls.clear()
            y = fmt.linear(xin, tensors, which).double()
            w = fmt.weight(tensors, which, torch.float64)
            bias = fmt.bias(tensors, which).double() if fmt.interleaved else 0.0
            ref = xin.double() @ w.t() + bias
            bound = xin.shape[1] * 2.0**-24 * (xin.double().abs() @ w.abs().t()) + 1e-12
            worst = max(worst, ((y - ref).abs() / bound).max().item())
            assert calls, which
        print(fmt.name, len(calls), worst, flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "wired":
        _wired_main()
    else:
        _interpreted_main(sys.argv[1])


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, tuple[int, float]]:
    pytest.importorskip("triton")
    path = tmp_path_factory.mktemp("gguf_triton") / "cases.pt"
    torch.save(list(_cases()), path)  # the script reads them: it imports moechat only
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, __file__, str(path)], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    out = {}
    for line in result.stdout.splitlines():
        case, exact, excess = line.split()
        out[case] = (int(exact), float(excess))
    return out


@pytest.mark.slow  # one interpreted run of every case: ~25 s on a loaded 2-core machine
@pytest.mark.parametrize("name", KINDS)
def test_interpreted_kernel_decodes_exactly_and_stays_within_the_bound(interpreted, name):
    cases = {c: v for c, v in interpreted.items() if c.startswith(f"{name}-")}
    assert len(cases) == len(SHAPES)
    for case, (exact, excess) in cases.items():
        assert exact == 1, case  # the in-register decode is dequantize, bit for bit
        assert excess <= 1.0, case  # within cols 2^-24 sum |x w|
        # and far inside it: a wrong block or row lands far outside (>> 1), while fp32 sums in any order stay within a
        # few hundredths (Q4_K's 37 x 256 case with a bf16 x: 0.012 under Triton 3.9's interpreter)
        assert excess < 0.05, case


@pytest.mark.slow
def test_gguf_experts_take_the_kernel_where_cuda_would():
    # The dispatch CUDA tensors take (quant/gguf.py gguf_linear -> kernels/gguf_matmul.py), run on CPU tensors under
    # the interpreter with MOECHAT_GGUF_TRITON=1: gate/up/down and the biases through the kernel, within the bound.
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", MOECHAT_GGUF_TRITON="1")
    result = subprocess.run([sys.executable, __file__, "wired"], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = dict((ln.split()[0], ln.split()[1:]) for ln in result.stdout.splitlines())
    assert sorted(lines) == ["gguf-MXFP4", "gguf-Q4_K-Q6_K"]
    for name, (calls, excess) in lines.items():
        assert int(calls) >= 1 and float(excess) <= 1.0, name


def test_cpu_tensors_keep_the_native_paths(monkeypatch):
    from moechat.engine.quant import gguf

    raw = torch.zeros(4, gguf.TYPES["Q8_0"].row_bytes(64), dtype=torch.uint8)
    x = torch.zeros(1, 64)
    monkeypatch.delenv(gguf.TRITON_ENV, raising=False)
    assert gguf._triton_matmul(x, raw, gguf.TYPES["Q8_0"]) is None  # CPU tensors: native_gguf.c
    monkeypatch.setenv(gguf.TRITON_ENV, "0")
    assert gguf._triton_matmul(x, raw, gguf.TYPES["Q8_0"]) is None
    if importlib.util.find_spec("triton") is not None:
        monkeypatch.setenv(gguf.TRITON_ENV, "1")
        assert gguf._triton_matmul(x, raw, gguf.TYPES["Q8_0"]) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "MXFP4", "IQ4_XS"])
def test_gguf_experts_on_cuda_take_the_kernel_and_match_the_reference(name, monkeypatch):
    # on CUDA gguf_linear sends any token count to the Triton kernel (bench/gpu_check.sh runs this)
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import moechat.engine.quant.kernels.gguf_matmul as kernel
    from moechat.engine.quant.gguf import TYPES as GGUF_TYPES
    from moechat.engine.quant.gguf import gguf_linear
    from tests.engine.test_gguf_quant import random_blocks

    calls = []
    real = kernel.gguf_matmul
    monkeypatch.setattr(kernel, "gguf_matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    rows, cols = 1536, 2048
    raw = torch.from_numpy(random_blocks(name, rows, cols, seed=7))
    w = dequantize(raw, name, cols).double()
    for T in (1, 4, 33):
        x = torch.randn(T, cols, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16)
        y = gguf_linear(x.cuda(), raw.cuda(), GGUF_TYPES[name], cols, out_dtype=torch.float32).cpu().double()
        ref = x.double() @ w.t()
        bound = cols * 2.0**-24 * (x.double().abs() @ w.abs().t()) + 1e-30
        assert ((y - ref).abs() / bound).max() <= 1.0, (name, T)
    assert len(calls) == 3
