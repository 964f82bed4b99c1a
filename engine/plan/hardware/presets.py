"""Units, the stated assumptions, PCIe link rates and the what-if presets (`moechat fit --gpu/--ram/--link`),
and `host_read_rate`: the rate the CPU reads expert bytes at, with its source."""

from __future__ import annotations

from dataclasses import dataclass

# The PCIe rates live with hybrid execution (pure Python), which assumes a link when none was probed.
from ...cache.hybrid import ASSUMED_LINK_GBPS, PCIE_EFFICIENCY, PCIE_LANE_GBPS  # noqa: F401 - re-exported
from ...units import GB, GiB  # noqa: F401 - re-exported

# Stated assumptions used when a number cannot be probed (docs/plan.md lists them all).
ASSUMED_GPU_MEMORY_GBPS = 300.0  # a modest consumer GPU (RTX 3060: 360 GB/s)
ASSUMED_RAM_GBPS = 20.0  # what a decode step's mat-vecs reach on dual-channel DDR4/DDR5 desktops
# A what-if CPU (--ram PRESET / --ram-bw-gbs / --cores) reads at min(RAM_EFFICIENCY x peak, threads x
# PER_THREAD_READ_GBPS), threads = cores - 1 (`leave_a_core`): one thread's mat-vecs reach ~20 GB/s on a desktop,
# all of them together ~70% of the DIMMs' peak (STREAM-like reads); docs/plan.md
RAM_EFFICIENCY = 0.7
PER_THREAD_READ_GBPS = ASSUMED_RAM_GBPS
ASSUMED_RAM_PEAK_GBPS = 51.2  # dual-channel DDR4-3200, when --cores is given without a RAM figure
ASSUMED_DISK_GBPS = 2.0  # an NVMe SSD reading MB-sized expert ranges with one reader


def pcie_link_gbps(generation: int | None, width: int | None) -> float | None:
    """Usable host->device GB/s of a PCIe link, or None when either number is unknown."""
    if not generation or not width or generation not in PCIE_LANE_GBPS:
        return None
    return PCIE_LANE_GBPS[generation] * width * PCIE_EFFICIENCY


# -- what-if presets (`moechat fit --gpu/--ram/--link`) ------------------------------------------------------
# Each figure is a vendor's or a standard's published number, named in `source`; the plan applies its own
# efficiencies on top (GPU_EFFICIENCY in plan.py, RAM_EFFICIENCY and PCIE_EFFICIENCY here), and says so.

@dataclass(frozen=True)
class GpuPreset:
    name: str  # the flag's value: rtx-4070
    label: str  # NVIDIA GeForce RTX 4070
    vram_gib: float  # GDDR sizes are binary: "12 GB" is 12 GiB
    memory_gbps: float  # peak memory bandwidth
    pcie_gen: int
    pcie_width: int
    source: str = "NVIDIA spec"


GPU_PRESETS = {p.name: p for p in (
    GpuPreset("rtx-3060", "NVIDIA GeForce RTX 3060", 12, 360, 4, 16),
    GpuPreset("rtx-3090", "NVIDIA GeForce RTX 3090", 24, 936, 4, 16),
    GpuPreset("rtx-4060", "NVIDIA GeForce RTX 4060", 8, 272, 4, 8),
    GpuPreset("rtx-4060-ti-16gb", "NVIDIA GeForce RTX 4060 Ti 16GB", 16, 288, 4, 8),
    GpuPreset("rtx-4070", "NVIDIA GeForce RTX 4070", 12, 504, 4, 16),
    GpuPreset("rtx-4080", "NVIDIA GeForce RTX 4080", 16, 716.8, 4, 16),
    GpuPreset("rtx-4090", "NVIDIA GeForce RTX 4090", 24, 1008, 4, 16),
    GpuPreset("rtx-5090", "NVIDIA GeForce RTX 5090", 32, 1792, 5, 16),
    GpuPreset("a100-80gb-pcie", "NVIDIA A100 80GB PCIe", 80, 1935, 4, 16),
    GpuPreset("h100-pcie", "NVIDIA H100 PCIe", 80, 2000, 5, 16),
)}


