"""The transfer protocol: one contiguous buffer per slot (one copy per miss), a layer's misses issued together on
the copy stream after its hits are handed out, joined by their own events, and prefetches waited for only by the
layer that uses them. On a CPU the order is checked through `RecordingStream`; the `gpu` tests check the same on
CUDA's streams."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moechat.engine.cache.provider import CacheConfig
from moechat.engine.cache.slots import ALIGN, SlotLayout, SlotPool
from moechat.engine.cache.transfer import CopyStream, Job, RecordingStream
from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, do_sample=False)
PROMPT = [(5 * i + 2) % 250 for i in range(13)]
DTYPES = [torch.uint8, torch.bfloat16, torch.float32, torch.float16, torch.int8]


def _tokens(engine, n=12):
    return [t for c in engine.generate(PROMPT, sampling=GREEDY, max_tokens=n) for t in c.token_ids]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 9), min_size=1, max_size=3), st.sampled_from(DTYPES)),
                min_size=1, max_size=6), st.integers(1, 5))
def test_named_tensors_are_views_of_one_row_per_slot(specs, n):
    shapes = {f"t{i}": (tuple(shape), dtype) for i, (shape, dtype) in enumerate(specs)}
    layout = SlotLayout(shapes)
    raw, views = layout.empty(n)
    assert raw.shape == (n, layout.nbytes) and layout.nbytes % ALIGN == 0
    assert layout.nbytes - layout.payload < ALIGN * len(shapes)
    spans = []
    for name, (shape, dtype) in shapes.items():
        v = views[name]
        assert v.shape == (n, *shape) and v.dtype == dtype and v[0].is_contiguous()
        assert layout.offsets[name] % ALIGN == 0
        spans.append((layout.offsets[name], layout.offsets[name] + v[0].numel() * dtype.itemsize))
        for s in range(n):  # slot s's tensor lies inside row s
            start = v[s].data_ptr() - raw[s].data_ptr()
            assert start == layout.offsets[name]
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # no two tensors overlap
    # Bytes written through a row are what the named views read, and the other way round.
    src_raw, src = layout.empty(1)
    for name, (shape, dtype) in shapes.items():
        src[name][0].copy_(torch.arange(src[name][0].numel()).reshape(shape).to(dtype))
    raw[n - 1].copy_(src_raw[0])
    for name in shapes:
        assert torch.equal(views[name][n - 1], src[name][0])
    assert layout.views(raw[n - 1])[name].shape == shapes[name][0]


def test_the_pool_and_the_ram_tier_share_the_layout(tiny_models):
    path, _ = tiny_models["mixtral"]
    engine = Engine.load(path, dtype="float32", cache=CacheConfig(expert_slots=3, policy="lru"))
    provider = engine.provider
    pool, store = provider.pool, provider.store
    assert store.layout == pool.layout and pool.raw.shape == (3, pool.slot_bytes)
    for name, buf in pool.buffers.items():
        assert buf.stride(0) * buf.element_size() == pool.slot_bytes and buf.untyped_storage().data_ptr() == \
            pool.raw.data_ptr(), name
    row, tier, nbytes = store.raw_row(1, 2)
    assert tier == "ram" and nbytes == store.expert_bytes and row.shape == (pool.slot_bytes,)
    named = store.layout.views(row)
    want = engine.loaded.provider.expert_weights(1, 2) if hasattr(engine.loaded.provider, "expert_weights") else None
    if want is not None:
        for name, t in named.items():
            assert torch.equal(t, want[name])


@pytest.mark.parametrize("tier", ["ram", "ram+disk"])
def test_a_layer_hands_out_its_hits_then_joins_exactly_its_misses(tiny_models, tier):
    """Driven by hand: the first batch holds only the hits' pairs and no wait precedes it; the misses were claimed
    first, then copied one copy each after one `begin`; the wait list is exactly the missed experts."""
    path, _ = tiny_models["qwen3_moe"]  # 8 experts, top-2
    config = CacheConfig(expert_slots=4, policy="lru", transfer="inline")
    engine = Engine.load(path, dtype="float32", cache=config)
    if tier == "ram+disk":  # a RAM tier of 3 experts over the shards: a miss may read the disk into it first
        budget = 3 * engine.provider.pool.slot_bytes
        engine = Engine.load(path, dtype="float32", cache=CacheConfig(**{**config.__dict__, "ram_cache_bytes": budget}))
        assert engine.provider.store.capacity == 3
    provider = engine.provider
    rec = provider.copies = RecordingStream()
    layer = 0
    first = torch.tensor([[1, 2], [2, 3]])
    assert [b.pairs for b in provider.batches(layer, first)] == [None]  # all misses: one batch
    assert rec.log[0] == ("begin",) and [e[0] for e in rec.log[1:]] == ["copy", "record"] * 3 + ["wait"] * 3
    assert all(e[1] == provider.pool.slot_bytes for e in rec.log if e[0] == "copy")  # ONE copy per expert
    assert [e[1] for e in rec.log if e[0] == "wait"] == [(layer, 1), (layer, 2), (layer, 3)]
    assert provider.copies_issued == 3
    rec.log.clear()
    ids = torch.tensor([[3, 5], [6, 2]])  # 3 and 2 hit, 5 and 6 miss (one evicts expert 1)
    gen = provider.batches(layer, ids)
    hits = next(gen)
    assert sorted(hits.pairs.tolist()) == [0, 3] and ("wait", (layer, 5)) not in rec.log
    assert [e[0] for e in rec.log] == ["begin", "copy", "record", "copy", "record"]
    misses = next(gen)
    assert sorted(misses.pairs.tolist()) == [1, 2]
    assert [e for e in rec.log if e[0] == "wait"] == [("wait", (layer, 5)), ("wait", (layer, 6))]
    assert next(gen, None) is None and provider.copies_issued == 5
    assert sorted(k for k in provider.pool.owner if k is not None) == [(layer, 2), (layer, 3), (layer, 5),
                                                                       (layer, 6)]
    for slot, key in enumerate(provider.pool.owner):
        row, _, _ = provider.store.raw_row(*key)
        assert torch.equal(provider.pool.raw_of(slot), row)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_split_hits_then_misses_keeps_cached_equal_to_resident(tiny_models, name):
    """With the copy protocol on (recorded on a CPU), every slot count gives the resident engine's tokens, and in
    bf16 its logits bit for bit (the CPU sums the pairs in k order however the layer was split)."""
    path, _ = tiny_models[name]
    ref = Engine.load(path, dtype="bfloat16", prefill_chunk=8)
    want = _tokens(ref, n=8)
    E = ref.args.num_experts
    for slots in (1, E, 3 * E):
        engine = Engine.load(path, dtype="bfloat16", prefill_chunk=8,
                             cache=CacheConfig(expert_slots=slots, policy="lru", ram_cache_bytes=None))
        engine.provider.copies = rec = RecordingStream()
        assert _tokens(engine, n=8) == want, slots
        waits = [e for e in rec.log if e[0] == "wait"]
        records = [e for e in rec.log if e[0] == "record"]
        assert sorted(waits, key=str) == sorted([("wait", e[1]) for e in records], key=str)  # each joined once
        snap = engine.cache_snapshot()
        assert len(records) == sum(snap.misses) == engine.provider.copies_issued  # one copy per miss
        engine.close()


def test_a_finished_prefetch_is_waited_for_only_by_the_layer_that_uses_it(tiny_models, monkeypatch):
    """Prefetch jobs carry a copy event (as on CUDA): the compute side waits for one only when its expert is used or
    its slot is reused, never because it finished; a late one is counted."""
    path, _ = tiny_models["mixtral"]
    engine = Engine.load(path, dtype="float32",
                         cache=CacheConfig(expert_slots=6, policy="lru", prefetch="next-layer", transfer="inline"))
    provider = engine.provider
    provider.copies = RecordingStream()
    now: dict = {"layer": None, "experts": set(), "evicting": False}
    waited: list[tuple] = []  # (key, layer computing, its experts, during an eviction)
    monkeypatch.setattr(Job, "wait_device",
                        lambda self: waited.append((self, now["layer"], set(now["experts"]), now["evicting"])))
    original, claim, batches = provider.transfer.submit, provider._claim, provider.batches

    def submit(job):
        job._copy_event = object()  # what ThreadTransfer attaches on CUDA
        return original(job)

    def claiming(*a, **k):
        now["evicting"] = True
        try:
            return claim(*a, **k)
        finally:
            now["evicting"] = False

    def spy(layer, topk_ids):
        now["layer"], now["experts"] = layer, set(topk_ids.reshape(-1).tolist())
        yield from batches(layer, topk_ids)

    provider.transfer.submit, provider._claim, provider.batches = submit, claiming, spy
    _tokens(engine, n=10)
    stats = provider.stats.layers
    issued = sum(s.prefetch_issued for s in stats)
    used = sum(s.prefetch_used for s in stats)
    assert issued > used > 0  # some predictions were wrong: those must never be waited for by their use
    assert len({id(w[0]) for w in waited}) == len(waited)  # each prefetch's copy is waited for at most once
    for job, layer, experts, evicting in waited:
        key = job.key
        # the layer that uses it, or an eviction of its slot before a new copy lands there
        assert evicting or (key[0] == layer and key[1] in experts), (key, layer, experts)
    assert sum(1 for w in waited if not w[3]) <= used


def _cuda():
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs CUDA")
def test_cuda_copy_stream_orders_a_miss_after_compute_and_before_its_use():
    """On CUDA's streams: a copy issued after `begin` does not overtake compute enqueued before it (the slot it
    overwrites is still being read), and a compute that waits on its event sees the new bytes."""
    dev = torch.device("cuda")
    layout = SlotLayout({"a": ((1024, 1024), torch.float32), "b": ((64,), torch.bfloat16)})
    raw, views = layout.empty(1, dev)
    host, hv = layout.empty(1, pin=True)
    hv["a"][0].fill_(2.0)
    views["a"][0].fill_(1.0)
    copies = CopyStream(dev)
    torch.cuda._sleep(50_000_000)  # compute still busy when the copy is issued
    before = views["a"][0].sum()  # reads the old bytes: must be 1.0 * 2^20
    copies.begin()
    copies.copy(raw[0], host[0])
    event = copies.record(("x", 0))
    copies.wait(event)
    after = views["a"][0].sum()
    assert before.item() == 1024 * 1024 and after.item() == 2 * 1024 * 1024


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs CUDA")
@pytest.mark.parametrize("slots", [1, 3, 24])
def test_cuda_split_hits_and_misses_match_resident(tiny_models, slots):
    path, _ = tiny_models["qwen3_moe"]
    want = _tokens(Engine.load(path, dtype="float32", device="cuda"))
    engine = Engine.load(path, dtype="float32", device="cuda", cache=CacheConfig(expert_slots=slots, policy="lru"))
    assert isinstance(engine.provider.copies, CopyStream)
    assert _tokens(engine) == want
    assert engine.provider.copies_issued == sum(engine.cache_snapshot().misses)
