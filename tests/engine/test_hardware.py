"""Hardware probe: fakes for NVML, torch.cuda, psutil and the cgroup/proc files, injected as data.

Every probe failure must degrade to a labelled mode with a note, never raise.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moechat.engine.plan.hardware import (
    CGROUP_V1_UNLIMITED,
    GiB,
    Hardware,
    HostMemory,
    cgroup_memory,
    pcie_link_gbps,
    probe,
)


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801 - pynvml's own spelling
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801
    pass


class FakeNvml:
    """pynvml's functions over a list of dicts; a value that is an exception class is raised ([N/A])."""

    NVML_CLOCK_MEM = 2

    def __init__(self, gpus: list[dict], init_error: type[Exception] | None = None):
        self.gpus, self.init_error = gpus, init_error
        self.shutdown = False

    def _get(self, handle: int, key: str):
        value = self.gpus[handle][key]
        if isinstance(value, type) and issubclass(value, Exception):
            raise value("Not Supported")
        return value

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shutdown = True

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self._get(h, "name")

    def nvmlDeviceGetUUID(self, h):
        return self._get(h, "uuid")

    def nvmlDeviceGetMemoryInfo(self, h):
        total, free = self._get(h, "mem")
        return SimpleNamespace(total=total, free=free, used=total - free)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self._get(h, "gen")

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._get(h, "width")

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return 1  # idle power saving: never what the plan should use

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self._get(h, "width")

    def nvmlDeviceGetMemoryBusWidth(self, h):
        return self._get(h, "bus")

    def nvmlDeviceGetMaxClockInfo(self, h, clock):
        assert clock == self.NVML_CLOCK_MEM
        return self._get(h, "clock")


class FakeCuda:
    """torch.cuda as seen by a process: `visible` lists the physical GPUs in torch order."""

    def __init__(self, gpus: list[dict], visible: list[int], mem_error: bool = False):
        self.gpus, self.visible, self.mem_error = gpus, visible, mem_error

    def is_available(self):
        return bool(self.visible)

    def device_count(self):
        return len(self.visible)

    def get_device_properties(self, i):
        g = self.gpus[self.visible[i]]
        return SimpleNamespace(name=g["name"], uuid=g["uuid"].removeprefix("GPU-"), total_memory=g["mem"][0])

    def mem_get_info(self, i):
        if self.mem_error:
            raise RuntimeError("CUDA error: unknown error")
        total, free = self.gpus[self.visible[i]]["mem"]
        return free, total


RTX4090 = dict(name="NVIDIA GeForce RTX 4090", uuid="GPU-aaaaaaaa-1111-2222-3333-444444444444",
               mem=(24 * GiB, 22 * GiB), gen=4, width=16, bus=384, clock=10501)
RTX3060 = dict(name="NVIDIA GeForce RTX 3060", uuid="GPU-bbbbbbbb-5555-6666-7777-888888888888",
               mem=(12 * GiB, 11 * GiB), gen=3, width=8, bus=192, clock=7501)


def vm(total=64 * GiB, available=40 * GiB):
    return lambda: SimpleNamespace(total=total, available=available)


def _probe(tmp_path, **kw):
    """probe() with every source faked: no cgroup, a fixed RAM and disk, unless overridden."""
    proc = tmp_path / "proc_cgroup"
    if not proc.exists():
        proc.write_text("0::/\n")
    defaults = dict(nvml=None, cuda=None, virtual_memory=vm(), environ={}, proc_cgroup=proc,
                    cgroup_root=tmp_path / "cgroup", meminfo=tmp_path / "meminfo",
                    disk_usage=lambda p: SimpleNamespace(free=500 * GiB, total=1000 * GiB))
    return probe(tmp_path, **{**defaults, **kw})


