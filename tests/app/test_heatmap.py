"""The heatmap's aggregation: groups fit the width, fractions and heat per cell, glyphs."""

from __future__ import annotations

import numpy as np
import pytest

from moechat.app.tui.widgets.heatmap import aggregate, cell_kind, group_size


@pytest.mark.parametrize("E, columns, g", [(32, 40, 1), (32, 31, 2), (256, 40, 8), (256, 31, 16), (8, 1, 8),
                                           (60, 20, 4)])
def test_group_size_is_the_smallest_power_of_two_that_fits(E, columns, g):
    assert group_size(E, columns) == g


def test_aggregate_fraction_and_heat_with_a_ragged_last_group():
    resident = np.array([[1, 1, 0, 1, 0], [0, 0, 0, 0, 1]], dtype=bool)  # [L=2, E=5]
    recent = np.array([[0.1, 0.9, 0.0, 0.2, 0.3], [0, 0, 0, 0, 0.5]])
    frac, heat, host_heat = aggregate(resident, recent, 2)  # groups (0,1) (2,3) (4)
    assert np.allclose(frac, [[1.0, 0.5, 0.0], [0.0, 0.0, 1.0]])
    assert np.allclose(heat, [[0.9, 0.2, 0.3], [0.0, 0.0, 0.5]])
    assert not host_heat.any()
    hosted = np.array([[0, 0, 0, 0, 1], [0, 0, 0, 0, 0]], dtype=bool)
    assert np.allclose(aggregate(resident, recent, 2, hosted)[2], [[0, 0, 0.3], [0, 0, 0]])


def test_cell_kinds():
    assert cell_kind(1.0, 0.9) == ("█", "heatmap--hot")
    assert cell_kind(1.0, 0.2) == ("█", "heatmap--warm")
    assert cell_kind(1.0, 0.0) == ("█", "heatmap--cold")
    assert cell_kind(0.0, 0.0) == ("·", "heatmap--absent")
    assert cell_kind(0.0, 0.3) == ("•", "heatmap--miss")  # used lately but not in a slot
    assert cell_kind(0.0, 0.3, 0.3) == ("○", "heatmap--host")  # used lately, computed on the host
    assert cell_kind(0.0, 0.3, 0.05) == ("•", "heatmap--miss")  # a group: its hosted expert idle, another loaded lately
    assert cell_kind(1.0, 0.9, 0.9) == ("█", "heatmap--hot")  # in a slot now: it runs on the device
    assert cell_kind(0.125, 0.0)[0] == "▁" and cell_kind(0.5, 0.0)[0] == "▄" and cell_kind(0.99, 0.0)[0] == "▇"
