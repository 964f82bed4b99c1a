"""Native CPU kernels for one token through a packed expert projection (native.c), built at first use; and one
token's attention over a bf16 K/V cache (`attn_decode`, bf16 decode on a CPU: engine/models/base.py).

The torch paths of int4, FP8 and MXFP4 (quant/cpu.py, mxfp4.py) decode row tiles with a handful of whole-tile ops,
each pass over the tile costing more than reading the packed bytes: 0.02-0.11 of the read bandwidth on one thread
(bench/format_compute.py). native.c reads the packed bytes once and decodes in registers; a bf16 token through
int4 (groups of 32) or MXFP4 is summed in integers over x rounded to 16 bits per block (`round_x16` is that
rounding's reference). A call splits its rows over torch's thread count (native.c's thread pool: each call cut
into chunks that the caller and the awake workers claim, so a late worker never holds a call up; `pin_threads` gives
the pool its own count); the kernels write fp32 or, where no bias follows, x's bf16 (`out_dtype`). One token through
a layer's routed experts is one call, `moe_decode` (gate/up, the activation, down and the routing weight for all
of them: two pool jobs instead of 2 x top-k calls of ~10 us of ctypes each), bit for bit the per-projection path. For several tokens (prefill) `int4_decode`,
`mxfp4_decode` and `fp8_decode` write a packed matrix's fp32 values, bit for bit the format's `weight()`, for one
GEMM by torch (quant/cpu.py); fp32, not bf16, because a bf16 copy of those values is not exact and a bf16 GEMM on an
AVX2 CPU is slower than an fp32 one. MOECHAT_NATIVE_DECODE=0 turns only these off (`decode_library()`). It is compiled with the
system C compiler (`cc -O3 -march=native`, ~1 s) into $XDG_CACHE_HOME/moechat/native/, named by a hash of the
source, the flags, the compiler and the CPU's flags, written through `files.atomic_write` (fsynced, then renamed:
two processes may build at once) with a sidecar `<name>.so.sha256` (its size and SHA-256) written after it, and
loaded with ctypes; the calls release the GIL and run on the calling thread. A library is verified against its
sidecar before dlopen: a truncated one (a power loss after a rename whose bytes never reached the disk) would
otherwise be mapped past its end and kill every later run with SIGBUS; a mismatch or no sidecar is a rebuild.

Fallback: without a compiler, when the build or the load fails, on a CPU without AVX2+FMA+F16C, or with
MOECHAT_NATIVE=0, `library()` is None and each format keeps its torch path. Silent at run time; `status()` says
which path is active and why (`moechat fit --json`, the tests).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ..io.files import atomic_write

ENV = "MOECHAT_NATIVE"  # "0": the torch paths
DECODE_ENV = "MOECHAT_NATIVE_DECODE"  # "0": many tokens decode their tiles with the torch decoders (one token unchanged)
INT8_I16_ENV = "MOECHAT_INT8_I16"  # "0": a bf16 x through int8 keeps the fp32 path (the A/B of native.c's integer one)
SOURCE = Path(__file__).with_name("native.c")
# native.c and its companions (native_*.c: kernels whose Python wrappers set their own argtypes on the loaded
# library) are compiled into one library; the cache key hashes all of them, in name order.


def sources() -> list[Path]:
    return [SOURCE, *sorted(SOURCE.parent.glob("native_*.c"))]


def _source_bytes() -> bytes:
    return b"\0\0".join(p.name.encode() + b"\0" + p.read_bytes() for p in sources())
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-fno-math-errno")
ABI = 7  # native.c's MOECHAT_ABI (5: int4's scales fp16; 6: the bf16 GEMV; 7: the layer call moe_decode)

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "lib": the CDLL or None, "why": the status line


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moechat" / "native"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    cc = os.environ.get("CC") or shutil.which("cc")
    return shutil.which(cc) if cc else None


def library_path(source: bytes, flags: tuple[str, ...], cc: str, directory: Path) -> Path:
    """Where the build of `source` with `flags` by `cc` on this CPU lives: a hash of all four (and the
    compiler's size and date, so an upgraded compiler rebuilds)."""
    real = os.path.realpath(cc)
    st = os.stat(real)
    key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), real.encode(), f"{st.st_size} {st.st_mtime_ns}"
                                     .encode(), _cpu_flags().encode(), platform.machine().encode()])).hexdigest()
    return directory / f"kernels-{key[:20]}.so"