def test_pcie_link_and_memory_bandwidth_arithmetic(tmp_path):
    # raw per-lane rates x lanes x 80%: gen4 x16 = 1.969 * 16 * 0.8; gen5 x8 is the same link speed
    assert pcie_link_gbps(4, 16) == pytest.approx(25.2032)
    assert pcie_link_gbps(5, 8) == pytest.approx(3.938 * 8 * 0.8)
    assert pcie_link_gbps(3, 8) == pytest.approx(6.304)
    assert pcie_link_gbps(None, 16) is None and pcie_link_gbps(4, None) is None and pcie_link_gbps(9, 16) is None
    hw = _probe(tmp_path, nvml=FakeNvml([RTX4090]), environ={})
    (g,) = hw.gpus
    # 10501 MHz x 2 (DDR) x 384 bit / 8 = 1008.1 GB/s, the RTX 4090's published 1008 GB/s
    assert g.memory_gbps == pytest.approx(10501e6 * 2 * 384 / 8 / 1e9)
    assert g.pcie_gen == 4 and g.pcie_gen_current == 1 and g.link_gbps == pytest.approx(25.2032)
    assert g.free_bytes == 22 * GiB and g.total_bytes == 24 * GiB and g.torch_index == 0
    assert hw.mode == "gpu" and hw.best_gpu() is g


def test_no_gpu_nvml_library_missing_and_no_cuda(tmp_path):
    nvml = FakeNvml([], init_error=NVMLError_LibraryNotFound)
    hw = _probe(tmp_path, nvml=nvml, cuda=FakeCuda([], visible=[]))
    assert hw.gpus == () and hw.mode == "cpu" and hw.best_gpu() is None
    assert any("NVML unavailable" in n and "Library Not Found" in n for n in hw.gpu_notes)
    assert any("no usable GPU" in n for n in hw.gpu_notes)
    assert hw.ram.available_bytes == 40 * GiB


def test_nvml_missing_falls_back_to_torch_mem_get_info(tmp_path):
    nvml = FakeNvml([], init_error=NVMLError_LibraryNotFound)
    hw = _probe(tmp_path, nvml=nvml, cuda=FakeCuda([RTX4090], visible=[0]))
    (g,) = hw.gpus
    assert g.source == "torch" and g.torch_index == 0 and g.free_bytes == 22 * GiB
    assert g.link_gbps is None and g.memory_gbps is None  # unknown, not invented
    assert hw.mode == "gpu-partial"
    assert any("mem_get_info" in n for n in hw.gpu_notes)


def test_two_gpus_reordered_by_cuda_visible_devices_are_mapped_by_uuid(tmp_path):
    nvml = FakeNvml([RTX4090, RTX3060])
    # CUDA_VISIBLE_DEVICES=1,0: torch's cuda:0 is NVML's GPU 1 (the 3060)
    hw = _probe(tmp_path, nvml=nvml, cuda=FakeCuda([RTX4090, RTX3060], visible=[1, 0]))
    assert hw.gpu(0).name == RTX3060["name"] and hw.gpu(0).nvml_index == 1 and hw.gpu(0).free_bytes == 11 * GiB
    assert hw.gpu(1).name == RTX4090["name"] and hw.gpu(1).nvml_index == 0
    assert hw.gpu(0).source == "nvml+torch"
    assert hw.best_gpu().torch_index == 1  # most free memory, under its torch number
    assert hw.gpu(0).link_gbps == pytest.approx(0.985 * 8 * 0.8)


