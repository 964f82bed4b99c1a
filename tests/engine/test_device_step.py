"""The device-resident MoE step (issue 32) on the CPU: exact against today's path, no host read inside a step.

Models end to end (qwen3_moe, mixtral, gpt_oss with MXFP4 + biases + clamped SwiGLU, deepseek_v2 with shared
experts) at 1, a few and all slots, so that experts are read from the RAM tier in the step; every expert format
at the layer against today's CPU path and the slow reference; a host-read counter; torch.compile(fullgraph=True).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moechat.engine.cache.provider import CacheConfig
from moechat.engine.cache.provider.device import DeviceResidentProvider
from moechat.engine.cache.slots import SlotLayout
from moechat.engine.layers.experts import expert_compute
from moechat.engine.layers.moe import SWIGLU, ExpertActivation, ExpertBatch, moe_reference, softmax_topk
from moechat.engine.layers.moe_device import map_moe
from moechat.engine.quant import get_format, mxfp4
from moechat.engine.quant.fp8 import fp8_format, quantize_blocks
from moechat.engine.runtime.generate import Engine

from ..conftest import TINY_MODELS, build_tiny_model
from .host_reads import HostReads
from .test_gpt_oss import write_tiny_gpt_oss
from .test_shared_expert_models import build_variant

PROMPT = [(7 * i + 3) % 250 for i in range(11)]
STEPS = 4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> model directory, built on first use."""
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            if name == "gpt_oss":
                write_tiny_gpt_oss(path)
            elif name == "deepseek_v2":
                build_variant(path, "deepseek_v2_lite", seed=3)
            else:
                build_tiny_model(path, *TINY_MODELS[name], seed=1)
            built[name] = path
        return built[name]

    return get


def _run(engine, steps=STEPS):
    """Prefill logits, then `steps` greedy decode steps' logits [steps + 1, V], and the tokens fed."""
    seq = engine.new_sequence()
    out, tokens = [], []
    with torch.inference_mode():
        logits = engine._forward(seq, PROMPT)
        for _ in range(steps):
            out.append(logits)
            tokens.append(int(logits.argmax()))
            logits = engine._forward(seq, [tokens[-1]])
    out.append(logits)
    return torch.stack(out), tokens


def _device_engine(path, slots, **cache):
    engine = Engine.load(path, dtype="float32", prefill_chunk=8, cache=CacheConfig(expert_slots=slots, **cache))
    engine.provider = DeviceResidentProvider.from_cached(engine.provider)
    return engine


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v2"])
def test_device_step_matches_todays_path_at_every_slot_count(models, name):
    path = models(name)
    resident = Engine.load(path, dtype="float32", prefill_chunk=8)
    ref_logits, ref_tokens = _run(resident)  # == today's cached path at any slot count (test_cached_provider.py)
    args = resident.args
    E, K = args.num_experts, args.top_k
    for slots in (1, K + 1, 64 * E):  # 1, a few, all (clamped to L x E)
        engine = _device_engine(path, slots)
        logits, tokens = _run(engine)
        provider = engine.provider
        assert tokens == ref_tokens, f"{slots} slots"
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5, msg=f"{slots} slots")
        assert provider.steps_settled == STEPS  # every decode step took the device path
        assert provider.residency.mismatches(provider.pool) == []
        assert torch.equal(provider.residency.map, torch.from_numpy(provider.residency.mirror))
        snap = engine.cache_snapshot()
        assert sum(snap.hits) + sum(snap.misses) > 0
        if slots < E:
            assert sum(snap.misses) > 0  # some experts were read from the RAM tier inside a step


