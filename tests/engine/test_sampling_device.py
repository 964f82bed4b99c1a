"""moechat.engine.runtime.sampling_device against Sampler (same tokens, same seed), with no host read, and compiled."""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from moechat.engine.runtime.sampling import Sampler, SamplingParams
from moechat.engine.runtime.sampling_device import (
    DeviceSampler,
    filtered_scores,
    knob_values,
    penalised_scores,
    readout,
    sample_scores,
)

GRID = list(itertools.product(
    [1.0, 1.3, 0.7],          # repetition_penalty
    [1.0, 0.6, 1.7, 0.0],     # temperature (0 = greedy)
    [0, 1, 5, 5000],          # top_k (5000 > vocab)
    [1.0, 0.9, 0.0],          # top_p
    [0.0, 0.05, 0.5],         # min_p
))


def tied_logits(gen: torch.Generator, vocab: int) -> torch.Tensor:
    """Logits on a coarse grid (many exact ties, which decide the kept sets) with a few -inf."""
    logits = torch.randint(-8, 9, (vocab,), generator=gen).float() / 2  # [V]
    logits[torch.randint(0, vocab, (3,), generator=gen)] = -torch.inf
    return logits


def run_both(params: SamplingParams, vocab: int, steps: int, seed: int, device: str = "cpu",
             dtype: torch.dtype = torch.float32) -> tuple[list[int], list[int]]:
    """Decode `steps` tokens from the same logits stream with Sampler (host id list) and DeviceSampler."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (5,), generator=gen)  # [P]
    ref, dev = Sampler(params, device=device), DeviceSampler(params, vocab, device=device)
    dev.start(prompt.to(device))
    history = prompt.tolist()
    ours, theirs = [], []
    for _ in range(steps):
        logits = tied_logits(gen, vocab).to(device=device, dtype=dtype)  # [V]
        theirs.append(int(ref(logits, torch.tensor(history, device=device))))
        ours.append(int(dev.step(logits)))
        history.append(theirs[-1])
    return ours, theirs


@pytest.mark.parametrize("vocab", [50, 700])
def test_same_tokens_as_sampler_over_the_grid(vocab):
    for i, (rp, temp, top_k, top_p, min_p) in enumerate(GRID):
        params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=rp,
                                seed=1000 + i)
        ours, theirs = run_both(params, vocab, steps=6, seed=i)
        assert ours == theirs, params


def test_same_scores_as_sampler():
    # The kept sets and the values, not only the drawn token: -inf where Sampler has -inf, equal elsewhere.
    gen = torch.Generator().manual_seed(7)
    for rp, temp, top_k, top_p, min_p in GRID:
        params = SamplingParams(temperature=temp or 1.0, top_k=top_k, top_p=top_p, min_p=min_p,
                                repetition_penalty=rp)
        logits = tied_logits(gen, 300)  # [V]
        ids = torch.randint(0, 300, (9,), generator=gen)  # [N] with repeats allowed
        seen = torch.zeros(300, dtype=torch.bool)
        seen[ids] = True
        knobs = torch.tensor(knob_values(params, 300))
        ours = filtered_scores(penalised_scores(logits, seen, knobs), knobs)  # [V]
        assert torch.equal(ours, Sampler(params).processed_logits(logits, ids)), params


@settings(max_examples=40, deadline=None)
@given(st.floats(0.5, 2.0), st.floats(0.05, 3.0), st.integers(0, 80), st.floats(0.0, 1.0), st.floats(0.0, 1.0),
       st.booleans(), st.integers(0, 2**32))
def test_same_tokens_random_params(rp, temp, top_k, top_p, min_p, do_sample, seed):
    params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=rp,
                            do_sample=do_sample, seed=seed)
    ours, theirs = run_both(params, 64, steps=4, seed=seed % 1000)
    assert ours == theirs


def test_bfloat16_logits_and_reuse_across_generations():
    # One DeviceSampler serves successive generations: set_params + start reset it fully.
    dev = DeviceSampler(SamplingParams(seed=1), 80)
    for i, params in enumerate([SamplingParams(temperature=0.8, top_p=0.9, seed=5, repetition_penalty=1.2),
                                SamplingParams(do_sample=False, repetition_penalty=1.5),
                                SamplingParams(top_k=3, min_p=0.1, seed=6)]):
        gen = torch.Generator().manual_seed(i)
        prompt = torch.randint(0, 80, (4,), generator=gen)
        dev.set_params(params)
        dev.start(prompt)
        ref, history = Sampler(params), prompt.tolist()
        for _ in range(8):
            logits = torch.randn(80, generator=gen).to(torch.bfloat16)  # [V]
            want = int(ref(logits, torch.tensor(history)))
            assert int(dev.step(logits)) == want
            history.append(want)


def test_distribution_is_the_filtered_softmax():
    # The draw itself is right (not only equal to Sampler's): frequencies follow softmax of the kept set.
    params = SamplingParams(temperature=0.7, top_k=4, seed=3)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.4, -1.0])  # [V]
    dev = DeviceSampler(params, 6)
    n = 4000
    counts = torch.zeros(6)
    for _ in range(n):
        dev.start()
        counts[dev.step(logits)] += 1
    want = torch.softmax(torch.tensor([2.0, 1.5, 1.0, 0.5]) / 0.7, dim=0)  # [4]
    assert counts[4:].sum() == 0
    assert torch.allclose(counts[:4] / n, want, atol=0.03)


class HostReads(TorchFunctionMode):
    """Counts the calls that read a device value on the host or make a shape depend on data."""

    NAMES = {"item", "tolist", "cpu", "numpy", "nonzero", "argwhere", "masked_select", "unique",
             "unique_consecutive", "bincount", "__bool__", "__int__", "__float__", "__index__", "__len__"}

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES or (name == "to" and any(str(a) == "cpu" for a in (*args[1:], *(kwargs or {}).values()))):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def test_no_host_read_in_step():
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.3, seed=2)
    dev = DeviceSampler(params, 100)
    dev.start(torch.arange(5))
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    with HostReads() as mode:
        tokens = [dev.step(logits) for _ in range(5)]
    assert mode.reads == []
    assert all(t.dtype == torch.long and t.dim() == 0 for t in tokens)
    # The counter does catch reads (so the check above can fail).
    with HostReads() as mode:
        tokens[0].item()
        torch.tensor([1, 0, 2]).nonzero()
    assert mode.reads == ["item", "nonzero"]


def check_compiled(backend: str) -> None:
    compiled = torch.compile(sample_scores, fullgraph=True, dynamic=False, backend=backend)
    gen = torch.Generator().manual_seed(11)
    vocab = 40
    settings_ = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.2),
                 SamplingParams(do_sample=False, repetition_penalty=1.4),
                 SamplingParams(top_p=0.5)]
    for i, params in enumerate(settings_):
        knobs = torch.tensor(knob_values(params, vocab))
        seen = torch.rand(vocab, generator=gen) < 0.2
        logits = tied_logits(gen, vocab)
        noise = torch.empty(vocab).exponential_(generator=gen)
        # After the first call the knobs are data: a different setting must not recompile.
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(logits, seen, knobs, noise)
        assert torch.equal(got, sample_scores(logits, seen, knobs, noise)), params


def test_compiles_fullgraph_without_graph_breaks():
    # Dynamo + AOT tracing (no C++ codegen): proves one graph, no break, no recompile across settings, in seconds.
    torch._dynamo.reset()
    check_compiled("aot_eager")


@pytest.mark.slow
@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="torch.compile's CPU backend (inductor) needs a C++ compiler; none on PATH")
def test_compiles_fullgraph_with_inductor():
    torch._dynamo.reset()
    check_compiled("inductor")


def test_readout_is_the_one_host_read():
    dev = DeviceSampler(SamplingParams(seed=4), 30)
    logits = torch.linspace(-2.0, 3.0, 30)
    logits[7] = torch.nan
    with HostReads() as mode:
        packed = readout(logits, dev.step(logits))  # [3]
    assert mode.reads == []
    token, lo, hi = packed.tolist()  # the caller's single read
    assert 0 <= token < 30 and token == int(token)
    assert lo != lo and hi != hi  # NaN reaches the host, so generate can raise NonFiniteLogitsError


def test_step_rejects_wrong_shape():
    with pytest.raises(ValueError, match="vocab=10"):
        DeviceSampler(SamplingParams(), 10).step(torch.zeros(11))


@pytest.mark.gpu
def test_same_tokens_as_sampler_on_cuda():
    # CUDA turns `x / python_float` into x * (1/float): the knobs' reciprocals must reproduce it exactly.
    for i, (rp, temp, top_k, top_p, min_p) in enumerate(GRID):
        params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=rp,
                                seed=2000 + i)
        ours, theirs = run_both(params, 5000, steps=3, seed=i, device="cuda")
        assert ours == theirs, params


@pytest.mark.gpu
def test_cuda_graph_replay_gives_the_eager_tokens():
    # The step captured once (generator registered with the graph), replayed with fresh logits copied in.
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.1, seed=9)
    vocab, steps = 5000, 6
    gen = torch.Generator().manual_seed(0)
    stream = [torch.randn(vocab, generator=gen).cuda() for _ in range(steps)]
    eager = DeviceSampler(params, vocab, device="cuda")
    eager.start(torch.arange(4, device="cuda"))
    want = [int(eager.step(logits)) for logits in stream]

    dev = DeviceSampler(params, vocab, device="cuda")
    static_logits = torch.zeros(vocab, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph asks
        dev.step(static_logits)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(dev.generator)
    with torch.cuda.graph(graph):
        token = dev.step(static_logits)
    dev.set_params(params)
    dev.start(torch.arange(4, device="cuda"))
    got = []
    for logits in stream:
        static_logits.copy_(logits)
        graph.replay()
        got.append(int(token))
    assert got == want
