"""moechat.engine.runtime.sampling against transformers' logits processors and GenerationConfig defaults."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import transformers
from transformers.generation import logits_process as lp

from moechat.engine.errors import ConfigError
from moechat.engine.runtime.sampling import Sampler, SamplingParams

QWEN3_GENERATION_CONFIG = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                           "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                           "transformers_version": "4.51.0"}
MIXTRAL_GENERATION_CONFIG = {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2,
                             "transformers_version": "4.36.0.dev0"}


def hf_chain(params: SamplingParams, logits: torch.Tensor, generated: torch.Tensor | None) -> torch.Tensor:
    """What transformers' _get_logits_processor builds for these params (num_beams=1), applied to [1, V]."""
    procs = []
    if params.repetition_penalty != 1.0:
        procs.append(lp.RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.do_sample:
        if params.temperature != 1.0:
            procs.append(lp.TemperatureLogitsWarper(params.temperature))
        if params.top_k != 0:
            procs.append(lp.TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
        if params.top_p < 1.0:
            procs.append(lp.TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
        if params.min_p != 0.0:
            procs.append(lp.MinPLogitsWarper(min_p=params.min_p, min_tokens_to_keep=1))
    input_ids = (generated if generated is not None else torch.zeros(0, dtype=torch.long))[None]  # [1, N]
    return lp.LogitsProcessorList(procs)(input_ids, logits.float()[None].clone())[0]  # [V]


def assert_same_scores(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    assert torch.equal(torch.isinf(ours), torch.isinf(ref)), "different set of removed tokens"
    finite = ~torch.isinf(ref)
    torch.testing.assert_close(ours[finite], ref[finite], rtol=1e-6, atol=1e-6)


GRID = list(itertools.product(
    [1.0, 1.3, 0.7],          # repetition_penalty
    [1.0, 0.6, 1.7],          # temperature
    [0, 1, 5, 40, 5000],      # top_k (5000 > vocab)
    [1.0, 0.95, 0.5, 0.0],    # top_p
    [0.0, 0.05, 0.5],         # min_p
))


@pytest.mark.parametrize("vocab", [50, 1000])
def test_processed_logits_match_transformers(vocab):
    gen = torch.Generator().manual_seed(vocab)
    for i, (rp, temp, top_k, top_p, min_p) in enumerate(GRID):
        logits = torch.randn(vocab, generator=gen) * 3  # [V]
        if i % 3 == 0:  # ties: top-k/top-p/min-p must keep the same tied tokens as transformers
            logits = torch.round(logits)
        n_seen = int(torch.randint(0, 30, (1,), generator=gen))
        generated = torch.randint(0, vocab, (n_seen,), generator=gen)  # [N]
        params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                                repetition_penalty=rp)
        sampler = Sampler(params)
        ours = sampler.processed_logits(logits, generated)
        assert_same_scores(ours, hf_chain(params, logits, generated))
        token = sampler(logits, generated)
        assert not torch.isinf(ours[token]), "sampled a removed token"


def test_processed_logits_half_precision_and_no_input_mutation():
    logits = (torch.randn(300, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16)  # [V]
    before = logits.clone()
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.2)
    generated = torch.tensor([3, 3, 7, 250, 299])  # [N]
    ours = Sampler(params).processed_logits(logits, generated)
    assert_same_scores(ours, hf_chain(params, logits, generated))
    assert torch.equal(logits, before)


def test_repetition_penalty_rule():
    logits = torch.tensor([2.0, -2.0, 0.0, 1.0])  # [V]
    out = Sampler(SamplingParams(repetition_penalty=2.0)).processed_logits(logits, torch.tensor([0, 1, 2, 0]))
    assert out.tolist() == [1.0, -4.0, 0.0, 1.0]


def test_greedy_is_first_argmax():
    logits = torch.tensor([0.5, 3.0, -1.0, 3.0, 2.9])  # [V]
    for params in (SamplingParams(do_sample=False), SamplingParams(temperature=0.0),
                   SamplingParams(do_sample=False, top_k=1, top_p=0.1, temperature=0.3)):
        assert params.greedy
        token = Sampler(params)(logits)
        assert token.dtype == torch.int64 and token.dim() == 0 and token.device == logits.device
        assert int(token) == 1  # first of the tied maxima, like torch.argmax
    # Greedy still applies the repetition penalty first, as transformers does.
    penalised = Sampler(SamplingParams(do_sample=False, repetition_penalty=2.0))
    assert int(penalised(logits, torch.tensor([1, 3]))) == 4
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(1000, generator=gen)  # [V]
        assert int(Sampler(SamplingParams(do_sample=False))(logits)) == int(torch.argmax(logits))


def test_sample_returns_0d_int64_on_logits_device():
    token = Sampler(SamplingParams(seed=1))(torch.randn(10))
    assert token.dtype == torch.int64 and token.shape == () and token.device.type == "cpu"


def _draw(seed: int | None, steps: int = 40) -> list[int]:
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, seed=seed))
    gen = torch.Generator().manual_seed(123)  # the same logits for every run
    return [int(sampler(torch.randn(500, generator=gen))) for _ in range(steps)]


def test_same_seed_same_tokens_different_seed_different():
    assert _draw(7) == _draw(7)
    assert _draw(7) != _draw(8)
    assert _draw(None) != _draw(None)  # unseeded: fresh entropy (a clash has probability ~500**-40)


def test_empirical_distribution_matches_softmax_of_processed_logits():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])  # [V]
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.97, seed=1234)
    sampler = Sampler(params)
    probs = torch.softmax(sampler.processed_logits(logits), dim=-1).double()  # [V]
    n = 6000
    counts = torch.bincount(torch.stack([sampler(logits) for _ in range(n)]), minlength=8).double()  # [V]
    kept = probs > 0
    assert counts[~kept].sum() == 0, "a filtered token was sampled"
    expected = probs[kept] * n
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    # df <= 5; P(chi2 > 40) < 1e-6, and the seed is fixed, so this never flakes.
    assert chi2 < 40, (counts.tolist(), expected.tolist())


