"""A batch whose kernels look the slots up themselves (ExpertBatch.slot_map + topk_ids, what the provider hands a
CUDA step whose experts are all in slots) against the same batch through host slot ids, bit for bit.

The experts sit in a real SlotPool (its one-buffer-per-slot views and its [L, E] map) at several placements, with
another layer's experts in the other slots as decoys, so reading the wrong slot or the wrong row of the map shows.
The map batch's own slot ids are poisoned (-1: every pair skipped), so only a kernel that reads the map gets the
answer. The format's `fused_moe` (what `expert_compute` calls on CUDA) runs under TRITON_INTERPRET=1 on CPU
tensors, in a subprocess (this file as a script) so the flag never reaches the rest of the suite.
"""

from __future__ import annotations

import os

import pytest
import torch

from moechat.engine.cache.slots import SlotPool
from moechat.engine.layers.moe import ExpertActivation, ExpertBatch, moe_reference
from moechat.engine.quant import get_format, mxfp4

try:
    from tests.engine.quant import interpreter
except ImportError:  # run as a script (the interpreter's cases): this folder is on sys.path
    import interpreter

# T = tokens, K = top-k, E = experts per layer, C = slots, H = hidden, I = intermediate
E, C, H, I, K, LAYER = 8, 7, 64, 64, 2, 1
RESIDENT = 4  # experts 0..3 of LAYER are routed to (and in slots); one more of LAYER and layer 0's fill the rest
PLACEMENTS = (1, 2, 3)
# (format, act, T, residual, dtype): decode at T = 1 and 4, prefill (grouped by slot) at T = 10 (20 pairs)
CASES = [("mxfp4", "clamped_swiglu", 1, True, torch.float32), ("mxfp4", "swiglu", 4, False, torch.bfloat16),
         ("mxfp4", "clamped_swiglu", 10, True, torch.float32), ("int8", "swiglu", 1, True, torch.float32),
         ("int8", "clamped_swiglu", 4, True, torch.bfloat16), ("int8", "swiglu", 10, False, torch.float32)]
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 2e-2)}  # atol, rtol


def case_name(case) -> str:
    fmt, kind, T, residual, dtype = case
    return f"{fmt}-{kind}-T{T}{'-res' if residual else ''}-{str(dtype).removeprefix('torch.')}"