def test_host_layers_and_host_misses_through_the_device_step(models):
    """`--on-miss host` and host layers: misses stay in the RAM tier (never slotted) and the output is unchanged."""
    path = models("qwen3_moe")
    ref_logits, ref_tokens = _run(Engine.load(path, dtype="float32", prefill_chunk=8))
    engine = _device_engine(path, 3, on_miss="host", host_layers=1)
    logits, tokens = _run(engine)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    provider = engine.provider
    first = min(provider.host_views)
    assert (provider.pool.host_map[first] < 0).all()  # the host layer holds no slot
    assert all(provider.residency.entry(first, e) == ("host", e) for e in range(provider.num_experts))
    assert sum(s.host_computed for s in provider.stats.layers) > 0


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_a_device_step_reads_the_host_at_most_once_per_token(models, name):
    """Today's path reads the routing on the host in every MoE layer; the device step reads it once per token,
    after the step (finish_step), and never inside it."""
    path = models(name)
    counts = {}
    for kind in ("cached", "device"):
        engine = (Engine.load(path, dtype="float32", prefill_chunk=8, cache=CacheConfig(expert_slots=3))
                  if kind == "cached" else _device_engine(path, 3))
        seq = engine.new_sequence()
        with torch.inference_mode():
            logits = engine._forward(seq, PROMPT)
            tokens = [int(logits.argmax())]
            inside = 0
            with HostReads() as all_reads:
                for _ in range(3):
                    with HostReads() as step:
                        hidden = engine.model(torch.tensor(tokens[-1:]), seq.kv, engine.provider)
                    inside += step.count
                    if kind == "device":
                        engine.provider.finish_step()
                    seq.tokens.append(tokens[-1])
                    logits = engine.model.logits(hidden[-1:])[0]
                    tokens.append(int(torch.argmax(logits)))  # the sampled token: the detokenizer's own read
        counts[kind] = (inside, all_reads.count - 3, all_reads.events)
    n_moe = len(engine.provider.host_views)
    inside, total, events = counts["device"]
    assert inside == 0, events
    assert total <= 3, events  # one per token: the routing record after the step
    inside, total, events = counts["cached"]
    assert inside >= 3 * n_moe, events  # the counter sees today's per-layer reads: it can fail


# -- every format at the layer: the map path against today's CPU path and the slow reference ---------------------
H, I, E, C, K, T = 32, 32, 6, 2, 3, 1
CLAMPED = ExpertActivation("clamped_swiglu", limit=7.0, alpha=1.702)


def _pack(fmt, w13: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
    """One expert's stored tensors in `fmt` (the writers the format tests use)."""
    out = {}
    for name, w in (("w13", w13), ("w2", w2)):
        if fmt.name == "dense":
            out[name] = w
        elif fmt.name == "mxfp4":
            out[f"{name}_blocks"], out[f"{name}_scales"] = mxfp4.quantize(w)
        elif fmt.name == "fp8":
            halves = w.chunk(2) if name == "w13" else (w,)  # gate and up blocked on their own
            parts = [quantize_blocks(h, fmt.block) for h in halves]
            out[name] = torch.cat([q for q, _ in parts])
            out[f"{name}_scale"] = torch.cat([s for _, s in parts])
        else:
            q = fmt.quantize(w)
            out[f"{name}_q"], out[f"{name}_scale"] = q["q"], q["scale"]
    return out


@pytest.mark.parametrize("act,bias", [(SWIGLU, False), (CLAMPED, True)], ids=["swiglu", "clamped+bias"])
@pytest.mark.parametrize("fmt_name,dtype", [("dense", torch.float32), ("dense", torch.bfloat16),
                                            ("mxfp4", torch.float32), ("fp8", torch.float32), ("int8", torch.float32),
                                            ("int4", torch.float32)])
def test_every_format_from_slots_and_host_matches_todays_path(fmt_name, dtype, act, bias):
    fmt = fp8_format((16, 16)) if fmt_name == "fp8" else get_format(fmt_name)
    g = torch.Generator().manual_seed(7)
    layout = SlotLayout(fmt.layout(H, I, dtype, bias))
    _, host = layout.empty(E)  # the RAM tier: every expert
    _, slots = layout.empty(C)
    dense13, dense2, b13, b2 = [], [], [], []
    for e in range(E):
        w13 = (torch.randn(2 * I, H, generator=g) * 0.2).to(dtype)
        w2 = (torch.randn(H, I, generator=g) * 0.2).to(dtype)
        stored = _pack(fmt, w13, w2)
        if bias:
            stored["w13_bias"] = (torch.randn(2 * I, generator=g) * 0.2).to(dtype)
            stored["w2_bias"] = (torch.randn(H, generator=g) * 0.2).to(dtype)
        for name, t in stored.items():
            host[name][e].copy_(t)
        view = {name: t[e] for name, t in host.items()}
        dense13.append(fmt.weight(view, "w13", torch.float32))
        dense2.append(fmt.weight(view, "w2", torch.float32))
        b13.append(view.get("w13_bias", torch.zeros(2 * I)).float())
        b2.append(view.get("w2_bias", torch.zeros(H)).float())
    for slot, e in enumerate((4, 1)):  # experts 4 and 1 in the slots, the rest read from the host tier
        for name in slots:
            slots[name][slot].copy_(host[name][e])
    residency = torch.tensor([C + 0, 1, C + 2, C + 3, 0, C + 5], dtype=torch.int32)  # [E] slot s, or C + host index
    x = (torch.randn(T, H, generator=g)).to(dtype)
    topk_weights, topk_ids = softmax_topk(torch.randn(T, E, generator=g), K, True)
    topk_ids = torch.tensor([[2, 4, 1]])  # a host expert first, then two slotted ones
    slot_ids = residency[topk_ids]  # [T, K]
    got = torch.zeros(T * K, H)
    map_moe(x, topk_weights, slot_ids, C, slots, host, fmt, act, contrib=got)
    today = torch.zeros(T * K, H)
    sid = slot_ids.long()
    expert_compute(x, topk_weights, ExpertBatch(slots, sid, sid, None, fmt, host_tensors=host), act=act,
                   contrib=today)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, today, **tol)
    ref = moe_reference(x.float(), topk_weights, topk_ids, torch.stack(dense13), torch.stack(dense2), act=act,
                        w13_bias=torch.stack(b13) if bias else None, w2_bias=torch.stack(b2) if bias else None)
    summed = map_moe(x, topk_weights, slot_ids, C, slots, host, fmt, act, residual=torch.zeros_like(x))
    torch.testing.assert_close(summed.float(), ref, **(tol if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)))