@dataclass(frozen=True)
class RamPreset:
    name: str  # ddr5-dual
    label: str  # dual-channel DDR5-5600
    channels: int  # 64-bit channels (a DDR5 DIMM's two 32-bit subchannels count as one)
    mts: int  # transfers per second, millions

    @property
    def peak_gbps(self) -> float:
        return self.channels * 8 * self.mts / 1000  # 8 bytes a transfer per channel

    @property
    def source(self) -> str:
        return (f"JEDEC {self.label.split()[-1]}: {self.channels} x 8 B x {self.mts:,} MT/s = {self.peak_gbps:g} GB/s "
                "peak")


RAM_PRESETS = {p.name: p for p in (
    RamPreset("ddr4-single", "single-channel DDR4-3200", 1, 3200),
    RamPreset("ddr4-dual", "dual-channel DDR4-3200", 2, 3200),
    RamPreset("ddr5-dual", "dual-channel DDR5-5600", 2, 5600),
    RamPreset("ddr5-quad", "quad-channel DDR5-5600", 4, 5600),
)}


@dataclass(frozen=True)
class LinkPreset:
    name: str  # pcie4-x16
    gen: int
    width: int

    @property
    def gbps(self) -> float:
        return pcie_link_gbps(self.gen, self.width)

    @property
    def source(self) -> str:
        return (f"PCI-SIG PCIe {self.gen}.0 x{self.width}: {PCIE_LANE_GBPS[self.gen] * self.width:.1f} GB/s raw, "
                f"{PCIE_EFFICIENCY:.0%} usable")


LINK_PRESETS = {p.name: p for p in (LinkPreset("pcie3-x16", 3, 16), LinkPreset("pcie4-x8", 4, 8),
                                    LinkPreset("pcie4-x16", 4, 16), LinkPreset("pcie5-x16", 5, 16))}


@dataclass(frozen=True)
class Rate:
    """A bandwidth the plan uses and where it comes from, said beside it: "measured on this machine", "from --gpu
    rtx-4070 preset (NVIDIA spec: 504 GB/s)", "given (--ram-bw-gbs)", "assumed (...)"."""

    gbps: float
    source: str

    def describe(self) -> str:
        return f"{self.gbps:.3g} GB/s ({self.source})"


def host_read_rate(*, peak: Rate | None = None, cores: int | None = None, cores_source: str = "",
                   measured_gbps: float | None = None, what_if: bool = False) -> Rate:
    """The rate the CPU reads expert bytes at during a decode (`Preferences.host_read_gbps`).

    A RAM peak (a --ram preset or --ram-bw-gbs) or --cores: min(RAM_EFFICIENCY x peak, threads x
    PER_THREAD_READ_GBPS), threads = cores - 1 (the pool `leave_a_core` leaves), the peak ASSUMED_RAM_PEAK_GBPS when
    only the cores are given. Else this machine's one-thread probe (`measured_gbps`, what engine/plan/calibration.py
    keeps), unless the machine is a what-if (--vram-gb/--ram-gb): then ASSUMED_RAM_GBPS, said as assumed, never
    this machine's figure silently."""
    if peak is not None or cores is not None:
        if peak is None:
            peak = Rate(ASSUMED_RAM_PEAK_GBPS, "assumed dual-channel DDR4-3200")
        threads = max(1, (cores or 1) - 1)
        by_ram, by_threads = RAM_EFFICIENCY * peak.gbps, threads * PER_THREAD_READ_GBPS
        if by_ram <= by_threads:
            how = f"{RAM_EFFICIENCY:.0%} of {peak.gbps:g} GB/s peak, {peak.source}"
        else:
            how = (f"{threads} thread{'s' if threads > 1 else ''} x {PER_THREAD_READ_GBPS:g} GB/s assumed each"
                   f" ({cores or 1} cores{', ' + cores_source if cores_source else ''}, one left free), under "
                   f"{RAM_EFFICIENCY:.0%} of the {peak.gbps:g} GB/s peak ({peak.source})")
        return Rate(min(by_ram, by_threads), how)
    if measured_gbps is not None and not what_if:
        return Rate(measured_gbps, "measured on this machine, one thread")
    if what_if:
        return Rate(ASSUMED_RAM_GBPS, "assumed: a what-if machine's RAM; --ram PRESET or --ram-bw-gbs sets it")
    return Rate(ASSUMED_RAM_GBPS, "assumed: not measured yet")