def make_expert(fmt: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One expert's named tensors in `fmt` (w13 [2I, H] gate rows then up rows, w2 [H, I]), O(1) activations."""
    if fmt == "mxfp4":
        def packed(rows, cols, gain):
            blocks = torch.randint(0, 256, (rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            base = round(127 + torch.log2(torch.tensor(gain / cols**0.5)).item())  # codes average |2.6|
            return blocks, torch.randint(base - 1, base + 1, (rows, cols // 32), generator=g).to(torch.uint8)
        b13, s13 = packed(2 * I, H, 0.77)
        b2, s2 = packed(H, I, 0.38)
        return {"w13_blocks": b13, "w13_scales": s13, "w2_blocks": b2, "w2_scales": s2}
    q = get_format(fmt)
    w13 = torch.randn(2 * I, H, generator=g) * torch.rand(2 * I, 1, generator=g) * 1.6 / H**0.5
    w2 = torch.randn(H, I, generator=g) * torch.rand(H, 1, generator=g) * 1.2 / I**0.5
    return {f"{which}_{part}": t for which, w in (("w13", w13), ("w2", w2)) for part, t in q.quantize(w).items()}


def dense(fmt: str, ex: dict[str, torch.Tensor], which: str) -> torch.Tensor:
    if fmt == "mxfp4":
        return mxfp4.dequantize_reference(ex[f"{which}_blocks"], ex[f"{which}_scales"]).float()
    return get_format(fmt).weight(ex, which, torch.float32)


def run_case(case, placement: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(through the map, through host slot ids, reference) for one case with the experts at one placement."""
    fmt, kind, T, residual, dtype = case
    g = torch.Generator().manual_seed(7)  # the same experts and routing at every placement
    layers = [[make_expert(fmt, g) for _ in range(E)] for _ in range(2)]  # [layer][expert]
    x = torch.randn(T, H, generator=g).to(dtype)
    res = torch.randn(T, H, generator=g).to(dtype) if residual else None
    topk_ids = torch.stack([torch.randperm(RESIDENT, generator=g)[:K] for _ in range(T)])  # [T, K] of 0..RESIDENT-1
    topk_weights = torch.softmax(torch.randn(T, K, generator=g), dim=-1)  # [T, K]

    p = torch.Generator().manual_seed(placement)
    pool = SlotPool(C, 2, E, {n: (tuple(t.shape), t.dtype) for n, t in layers[0][0].items()})
    slots = torch.randperm(C, generator=p).tolist()
    extra = int(torch.randint(RESIDENT, E, (1,), generator=p))  # a resident expert of LAYER nobody routes to
    keys = [(LAYER, e) for e in range(RESIDENT)] + [(LAYER, extra)]
    keys += [(0, e) for e in torch.randperm(E, generator=p)[: C - len(keys)].tolist()]  # decoys from layer 0
    for (layer, e), slot in zip(keys, slots):
        pool.begin_load(layer, e, slot)
        for name, t in pool.views(slot).items():
            t.copy_(layers[layer][e][name])
        pool.finish_load(slot)
    assert bool((pool.slot_map[LAYER][topk_ids] >= 0).all())

    fused = get_format(fmt).fused_moe
    act = ExpertActivation(kind)
    host_slots = torch.from_numpy(pool.host_map[LAYER][topk_ids.numpy()])  # [T, K]
    by_ids = ExpertBatch(pool.buffers, pool.slot_map[LAYER][topk_ids], host_slots, None, get_format(fmt))
    poisoned = torch.full_like(host_slots, -1)  # only a kernel that reads the map computes anything
    by_map = ExpertBatch(pool.buffers, poisoned, poisoned, None, get_format(fmt), slot_map=pool.slot_map[LAYER],
                         topk_ids=topk_ids)
    assert by_map.kernel_ids()[1] is not None and by_ids.kernel_ids()[1] is None
    got_map = fused(x, topk_weights, by_map, res, act)
    got_ids = fused(x, topk_weights, by_ids, res, act)
    want = moe_reference(x.float(), topk_weights, topk_ids, torch.stack([dense(fmt, ex, "w13") for ex in layers[1]]),
                         torch.stack([dense(fmt, ex, "w2") for ex in layers[1]]), act=act)
    if res is not None:
        want = want + res.float()
    return got_map, got_ids, want


def _interpreted_main() -> None:
    """Run as a script under TRITON_INTERPRET=1: per case and placement, the map and host-id outputs' equality,
    the map output's error against the reference as a fraction of the tolerance, and its equality with the
    first placement's."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for case in interpreter.shard(CASES):
        first = None
        for placement in PLACEMENTS:
            got_map, got_ids, want = run_case(case, placement)
            first = got_map if first is None else first
            atol, rtol = TOLERANCE[case[4]]
            err = float(((got_map.float() - want).abs() / (atol + rtol * want.abs())).max())
            same = torch.equal(got_map, got_ids) and got_map.dtype == got_ids.dtype == case[4]
            print(f"{case_name(case)}-p{placement}", int(same), err, int(torch.equal(got_map, first)), flush=True)


if __name__ == "__main__":
    _interpreted_main()


@pytest.fixture(scope="module")
def interpreted() -> dict[str, tuple[float, ...]]:
    pytest.importorskip("triton")
    return {name: tuple(map(float, rest)) for name, *rest in (line.split() for line in interpreter.run(__file__, 600))}


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_the_kernels_lookup_equals_host_slot_ids_bit_for_bit(interpreted, case, placement):
    same, err, placement_invariant = interpreted[f"{case_name(case)}-p{placement}"]
    assert same == 1.0  # through slot_map[topk_ids] == through the host's slot ids
    assert err <= 1.0  # and both are the MoE (the reference on the dequantized weights)
    assert placement_invariant == 1.0  # whichever slots hold the experts


def test_a_batch_without_a_map_gives_the_kernels_its_slot_ids():
    ids = torch.tensor([[3, 1]])
    batch = ExpertBatch({}, ids, ids)
    assert batch.kernel_ids() == (ids, None)
    smap = torch.tensor([5, -1, 0, 2], dtype=torch.int32)
    mapped = ExpertBatch({}, ids, ids, slot_map=smap, topk_ids=torch.tensor([[2, 3]]))
    routed, got_map = mapped.kernel_ids()
    assert got_map is smap and routed.tolist() == [[2, 3]]


# -- on CUDA: the provider hands whole steps the map, subsets host ids, and cached == resident still ---------------

GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 256, "hidden_size": 64,
           "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "num_local_experts": 8, "experts_per_token": 2, "num_experts_per_tok": 2,
           "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"], "rms_norm_eps": 1e-5,
           "rope_theta": 150000, "max_position_embeddings": 512, "swiglu_limit": 7.0, "attention_bias": True,
           "tie_word_embeddings": False, "eos_token_id": None, "pad_token_id": None, "dtype": "float32",
           "quantization_config": {"quant_method": "mxfp4"}}


def _tiny_gpt_oss(path):
    """A random tiny GPT-OSS with MXFP4 experts from moechat's writer (as tests/engine/test_gpu.py builds it)."""
    from moechat.engine.models import ARCHITECTURES
    from moechat.engine.quant.writer import gpt_oss_expert_tensors, save_checkpoint

    cls = ARCHITECTURES["gpt_oss"]
    args = cls.args_class.from_dict(GPT_OSS)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in cls.dense_weight_names(args).items():
        std = 0.0 if name.endswith("norm.weight") else 0.5 if name.endswith("sinks") else 0.2
        tensors[name] = torch.randn(shape, generator=g) * std + (1.0 if name.endswith("norm.weight") else 0.0)
    E_, H_, I_ = GPT_OSS["num_local_experts"], GPT_OSS["hidden_size"], GPT_OSS["intermediate_size"]
    for layer in cls.moe_layers(args):
        tensors.update(gpt_oss_expert_tensors(layer, torch.randn(E_, 2 * I_, H_, generator=g) * 0.2,
                                              torch.randn(E_, H_, I_, generator=g) * 0.2,
                                              torch.randn(E_, 2 * I_, generator=g) * 0.2,
                                              torch.randn(E_, H_, generator=g) * 0.2, bias_dtype=torch.float32))
    save_checkpoint(path, tensors, GPT_OSS)
    return path


@pytest.mark.gpu
def test_cuda_whole_steps_look_slots_up_in_the_kernel_and_match_resident(tmp_path, monkeypatch):
    from moechat.engine.cache.provider import CacheConfig
    from moechat.engine.runtime.generate import Engine
    from moechat.engine.runtime.sampling import SamplingParams

    path = _tiny_gpt_oss(tmp_path)
    seen = []  # (the batch carries a map, the batch is the whole step) per fused call of a cached run
    real = mxfp4._fused_moe

    def spy(hidden_states, topk_weights, batch, residual, act):
        seen.append((batch.slot_map is not None, batch.pairs is None))
        return real(hidden_states, topk_weights, batch, residual, act)

    greedy = SamplingParams(temperature=0.0, do_sample=False)
    ids = list(range(5, 30))
    run = lambda engine: [t for c in engine.generate(ids, sampling=greedy, max_tokens=16) for t in c.token_ids]
    want = run(Engine.load(path, dtype="float32", device="cuda"))
    monkeypatch.setattr(mxfp4, "_fused_moe", spy)
    for slots in (16, 3):  # every expert fits (hits: the map), and fewer than a step needs (groups: host ids)
        seen.clear()
        cached = Engine.load(path, dtype="float32", device="cuda", cache=CacheConfig(expert_slots=slots, policy="lru"))
        assert run(cached) == want, slots
        assert (True, False) not in seen  # a subset of pairs never goes through the map
        assert (True, True) in seen if slots == 16 else (False, False) in seen
