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


def prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    """PTX prmt.b32 (default mode) by its definition: output byte i is byte (nibble i of sel) & 7 of {b, a} (a's
    bytes 0..3, b's 4..7); a nibble with bit 3 set would replicate that byte's sign (not used here)."""
    src = [(a >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)] + \
          [(b >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        n = (sel >> (4 * i)) & 0xF
        assert n < 8
        out |= src[n] << np.uint32(8 * i)
    return out


def test_e2m1_f16x2x4_ptx_is_its_twin():
    """sm_80/86's MXFP4 decode for a 16-bit x (kernels/packed.py _e2m1_f16x2x4): the PTX run op by op (and, shifts,
    prmt, lop3) against the twin's four _e2m1_f16x2 formulas, and the halves are the E2M1 values x 2^-14."""
    src = (KERNELS / "packed.py").read_text()
    body = src[src.index("def _e2m1_f16x2x4"):]
    asm = body[body.index('asm="""') + 7:].split('"""', 1)[0]
    w = _words()
    z = np.zeros_like(w)
    reg = {"$4": w, "z": z}

    def val(op: str) -> np.ndarray:
        return reg[op] if op in reg else np.full_like(w, int(op, 0))

    ops = re.findall(r"^\s*(\w+(?:\.\w+)*) (.*?);$", asm, re.M)
    assert [o for o, _ in ops if not o.startswith(".reg")][:3] == ["mov.b32", "and.b32", "shl.b32"]
    for op, args in ops:
        if op.startswith(".reg"):
            continue
        a = [x.strip() for x in args.split(",")]
        d = a[0]
        if op == "mov.b32":
            reg[d] = val(a[1])
        elif op == "and.b32":
            reg[d] = val(a[1]) & val(a[2])
        elif op == "shl.b32":
            reg[d] = val(a[1]) << np.uint32(int(a[2]))
        elif op == "shr.b32":
            reg[d] = val(a[1]) >> np.uint32(int(a[2]))
        elif op == "prmt.b32":
            reg[d] = prmt(val(a[1]), val(a[2]), int(a[3], 0))
        elif op == "lop3.b32":
            reg[d] = lop3(val(a[1]), val(a[2]), val(a[3]), int(a[4], 0))
        else:
            raise AssertionError(op)

    def twin(em: int, sign: int) -> np.ndarray:  # _e2m1_f16x2
        e = w << np.uint32(em) if em >= 0 else w >> np.uint32(-em)
        return (e & np.uint32(0x0E000E00)) | ((w << np.uint32(sign)) & np.uint32(0x80008000))

    for out, (em, sign) in zip(("$0", "$1", "$2", "$3"), ((9, 12), (5, 8), (1, 4), (-3, 0))):
        np.testing.assert_array_equal(reg[out], twin(em, sign))
    # the halves: code c of nibble t (t + 4 in the high half) is its E2M1 value x 2^-14
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    for t, out in enumerate(("$0", "$1", "$2", "$3")):
        for half in range(2):
            code = (w >> np.uint32(4 * t + 16 * half)) & np.uint32(0xF)
            bits = (reg[out] >> np.uint32(16 * half)) & np.uint32(0xFFFF)
            got = bits.astype(np.uint16).view(np.float16).astype(np.float64) * 2.0**14
            np.testing.assert_array_equal(got, e2m1[code])
