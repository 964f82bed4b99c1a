"""The app leaves one core to the UI thread: torch's pool gets every other one, unless the user chose."""

from __future__ import annotations

import os

import pytest

from moechat.engine.plan.hardware import leave_a_core as leave_a_core_for_the_ui


class FakeTorch:
    def __init__(self, threads: int):
        self.threads = threads

    def get_num_threads(self) -> int:
        return self.threads

    def set_num_threads(self, n: int) -> None:
        self.threads = n


@pytest.mark.parametrize("cores, threads, want", [(2, 2, 1), (16, 16, 15), (1, 1, 1), (8, 4, 4)])
def test_torch_gets_every_core_but_one(monkeypatch, cores, threads, want):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    torch = FakeTorch(threads)
    assert leave_a_core_for_the_ui(torch) == want and torch.threads == want


def test_an_explicit_thread_count_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    torch = FakeTorch(2)
    assert leave_a_core_for_the_ui(torch) == 2
