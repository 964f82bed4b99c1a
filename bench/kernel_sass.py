"""SASS of the fused expert decode kernels (MXFP4, FP8 block, int8, int4) on sm_80..sm_120, without a GPU.

Method. Each decode kernel (`_w13_decode_kernel` / `_w2_decode_kernel` of kernels/mxfp4_moe.py and
kernels/quant_moe.py, the first of `_decode_configs`, slot ids without a map, the residual added in w2) is
compiled with `triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", cap, 32))`:
Triton lowers to PTX and runs its bundled ptxas for the target, so no device or driver is needed. The signature
is the one a bf16 model passes (x, biases, residual and output bf16, codes uint8, fp32 scales (int4: fp16); `--x
fp32`: an fp32 model's, whose MXFP4 and int4 GEMVs keep fp32 sums);
pointers and the integer strides / widths are marked 16-divisible, as the JIT specializes them at GPT-OSS-20B and
Qwen3-30B-A3B widths. The cubin is disassembled with the bundled `cuobjdump -sass`; a loop is a predicated
backward branch (target below it, not the self-branch after EXIT), its instructions those from the target to the
branch, and a K loop is an inner one (w2's loop over a token's K pairs holds one). Per kernel x arch it prints:

* loop: SASS instructions in one iteration of a K loop (the mean where a kernel has several; the packed fp16
  decode's |x| guard, a max over x before the K loop, multiplies nothing and is no K loop),
* B/thr: packed code bytes one thread consumes per iteration, R x BLOCK_KB / (32 x num_warps), R = BLOCK_N rows
  (w2) or 2 BLOCK_N (w13's one loop over the tile's gate and up rows; scales are extra: 1/16 of that for MXFP4,
  less for the others),
* i/B: instructions per packed byte, loop / (B/thr) (each thread runs the loop's instructions once per
  iteration): the figure to hold to <= ~4 for a decode step to stay memory bound (an H200 issues about
  33 T thread-instructions/s against 4.8 TB/s: ~7 per byte is the break-even at full occupancy),
* aim: whether i/B is at most AIM (4, the issue's aim),
* regs, spills (STL + LDL in the whole kernel), and LDG width (the widest global load in the loop).

`--json` prints the rows as JSON. The bundled ptxas decides which targets exist (sm_120 needs CUDA >= 12.8);
a target it refuses is reported and skipped. Compiles run in two worker processes; Triton's cache
(~/.triton/cache) makes a second run a few seconds. Usage: python bench/kernel_sass.py [--arch 90]
[--kernel mxfp4:w2] [--x bf16] [--x fp32] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

ARCHS = (80, 86, 89, 90, 120)
FORMATS = ("mxfp4", "fp8", "int8", "int4")
WHICH = ("w13", "w2")
# widths the signature's divisibility stands for: GPT-OSS-20B (MXFP4) and Qwen3-30B-A3B (the others)
_POINTER_TYPES = {"x_ptr": "*bf16", "act_ptr": "*bf16", "bias_ptr": "*bf16", "weights_ptr": "*fp32", "y_ptr": "*fp32",
                  "group_slot_ptr": "*i32", "group_pairs_ptr": "*i32", "blocks_ptr": "*u8", "w_ptr0": "*u8",
                  "ids_ptr": "*i32", "map_ptr": "*i32", "res_ptr": "*bf16", "out_ptr": "*bf16"}
_FLOATS = ("limit", "alpha")
_DIVISIBLE = ("stride_x", "stride_act", "stride_y", "N", "KB", "stride_bc", "stride_sc", "stride_wc",
              "stride_biasc", "stride_res", "stride_out")
_X_POINTERS = ("x_ptr", "act_ptr", "bias_ptr", "res_ptr", "out_ptr")  # the model's dtype
AIM = 4.0  # SASS instructions per packed byte of the inner loop: the aim for a memory-bound decode


@dataclass
class Row:
    kernel: str  # "<format>:<w13|w2>"
    x: str  # the activations' dtype the kernel was compiled for
    arch: int
    loop_instructions: float  # one iteration of a K loop (the mean over the kernel's K loops)
    loops: int
    bytes_per_thread: int  # packed code bytes per thread per iteration
    instructions_per_byte: float
    registers: int
    spills: int  # STL + LDL instructions in the kernel
    widest_load_bits: int  # the widest LDG in the loop
    config: str
    meets_aim: bool = False  # instructions_per_byte <= AIM


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def kernel_spec(fmt: str, which: str, arch: int = 90, x: str = "bf16"):
    """(jit function, signature, constexprs, attrs, num_warps, num_stages, BLOCK_N, BLOCK_KB) of a decode kernel;
    `x` the activations' dtype (bf16: a bf16 model, MXFP4 and int4 then in fp16x2 from sm_89; fp32: fp32 sums)."""
    os.environ.pop("TRITON_INTERPRET", None)  # the compiled kernels, not the interpreter's
    # the decode launches as expert_compute makes them today: slot ids (no map), the residual added in w2; e4m3
    # (FP8, and MXFP4 and int4 codes through it) converted by the hardware from sm_89 (mxfp4_moe.hardware_fp8)
    consts = dict(HAS_MAP=False, HAS_RES=True, HW_CVT=arch >= 89 and fmt != "int8")
    if fmt == "mxfp4":
        from moechat.engine.quant.kernels import mxfp4_moe as mod

        consts.update(HAS_BIAS=True)
        if which == "w13":
            consts["CLAMPED"] = True
        scales = "*u8"
    else:
        from moechat.engine.quant.kernels import quant_moe as mod

        consts.update(FMT=mod.FORMAT_IDS[fmt], HAS_BIAS=False)
        if which == "w13":
            consts["CLAMPED"] = False
        # the scale blocking as compile-time constants (Qwen3-30B-A3B-FP8: 128 x 128 blocks; int4: groups of 32)
        consts.update(mod.decode_constexprs(fmt, (128, 128) if fmt == "fp8" else None, group=32))
        scales = "*fp16" if fmt == "int4" else "*fp32"  # int4: fp16 group scales (quant/intq.py)
    fn = mod._w13_decode_kernel if which == "w13" else mod._w2_decode_kernel
    cfg = (mod._decode_configs(which, x == "fp32") if fmt == "mxfp4" else mod._decode_configs(which, fmt))[0]
    consts.update(cfg.kwargs)
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr") or name.endswith("_ptr0"):
            sig[name] = _POINTER_TYPES.get(name, scales)
            if x == "fp32" and name in _X_POINTERS:
                sig[name] = "*fp32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name in _DIVISIBLE:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return fn, sig, consts, attrs, cfg.num_warps, cfg.num_stages, consts["BLOCK_N"], consts["BLOCK_KB"]


