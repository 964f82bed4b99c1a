"""Routing and expert compute against the slow reference."""

from __future__ import annotations

import pytest
import torch

from moechat.engine.layers.experts import expert_compute
from moechat.engine.layers.moe import ExpertBatch, ExpertProvider, ResidentProvider, moe_reference, softmax_topk


def _experts(E, H, I, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk(renormalize):
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    w, ids = softmax_topk(logits, 2, renormalize)
    assert ids.tolist() == [[1, 2], [2, 3]]
    probs = torch.softmax(logits, -1)
    expected = torch.stack([probs[0, [1, 2]], probs[1, [2, 3]]])
    if renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(w, expected)


@pytest.mark.parametrize("T, E, K", [(1, 8, 2), (1, 4, 4), (7, 8, 2), (33, 16, 4), (5, 3, 1)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_expert_compute_matches_reference(T, E, K, dtype, tol):
    H, I = 32, 24
    w13, w2 = _experts(E, H, I)
    g = torch.Generator().manual_seed(T * 100 + E)
    x = torch.randn(T, H, generator=g)
    weights, ids = softmax_topk(torch.randn(T, E, generator=g), K, renormalize=False)
    provider = ResidentProvider.dense({0: w13.to(dtype)}, {0: w2.to(dtype)}, num_layers=1)
    assert isinstance(provider, ExpertProvider)
    out = expert_compute(x.to(dtype), weights, provider.prepare(0, ids))
    ref = moe_reference(x.to(dtype), weights, ids, w13.to(dtype), w2.to(dtype))
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=0)


def test_expert_compute_uses_slot_ids_not_expert_ids():
    """Kernels see only slots: the same experts placed in other slots give the same result."""
    E, H, I, T, K = 6, 16, 8, 9, 2
    w13, w2 = _experts(E, H, I)
    x = torch.randn(T, H)
    weights, ids = softmax_topk(torch.randn(T, E), K, True)
    perm = torch.randperm(E)  # slot s holds expert perm[s]
    slot_of = torch.argsort(perm)  # expert e lives in slot slot_of[e]
    batch = ExpertBatch({"w13": w13[perm], "w2": w2[perm]}, slot_of[ids])
    torch.testing.assert_close(expert_compute(x, weights, batch), moe_reference(x, weights, ids, w13, w2),
                               atol=1e-5, rtol=0)