def test_from_generation_config_qwen3():
    params = SamplingParams.from_generation_config(QWEN3_GENERATION_CONFIG)
    assert params == SamplingParams(temperature=0.6, top_k=20, top_p=0.95, min_p=0.0, repetition_penalty=1.0,
                                    seed=None, do_sample=True)
    assert not params.greedy


def test_from_generation_config_mixtral_is_greedy_like_transformers():
    params = SamplingParams.from_generation_config(MIXTRAL_GENERATION_CONFIG)
    assert params == SamplingParams(temperature=1.0, top_k=50, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                                    do_sample=False)
    assert params.greedy
    assert SamplingParams.from_generation_config(None) == params
    assert SamplingParams.from_generation_config({}) == params


@pytest.mark.parametrize("config", [QWEN3_GENERATION_CONFIG, MIXTRAL_GENERATION_CONFIG,
                                    {"do_sample": True, "temperature": 0.7, "top_p": None},
                                    {"do_sample": True, "min_p": 0.05, "repetition_penalty": 1.1}])
def test_absent_keys_get_transformers_defaults(config):
    ref = transformers.GenerationConfig(**config)
    defaults = transformers.GenerationConfig._get_default_generation_params()
    ours = SamplingParams.from_generation_config(config)
    for name in ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty"):
        value = getattr(ref, name)
        assert getattr(ours, name) == (defaults[name] if value is None else value), name
    assert ours.min_p == (ref.min_p or 0.0)


def test_overrides():
    qwen = SamplingParams.from_generation_config
    assert qwen(QWEN3_GENERATION_CONFIG, temperature=None, top_k=None, seed=5).seed == 5
    assert qwen(QWEN3_GENERATION_CONFIG, temperature=None) == qwen(QWEN3_GENERATION_CONFIG)
    assert qwen(QWEN3_GENERATION_CONFIG, temperature=0).greedy
    assert qwen(QWEN3_GENERATION_CONFIG, top_p=0.8, top_k=0).top_p == 0.8
    mixtral = qwen(MIXTRAL_GENERATION_CONFIG, temperature=0.7)
    assert mixtral.do_sample and mixtral.temperature == 0.7 and mixtral.top_k == 50 and not mixtral.greedy
    assert qwen(MIXTRAL_GENERATION_CONFIG, temperature=0.7, do_sample=False).greedy
    assert qwen(MIXTRAL_GENERATION_CONFIG, do_sample=True).do_sample
    assert qwen(MIXTRAL_GENERATION_CONFIG, top_k=20).greedy  # filters alone do not turn sampling on
    with pytest.raises(TypeError, match="top_q"):
        qwen(QWEN3_GENERATION_CONFIG, top_q=0.5)


@pytest.mark.parametrize("bad", [
    {"temperature": -0.1}, {"temperature": math.nan}, {"temperature": math.inf}, {"temperature": "hot"},
    {"top_k": -1}, {"top_k": 2.5}, {"top_k": True}, {"top_p": 1.5}, {"top_p": -0.1}, {"min_p": 2.0},
    {"min_p": -0.5}, {"repetition_penalty": 0.0}, {"repetition_penalty": -1.0}, {"do_sample": "yes"},
    {"do_sample": 1}, {"seed": -1}, {"seed": 2**64}, {"seed": 1.5},
])
def test_invalid_values_raise_config_error(bad):
    name = next(iter(bad))
    with pytest.raises(ConfigError, match=name):
        SamplingParams(**bad)
    with pytest.raises(ConfigError, match=name):
        SamplingParams.from_generation_config({}, **bad)
    if name != "seed":  # seed is not a generation_config.json key
        with pytest.raises(ConfigError, match="generation_config.json"):
            SamplingParams.from_generation_config({"do_sample": True, **bad})


def test_valid_edge_values():
    SamplingParams(temperature=0, top_k=0, top_p=0.0, min_p=1.0, repetition_penalty=0.01, seed=0)
    assert SamplingParams.from_generation_config({"top_k": 20.0, "temperature": 1}).top_k == 20
    with pytest.raises(ConfigError, match="JSON object"):
        SamplingParams.from_generation_config([1, 2])  # type: ignore[arg-type]
