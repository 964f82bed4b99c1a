"""Group-limited routing (`grouped_topk`) against transformers' own routers (DeepSeek-V2, DeepSeek-V3, GLM-4.5).

Each transformers router is given an identity gate (hidden size = E), so its input *is* the router logits and the
two are compared on exactly the same numbers: random logits, and logits drawn from a few values so that experts
and whole groups tie.
"""

from __future__ import annotations

import pytest
import torch

from moechat.engine.layers.moe import grouped_topk

E = 16


def _router(kind: str, **config):
    """A transformers router whose logits are its input."""
    import transformers
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    cfg_cls, router_cls = {"deepseek_v2": (transformers.DeepseekV2Config, DeepseekV2TopkRouter),
                           "deepseek_v3": (transformers.DeepseekV3Config, DeepseekV3TopkRouter),
                           "glm4_moe": (transformers.Glm4MoeConfig, Glm4MoeTopkRouter)}[kind]
    cfg = cfg_cls(hidden_size=E, n_routed_experts=E, num_attention_heads=1, num_key_value_heads=1, **config)
    router = router_cls(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
    return router


def _logits(kind: str, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randn(T, E, generator=g) * 2
    if kind == "ties":  # five distinct values: many experts tie, and so do whole groups
        return torch.randint(-2, 3, (T, E), generator=g).float() / 2
    return torch.zeros(T, E)  # every expert ties


def _same(ours, theirs):
    """Same chosen experts and the same weight for each (the order within a row is topk's, unsorted)."""
    (w1, i1), (w2, i2) = ours, theirs
    o1, o2 = i1.sort(-1), i2.sort(-1)
    assert torch.equal(o1.values, o2.values)
    torch.testing.assert_close(w1.gather(1, o1.indices), w2.float().gather(1, o2.indices), rtol=0, atol=1e-6)


@pytest.mark.parametrize("logits", ["random", "ties", "all equal"])
@pytest.mark.parametrize("n_group, topk_group, K", [(4, 2, 4), (8, 3, 2), (4, 1, 4), (1, 1, 6), (4, 4, 8)])
@pytest.mark.parametrize("renormalize, scale", [(True, 2.5), (False, 1.0)])
@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
def test_sigmoid_with_correction_bias_matches_transformers(kind, logits, n_group, topk_group, K, renormalize, scale):
    router = _router(kind, num_experts_per_tok=K, n_group=n_group, topk_group=topk_group,
                     norm_topk_prob=renormalize, routed_scaling_factor=scale)
    g = torch.Generator().manual_seed(K)
    bias = torch.randn(E, generator=g) * 0.1 if logits == "random" else torch.randint(0, 2, (E,), generator=g) * 0.25
    router.e_score_correction_bias.copy_(bias)
    x = _logits(logits, 9, seed=n_group * 10 + K)
    with torch.no_grad():
        _, w_ref, ids_ref = router(x)
    ours = grouped_topk(x, K, n_group, topk_group, scoring="sigmoid", correction_bias=bias, renormalize=renormalize,
                        routed_scaling_factor=scale)
    _same(ours, (w_ref, ids_ref))
    assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.int64


@pytest.mark.parametrize("logits", ["random", "ties", "all equal"])
@pytest.mark.parametrize("method, n_group, topk_group, K", [("greedy", 1, 1, 6), ("group_limited_greedy", 4, 2, 3),
                                                            ("group_limited_greedy", 8, 3, 6),
                                                            ("group_limited_greedy", 2, 1, 8)])
@pytest.mark.parametrize("scale", [1.0, 16.0])
def test_softmax_group_limited_matches_transformers_deepseek_v2(logits, method, n_group, topk_group, K, scale):
    router = _router("deepseek_v2", num_experts_per_tok=K, n_group=n_group, topk_group=topk_group, topk_method=method,
                     routed_scaling_factor=scale)
    x = _logits(logits, 9, seed=n_group + K)
    with torch.no_grad():
        _, w_ref, ids_ref = router(x)
    ours = grouped_topk(x, K, n_group, topk_group, scoring="softmax", renormalize=False, routed_scaling_factor=scale)
    _same(ours, (w_ref, ids_ref))


def test_the_bias_steers_the_choice_but_not_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # expert 3 chosen despite the lowest score
    w, ids = grouped_topk(logits, 2, correction_bias=bias, renormalize=False)
    assert sorted(ids[0].tolist()) == [0, 3]
    expected = {0: torch.sigmoid(torch.tensor(2.0)), 3: torch.sigmoid(torch.tensor(-1.0))}
    for k, e in enumerate(ids[0].tolist()):
        assert w[0, k].item() == pytest.approx(expected[e].item(), abs=1e-7)


def test_groups_limit_the_choice():
    # groups {0,1} {2,3} {4,5} {6,7}; the best single expert (7) sits in the worst group by top-2 sum
    logits = torch.tensor([[3.0, 3.0, 2.0, 2.0, 1.0, 1.0, -5.0, 4.0]])
    _, ids = grouped_topk(logits, 2, n_group=4, topk_group=1, correction_bias=torch.zeros(8), renormalize=True)
    assert sorted(ids[0].tolist()) == [0, 1]
    w, ids = grouped_topk(logits, 4, n_group=4, topk_group=2, correction_bias=torch.zeros(8), renormalize=True,
                          routed_scaling_factor=2.5)
    assert sorted(ids[0].tolist()) == [0, 1, 2, 3]
    assert w.sum().item() == pytest.approx(2.5)  # renormalised, then scaled
    # V2's group score is the best expert alone: expert 7's group wins
    _, ids = grouped_topk(logits, 2, n_group=4, topk_group=1, scoring="softmax", renormalize=False)
    assert sorted(ids[0].tolist()) == [6, 7]


def test_bfloat16_logits_route_in_float32():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, E, generator=g)
    a = grouped_topk(logits.bfloat16(), 4, 4, 2, correction_bias=torch.zeros(E))
    b = grouped_topk(logits.bfloat16().float(), 4, 4, 2, correction_bias=torch.zeros(E))
    assert a[0].dtype == torch.float32
    _same(a, b)
