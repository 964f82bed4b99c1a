"""bench/kernel_sass.py on four decode kernels: they compile for sm_90 on the CPU, the K loop is found and the
figures parse, and the int8, FP8 and int4 GEMVs meet the issue's aim (<= 4 SASS instructions per packed byte of the
inner loop; FP8 through the hardware's e4m3 conversion, sm_89 on; int4 in fp16x2 for a bf16 model); MXFP4 stays
under its rewrites' bound.

The report runs as a script in a child process without TRITON_INTERPRET (an interpreted kernel cannot be
compiled); it needs triton's bundled ptxas and cuobjdump, not a GPU. Its figures are deterministic for one triton
and ptxas, so the bounds below hold the loops to their rewrites: MXFP4 31.6 SASS instructions per packed byte
before (8-byte code loads, a scale load per byte), 8.7 after (through e4m3 bytes); int8 6.1, then 4.7 (x through
shared memory), 3.0 with x loaded in the codes' layout; FP8 34.4, 11.3, then 3.7. Then for a bf16 x, products in
fp16x2 (e4m3 conversion two codes an instruction, a packed FMA per two weights), one warp of 8 rows a thread (x in
the codes' layout) and whole tiles unmasked: MXFP4 8.7 -> 4.9, int4 7.9 -> 4.4, int8 2.6, FP8 3.1. Then 16 rows a
thread (x's conversion shared by twice the rows), int4's - 8 sum(x) folded into the fp16x2 lanes' start, the
lanes added in fp16, MXFP4's e4m3 bytes in 6 integer ops: MXFP4 4.44, int4 3.95 (the aim). w2's loop over a
token's K pairs holds the K loop: only inner loops count, and the |x| guard's max pass over x is no K loop.
Then int4's nibbles as fp16 subnormals (no conversion instruction): 3.41 on sm_90, 3.36 on sm_80 (from 3.95 /
4.42); sm_80's FP8 decode in 6 integer ops a word and one scale load for a tile's rows: 3.83 (from 4.37); sm_80's
MXFP4 in fp16x2 (E2M1 bits shifted under fp16's exponent): 5.45 (from the fp32 chain's 8.37).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "kernel_sass.py"


def _bundled_tools() -> Path | None:
    try:
        import triton
    except ImportError:
        return None
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def test_sass_report_parses_and_int8_fp8_meet_the_aim_on_sm_90():
    tools = _bundled_tools()
    if tools is None:
        pytest.skip("triton is not installed: nothing to compile")
    if not (tools / "ptxas").exists() or not (tools / "cuobjdump").exists():
        pytest.skip(f"triton's bundled ptxas / cuobjdump are absent from {tools}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run([sys.executable, str(SCRIPT), "--arch", "90", "--kernel", "mxfp4:w2", "--kernel", "int8:w2",
                          "--kernel", "fp8:w2", "--kernel", "int4:w2", "--json", "--workers", "1"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["skipped"] == []
    rows = {r["kernel"]: r for r in report["rows"]}
    assert set(rows) == {"mxfp4:w2", "int8:w2", "fp8:w2", "int4:w2"}
    for row in rows.values():
        assert row["arch"] == 90 and row["loops"] == 1  # the K loop alone, not the loop over K pairs around it
        assert row["bytes_per_thread"] >= 16 and row["widest_load_bits"] == 128  # whole 16-byte chunks
        assert row["instructions_per_byte"] == pytest.approx(row["loop_instructions"] / row["bytes_per_thread"],
                                                             abs=0.01)
        assert row["registers"] > 0 and row["spills"] == 0
    assert 1 < rows["mxfp4:w2"]["instructions_per_byte"] < 4.6  # 8.7 before the fp16x2 decode, 4.9 before 16 rows
    assert 1 < rows["int4:w2"]["instructions_per_byte"] <= 4.0 and rows["int4:w2"]["meets_aim"]  # 7.9, 4.4 before
    for fmt in ("int8", "fp8"):  # the formats that reach the aim (bench/kernel_sass.py's AIM); fp8 from sm_89
        assert 1 < rows[f"{fmt}:w2"]["instructions_per_byte"] <= 4.0 and rows[f"{fmt}:w2"]["meets_aim"]


def test_fp8_int4_meet_the_aim_without_e4m3_hardware_on_sm_80():
    """sm_80 has no e4m3 conversion: FP8 decodes in integer ops (fp32 sums), int4 and MXFP4 run fp16x2 from integer
    decodes; FP8 and int4 meet the aim there too, MXFP4 stays under its fp16x2 rewrite's bound."""
    tools = _bundled_tools()
    if tools is None or not (tools / "ptxas").exists() or not (tools / "cuobjdump").exists():
        pytest.skip("triton's bundled ptxas / cuobjdump are needed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run([sys.executable, str(SCRIPT), "--arch", "80", "--kernel", "fp8:w2", "--kernel", "int4:w2",
                          "--kernel", "mxfp4:w2", "--json", "--workers", "1"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["kernel"]: r for r in json.loads(out.stdout)["rows"]}
    for fmt in ("fp8", "int4"):
        assert rows[f"{fmt}:w2"]["meets_aim"] and rows[f"{fmt}:w2"]["spills"] == 0  # 4.37, 4.42 before
    assert 1 < rows["mxfp4:w2"]["instructions_per_byte"] < 6.0  # 8.37 in the fp32 chain


def test_parse_sass_finds_the_backward_branch_of_both_syntaxes(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("kernel_sass", SCRIPT)  # by path: bench/ is no package
    ks = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "kernel_sass", ks)  # its dataclass looks its module up
    spec.loader.exec_module(ks)
    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;",
        "        /*0020*/                   FFMA R8, R4, R5, R8 ;",
        "        /*0030*/                   STL [R1], R8 ;",
        "        /*0040*/              @!P0 BRA 0x10 ;",
        "        /*0050*/                   LDG.E.64 R4, desc[UR4][R2.64] ;",
        "        /*0058*/                   HFMA2 R8, R4, R5, R8 ;",
        "        /*0060*/                   BRA.U !UP1, 0x50 ;",
        "        /*0068*/                   LDG.E.128 R4, desc[UR4][R2.64] ;",
        "        /*0070*/                   HFMA2.BF16_V2 R4, -RZ, RZ, R4 ;",
        "        /*0074*/                   FMNMX R9, |R4|, R9, !PT ;",
        "        /*0078*/              @!P0 BRA 0x68 ;",
        "        /*0080*/                   EXIT ;",
        "        /*0090*/                   BRA 0x90;",
    ])
    loops, info = ks.parse_sass(sass)
    # 0x10..0x40 and 0x50..0x60; 0x68..0x78 (a max over x, the |x| guard's pre-pass) multiplies nothing: no K
    # loop; the self-branch after EXIT is no loop
    assert loops == [4, 3]
    assert info == {"spills": 1, "widest_load_bits": 128}