_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
# "@!P0 BRA 0x770" (sm_80-90) or "BRA.U !UP1, 0x6c0" (sm_120: the predicate an operand)
_BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+(?:!?U?P[T\d],\s*)?(?:`\()?0x([0-9a-f]+)")


def parse_sass(sass: str) -> tuple[list[int], dict]:
    """cuobjdump -sass text -> (instruction count of each K loop, {spills, widest_load_bits per loop})."""
    code = [(int(m.group(1), 16), m.group(2)) for line in sass.splitlines() if (m := _INSTR.match(line))]
    index = {addr: i for i, (addr, _) in enumerate(code)}
    spans = []  # (first, last) instruction index of each loop
    for i, (addr, text) in enumerate(code):
        b = _BRANCH.search(text)
        if b and (target := int(b.group(1), 16)) < addr and target in index:
            spans.append((index[target], i))
    # the inner loops only: w2's loop over a token's K pairs holds the K loop; a K loop multiplies and adds and takes
    # no max (the packed fp16 decode's |x| pre-pass, a max over x before the K loop; sm_80 takes |bf16| by HFMA2)
    inner = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)
             and any(re.search(r"\b(FFMA|HFMA2|HMMA)\b", t) for _, t in code[a: b + 1])
             and not any(re.search(r"\bFMNMX\b", t) for _, t in code[a: b + 1])]
    loops, widths = [], []
    for first, last in inner:
        body = code[first: last + 1]
        loops.append(len(body))
        bits = [int(w.group(1)) if (w := re.search(r"LDG\.E(?:\.\w+)*?\.(\d+)\b", t)) else 32
                for _, t in body if re.search(r"\bLDG\b", t)]
        widths.append(max(bits, default=0))
    spills = sum(1 for _, t in code if re.search(r"\b(STL|LDL)\b", t))
    return loops, {"spills": spills, "widest_load_bits": max(widths, default=0)}


def compile_one(job: tuple) -> Row | str:
    """One kernel for one arch (job: format, w13|w2, arch[, x dtype]) -> its Row, or a line saying why not."""
    fmt, which, arch, x = (*job, "bf16")[:4]
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, sig, consts, attrs, warps, stages, bn, bkb = kernel_spec(fmt, which, arch, x)
    try:
        k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                           options=dict(num_warps=warps, num_stages=stages))
    except Exception as e:  # noqa: BLE001 - an arch the bundled ptxas refuses: reported, not fatal
        return f"{fmt}:{which} sm_{arch}: not compiled ({type(e).__name__}: {str(e).splitlines()[0][:100]})"
    path = f"/tmp/moechat_sass_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(k.asm["cubin"])
    try:
        sass = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                             check=True).stdout
    finally:
        os.unlink(path)
    regs = int(m.group(1)) if (m := re.search(r"REG:(\d+)", res)) else -1
    loops, info = parse_sass(sass)
    if not loops:
        return f"{fmt}:{which} sm_{arch}: no K loop found in the SASS"
    per_thread = (2 if which == "w13" else 1) * bn * bkb // (32 * warps)  # w13: gate and up rows in one loop
    mean = sum(loops) / len(loops)
    per_byte = round(mean / per_thread, 2)
    return Row(f"{fmt}:{which}", x, arch, mean, len(loops), per_thread, per_byte, regs, info["spills"],
               info["widest_load_bits"], f"BLOCK_N={bn} BLOCK_KB={bkb} warps={warps} stages={stages}", per_byte <= AIM)


def report(kernels: list[str], archs: list[int], workers: int = 2,
           xs: tuple[str, ...] = ("bf16",)) -> tuple[list[Row], list[str]]:
    jobs = [(*k.split(":"), a, x) for k in kernels for x in xs for a in archs]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            out = list(pool.map(compile_one, jobs))
    else:
        out = [compile_one(j) for j in jobs]
    return [r for r in out if isinstance(r, Row)], [r for r in out if isinstance(r, str)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, action="append", help=f"compute capability (default: {ARCHS})")
    p.add_argument("--kernel", action="append", help="format:w13|w2 (default: all)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--x", action="append", choices=("bf16", "fp32"),
                   help="activation dtype to compile for (default: bf16; fp32 counts the fp32-sum paths)")
    a = p.parse_args(argv)
    kernels = a.kernel or [f"{f}:{w}" for f in FORMATS for w in WHICH]
    rows, skipped = report(kernels, a.arch or list(ARCHS), a.workers, tuple(a.x or ["bf16"]))
    if a.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "skipped": skipped}, indent=1))
        return 0 if rows else 1
    print(f"{'kernel':<10} {'x':>4} {'arch':>6} {'loop':>6} {'B/thr':>6} {'i/B':>6} {'aim':>4} {'regs':>5} "
          f"{'spill':>5} "
          f"{'LDG':>4}  config")
    for r in rows:
        print(f"{r.kernel:<10} {r.x:>4} sm_{r.arch:<3} {r.loop_instructions:>6.0f} {r.bytes_per_thread:>6} "
              f"{r.instructions_per_byte:>6.2f} {'yes' if r.meets_aim else 'no':>4} {r.registers:>5} {r.spills:>5} "
              f"{r.widest_load_bits:>4}  {r.config}")
    for s in skipped:
        print(s)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
