"""The app's compute threads: every core on 1-2 cores, one left to the UI thread from 3, unless the user chose."""

from __future__ import annotations

import os

import pytest

from moechat.engine.plan.hardware import leave_a_core as leave_a_core_for_the_ui
from moechat.engine.plan.hardware.cores import torch_threads


class FakeTorch:
    def __init__(self, threads: int):
        self.threads = threads

    def get_num_threads(self) -> int:
        return self.threads

    def set_num_threads(self, n: int) -> None:
        self.threads = n


@pytest.mark.parametrize("cores, threads, want", [(2, 2, 2), (16, 16, 15), (1, 1, 1), (8, 4, 4)])
def test_every_core_but_one_from_three(monkeypatch, cores, threads, want):
    """Compute threads: every core on 1-2 cores, every core but one from 3, never more than a pool already made
    smaller; torch's own ops on one thread up to 2 (native.c's pool takes them all)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    torch = FakeTorch(threads)
    assert leave_a_core_for_the_ui(torch) == want and torch.threads == torch_threads(want)


def test_an_explicit_thread_count_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    torch = FakeTorch(2)
    assert leave_a_core_for_the_ui(torch) == 2