def test_cuda_visible_devices_without_torch(tmp_path):
    nvml = FakeNvml([RTX4090, RTX3060])
    by_uuid = _probe(tmp_path, nvml=nvml, environ={"CUDA_VISIBLE_DEVICES": "GPU-bbbbbbbb,GPU-aaaaaaaa"})
    assert by_uuid.gpu(0).uuid == RTX3060["uuid"] and by_uuid.gpu(1).uuid == RTX4090["uuid"]
    only_one = _probe(tmp_path, nvml=nvml, environ={"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert only_one.gpu(0).name == RTX3060["name"]
    hidden = next(g for g in only_one.gpus if g.name == RTX4090["name"])
    assert hidden.torch_index is None and not hidden.usable  # listed, but this process cannot use it
    assert only_one.best_gpu().name == RTX3060["name"]
    none_visible = _probe(tmp_path, nvml=nvml, environ={"CUDA_VISIBLE_DEVICES": ""})
    assert none_visible.best_gpu() is None and none_visible.mode == "gpu-partial"


def test_na_memory_on_a_unified_memory_board(tmp_path):
    gb10 = dict(RTX4090, name="NVIDIA GB10", mem=NVMLError_NotSupported, gen=NVMLError_NotSupported,
                width=NVMLError_NotSupported, bus=NVMLError_NotSupported, clock=NVMLError_NotSupported)
    hw = _probe(tmp_path, nvml=FakeNvml([gb10]))
    (g,) = hw.gpus
    assert g.free_bytes is None and g.link_gbps is None and not g.usable
    assert hw.mode == "gpu-partial" and hw.best_gpu() is None
    assert any("[N/A]" in n for n in hw.gpu_notes)
    # torch can still report it: filled in from mem_get_info
    hw = _probe(tmp_path, nvml=FakeNvml([gb10]), cuda=FakeCuda([dict(gb10, mem=(120 * GiB, 100 * GiB))], [0]))
    assert hw.gpus[0].free_bytes == 100 * GiB and hw.gpus[0].source == "nvml+torch" and hw.gpus[0].usable
    # and when torch fails too, the GPU stays unusable, with a note, no exception
    hw = _probe(tmp_path, nvml=FakeNvml([gb10]), cuda=FakeCuda([dict(gb10, mem=(1, 1))], [0], mem_error=True))
    assert not hw.gpus[0].usable and any("mem_get_info failed" in n for n in hw.gpu_notes)


def test_nvml_gpus_but_torch_without_cuda_are_not_usable(tmp_path):
    hw = _probe(tmp_path, nvml=FakeNvml([RTX4090]), cuda=FakeCuda([RTX4090], visible=[]))
    assert hw.best_gpu() is None and any("CPU-only torch" in n for n in hw.gpu_notes)


def _cgroup_v2(tmp_path, rel: str, files: dict[str, dict[str, str]]):
    root = tmp_path / "cgroup"
    for d, content in files.items():
        path = root / d
        path.mkdir(parents=True, exist_ok=True)
        for name, text in content.items():
            (path / name).write_text(text)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"0::{rel}\n")
    return proc, root


def test_cgroup_v2_limit_below_host_ram_clamps_available(tmp_path):
    proc, root = _cgroup_v2(tmp_path, "/job", {"job": {"memory.max": str(8 * GiB), "memory.current": str(2 * GiB),
                                                         "memory.stat": f"anon 1\ninactive_file {GiB}\n"}})
    hw = _probe(tmp_path, proc_cgroup=proc, cgroup_root=root, virtual_memory=vm(64 * GiB, 40 * GiB))
    # 8 GiB limit - (2 GiB used - 1 GiB reclaimable page cache) = 7 GiB, below the host's 40 GiB
    assert hw.ram.available_bytes == 7 * GiB and hw.ram.total_bytes == 8 * GiB
    assert hw.ram.cgroup_limit_bytes == 8 * GiB and "cgroup" in hw.ram.source
    assert any("cgroup limit (8.0 GiB" in n for n in hw.notes)


def test_cgroup_v2_parent_limit_and_unlimited_child(tmp_path):
    proc, root = _cgroup_v2(tmp_path, "/a/b", {"a": {"memory.max": str(4 * GiB), "memory.current": "0"},
                                               "a/b": {"memory.max": "max", "memory.current": "0"}})
    assert cgroup_memory(proc, root)[:2] == (4 * GiB, 4 * GiB)
    proc, root = _cgroup_v2(tmp_path, "/c", {"c": {"memory.max": "max"}})
    assert cgroup_memory(proc, root)[0] is None


def test_cgroup_v1_in_a_container(tmp_path):
    root = tmp_path / "cgroup"
    (root / "memory").mkdir(parents=True)
    # inside a container the path from /proc/self/cgroup does not exist: the mounted root is the cgroup
    (root / "memory" / "memory.limit_in_bytes").write_text(str(6 * GiB))
    (root / "memory" / "memory.usage_in_bytes").write_text(str(3 * GiB))
    (root / "memory" / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {GiB}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    assert cgroup_memory(proc, root) == (6 * GiB, 4 * GiB, str(root / "memory" / "memory.limit_in_bytes"))
    hw = _probe(tmp_path, proc_cgroup=proc, cgroup_root=root)
    assert hw.ram.available_bytes == 4 * GiB and hw.ram.total_bytes == 6 * GiB
    # v1 writes "no limit" as a huge number: no clamp
    (root / "memory" / "memory.limit_in_bytes").write_text(str(CGROUP_V1_UNLIMITED * 2 - 4096))
    hw = _probe(tmp_path, proc_cgroup=proc, cgroup_root=root)
    assert hw.ram.available_bytes == 40 * GiB and hw.ram.cgroup_limit_bytes is None


def test_every_source_failing_at_once_is_still_a_result(tmp_path):
    def broken_vm():
        raise OSError("no /proc")

    def broken_disk(path):
        raise PermissionError("denied")

    class BrokenNvml(FakeNvml):
        def nvmlDeviceGetCount(self):
            raise NVMLError("driver/library version mismatch")

    hw = _probe(tmp_path, nvml=BrokenNvml([]), cuda=FakeCuda([], []), virtual_memory=broken_vm,
                disk_usage=broken_disk, proc_cgroup=tmp_path / "missing")
    assert hw.mode == "cpu" and hw.ram.available_bytes is None and hw.disk.free_bytes is None
    notes = " | ".join(hw.all_notes)
    assert "version mismatch" in notes and "pass --ram-gb" in notes and "denied" in notes
    # psutil failing but /proc/meminfo readable
    (tmp_path / "meminfo").write_text("MemTotal: 16777216 kB\nMemAvailable: 8388608 kB\n")
    hw = _probe(tmp_path, virtual_memory=broken_vm)
    assert hw.ram.total_bytes == 16 * GiB and hw.ram.available_bytes == 8 * GiB


def test_disk_free_where_the_model_will_be(tmp_path):
    seen = []

    def usage(path):
        seen.append(path)
        return SimpleNamespace(free=123, total=456)

    hw = probe(tmp_path / "not" / "downloaded", nvml=None, cuda=None, virtual_memory=vm(), disk_usage=usage,
               proc_cgroup=tmp_path / "none")
    assert seen == [str(tmp_path.resolve())] and hw.disk.free_bytes == 123


def test_what_if_overrides(tmp_path):
    real = _probe(tmp_path, nvml=FakeNvml([RTX4090]))
    hw = real.with_overrides(vram_gb=12, ram_gb=32, disk_gb=100, link_gbps=50)
    (g,) = hw.gpus
    assert g.free_bytes == g.total_bytes == 12 * GiB and g.link_gbps == 50 and g.link_source == "given (--link-gbs)"
    assert g.memory_gbps == real.gpus[0].memory_gbps  # the probed GPU's bandwidth is kept
    assert hw.ram == HostMemory(32 * GiB, 32 * GiB, source="what-if") and hw.disk.free_bytes == 100 * GiB
    assert len(hw.what_if) == 4
    assert real.with_overrides(vram_gb=0).mode == "cpu"
    cpu_only = Hardware((), HostMemory(8 * GiB, 8 * GiB), None).with_overrides(vram_gb=8)
    assert cpu_only.best_gpu().free_bytes == 8 * GiB and cpu_only.best_gpu().link_gbps is None


def test_probe_on_this_machine_never_raises():
    hw = probe()
    assert hw.mode in ("gpu", "gpu-partial", "cpu")
    assert hw.to_json()["mode"] == hw.mode
