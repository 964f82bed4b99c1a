"""How many CPU threads torch gets: the affinity mask lowered to a container's CPU quota, minus one core."""

from __future__ import annotations

import os

import pytest

from moechat.engine.plan.hardware import cgroup_cpu_quota, usable_cores


def _v2(tmp_path, cpu_max: str | None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "proc").write_text("0::/box/app\n")
    d = tmp_path / "cg" / "box" / "app"
    d.mkdir(parents=True)
    if cpu_max is not None:
        (tmp_path / "cg" / "box" / "cpu.max").write_text(cpu_max)
    (d / "cpu.max").write_text("max 100000\n")
    return tmp_path / "proc", tmp_path / "cg"


@pytest.mark.parametrize("cpu_max, quota", [(None, None), ("max 100000\n", None), ("200000 100000\n", 2.0),
                                            ("150000 100000\n", 1.5), ("garbage\n", None)])
def test_cgroup_v2_quota_the_tightest_ancestor(tmp_path, cpu_max, quota):
    assert cgroup_cpu_quota(*_v2(tmp_path, cpu_max)) == quota


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "proc").write_text("4:memory:/x\n3:cpu,cpuacct:/docker/abc\n")
    d = tmp_path / "cg" / "cpu,cpuacct" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("300000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path / "proc", tmp_path / "cg") == 3.0
    (d / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(tmp_path / "proc", tmp_path / "cg") is None


def test_usable_cores_is_the_affinity_lowered_to_the_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert usable_cores(*_v2(tmp_path / "a", "150000 100000\n")) == 2  # 1.5 cores of time: 2 threads, not 64
    assert usable_cores(*_v2(tmp_path / "b", None)) == 64
    assert usable_cores(tmp_path / "missing", tmp_path / "none") == 64


@pytest.mark.parametrize("version, gpu", [("cuda: Optional[str] = None\nhip: Optional[str] = None\n", False),
                                          ("cuda: Optional[str] = '12.8'\nhip: Optional[str] = None\n", True),
                                          ("cuda = None\nhip = '6.2'\n", True), ("# nothing\n", True)])
def test_a_cpu_only_torch_build_is_known_without_importing_it(tmp_path, monkeypatch, version, gpu):
    import importlib.util
    from types import SimpleNamespace

    from moechat.engine.plan.hardware import detect

    (tmp_path / "version.py").write_text(version)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: SimpleNamespace(submodule_search_locations=[str(tmp_path)]))
    assert detect._torch_build_has_gpu() is gpu
