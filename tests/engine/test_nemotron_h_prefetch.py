"""Prefetch and hybrid execution on Nemotron-H, whose Mamba-2, attention and MLP layers have no routed experts.

The next-layer predictor ranks experts by the router's own scoring (sigmoid, the correction bias, the top-k within
`topk_group` of `n_group` groups: NemotronHMoE.choice_scores), so fed the residual that enters a MoE layer it names
exactly the experts that layer's router chooses, where a top-k of the raw logits (what it read before) does not.
A generation with prefetch on (and with hybrid execution) gives the resident model's tokens, and every prediction
and every expert request names a MoE layer only."""

from __future__ import annotations

import pytest
import torch

from moechat.engine.cache.prefetch import Predictor
from moechat.engine.cache.provider import CacheConfig
from moechat.engine.models.nemotron_h import NemotronHMoE
from moechat.engine.runtime.generate import Engine

from .test_nemotron_h import PATTERN, _greedy, _prompt, build

pytest.importorskip("transformers")

MOE = [i for i, c in enumerate(PATTERN) if c == "E"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotron_h_prefetch")
    build(path, seed=6)
    return path


def test_prediction_from_a_layers_own_input_is_its_routers_choice(tiny, monkeypatch):
    """For every MoE layer, decode step and prefill chunk: the predictor fed the residual entering that layer's MoE
    names the experts its router picked (decode: its top-k, in any order; prefill: the union over the tokens), and
    a top-k of the folded raw logits disagrees somewhere (the test tells the two apart)."""
    engine = Engine.load(tiny, dtype="float32", prefill_chunk=16)
    model = engine.model
    predictor = Predictor.from_model(model)
    assert predictor.moe_layers == MOE and all(predictor.routers[j].choice is not None for j in MOE)
    seen = []  # (layer, residual [T, H], the router's ids [T, K])
    real = NemotronHMoE.forward

    def forward(self, x, provider, residual):
        seen.append((self.layer, residual.clone(), self.route(x)[1]))
        return real(self, x, provider, residual)

    monkeypatch.setattr(NemotronHMoE, "forward", forward)
    _greedy(engine, _prompt(21, seed=8), 12)  # chunks of 16 and 5, then decode steps
    assert {layer for layer, _, _ in seen} == set(MOE) and any(r.shape[0] > 1 for _, r, _ in seen)
    raw_differs = 0
    for layer, residual, ids in seen:
        E = predictor.routers[layer].gate.shape[0]
        got = predictor.predict("next-layer", layer, residual, budget=E * residual.shape[0])
        if residual.shape[0] == 1:
            assert set(got[: predictor.top_k]) == set(ids[0].tolist()), layer
        else:
            assert set(got) == set(ids.reshape(-1).tolist()), layer
        r = predictor.routers[layer]
        raw = torch.topk(residual @ (r.gate * r.norm[None, :]).t(), predictor.top_k, dim=-1).indices  # [T, K]
        raw_differs += sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(raw, ids, strict=True))
    assert raw_differs > 0


@pytest.mark.parametrize("prefetch,on_miss,host_layers", [("next-layer", "load", 0), ("both", "host", 1)])
def test_prefetch_on_a_hybrid_model_keeps_the_tokens_and_names_moe_layers_only(tiny, monkeypatch, prefetch,
                                                                                 on_miss, host_layers):
    ids = _prompt(17, seed=9)
    resident = _greedy(Engine.load(tiny, dtype="float32"), ids, 10)
    asked = []  # (target layer, predicted experts)
    real = Predictor.predict

    def predict(self, mode, target, hidden_states, budget):
        out = real(self, mode, target, hidden_states, budget)
        asked.append((target, out))
        return out

    monkeypatch.setattr(Predictor, "predict", predict)
    ram = 0 if on_miss == "load" else 6 * 2 * 32 * 64 * 4  # hybrid: misses computed from a 6-expert RAM tier
    cache = CacheConfig(expert_slots=3, ram_cache_bytes=ram, prefetch=prefetch,
                        on_miss=on_miss, host_layers=host_layers)
    engine = Engine.load(tiny, dtype="float32", cache=cache)
    assert _greedy(engine, ids, 10) == resident
    assert asked and {t for t, _ in asked} <= set(MOE) and all(e for _, e in asked)
    assert all(0 <= e < 8 for _, out in asked for e in out)
    snap = engine.cache_snapshot()
    requests = [h + m for h, m in zip(snap.hits, snap.misses, strict=True)]
    assert [i for i, n in enumerate(requests) if n] == MOE, requests
