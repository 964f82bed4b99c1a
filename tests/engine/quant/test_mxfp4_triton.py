"""The fused MXFP4 MoE kernel against moe_reference on the dequantized weights.

On the CPU the Triton interpreter runs it (small shapes, one config). TRITON_INTERPRET is read when a kernel
is decorated, so those cases run in a subprocess (this file as a script) and the flag never reaches the rest
of the suite. The `gpu` tests run the compiled kernel at GPT-OSS-20B's widths.

Every case keeps experts in shuffled slots of a pool larger than E (unused slots hold random bytes), so a
wrong slot shows; a case with `pairs` points the left-out pairs at real slots, so computing one shows too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from moechat.engine.layers.moe import ExpertActivation, moe_reference
from moechat.engine.quant import mxfp4

try:
    from tests.engine.quant import interpreter
except ImportError:  # run as a script (the interpreter's cases): this folder is on sys.path
    import interpreter

# T = tokens, K = top-k, E = experts, C = slots, H = hidden, I = intermediate


@dataclass(frozen=True)
class Case:
    kind: str = "clamped_swiglu"
    T: int = 1
    mode: str | None = None  # "gemv" / "grouped" / None: the kernel's own choice
    pairs: str = "all"  # "all", "some" (left-out pairs point at real slots), "some-absent" (left-out: slot -1)
    residual: bool = False
    dtype: torch.dtype = torch.float32
    H: int = 64
    I: int = 64
    E: int = 4
    K: int = 2
    gain: int = 0  # w13 scaled by 2^gain: 2 drives GPT-OSS's clamp (|gate| > 7) on a fair share of outputs
    lookup: bool = False  # the kernels get the routed expert ids and the layer's slot map, not slot ids
    x_gain: int = 0  # x scaled by 2^x_gain: past fp16's range, the packed decode's guard scales it on the device
    hw_e4m3: bool = False  # the kernels told the device converts e4m3 (sm_89+'s decode): its twin runs here

    @property
    def name(self) -> str:
        return (f"{self.kind}-T{self.T}-{self.mode or 'auto'}-{self.pairs}{'-res' if self.residual else ''}-"
                f"{str(self.dtype).removeprefix('torch.')}-H{self.H}{f'-gain{self.gain}' if self.gain else ''}"
                f"{f'-K{self.K}' if self.K != 2 else ''}{'-map' if self.lookup else ''}"
                f"{f'-x2^{self.x_gain}' if self.x_gain else ''}{'-e4m3' if self.hw_e4m3 else ''}")


def _packed(g: torch.Generator, *lead: int, cols: int, scale: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes (every byte value), scales 2^(scale - 127 +- 1): [..., cols/32, 16], [..., cols/32]."""
    blocks = torch.randint(0, 256, (*lead, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(scale - 1, scale + 1, (*lead, cols // 32), generator=g).to(torch.uint8)
    return blocks, scales


def make_problem(case: Case, device: str = "cpu", seed: int = 0):
    """Slot buffers, routing and the reference output (on `device`) of one case."""
    g = torch.Generator().manual_seed(seed)
    H, I, E, K, T = case.H, case.I, case.E, case.K, case.T
    C = E + 2
    # codes average |2.6|: scales near 2 / (2.6 sqrt(in)) keep every activation O(1)
    b13, s13 = _packed(g, E, 2 * I, cols=H,
                       scale=case.gain + round(127 + torch.log2(torch.tensor(0.77 / H**0.5)).item()))
    b2, s2 = _packed(g, E, H, cols=I, scale=round(127 + torch.log2(torch.tensor(0.38 / I**0.5)).item()))
    bias13 = (torch.randn(E, 2 * I, generator=g) * 0.2).to(case.dtype)
    bias2 = (torch.randn(E, H, generator=g) * 0.2).to(case.dtype)
    perm = torch.randperm(C, generator=g)
    slot_of, free = perm[:E], perm[E:]  # expert e lives in slot slot_of[e]; the free slots hold junk
    tensors = {}
    for name, t in (("w13_blocks", b13), ("w13_scales", s13), ("w2_blocks", b2), ("w2_scales", s2),
                    ("w13_bias", bias13), ("w2_bias", bias2)):
        tensors[name] = torch.empty((C, *t.shape[1:]), dtype=t.dtype)  # [C, ...]
        tensors[name][slot_of] = t
        junk = torch.randint(0, 256, (len(free), *t.shape[1:]), generator=g, dtype=torch.uint8)
        tensors[name][free] = junk if t.dtype == torch.uint8 else junk.to(t.dtype) - 128
    x = (torch.randn(T, H, generator=g) * 2.0**case.x_gain).to(case.dtype)
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
    to = lambda t: None if t is None else t.to(device)
    # the reference, in fp32 from the same (rounded) inputs; left-out pairs weigh nothing
    want = moe_reference(to(x).float(), to(topk_weights * used.view(T, K)), topk_ids,
                         mxfp4.dequantize_reference(to(b13), to(s13)), mxfp4.dequantize_reference(to(b2), to(s2)),
                         act=ExpertActivation(case.kind), w13_bias=to(bias13).float(), w2_bias=to(bias2).float())
    if residual is not None:
        want = want + to(residual).float()
    return ({k: to(v) for k, v in tensors.items()}, to(x), to(topk_weights), to(slot_ids), to(residual),
            to(pairs), want.cpu(), to(slot_map))


def run_case(case: Case, device: str = "cpu", seed: int = 0, moved: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's output and the reference; `moved` > 0 first moves the experts to other slots (a permutation
    drawn from it), which must not change a bit of the output."""
    from moechat.engine.quant.kernels.mxfp4_moe import mxfp4_moe

    tensors, x, tw, slot_ids, residual, pairs, want, slot_map = make_problem(case, device, seed)
    if moved:
        C = tensors["w13_blocks"].shape[0]
        perm = torch.randperm(C, generator=torch.Generator().manual_seed(moved)).to(slot_ids.device)  # s -> perm[s]
        tensors = {k: torch.empty_like(v).index_copy_(0, perm, v) for k, v in tensors.items()}
        if slot_map is not None:
            slot_map = torch.where(slot_map >= 0, perm[slot_map.long().clamp(min=0)].to(torch.int32), -1)
        else:
            slot_ids = torch.where(slot_ids >= 0, perm[slot_ids.long().clamp(min=0)], -1)
    from moechat.engine.quant.kernels import mxfp4_moe as mm

    hardware_fp8 = mm.hardware_fp8
    if case.hw_e4m3:  # the interpreter runs the e4m3 conversion's twin: the sm_89+ decode, on the CPU
        mm.hardware_fp8 = lambda device: True
    try:
        got = mxfp4_moe(x, tw, slot_ids, tensors, ExpertActivation(case.kind), residual=residual, pairs=pairs,
                        mode=case.mode, slot_map=slot_map)
    finally:
        mm.hardware_fp8 = hardware_fp8
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
INTERPRETED = [Case(kind, T, mode, pairs, residual)
               for kind in ("swiglu", "clamped_swiglu")
               for T, mode, pairs, residual in [(1, None, "all", False), (5, "gemv", "all", True),
                                                (5, "grouped", "all", False), (5, "grouped", "some", True),
                                                (5, "gemv", "some", False), (1, None, "some-absent", False)]]
INTERPRETED += [Case("clamped_swiglu", 5, "grouped", "some-absent", True), Case("clamped_swiglu", 5, gain=2),
                Case("swiglu", 3, "gemv", "all", True), Case("clamped_swiglu", 4, "gemv", "all", False, torch.bfloat16),
                Case("clamped_swiglu", 4, "grouped", "all", True, torch.bfloat16, H=96, I=32)]
# the decode GEMV at odd widths: a last tile with part of its 16-byte scale blocks (KB = 48, 80 against a tile of
# 32 bytes), outputs past the last BLOCK_N tile (I = 160 in tiles of 32 is whole, H = 96 is not a power of two)
INTERPRETED += [Case("clamped_swiglu", 3, "gemv", "some", True, H=96, I=160),
                Case("swiglu", 2, "gemv", "all", False, torch.bfloat16, H=160, I=96, E=3, K=3)]
# the slot lookup inside the kernels (decode) and before the grouping (prefill); T = 8 is still a decode at 32 pairs
INTERPRETED += [Case("clamped_swiglu", 1, None, "all", True, lookup=True),
                Case("clamped_swiglu", 3, "gemv", "some-absent", True, torch.bfloat16, lookup=True),
                Case("swiglu", 5, "grouped", "some", False, lookup=True),
                Case("clamped_swiglu", 8, None, "all", True, torch.bfloat16, H=96, I=32, E=6, K=4)]
# an x of 2^20 (fp16 would overflow): the packed fp16 decode's guard scales x by a power of two on the device, in
# w13 and (swiglu: huge activations) in w2; sm_80/86's decode (the interpreter's default: the values x 2^-14 in
# fp16, x scaled up into [2^13, 2^14) too: a tiny x without a residual) and sm_89+'s through e4m3 bytes
INTERPRETED += [Case("swiglu", 2, "gemv", "all", True, torch.bfloat16, x_gain=20),
                Case("swiglu", 2, "gemv", "all", True, torch.bfloat16, x_gain=20, hw_e4m3=True),
                Case("swiglu", 2, "gemv", "all", False, torch.bfloat16, x_gain=-20),
                Case("clamped_swiglu", 3, "gemv", "some-absent", True, torch.bfloat16, H=96, I=160, hw_e4m3=True),
                Case("swiglu", 2, "gemv", "all", False, torch.bfloat16, H=160, I=96, E=3, K=3, hw_e4m3=True)]
# the same bits whatever slots hold the experts (the k-sum in the kernel, in k order, no atomics)
MOVED = [Case("clamped_swiglu", 3, "gemv", "all", True, torch.bfloat16, K=3),
         Case("swiglu", 2, "gemv", "some-absent", True, lookup=True)]


def _e2m1_as_e4m3_error() -> float:
    """The largest error of kernels/packed.py's E2M1 -> e4m3 byte mapping (the sm_89+ decode feeds its bytes to
    the hardware's e4m3 conversion) over every code byte: e4m3 value x 2^6 against the E2M1 value. Script only:
    the kernel is defined in the __main__ block."""
    codes = torch.arange(256, dtype=torch.uint8)  # every byte: low nibble element 2j, high nibble 2j + 1
    words = codes.view(torch.int32)  # [64]
    lows, highs = torch.empty_like(words), torch.empty_like(words)
    _e2m1_as_e4m3_kernel[(1,)](words, lows, highs)  # noqa: F821 - defined when run as a script
    got = torch.stack([lows.view(torch.uint8), highs.view(torch.uint8)], dim=1).view(torch.float8_e4m3fn)  # [256, 2]
    want = mxfp4.dequantize_reference(codes.view(16, 16), torch.full((16,), 127 - 6, dtype=torch.uint8))  # x 2^-6
    return float((got.float().flatten() - want.flatten()).abs().max())


def _packed_twins_error() -> float:
    """The interpreter's twins of the packed decode's PTX against torch, on every input they meet: cvt.rn.f16x2.e4m3x2
    (every e4m3 byte but the NaN pattern, to fp16 bits) and fma.rn.f16x2 (fp16 a * b + c rounded once, on random
    fp16 lanes and the e2m1 / int4 products the kernels form). Returns the count of differing fp16 lanes. Script
    only: the kernels are defined in the __main__ block."""
    codes = torch.arange(256, dtype=torch.uint8)
    words = codes.view(torch.int32)  # [64]: bytes 4i .. 4i + 3
    lo, hi = torch.empty_like(words), torch.empty_like(words)
    _cvt_kernel[(1,)](words, lo, hi)  # noqa: F821 - defined when run as a script
    # lo holds bytes 0, 1 of each word, hi bytes 2, 3
    got = torch.stack([lo.view(torch.int16).view(-1, 2), hi.view(torch.int16).view(-1, 2)], dim=1).flatten()
    want = codes.view(torch.float8_e4m3fn).half().view(torch.int16)  # [256]
    finite = codes.view(torch.float8_e4m3fn).float().isfinite()
    bad = int((got != want)[finite].sum())
    g = torch.Generator().manual_seed(0)
    n = 4096
    a = torch.cat([torch.randn(n, generator=g), codes.view(torch.float8_e4m3fn).float()[finite][:64].repeat(16)])
    b = torch.cat([torch.randn(n, generator=g) * 8, torch.randn(1024, generator=g)])
    c = torch.cat([torch.randn(n, generator=g) * 4, torch.randn(1024, generator=g)])
    a, b, c = (v[: (len(v) // 2) * 2].half() for v in (a, b, c))
    out = torch.empty(len(a) // 2, dtype=torch.int32)
    _fma_kernel[(1,)](a.view(torch.int32), b.view(torch.int32), c.view(torch.int32), out,  # noqa: F821
                      N=triton.next_power_of_2(len(out)), LEN=len(out))
    # fp16 x fp16 + fp16 is exact in fp64 here, then one rounding, as fma.rn: numpy's, since torch's double -> half
    # goes through float (two roundings)
    exact = torch.from_numpy((a.double() * b.double() + c.double()).numpy().astype("float16"))
    return float(bad + int((out.view(torch.float16) != exact).sum()))


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
    if interpreter.first_shard():
        print("e2m1-as-e4m3", _e2m1_as_e4m3_error(), flush=True)
        print("packed-twins", _packed_twins_error(), flush=True)


if __name__ == "__main__":
    import triton
    import triton.language as tl

    from moechat.engine.quant.kernels.packed import _cvt_e4m3x2, _e2m1_as_e4m3, _hfma2

    @triton.jit
    def _e2m1_as_e4m3_kernel(w_ptr, lo_ptr, hi_ptr):
        i = tl.arange(0, 64)
        lows, highs = _e2m1_as_e4m3(tl.load(w_ptr + i).to(tl.uint32, bitcast=True))
        tl.store(lo_ptr + i, lows.to(tl.int32, bitcast=True))
        tl.store(hi_ptr + i, highs.to(tl.int32, bitcast=True))

    @triton.jit
    def _cvt_kernel(w_ptr, lo_ptr, hi_ptr):
        i = tl.arange(0, 64)
        lo, hi = _cvt_e4m3x2(tl.load(w_ptr + i).to(tl.uint32, bitcast=True))
        tl.store(lo_ptr + i, lo.to(tl.int32, bitcast=True))
        tl.store(hi_ptr + i, hi.to(tl.int32, bitcast=True))

    @triton.jit
    def _fma_kernel(a_ptr, b_ptr, c_ptr, out_ptr, N: tl.constexpr, LEN):
        i = tl.arange(0, N)
        ok = i < LEN
        a, b, c = (tl.load(p + i, mask=ok, other=0).to(tl.uint32, bitcast=True) for p in (a_ptr, b_ptr, c_ptr))
        tl.store(out_ptr + i, _hfma2(a, b, c).to(tl.int32, bitcast=True), mask=ok)

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


def test_e2m1_codes_map_to_e4m3_bytes_of_the_same_value(interpreted):
    assert interpreted["e2m1-as-e4m3"] == 0.0


def test_packed_decode_twins_match_the_hardware_formulas(interpreted):
    """The fp16x2 decode's interpreter twins (the compiled kernels run cvt.rn.f16x2.e4m3x2 and fma.rn.f16x2 as PTX)
    give the bits those instructions are defined to give: each e4m3 byte's fp16, fp16 a * b + c rounded once."""
    assert interpreted["packed-twins"] == 0.0


def test_case_names_are_unique():
    assert len({c.name for c in INTERPRETED}) == len(INTERPRETED)


def test_grouping_pads_each_slot_and_skips_absent_pairs():
    from moechat.engine.quant.kernels.mxfp4_moe import group_by_slot

    flat_slots = torch.tensor([3, 1, 3, -1, 3, 1, 0, 3], dtype=torch.int32)  # [T*K]
    pair_ids = torch.tensor([0, 1, 2, 3, 4, 5, 7], dtype=torch.int32)  # pair 6 left out
    group_slot, group_pairs = group_by_slot(flat_slots, pair_ids, slots=4, block_m=2)
    groups = {}
    for s, row in zip(group_slot.tolist(), group_pairs.tolist(), strict=True):
        if s >= 0:
            groups.setdefault(s, []).append(sorted(p for p in row if p >= 0))
        else:
            assert s == -1
    assert groups == {1: [[1, 5]], 3: [[0, 2], [4, 7]]}  # slot 0's only pair (6) is left out; pair 3 is absent
    assert group_slot.numel() == 4 + 5  # cdiv(7, 2) + min(7, C + 1): the bound, whatever the routing


GPT_OSS_20B = dict(H=2880, I=2880, E=32, K=4)
GPU_CASES = [Case("clamped_swiglu", T, None, pairs, residual, dtype, **GPT_OSS_20B)
             for T, pairs, residual, dtype in [(1, "all", True, torch.bfloat16), (1, "all", False, torch.float32),
                                               (4, "some", True, torch.bfloat16), (64, "all", True, torch.bfloat16),
                                               (64, "some-absent", False, torch.float32),
                                               (300, "all", True, torch.bfloat16)]]
GPU_CASES += [Case("swiglu", 1, None, "all", True, torch.bfloat16, **GPT_OSS_20B),
              Case("swiglu", 64, None, "all", False, torch.float32, **GPT_OSS_20B)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_cuda_kernel_matches_the_reference_at_gpt_oss_20b_widths(case):
    got, want = run_case(case, device="cuda")
    atol, rtol = TOLERANCE[case.dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
