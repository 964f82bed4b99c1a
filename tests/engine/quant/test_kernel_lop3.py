"""The lop3 instructions of the packed decode's inline PTX against their pure-Triton twins, on the CPU.

The compiled kernels (kernels/packed.py's E2M1 -> e4m3 bytes and sm_80/86's e4m3 -> fp16 bits)
run `lop3.b32 d, a, b, c, LUT` where the interpreter runs the twin's and / or / shift formula, so the interpreter
tests never see the PTX. Here each PTX string is read from the module source, its lop3 evaluated by the
instruction's definition (bit i of d is bit (a_i << 2 | b_i << 1 | c_i) of LUT), and the result compared with the
twin's formula on every byte pattern that matters (all 2^16 values of two bytes, spread over all positions) and
random words.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

KERNELS = Path(__file__).resolve().parents[3] / "engine" / "quant" / "kernels"


def lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    """PTX lop3.b32 by its definition: each output bit is the LUT entry its three input bits index."""
    out = np.zeros_like(a)
    for i in range(8):
        if lut >> i & 1:
            sel = (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
            out |= sel
    return out


def _words() -> np.ndarray:
    g = np.random.default_rng(0)
    pairs = np.arange(1 << 16, dtype=np.uint32)
    return np.concatenate([pairs, pairs << 16, (pairs << 8) | (pairs >> 8 << 24),
                           g.integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(np.uint32)])


def test_e2m1_as_e4m3_ptx_is_its_twin():
    src = (KERNELS / "packed.py").read_text()
    body = src[src.index("def _e2m1_as_e4m3"):]
    asm = body[body.index('asm="""') + 7:].split('"""', 1)[0]  # the function's PTX block
    lines = re.findall(r"lop3\.b32 \$(\d), (\w+), (\w+), (0x[0-9A-Fa-f]+), (0x[0-9A-Fa-f]+);", asm)
    assert len(lines) == 2, asm
    assert "and.b32 s, $2, 0x88888888;" in asm and "shl.b32 u, s, 4;" in asm and "shr.b32 t, $2, 2;" in asm
    w = _words()
    s = w & np.uint32(0x88888888)
    operands = {"0": (w << np.uint32(2), s << np.uint32(4)), "1": (w >> np.uint32(2), s)}  # t, u / t, s as the PTX
    got = {out: lop3(*operands[out], np.full_like(w, int(c, 16)), int(lut, 16)) for out, _, _, c, lut in lines}
    # the twin (the interpreter's formula)
    lows = ((w << np.uint32(2)) & np.uint32(0x1C1C1C1C)) | ((w << np.uint32(4)) & np.uint32(0x80808080))
    highs = ((w >> np.uint32(2)) & np.uint32(0x1C1C1C1C)) | (w & np.uint32(0x80808080))
    np.testing.assert_array_equal(got["0"], lows)
    np.testing.assert_array_equal(got["1"], highs)


def test_e4m3x4_int_ptx_is_its_twin():
    """sm_80/86's FP8 decode: the signs masked once, bytes 0, 2 and 1, 3 each one bit-select lop3 (kernels/packed.py
    _e4m3x4_int) against the twin's formula, the fp16x2 words of the values x 2^-8."""
    src = (KERNELS / "packed.py").read_text()
    body = src[src.index("def _e4m3x4_int"):]
    asm = body[body.index('asm="""') + 7:].split('"""', 1)[0]
    lines = re.findall(r"lop3\.b32 (\w), (\w+), (\w+), (0x[0-9A-Fa-f]+), (0x[0-9A-Fa-f]+);", asm)
    assert len(lines) == 2, asm
    for op in ("and.b32 s, $4, 0x80808080;", "shl.b32 t, $4, 7;", "shl.b32 u, s, 8;", "shr.b32 t, $4, 1;",
               "mov.b32 {a0, a1}, a;", "mov.b32 {b0, b1}, b;", "cvt.f32.f16 $0, a0;", "cvt.f32.f16 $1, b0;",
               "cvt.f32.f16 $2, a1;", "cvt.f32.f16 $3, b1;"):
        assert op in asm, op
    w = _words()
    s = w & np.uint32(0x80808080)
    operands = {"a": (w << np.uint32(7), s << np.uint32(8)), "b": (w >> np.uint32(1), s)}  # t, u / t, s as the PTX
    got = {out: lop3(*operands[out], np.full_like(w, int(c, 16)), int(lut, 16)) for out, _, _, c, lut in lines}
    pair02 = ((w << np.uint32(7)) & np.uint32(0x3F803F80)) | ((w << np.uint32(8)) & np.uint32(0x80008000))
    pair13 = ((w >> np.uint32(1)) & np.uint32(0x3F803F80)) | (w & np.uint32(0x80008000))
    np.testing.assert_array_equal(got["a"], pair02)
    np.testing.assert_array_equal(got["b"], pair13)
    # and the halves are the e4m3 values x 2^-8 (every byte, at every position)
    b = np.arange(256, dtype=np.uint32)
    import torch

    want = torch.from_numpy(b.astype(np.uint8)).view(torch.float8_e4m3fn).float().numpy() / 256.0
    for pos in range(4):
        ww = b << np.uint32(8 * pos)
        pair = (((ww << np.uint32(7)) & np.uint32(0x3F803F80)) | ((ww << np.uint32(8)) & np.uint32(0x80008000))
                if pos % 2 == 0 else ((ww >> np.uint32(1)) & np.uint32(0x3F803F80)) | (ww & np.uint32(0x80008000)))
        half = (pair >> np.uint32(16 * (pos // 2))) & np.uint32(0xFFFF)
        got_v = half.astype(np.uint16).view(np.float16).astype(np.float32)
        ok = ~np.isnan(want)  # 0x7F / 0xFF (NaN, refused at load) read as 480 x 2^-8
        np.testing.assert_array_equal(got_v[ok], want[ok])