def test_a_few_tokens_at_once_match_the_reference():
    """T > 1 (a small batch with max_tokens > 1): pairs token-major, each token's k-sum in order."""
    g = torch.Generator().manual_seed(5)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
    slots = {"w13": w13[[4, 0]].clone(), "w2": w2[[4, 0]].clone()}  # experts 4 and 0 in slots 0 and 1
    host = {"w13": w13, "w2": w2}
    residency = torch.tensor([1, C + 1, C + 2, C + 3, 0, C + 5], dtype=torch.int32)
    x = torch.randn(3, H, generator=g)
    topk_weights, topk_ids = softmax_topk(torch.randn(3, E, generator=g), K, True)
    got = map_moe(x, topk_weights, residency[topk_ids], C, slots, host, get_format("dense"), SWIGLU, residual=x)
    torch.testing.assert_close(got, x + moe_reference(x, topk_weights, topk_ids, w13, w2), rtol=1e-5, atol=1e-5)


def test_the_layer_step_compiles_whole_and_matches_eager():
    """torch.compile(fullgraph=True) of one MoE layer's device step (route, record, map lookup, gather, dequantize,
    compute, k-sum): no graph break, so nothing in it waits for the host. aot_eager traces the same graph inductor
    would compile (inductor itself, ~40 s on a loaded 2-core machine, gives the same output: measured)."""
    g = torch.Generator().manual_seed(3)
    fmt = get_format("int4")
    layout = SlotLayout(fmt.layout(H, I, torch.float32, True))
    _, host = layout.empty(E)
    _, slots = layout.empty(C)
    for e in range(E):
        stored = _pack(fmt, torch.randn(2 * I, H, generator=g) * 0.2, torch.randn(H, I, generator=g) * 0.2)
        stored["w13_bias"], stored["w2_bias"] = torch.randn(2 * I, generator=g), torch.randn(H, generator=g)
        for name, t in stored.items():
            host[name][e].copy_(t)
    for name in slots:
        slots[name][0].copy_(host[name][3])
        slots[name][1].copy_(host[name][5])
    residency = torch.tensor([C + 0, C + 1, C + 2, 0, C + 4, 1], dtype=torch.int32)  # [E]
    gate = torch.randn(E, H, generator=g)
    record = torch.zeros(2, 1, K, dtype=torch.long)  # [L, T_max, K]

    def step(x, residual):
        topk_weights, topk_ids = softmax_topk(F.linear(x, gate), K, True)
        record[1, : x.shape[0]].copy_(topk_ids)
        return map_moe(x, topk_weights, residency[topk_ids], C, slots, host, fmt, CLAMPED, residual)

    x, residual = torch.randn(1, H, generator=g), torch.randn(1, H, generator=g)
    want = step(x, residual)
    want_ids = record.clone()
    record.zero_()
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(x, residual)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(record, want_ids)