def sidecar_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _digest(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def verified(path: Path) -> bool:
    """Whether the library at `path` is whole: its size and SHA-256 are the ones its sidecar recorded after the
    build (a ~50 KB file: hashing it costs ~0.1 ms at start-up)."""
    try:
        want = json.loads(sidecar_path(path).read_text())
        data = path.read_bytes()
    except (OSError, ValueError):
        return False
    return isinstance(want, dict) and want == _digest(data)


def _compile_all(cc: str, flags: tuple[str, ...], files: list[Path], objects: list[str]) -> None:
    """Each source to its object file, all compilers running at once (the C files are independent); the first
    failure raised as subprocess.run raises it, after every compiler has ended."""
    compile_flags = [f for f in flags if f != "-shared"]
    procs = [subprocess.Popen([cc, *compile_flags, "-c", "-o", obj, str(src)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for src, obj in zip(files, objects, strict=True)]
    failed = None
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            failed = failed or subprocess.TimeoutExpired(proc.args, 120, out, err)
            continue
        if proc.returncode and failed is None:
            failed = subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
    if failed is not None:
        raise failed


def build(flags: tuple[str, ...] = FLAGS, directory: Path | None = None, cc: str | None = None) -> Path:
    """Compile native.c and its native_*.c companions (unless this source, flags, compiler and CPU already have a verified library) -> its path.
    Raises OSError / CalledProcessError / TimeoutExpired when it cannot."""
    cc = cc or _compiler()
    if cc is None:
        raise FileNotFoundError("no C compiler (cc) on PATH")
    source = _source_bytes()
    directory = directory or cache_dir()
    path = library_path(source, flags, cc, directory)
    if verified(path):
        return path
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".build", dir=directory)
    os.close(fd)
    objects = [f"{tmp}.{i}.o" for i in range(len(sources()))]
    try:
        _compile_all(cc, flags, sources(), objects)  # one cc per file, side by side: the build in ~1/cores the time
        subprocess.run([cc, *flags, "-o", tmp, *objects, "-lm"], check=True, capture_output=True, timeout=120)
        data = Path(tmp).read_bytes()
    finally:
        for leftover in (tmp, *objects):
            if os.path.exists(leftover):
                os.unlink(leftover)
    # the library whole on disk before its sidecar says so: a crash between the two leaves no sidecar (a rebuild)
    atomic_write(path, data, mode=0o755, what="kernel library")
    atomic_write(sidecar_path(path), json.dumps(_digest(data)), what="kernel library's checksum")
    return path


def load(path: Path) -> ctypes.CDLL:
    """The library at `path` with its functions typed; OSError where it is damaged or not this source's."""
    lib = ctypes.CDLL(str(path))
    try:
        abi = lib.moechat_abi()
    except AttributeError as e:
        raise OSError(f"{path} is not moechat's kernel library") from e
    if abi != ABI:
        raise OSError(f"{path} has ABI {abi}, not {ABI}")
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.moechat_int4_gemv.argtypes = [p, i32, p, p, i64, i64, i64, p]
    lib.moechat_mxfp4_gemv.argtypes = [p, i32, p, p, i64, i64, p]
    lib.moechat_fp8_gemv.argtypes = [p, i32, p, p, i64, i64, i64, i64, p]
    lib.moechat_int8_gemv.argtypes = [p, i32, p, p, i64, i64, p]
    lib.moechat_bf16_gemv.argtypes = [p, i32, p, i64, i64, p]
    lib.moechat_attn_decode.argtypes = [p, p, p, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, p]
    lib.moechat_int4_decode.argtypes = [p, p, i64, i64, i64, p]
    lib.moechat_mxfp4_decode.argtypes = [p, p, i64, i64, p]
    lib.moechat_fp8_decode.argtypes = [p, p, i64, i64, i64, i64, p]
    for f in (lib.moechat_int4_gemv, lib.moechat_mxfp4_gemv, lib.moechat_fp8_gemv, lib.moechat_int8_gemv,
              lib.moechat_bf16_gemv,
              lib.moechat_attn_decode, lib.moechat_int4_decode, lib.moechat_mxfp4_decode, lib.moechat_fp8_decode):
        f.restype = i32
    lib.moechat_moe_decode.argtypes = [i32, p, i32, p, p, i64, i64, i64, i64, i64, i64, i64, i32, i32,
                                       ctypes.c_float, ctypes.c_float, i64]
    lib.moechat_moe_decode.restype = i32
    lib.moechat_moe_prefill_q8.argtypes = [i32, p, i64, p, p, i64, p, p, p, i64, i64, i32, i32, ctypes.c_float,
                                           ctypes.c_float, i64, p, i64]
    lib.moechat_moe_prefill_q8.restype = i32
    lib.moechat_moe_prefill_q8_gguf.argtypes = [i32, i32, p, i64, p, p, i64, p, p, p, i64, i64, i64, p, i64]
    lib.moechat_moe_prefill_q8_gguf.restype = i32
    lib.moechat_quantize_int8.argtypes = [p, i32, i64, i64, p, p]
    lib.moechat_quantize_int4.argtypes = [p, i32, i64, i64, i64, p, p]
    lib.moechat_quantize_int8.restype = lib.moechat_quantize_int4.restype = i32
    lib.moechat_rms_norm.argtypes = [p, i32, i64, i64, p, i32, ctypes.c_float, p]
    lib.moechat_rms_norm.restype = i32
    lib.moechat_scatter_weighted.argtypes = [p, i32, p, p, i64, i64, p, i64]
    lib.moechat_scatter_weighted.restype = i32
    lib.moechat_set_threads.argtypes = [i32]
    lib.moechat_set_threads.restype = None
    lib.moechat_set_int8_i16.argtypes = [i32]
    lib.moechat_set_int8_i16.restype = None
    lib.moechat_set_int8_i16(0 if os.environ.get(INT8_I16_ENV, "1") == "0" else 1)
    lib.moechat_init()
    return lib


def build_and_load(flags: tuple[str, ...] = FLAGS, directory: Path | None = None,
                   cc: str | None = None) -> ctypes.CDLL:
    """build + load; a cached library that does not load (another moechat's, a damaged one its sidecar matches) is
    removed and built again."""
    path = build(flags, directory, cc)
    try:
        return load(path)
    except OSError:
        sidecar_path(path).unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        return load(build(flags, directory, cc))


def _resolve() -> tuple[ctypes.CDLL | None, str]:
    if not SOURCE.is_file():
        return None, f"torch paths: the kernel source {SOURCE.name} is not installed"
    try:
        lib = build_and_load()
    except FileNotFoundError as e:
        return None, f"torch paths: {e}"
    except subprocess.CalledProcessError as e:
        err = (e.stderr or b"").decode(errors="replace").strip().splitlines()
        return None, f"torch paths: the kernels did not compile ({err[0] if err else e})"
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"torch paths: the kernels did not build or load ({e})"
    if not lib.moechat_simd():
        return None, "torch paths: the compiler did not target AVX2+FMA+F16C on this CPU"
    return lib, f"native kernels ({', '.join(_isa_parts(lib))}), {lib._name}"


_I16_ISA = {2: "4-bit GEMV in AVX-512", 3: "4-bit GEMV in AVX-512 VNNI"}  # moechat_i16_isa(); 1 is the AVX2 loop


def _isa_parts(lib) -> list[str]:
    """What the build uses beyond the AVX2 base, as status() says it (each query absent from an older library)."""
    parts = ["AVX2+FMA+F16C"]
    i16 = getattr(lib, "moechat_i16_isa", None)
    if i16 is not None and (name := _I16_ISA.get(i16())):
        parts.append(name)
    bf16 = getattr(lib, "moechat_prefill_bf16_isa", None)
    if bf16 is not None and (isa := bf16()):
        parts.append("bf16 prefill in AVX-512 BF16" if isa == 1 else "bf16 prefill in fp32 FMA tiles")
    return parts


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None: the torch paths (MOECHAT_NATIVE=0, no compiler, a failed build, another CPU).
    Built on the first call of a process (cached on disk after the first ever)."""
    if os.environ.get(ENV, "1") == "0":
        return None
    if "lib" not in _STATE:
        with _LOCK:
            if "lib" not in _STATE:
                _STATE["lib"], _STATE["why"] = _resolve()
    return _STATE["lib"]  # type: ignore[return-value]


def decode_library() -> ctypes.CDLL | None:
    """The kernels for many-token tile decoding (quant/cpu.py, mxfp4.py), or None: the torch decoders, where
    `library()` is None or MOECHAT_NATIVE_DECODE=0 (the bench's old path; one token keeps its GEMV)."""
    return None if os.environ.get(DECODE_ENV, "1") == "0" else library()


def status() -> str:
    """Which CPU path one-token expert compute takes, and why."""
    if os.environ.get(ENV, "1") == "0":
        return f"torch paths: {ENV}=0"
    library()
    return str(_STATE["why"])


def reset() -> None:
    """Forget the loaded library (tests): the next `library()` resolves again."""
    with _LOCK:
        _STATE.clear()


# -- calls: x [1, in] (fp32 or bf16; other dtypes are cast), packed tensors contiguous -> y [1, out] in `dtype`
# (fp32, or bf16: the kernel rounds each output once, as .to(torch.bfloat16) would) ---------------------------------
def _x(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    return x.contiguous(), int(x.dtype == torch.bfloat16)


def out_dtype(x: torch.Tensor, bias: torch.Tensor | None) -> torch.dtype:
    """What a kernel should write for x: x's own bf16 where no bias follows (the kernel rounds once), else fp32."""
    return torch.bfloat16 if bias is None and x.dtype == torch.bfloat16 else torch.float32


def set_threads(lib, n: int) -> None:
    """Let one call use up to n threads (native.c's pool: the caller and n - 1 workers). Rows are split, never a
    sum, so every count writes the same bits; `hardware.set_threads` sets it with torch's at load."""
    lib.moechat_set_threads(n)
    lib.moechat_threads = n


def pin_threads(lib, n: int | None) -> None:
    """Fix the pool's thread count at n whatever torch's count is (None: follow torch's again)."""
    lib.moechat_pinned = n
    if n is not None:
        set_threads(lib, n)


def _threads(lib) -> None:
    """The GEMVs split their rows over torch's intra-op thread count (native.c's pool), told when it changes (a
    later torch.set_num_threads: the tests, the benches), unless `pin_threads` fixed it."""
    n = getattr(lib, "moechat_pinned", None) or torch.get_num_threads()
    if getattr(lib, "moechat_threads", None) != n:
        set_threads(lib, n)


def _flags(x_bf16: int, y: torch.Tensor) -> int:
    if y.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"native kernels write fp32 or bf16, not {y.dtype}")
    return x_bf16 | (2 if y.dtype == torch.bfloat16 else 0)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"native {what} kernel failed ({rc})")


def _run(lib, fn, what: str, x: torch.Tensor, out: torch.Tensor, *args) -> torch.Tensor:
    """One GEMV call: fn(x, flags, *args, out) with x made fp32/bf16 and contiguous, the thread count told."""
    x, bf = _x(x)
    _threads(lib)
    _check(fn(x.data_ptr(), _flags(bf, out), *args, out.data_ptr()), what)
    return out


def _int4_scale(scale: torch.Tensor) -> torch.Tensor:
    """int4's group scales as native.c reads them: fp16 (the layout's dtype; quant/intq.py), contiguous."""
    if scale.dtype != torch.float16 or not scale.is_contiguous():
        raise ValueError(f"native int4 kernels read contiguous fp16 scales, not {scale.dtype}")
    return scale


def int4_gemv(lib, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [R, in/2] u8 and scale [R, in/group] fp16 (contiguous) -> [1, R]."""
    rows, cols = q.shape[0], q.shape[1] * 2
    scale = _int4_scale(scale)
    return _run(lib, lib.moechat_int4_gemv, "int4", x, torch.empty(1, rows, dtype=dtype), q.data_ptr(),
                scale.data_ptr(), rows, cols, cols // scale.shape[1])


def mxfp4_gemv(lib, x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    rows, cols = blocks.shape[0], blocks.shape[1] * 32
    return _run(lib, lib.moechat_mxfp4_gemv, "mxfp4", x, torch.empty(1, rows, dtype=dtype), blocks.data_ptr(),
                scales.data_ptr(), rows, cols)


def fp8_gemv(lib, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
             out: torch.Tensor) -> torch.Tensor:
    """One block-scaled e4m3 matrix w [R, in] (scale [ceil(R/b0), ceil(in/b1)]) into out [R] (a contiguous fp32 or
    bf16 view); w13's halves are two calls."""
    return _run(lib, lib.moechat_fp8_gemv, "fp8", x, out, w.data_ptr(), scale.data_ptr(), w.shape[0], w.shape[1],
                block[0], block[1])


def bf16_gemv(lib, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [1, in] @ w^T for a bf16 w [out, in] (contiguous) -> [1, out] in `dtype` (fp32 sums; bf16 rounded once)."""
    if w.dtype != torch.bfloat16 or not w.is_contiguous():
        raise ValueError("the bf16 GEMV takes a contiguous bf16 [out, in] matrix")
    rows, cols = w.shape
    return _run(lib, lib.moechat_bf16_gemv, "bf16", x, torch.empty(1, rows, dtype=dtype), w.data_ptr(), rows, cols)


def int8_gemv(lib, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    rows, cols = q.shape
    return _run(lib, lib.moechat_int8_gemv, "int8", x, torch.empty(1, rows, dtype=dtype), q.data_ptr(),
                scale.data_ptr(), rows, cols)


# -- many tokens: a packed matrix decoded into out [rows, cols] fp32 (contiguous), bit for bit the format's weight()
# (native.c's decoders; rows split over torch's thread count, the same bits at any count) -------------------------
def _decoded(lib, fn, what: str, out: torch.Tensor, shape: tuple[int, int], *args) -> torch.Tensor:
    if out.dtype != torch.float32 or tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"native {what} decoder writes a contiguous fp32 {list(shape)}, not {out.dtype} "
                         f"{list(out.shape)}")
    _threads(lib)
    _check(fn(*args, out.data_ptr()), f"{what} decode")
    return out


def int4_decode(lib, q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """q [R, in/2] u8 and scale [R, in/group] fp16 (contiguous) -> out [R, in] fp32."""
    rows, cols = q.shape[0], q.shape[1] * 2
    scale = _int4_scale(scale)
    return _decoded(lib, lib.moechat_int4_decode, "int4", out, (rows, cols), q.data_ptr(), scale.data_ptr(), rows,
                    cols, cols // scale.shape[1])


def mxfp4_decode(lib, blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """blocks [R, in/32, 16] u8 and scales [R, in/32] u8 (contiguous) -> out [R, in] fp32."""
    rows, cols = blocks.shape[0], blocks.shape[1] * 32
    return _decoded(lib, lib.moechat_mxfp4_decode, "mxfp4", out, (rows, cols), blocks.data_ptr(), scales.data_ptr(),
                    rows, cols)


def fp8_decode(lib, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], out: torch.Tensor) -> torch.Tensor:
    """One block-scaled e4m3 matrix w [R, in] (scale [ceil(R/b0), ceil(in/b1)] fp32, contiguous) -> out [R, in] fp32
    (a contiguous view); w13's halves are two calls."""
    rows, cols = w.shape
    return _decoded(lib, lib.moechat_fp8_decode, "fp8", out, (rows, cols), w.data_ptr(), scale.data_ptr(), rows, cols,
                    block[0], block[1])


def round_x16(x: torch.Tensor) -> torch.Tensor:
    """The x that int4_gemv (groups of 32), mxfp4_gemv and int8_gemv (inputs a multiple of 32) sum over for a bf16 x on
    the SIMD build (native.c's integer paths), as a slow reference in fp64: per 32-element block with max |x| = m 2^e (m
    in [0.5, 1)), round(x 2^(15-e)) to nearest even, times 2^(e-15); NaN for a block with a non-finite element. Within
    2^-16 of the block's largest |x|; every element within 2^7 of it is exact."""
    b = x.double().reshape(*x.shape[:-1], -1, 32)  # [..., G, 32]
    mx = b.abs().amax(dim=-1, keepdim=True)  # [..., G, 1]
    _, e = torch.frexp(mx.float())
    step = torch.ldexp(torch.ones_like(mx), e.double() - 15).where(mx.isfinite(), torch.nan)
    return (torch.round(b / step) * step).reshape(x.shape)


def attn_decode(lib, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, end: int,
                scale: float) -> torch.Tensor:
    """One query token's attention: q [nKV, G, D] bf16, k / v [nKV, S_max, D] bf16 caches (rows contiguous, any
    head stride), keys first..end-1 -> softmax(scale q K^T) V per query head, fp32 [nKV, G, D] (native.c)."""
    nkv, G, D = q.shape
    q = q.contiguous()
    out = torch.empty(nkv, G, D)
    _check(lib.moechat_attn_decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), nkv, G, D,
                                   first, end, scale, out.data_ptr()), "attention")
    return out


# -- RMSNorm of a decode step's rows (native_norm.c) --------------------------------------------------------------
NORM_NONE, NORM_AFTER, NORM_FP32_W = 0, 1, 2  # no weight; weight on the rounded y (transformers); fp32 weight before


def rms_norm(lib, x: torch.Tensor, weight: torch.Tensor | None, eps: float, kind: int) -> torch.Tensor:
    """x [..., n] (bf16 or fp32, contiguous) -> its RMSNorm in x's dtype (native_norm.c, transformers' order;
    `kind` NORM_*, the weight [n] bf16 with a bf16 x under NORM_AFTER, else fp32)."""
    n = x.shape[-1]
    y = torch.empty_like(x)
    rc = lib.moechat_rms_norm(x.data_ptr(), x.dtype == torch.bfloat16, x.numel() // n, n,
                              weight.data_ptr() if weight is not None else None, kind, eps, y.data_ptr())
    if rc:
        _check(rc, "rms_norm")
    return y


def scatter_weighted(lib, contrib: torch.Tensor, idx: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> None:
    """contrib[idx] = y * w[:, None] in fp32 (native_scatter.c, rows over the pool): y [P, H] bf16 or fp32, idx [P]
    int64, w [P], contrib [rows, H] fp32, all contiguous CPU tensors."""
    _threads(lib)
    yc, ic, wc = y.contiguous(), idx.to(torch.int64).contiguous(), w.float().contiguous()
    _check(lib.moechat_scatter_weighted(yc.data_ptr(), yc.dtype == torch.bfloat16, ic.data_ptr(), wc.data_ptr(),
                                        yc.shape[0], yc.shape[1], contrib.data_ptr(), contrib.shape[0]),
           "expert outputs' scatter")


# -- one token through a layer's experts (decode): one call for all its routed experts ------------------------------
MOE_KINDS = {"int4": 0, "mxfp4": 1, "fp8": 2, "int8": 3}  # native.c's Job kinds of the GEMVs
BIAS_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ACT_KINDS = {"swiglu": 0, "clamped_swiglu": 1}


@functools.cache
def vector_step(dtype: torch.dtype) -> int:
    """Elements a torch CPU elementwise op takes per vectorised step here (2 x its vector width: cpu_kernel_vec); the
    rest of a contiguous tensor goes through the op's scalar form. 0 where torch has no vectorised exp (DEFAULT
    capability: every element through libm's expf). native.c's activations follow the same split."""
    width = {"AVX512": 64, "AVX2": 32}.get(torch.backends.cpu.get_cpu_capability(), 0)  # bytes a vector
    return 2 * width // dtype.itemsize


def moe_decode(lib, kind: int, x: torch.Tensor, ptrs, weights, n: int, hidden: int, inter: int, group13: int,
               group2: int, block: tuple[int, int], bias_kind: int, act: int, limit: float, alpha: float) -> None:
    """n experts on one token x [1, H] (fp32 or bf16, contiguous) into their output rows: ptrs a ctypes int64 array
    [n, 7] (each expert's w13, w13 scale, w2, w2 scale, w13 bias or 0, w2 bias or 0, and its fp32 [H] output row),
    weights a ctypes float array [n] (native.c's moechat_moe_decode; engine/layers/experts.py builds both)."""
    _threads(lib)
    _check(lib.moechat_moe_decode(kind, x.data_ptr(), int(x.dtype == torch.bfloat16), ptrs, weights, n, hidden,
                                  inter, group13, group2, block[0], block[1], bias_kind, act, limit, alpha,
                                  vector_step(x.dtype)), "expert layer")


def moe_prefill(lib, kind: int, x: torch.Tensor, ptrs: torch.Tensor, start: torch.Tensor, tok: torch.Tensor,
                dst: torch.Tensor, wt: torch.Tensor, inter: int, bias_kind: int, act: int, limit: float, alpha: float,
                out: torch.Tensor) -> None:
    """A prefill chunk's pairs through a layer's experts in one call (native_prefill_int.c moechat_moe_prefill_q8):
    x [T, H] bf16; ptrs int64 [n, 6] (each expert's w13, w13 scale, w2, w2 scale, w13 bias or 0, w2 bias or 0);
    expert k takes the pairs start[k]..start[k+1]-1 (int64 [n + 1]); pair p is token tok[p] with weight wt[p] (fp32),
    written to row dst[p] of out (fp32 [rows, H]); all contiguous CPU tensors (engine/layers/experts.py builds them)."""
    _threads(lib)
    _check(lib.moechat_moe_prefill_q8(kind, x.data_ptr(), x.shape[0], ptrs.data_ptr(), start.data_ptr(),
                                      ptrs.shape[0], tok.data_ptr(), dst.data_ptr(), wt.data_ptr(), x.shape[1], inter,
                                      bias_kind, act, limit, alpha, vector_step(x.dtype), out.data_ptr(),
                                      out.shape[0]), "expert layer prefill")


def moe_prefill_gguf(lib, type13: int, type2: int, x: torch.Tensor, ptrs: torch.Tensor, start: torch.Tensor,
                     tok: torch.Tensor, dst: torch.Tensor, wt: torch.Tensor, inter: int, out: torch.Tensor) -> None:
    """`moe_prefill` for GGUF experts as the file stores them (moechat_moe_prefill_q8_gguf): gate's and up's rows of
    ggml type `type13`, down's of `type2` (Q8_0, Q4_0, MXFP4, Q4_K, Q5_K or Q6_K ids); ptrs int64 [n, 6]: each expert's
    gate, up and down rows, then zeros; SwiGLU, no biases."""
    _threads(lib)
    _check(lib.moechat_moe_prefill_q8_gguf(type13, type2, x.data_ptr(), x.shape[0], ptrs.data_ptr(),
                                           start.data_ptr(), ptrs.shape[0], tok.data_ptr(), dst.data_ptr(),
                                           wt.data_ptr(), x.shape[1], inter, vector_step(x.dtype), out.data_ptr(),
                                           out.shape[0]), "GGUF expert layer prefill")


# -- the recurrent layers' one-token steps (native_recurrent.c; engine/models/gated_deltanet.py, mamba2.py): fp32 or
# bf16 inputs (a flag bit each, in argument order), contiguous; the fp32 state updated in place -----------------------
def _recurrent(lib):
    if lib.moechat_delta_rule_step.argtypes is None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.moechat_delta_rule_step.argtypes = [p, p, p, p, p, i32, i64, i64, i64, i64, p, p]
        lib.moechat_ssd_step.argtypes = [p, p, p, p, p, p, i32, i64, i64, i64, i64, p, p]
        lib.moechat_conv_step.argtypes = [p, p, p, p, p, i32, i64, i64]
        for f in (lib.moechat_delta_rule_step, lib.moechat_ssd_step, lib.moechat_conv_step):
            f.restype = i32
    _threads(lib)


def _bits(*ts: torch.Tensor | None) -> int:
    bits = 0
    for i, t in enumerate(ts):
        if t is not None and t.dtype == torch.bfloat16:
            bits |= 1 << i
    return bits


def delta_rule_step(lib, q, k, v, g, beta, state: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """q, k [(1,) HK, Dk], v [(1,) HV, Dv], g, beta [(1,) HV] -> out [(1,) HV, Dv] fp32; state [HV, Dk, Dv] fp32."""
    _recurrent(lib)
    HV, Dk, Dv = state.shape
    _check(lib.moechat_delta_rule_step(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                       _bits(q, k, v, g, beta), q.shape[-2], HV, Dk, Dv, state.data_ptr(),
                                       out.data_ptr()), "delta rule")
    return out


def ssd_step(lib, x, dt, A, B, C, D, state: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x [(1,) H, P], dt [(1,) H], A, D [H], B, C [(1,) G, N] -> out [(1,) H, P] fp32; state [H, P, N] fp32."""
    _recurrent(lib)
    H, P, N = state.shape
    _check(lib.moechat_ssd_step(x.data_ptr(), dt.data_ptr(), A.data_ptr(), B.data_ptr(), C.data_ptr(), D.data_ptr(),
                                _bits(x, dt, A, B, C, D), H, B.shape[-2], P, N, state.data_ptr(), out.data_ptr()),
           "ssd")
    return out


def conv_step(lib, x, w, bias, state: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x [(1,) C], w [C, W], bias [C] or None, state [C, W-1] (shifted in place) -> out [(1,) C] = silu(conv)."""
    _recurrent(lib)
    _check(lib.moechat_conv_step(x.data_ptr(), w.data_ptr(), None if bias is None else bias.data_ptr(),
                                 state.data_ptr(), out.data_ptr(), _bits(x, w, bias, state, out), w.shape[0],
                                 w.shape[1]), "conv")
    return out


# -- NaN/Inf checks of weights as they are read (native_check.c; engine/cache/store.py, engine/load/loader.py) ------
CHECK_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3, torch.float8_e4m3fn: 4,
               torch.float8_e5m2: 5}  # native_check.c's kinds; any other dtype (packed codes) is not checked


def _check_lib(lib):
    if lib.moechat_read_checked.argtypes is None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.moechat_first_nonfinite.argtypes = [p, i64, ctypes.c_int]
        lib.moechat_read_checked.argtypes = [ctypes.c_int, p, i64, i64, ctypes.c_int, ctypes.POINTER(i64)]
        lib.moechat_first_nonfinite.restype = lib.moechat_read_checked.restype = i64
    return lib


def first_nonfinite(lib, t: torch.Tensor) -> int:
    """The flat index of t's first NaN/Inf (t contiguous, on the CPU, a dtype of CHECK_KINDS), -1 when none."""
    return _check_lib(lib).moechat_first_nonfinite(t.data_ptr(), t.numel() * t.element_size(), CHECK_KINDS[t.dtype])


def read_checked(lib, fd: int, out: torch.Tensor, offset: int, check: bool) -> tuple[int, int]:
    """Fill the contiguous CPU tensor `out` from byte `offset` of fd, each chunk checked for NaN/Inf as it lands
    (when `check` and out's dtype is a float): (bytes read, less at the file's end, or -errno; first bad element
    or -1)."""
    bad = ctypes.c_int64(-1)
    kind = CHECK_KINDS.get(out.dtype, -1) if check else -1
    n = _check_lib(lib).moechat_read_checked(fd, out.data_ptr(), out.numel() * out.element_size(), offset, kind,
                                             ctypes.byref(bad))
    return n, bad.value
