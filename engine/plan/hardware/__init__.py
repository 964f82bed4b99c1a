"""What this machine has (GPUs, RAM, disk, cores) and what a what-if machine would have.

The package, by seam (each module imports only those above it):

* `cgroups.py`: a container's limits from cgroup v1/v2 files: `cgroup_cpu_quota`, `cgroup_memory`.
* `cores.py`: `usable_cores` (affinity lowered to the CPU quota) and the thread pools: `default_threads`,
  `set_threads`, `leave_a_core`, `quiet_openmp`.
* `presets.py`: the units (`GiB`, `GB`), the stated assumptions (`ASSUMED_*_GBPS`, `RAM_EFFICIENCY`), PCIe link
  rates, the `--gpu/--ram/--link` presets, `Rate` and `host_read_rate`.
* `machine.py`: the frozen values `GpuInfo`, `HostMemory`, `DiskInfo`, `Hardware` (and its what-ifs,
  `with_overrides`).
* `detect.py`: `probe`: NVML, torch.cuda, RAM (clamped to the cgroup) and free disk; it never raises.

Every name callers take from `moechat.engine.plan.hardware` is re-exported here; a test that patches a function
patches it in the part that calls it (`cores.usable_cores` for `set_threads`).
"""

from __future__ import annotations

from .cgroups import CGROUP_V1_UNLIMITED, cgroup_cpu_quota, cgroup_memory
from .cores import (
    MAX_THREADS,
    THREAD_ENV,
    default_threads,
    leave_a_core,
    quiet_openmp,
    set_threads,
    usable_cores,
)
from .detect import probe
from .machine import DiskInfo, GpuInfo, Hardware, HostMemory
from .presets import (
    ASSUMED_DISK_GBPS,
    ASSUMED_GPU_MEMORY_GBPS,
    ASSUMED_LINK_GBPS,
    ASSUMED_RAM_GBPS,
    ASSUMED_RAM_PEAK_GBPS,
    GB,
    GPU_PRESETS,
    LINK_PRESETS,
    PCIE_EFFICIENCY,
    PCIE_LANE_GBPS,
    PER_THREAD_READ_GBPS,
    RAM_EFFICIENCY,
    RAM_PRESETS,
    GiB,
    GpuPreset,
    LinkPreset,
    RamPreset,
    Rate,
    host_read_rate,
    pcie_link_gbps,
)

__all__ = [
    "ASSUMED_DISK_GBPS",
    "ASSUMED_GPU_MEMORY_GBPS",
    "ASSUMED_LINK_GBPS",
    "ASSUMED_RAM_GBPS",
    "ASSUMED_RAM_PEAK_GBPS",
    "CGROUP_V1_UNLIMITED",
    "GB",
    "GPU_PRESETS",
    "GiB",
    "DiskInfo",
    "GpuInfo",
    "GpuPreset",
    "Hardware",
    "HostMemory",
    "LINK_PRESETS",
    "LinkPreset",
    "MAX_THREADS",
    "PCIE_EFFICIENCY",
    "PCIE_LANE_GBPS",
    "PER_THREAD_READ_GBPS",
    "RAM_EFFICIENCY",
    "RAM_PRESETS",
    "RamPreset",
    "Rate",
    "THREAD_ENV",
    "cgroup_cpu_quota",
    "cgroup_memory",
    "default_threads",
    "host_read_rate",
    "leave_a_core",
    "pcie_link_gbps",
    "probe",
    "quiet_openmp",
    "set_threads",
    "usable_cores",
]