@pytest.mark.gpu
def test_the_layer_step_compiles_with_inductor_on_cuda():
    """The same step compiled by inductor on CUDA with the host tier read in place (host-mapped pinned memory)."""
    from moechat.engine.cache.residency import host_mapped

    dev = torch.device("cuda")
    fmt = get_format("dense")
    layout = SlotLayout(fmt.layout(H, I, torch.float32, False))
    raw_host, _ = layout.empty(E, pin=True)
    raw_host.copy_(torch.randint(0, 255, raw_host.shape, dtype=torch.uint8))
    host = layout.views(host_mapped(raw_host, dev))
    for t in layout.views(raw_host).values():  # finite fp32 values in every host expert
        t.copy_(torch.randn(t.shape) * 0.2)
    _, slots = layout.empty(C, device=dev)
    for name in slots:
        slots[name].copy_(host[name][:C])
    residency = torch.tensor([0, 1, C + 2, C + 3, C + 4, C + 5], dtype=torch.int32, device=dev)
    gate = torch.randn(E, H, device=dev)

    def step(x, residual):
        topk_weights, topk_ids = softmax_topk(F.linear(x, gate), K, True)
        return map_moe(x, topk_weights, residency[topk_ids], C, slots, host, fmt, SWIGLU, residual)

    x, residual = torch.randn(1, H, device=dev), torch.randn(1, H, device=dev)
    want = step(x, residual)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(step, fullgraph=True)(x, residual), want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_on_cuda_the_device_step_matches_the_cached_step(models, name):
    """On CUDA: host experts read over the link from pinned RAM, fills on the copy stream, the map ordered after
    them by events; the same tokens as the cached provider's step at 1 and a few slots."""
    path = models(name)
    for slots in (1, 3):
        cache = CacheConfig(expert_slots=slots, policy="lru")
        ref_logits, ref_tokens = _run(Engine.load(path, dtype="float32", device="cuda", prefill_chunk=8, cache=cache))
        engine = Engine.load(path, dtype="float32", device="cuda", prefill_chunk=8, cache=cache)
        engine.provider = DeviceResidentProvider.from_cached(engine.provider)
        logits, tokens = _run(engine)
        assert tokens == ref_tokens, f"{slots} slots"
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        assert engine.provider.steps_settled == STEPS
        assert engine.provider.residency.mismatches(engine.provider.pool) == []


@pytest.mark.parametrize("expert_format", ["int8", "int4"])
def test_quantized_experts_through_the_device_step_match_the_cached_step(models, expert_format, tmp_path):
    """Experts converted by moechat (`--expert-format`): dequantized by torch ops from the gathered codes, the same
    tokens and logits (1e-5) as the CPU's native kernels on the cached step."""
    path = models("qwen3_moe")
    cache = CacheConfig(expert_slots=3, policy="lru", repack_dir=str(tmp_path))
    ref_logits, ref_tokens = _run(Engine.load(path, dtype="float32", prefill_chunk=8, cache=cache,
                                              expert_format=expert_format))
    engine = Engine.load(path, dtype="float32", prefill_chunk=8, cache=cache, expert_format=expert_format)
    engine.provider = DeviceResidentProvider.from_cached(engine.provider)
    assert engine.provider.format.name == expert_format
    logits, tokens = _run(engine)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
