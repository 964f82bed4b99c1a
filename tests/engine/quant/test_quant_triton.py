"""The fused FP8 / int8 / int4 MoE kernel (kernels/quant_moe.py) against moe_reference on each format's `weight()`.

On the CPU the Triton interpreter runs it (small shapes, one config), in a subprocess (this file as a script)
so TRITON_INTERPRET never reaches the rest of the suite. The `gpu` tests run the compiled kernel at
Qwen3-30B-A3B's widths, and check that `expert_compute` takes it for CUDA batches of each format.

Shapes leave partial FP8 blocks (block 16 x 32 over I = 40 and H = 96) and an int4 group of 8 along I = 40;
experts sit in shuffled slots of a pool larger than E whose other slots hold junk, so a wrong slot shows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from moechat.engine.layers.moe import ExpertActivation, ExpertBatch, moe_reference
from moechat.engine.quant import get_format
from moechat.engine.quant.fp8 import fp8_format, quantize_blocks
from moechat.engine.quant.kernels import has_triton

try:
    from tests.engine.quant import interpreter
except ImportError:  # run as a script (the interpreter's cases): this folder is on sys.path
    import interpreter

# T = tokens, K = top-k, E = experts, C = slots, H = hidden, I = intermediate


@dataclass(frozen=True)
class Case:
    fmt: str
    kind: str = "swiglu"
    T: int = 1
    mode: str | None = None  # "gemv" / "grouped" / None: the kernel's own choice
    pairs: str = "all"  # "all", "some" (left-out pairs point at real slots), "some-absent" (left-out: slot -1)
    residual: bool = False
    dtype: torch.dtype = torch.float32
    bias: bool = False
    H: int = 96
    I: int = 40
    E: int = 4
    K: int = 2
    block: tuple[int, int] = (16, 32)  # fp8 only
    lookup: bool = False  # the kernels get the routed expert ids and the layer's slot map, not slot ids
    x_gain: int = 0  # x scaled by 2^x_gain: past fp16's range, the packed decode's guard scales it on the device
    hw_e4m3: bool = False  # the kernels told the device converts e4m3 (sm_89+): its twin runs in the interpreter
    x_flat: bool = False  # x = 2^x_gain (1.2 + 0.01 randn): every lane's x near max|x|

    @property
    def name(self) -> str:
        return (f"{self.fmt}-{self.kind}-T{self.T}-{self.mode or 'auto'}-{self.pairs}{'-res' if self.residual else ''}"
                f"{'-bias' if self.bias else ''}-{str(self.dtype).removeprefix('torch.')}-H{self.H}-I{self.I}"
                f"{f'-K{self.K}' if self.K != 2 else ''}"
                f"{f'-b{self.block[0]}x{self.block[1]}' if self.fmt == 'fp8' else ''}{'-map' if self.lookup else ''}"
                f"{f'-x2^{self.x_gain}' if self.x_gain else ''}{'-flat' if self.x_flat else ''}"
                f"{'-e4m3' if self.hw_e4m3 else ''}")


def format_of(case: Case):
    return fp8_format(case.block) if case.fmt == "fp8" else get_format(case.fmt)


def pack(case: Case, w13: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
    """One expert's dense w13 [2I, H] / w2 [H, I] in the case's format (FP8: gate and up blocked apart)."""
    if case.fmt == "fp8":
        gate, gs = quantize_blocks(w13[: case.I], case.block)
        up, us = quantize_blocks(w13[case.I :], case.block)
        down, ds = quantize_blocks(w2, case.block)
        return {"w13": torch.cat([gate, up]), "w13_scale": torch.cat([gs, us]), "w2": down, "w2_scale": ds}
    fmt = get_format(case.fmt)
    return {f"{which}_{part}": t for which, w in (("w13", w13), ("w2", w2)) for part, t in fmt.quantize(w).items()}


def junk_like(t: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    if t.dtype.is_floating_point and t.dtype.itemsize > 1:  # scales (int4's fp16 too), biases
        return torch.randn((n, *t.shape), generator=g).to(t.dtype)
    return torch.randint(0, 256, (n, *t.shape), generator=g, dtype=torch.uint8).view(t.dtype)


def make_problem(case: Case, device: str = "cpu", seed: int = 0):
    """Slot buffers, routing and the reference output (on `device`) of one case."""
    g = torch.Generator().manual_seed(seed)
    H, I, E, K, T = case.H, case.I, case.E, case.K, case.T
    C = E + 2
    fmt = format_of(case)
    # rows of different magnitudes, O(1) activations
    experts = [pack(case, torch.randn(2 * I, H, generator=g) * torch.rand(2 * I, 1, generator=g) * 1.6 / H**0.5,
                    torch.randn(H, I, generator=g) * torch.rand(H, 1, generator=g) * 1.2 / I**0.5) for _ in range(E)]
    perm = torch.randperm(C, generator=g)
    slot_of, free = perm[:E], perm[E:]  # expert e lives in slot slot_of[e]; the free slots hold junk
    tensors = {}
    for name in experts[0]:
        t = experts[0][name]
        tensors[name] = torch.empty((C, *t.shape), dtype=t.dtype)  # [C, ...]
        tensors[name][slot_of] = torch.stack([ex[name] for ex in experts])
        tensors[name][free] = junk_like(t, len(free), g)
    if case.bias:
        tensors["w13_bias"] = (torch.randn(C, 2 * I, generator=g) * 0.2).to(case.dtype)
        tensors["w2_bias"] = (torch.randn(C, H, generator=g) * 0.2).to(case.dtype)
    x = torch.randn(T, H, generator=g)
    x = ((1.2 + 0.01 * x if case.x_flat else x) * 2.0**case.x_gain).to(case.dtype)
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # [T, K]
    topk_weights = torch.softmax(torch.randn(T, K, generator=g), dim=-1)  # [T, K] fp32
    slot_ids = slot_of[topk_ids]  # [T, K]
    residual = torch.randn(T, H, generator=g).to(case.dtype) if case.residual else None
    pairs = None
    used = torch.ones(T * K, dtype=torch.bool)
    if case.pairs != "all":
        used = torch.rand(T * K, generator=g) < 0.6
        used[0] = True
        used[-1] = False
        pairs = used.nonzero().flatten()  # [P]
        if case.pairs == "some-absent":
            slot_ids = slot_ids.clone()
            slot_ids.view(-1)[~used] = -1
    slot_map = None
    if case.lookup:  # expert ids (-1 where the slot id is) and the map the kernels read them through
        slot_map = torch.full((E + 1,), -1, dtype=torch.int32)  # [E + 1]: expert E has no slot
        slot_map[:E] = slot_of.to(torch.int32)
        slot_ids = torch.where(slot_ids >= 0, topk_ids, -1).to(torch.int32)  # [T, K]
    # the reference: each expert's slow dequantized weights, in fp32 from the same (rounded) inputs
    w13 = torch.stack([fmt.weight(ex, "w13", torch.float32) for ex in experts])  # [E, 2I, H]
    w2 = torch.stack([fmt.weight(ex, "w2", torch.float32) for ex in experts])  # [E, H, I]
    bias = {}
    if case.bias:
        bias = {"w13_bias": tensors["w13_bias"][slot_of].float(), "w2_bias": tensors["w2_bias"][slot_of].float()}
    want = moe_reference(x.float(), topk_weights * used.view(T, K), topk_ids, w13, w2, act=ExpertActivation(case.kind),
                         **bias)
    if residual is not None:
        want = want + residual.float()
    to = lambda t: None if t is None else t.to(device)
    return ({k: to(v) for k, v in tensors.items()}, to(x), to(topk_weights), to(slot_ids), to(residual), to(pairs),
            want, to(slot_map))


def run_case(case: Case, device: str = "cpu", seed: int = 0, moved: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's output and the reference; `moved` > 0 first moves the experts to other slots (a permutation
    drawn from it), which must not change a bit of the output."""
    from moechat.engine.quant.kernels.quant_moe import quant_moe

    tensors, x, tw, slot_ids, residual, pairs, want, slot_map = make_problem(case, device, seed)
    if moved:
        C = next(iter(tensors.values())).shape[0]
        perm = torch.randperm(C, generator=torch.Generator().manual_seed(moved)).to(slot_ids.device)  # s -> perm[s]
        raw = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t  # fp8 has no index_copy_
        tensors = {k: torch.empty_like(raw(v)).index_copy_(0, perm, raw(v)).view(v.dtype) for k, v in tensors.items()}
        if slot_map is not None:
            slot_map = torch.where(slot_map >= 0, perm[slot_map.long().clamp(min=0)].to(torch.int32), -1)
        else:
            slot_ids = torch.where(slot_ids >= 0, perm[slot_ids.long().clamp(min=0)], -1)
    from moechat.engine.quant.kernels import quant_moe as qm

    hardware_fp8 = qm.hardware_fp8
    if case.hw_e4m3:  # the interpreter runs the e4m3 conversion's twin: the sm_89+ int4 decode, on the CPU
        qm.hardware_fp8 = lambda device: True
    try:
        got = quant_moe(x, tw, slot_ids, tensors, ExpertActivation(case.kind), case.fmt,
                        block=case.block if case.fmt == "fp8" else None, residual=residual, pairs=pairs,
                        mode=case.mode, slot_map=slot_map)
    finally:
        qm.hardware_fp8 = hardware_fp8
    assert got.dtype == case.dtype and got.shape == want.shape
    return got.float().cpu(), want


TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 2e-2)}  # atol, rtol


def excess(case: Case, got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest error as a fraction of what the tolerance allows there (<= 1 passes); a case with a huge x has
    outputs ~2^40 (swiglu is quadratic), so its absolute tolerance is relative to the largest output."""
    atol, rtol = TOLERANCE[case.dtype]
    if case.x_gain:
        atol *= float(want.abs().max())
    return float(((got - want).abs() / (atol + rtol * want.abs())).max())


INTERPRETED = [Case(fmt, kind, T, mode, pairs, residual, bias=bias)
               for fmt in ("fp8", "int8", "int4")
               for kind, T, mode, pairs, residual, bias in [
                   ("swiglu", 1, None, "all", False, False), ("swiglu", 5, "gemv", "all", True, False),
                   ("swiglu", 5, "grouped", "all", False, False), ("swiglu", 5, "grouped", "some", True, False),
                   ("swiglu", 1, None, "some-absent", False, False), ("clamped_swiglu", 5, "gemv", "some", False, True),
                   ("clamped_swiglu", 5, "grouped", "some-absent", True, True)]]
INTERPRETED += [Case(fmt, "swiglu", 4, mode, "all", True, torch.bfloat16)
                for fmt in ("fp8", "int8", "int4") for mode in ("gemv", "grouped")]
INTERPRETED += [Case("fp8", "swiglu", 3, "grouped", block=(32, 16)), Case("int4", "swiglu", 3, "gemv", H=64, I=48)]
# the decode GEMV at odd widths with the scale blocking a compile-time constant: FP8 blocks of 16 columns against
# a 32-byte tile (H = 80, I = 56: a partial last block and tile), bias and clamped activation
INTERPRETED += [Case("fp8", "clamped_swiglu", 3, "gemv", "some", True, bias=True, H=80, I=56, block=(32, 16)),
                Case("int8", "swiglu", 2, "gemv", "all", False, torch.bfloat16, H=80, I=56)]
# the slot lookup inside the kernels (decode) and before the grouping (prefill); T = 8 is still a decode at 32 pairs;
# FP8 blocks of 8 columns and int4 groups of 16 (scales a word, not a 16-byte chunk)
INTERPRETED += [Case("fp8", "swiglu", 3, "gemv", "some-absent", True, torch.bfloat16, lookup=True),
                Case("int4", "clamped_swiglu", 5, "grouped", "some", False, lookup=True),
                Case("int8", "swiglu", 8, None, "all", True, torch.bfloat16, E=6, K=4),
                Case("fp8", "swiglu", 1, None, "all", True, H=64, I=48, block=(16, 8)),
                Case("int4", "swiglu", 2, "gemv", "all", True, H=48, I=80)]
# int4 in fp16x2 (a bf16 x, groups of 32 on both sides: the packed decode in w13 and w2, code x 2^-24 as fp16
# subnormals on every target), a partial last tile, with and without the e4m3 hardware flag; an x of 2^20 (fp16
# would overflow), swiglu so w2's activations are huge too
INTERPRETED += [Case("int4", "clamped_swiglu", 3, "gemv", "some", True, torch.bfloat16, bias=True, H=64, I=96),
                Case("int4", "clamped_swiglu", 3, "gemv", "some", True, torch.bfloat16, bias=True, H=64, I=96,
                     hw_e4m3=True),
                Case("int4", "swiglu", 2, "gemv", "all", True, torch.bfloat16, H=64, I=64, x_gain=20),
                Case("int4", "swiglu", 2, "gemv", "all", True, torch.bfloat16, H=64, I=64, x_gain=20, hw_e4m3=True),
                # a tiny x (2^-20, no residual to hide it): the guard scales it up into [2^13, 2^14) first, so the
                # lanes stay off fp16's subnormals; a flat x near 2^14 (each lane's x sum past fp16's range before
                # the start's -2^-21 applies)
                Case("int4", "swiglu", 2, "gemv", "all", False, torch.bfloat16, H=64, I=64, x_gain=-20),
                Case("int4", "swiglu", 2, "gemv", "all", False, torch.bfloat16, H=64, I=64, x_gain=14, x_flat=True)]
# the same bits whatever slots hold the experts (the k-sum in the kernel, in k order, no atomics)
MOVED = [Case("int8", "swiglu", 3, "gemv", "all", True, torch.bfloat16, K=3),
         Case("int4", "clamped_swiglu", 2, "gemv", "some-absent", True, bias=True, lookup=True)]


def _interpreted_main() -> None:
    """Run as a script under TRITON_INTERPRET=1: one line per case, its name and its error's `excess`."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for case in interpreter.shard(INTERPRETED):
        got, want = run_case(case)
        print(case.name, excess(case, got, want), flush=True)
    for case in interpreter.shard(MOVED):
        got, _ = run_case(case)
        moved, _ = run_case(case, moved=1)
        print(f"moved-{case.name}", float(not torch.equal(got, moved)), flush=True)


if __name__ == "__main__":
    _interpreted_main()


@pytest.fixture(scope="module")
def interpreted() -> dict[str, float]:
    pytest.importorskip("triton")
    errors = {}
    for line in interpreter.run(__file__, timeout=900):
        name, err = line.split()
        errors[name] = float(err)
    return errors


@pytest.mark.parametrize("case", INTERPRETED, ids=lambda c: c.name)
def test_interpreted_kernel_matches_the_reference(interpreted, case):
    assert interpreted[case.name] <= 1.0


@pytest.mark.parametrize("case", MOVED, ids=lambda c: c.name)
def test_moving_experts_between_slots_changes_no_bit(interpreted, case):
    assert interpreted[f"moved-{case.name}"] == 0.0


def test_case_names_are_unique():
    assert len({c.name for c in INTERPRETED}) == len(INTERPRETED)


@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
def test_formats_offer_the_fused_kernel_where_triton_is_installed(name):
    fmt = fp8_format((128, 128)) if name == "fp8" else get_format(name)
    assert (fmt.fused_moe is not None) == has_triton()


def test_int4_code_bytes_are_e4m3_of_the_code_times_2_pow_minus_9():
    """The sm_89+ int4 decode feeds bytes 0..15 (a nibble each) to the hardware's e4m3 conversion: byte n is n x 2^-9
    exactly (subnormal below 8, exponent 1 from 8), so sum(n x) / 2^9 - 8 sum(x) is the int4 dot product."""
    n = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(n.view(torch.float8_e4m3fn).float() * 512, n.float())


def test_fp8_blocks_the_decode_cannot_read_take_the_per_expert_path():
    from moechat.engine.quant.kernels import quant_fused_moe

    pytest.importorskip("triton")
    assert quant_fused_moe("fp8", (16, 6)) is None  # 6 columns a block: a 4-byte word would straddle two
    assert quant_fused_moe("fp8", (16, 8)) is not None


QWEN3_30B = dict(H=2048, I=768, E=16, K=8, block=(128, 128))
# bf16 (the models' dtype) at each grouping the kernel picks (GEMV, BLOCK_M 16 / 32 / 64) + int8 in fp32: few shapes,
# so gpu_check compiles ~60 kernel variants, not hundreds
GPU_CASES = [Case(fmt, "swiglu", T, None, pairs, residual, torch.bfloat16, **QWEN3_30B)
             for fmt in ("fp8", "int8", "int4")
             for T, pairs, residual in [(1, "all", True), (4, "some", True), (64, "some-absent", False),
                                        (300, "all", True)]]
GPU_CASES += [Case("int8", "swiglu", 1, None, "all", False, torch.float32, **QWEN3_30B)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_cuda_kernel_matches_the_reference_at_qwen3_30b_widths(case):
    got, want = run_case(case, device="cuda")
    atol, rtol = TOLERANCE[case.dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("T", [1, 40])
def test_expert_compute_runs_the_fused_kernel_on_cuda(fmt, T, monkeypatch):
    """expert_compute on a CUDA batch of each format goes through quant_moe and equals the per-expert path."""
    from moechat.engine.layers import experts
    from moechat.engine.quant.kernels import quant_moe as kernel

    case = Case(fmt, "swiglu", T, None, "all", True, torch.bfloat16, **QWEN3_30B)
    tensors, x, tw, slot_ids, residual, _, want, _ = make_problem(case, "cuda")
    batch = ExpertBatch(tensors, slot_ids, slot_ids_cpu=slot_ids.cpu(), format=format_of(case))
    calls = []
    real = kernel.quant_moe
    monkeypatch.setattr(kernel, "quant_moe", lambda *a, **k: calls.append(a[5]) or real(*a, **k))
    got = experts.expert_compute(x, tw, batch, residual)
    assert calls == [fmt]
    slow = experts._general_compute(x, tw, batch, residual, ExpertActivation())
    atol, rtol = TOLERANCE[case.dtype]
    torch.testing.assert_close(got.float().cpu(), want, atol=atol, rtol=rtol)
    torch.testing.assert_close(got.float(), slow.float(), atol=atol, rtol=rtol)
