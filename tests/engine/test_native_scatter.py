"""native_scatter.c: a chunk's expert outputs into their pairs' fp32 rows, the same bits as torch's index_copy_ of
y.float() * w (layers/experts.py `_put`), at any thread count; a bad index refused, not written past the end."""

from __future__ import annotations

import pytest
import torch

from moechat.engine.layers import experts
from moechat.engine.quant import native


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("P", "H", "rows"), [(1, 64, 1), (7, 96, 16), (1024, 2048, 1024), (37, 2880, 40)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_same_bits_as_the_torch_ops(lib, dtype, P, H, rows, threads):
    g = torch.Generator().manual_seed(P + H)
    y = (torch.randn(P, H, generator=g) * 8).to(dtype)
    y[0, :3] = torch.tensor([float("inf"), float("nan"), -0.0])
    w = torch.rand(P, generator=g).to(torch.bfloat16)
    idx = torch.randperm(rows, generator=g)[:P]
    want = torch.full((rows, H), 7.0).index_copy_(0, idx, y.float() * w.float()[:, None])
    got = torch.full((rows, H), 7.0)  # rows no pair names keep what they held
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        experts._put(got, idx, y, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def test_an_index_out_of_range_is_refused(lib):
    contrib = torch.zeros(4, 8)
    with pytest.raises(Exception, match="scatter"):
        native.scatter_weighted(lib, contrib, torch.tensor([0, 4]), torch.ones(2, 8), torch.ones(2))
    with pytest.raises(Exception, match="scatter"):
        native.scatter_weighted(lib, contrib, torch.tensor([-1]), torch.ones(1, 8), torch.ones(1))
