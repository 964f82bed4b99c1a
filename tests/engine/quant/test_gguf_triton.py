"""The GGUF Triton kernel (kernels/gguf_matmul.py) under the Triton interpreter, for every ggml type moechat computes:
its in-register decoding bit for bit quant/gguf.py's dequantize (itself the gguf package's:
tests/engine/test_gguf_quant.py), and x @ W^T within cols 2^-24 sum |x w| of dequantize + the dot in fp64, with
partial token and row tiles.

TRITON_INTERPRET is read when a kernel is decorated, so the cases run in a subprocess (this file as a script) and the
flag never reaches the rest of the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys

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


if __name__ == "__main__":
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
        assert excess < 0.01, case  # and far inside it (a wrong block or row would be far outside)
