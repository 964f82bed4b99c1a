"""What this machine has: GPUs (memory, PCIe link), RAM (clamped to a container's cgroup), free disk.

The probe never raises. Each source can fail on its own (no NVIDIA driver, an NVML library that
does not match the driver, `[N/A]` memory on unified-memory boards, no torch, a container without
cgroup files), and each failure becomes a note and a weaker mode instead of a crash:

    gpu          NVML (or torch) reported every GPU's free memory
    gpu-partial  a GPU was found but some numbers are estimated or missing (see `notes`)
    cpu          no usable GPU: the compute device is RAM

Sources, in order: NVML per GPU (name, UUID, total/free memory, PCIe generation and width, memory
clock and bus width); `torch.cuda` to map NVML devices to torch indices by UUID (CUDA_VISIBLE_DEVICES
and CUDA's default FASTEST_FIRST order both renumber devices) and as the fallback for memory
(`mem_get_info`); psutil for RAM, clamped to the tightest cgroup v1/v2 limit above this process; and
`shutil.disk_usage` where the model lives. Every source is a parameter of `probe`, so tests inject
fakes instead of patching this module.

Link bandwidth is the negotiated PCIe generation x width at 80% of the raw rate (TLP and DMA
overheads): PCIe 4.0 x16 is 31.5 GB/s raw, ~25 GB/s usable, so one 9.4 MB Qwen3-30B-A3B expert
crosses in 0.37 ms. GPU memory bandwidth is NVML's max memory clock x 2 (double data rate) x bus width
(RTX 4090: 10501 MHz x 2 x 384 bit = 1008 GB/s; H100 SXM: 2619 MHz x 2 x 5120 bit = 3.35 TB/s).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

# The PCIe rates live with hybrid execution (pure Python), which assumes a link when none was probed.
from ..cache.hybrid import ASSUMED_LINK_GBPS, PCIE_EFFICIENCY, PCIE_LANE_GBPS  # re-exported

GiB = 1 << 30
GB = 1e9

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
# cgroup v1 writes "no limit" as a huge page-aligned number (2^63 - 4096 on x86-64).
CGROUP_V1_UNLIMITED = 1 << 62


def usable_cores(proc_cgroup: Path = Path("/proc/self/cgroup"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPU cores this process may run on: its affinity mask where the OS has one, lowered to a container's CPU
    quota (`docker --cpus 2` on a 64-core host sets a quota, not an affinity: 63 torch threads on 2 cores' time)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(proc_cgroup, cgroup_root)
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def cgroup_cpu_quota(proc_cgroup: Path, cgroup_root: Path) -> float | None:
    """The tightest CPU quota above this process, in cores (v2 cpu.max "quota period"; v1 cpu.cfs_quota_us /
    cpu.cfs_period_us, -1 for none); None when there is none or it cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    best = None
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, rel = fields
        if controllers == "":
            dirs, read = _ancestors(cgroup_root, rel), _cpu_max
        elif "cpu" in controllers.split(","):
            dirs, read = _ancestors(cgroup_root / controllers, rel) or _ancestors(cgroup_root / "cpu", rel), _cfs
        else:
            continue
        for d in dirs:
            q = read(d)
            if q is not None and q > 0 and (best is None or q < best):
                best = q
    return best


def _cpu_max(d: Path) -> float | None:
    try:
        words = (d / "cpu.max").read_text().split()
        if not words or words[0] == "max":
            return None
        return int(words[0]) / int(words[1] if len(words) > 1 else 100_000)
    except (OSError, UnicodeDecodeError, ValueError, ZeroDivisionError):
        return None


def _cfs(d: Path) -> float | None:
    quota, period = _read_int(d / "cpu.cfs_quota_us"), _read_int(d / "cpu.cfs_period_us")
    if quota is None or quota <= 0 or not period:
        return None
    return quota / period


THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
MAX_THREADS = 1024  # --threads above this is a typo (native.c's pool takes 64; torch's cap is the core count anyway)


def default_threads(cores: int | None = None) -> int:
    """The compute threads `--threads` defaults to: every core but one (one thread on 1 or 2 cores).

    Measured on the 2-core CI machine (bench/threads.py, load average 6-9 from other work, medians of interleaved
    fresh processes): the demo model decoded at ~100 tok/s on 1 thread and 1.4-95 on 2, the Qwen3-30B-A3B-shaped
    layer at 24-29 on 1 and 7-9 on 2: the second thread's core is never free there, and an OpenMP op waits for its
    slowest thread. The spare core keeps the UI thread, the transfer worker and the CUDA driver off the pool's."""
    cores = usable_cores() if cores is None else cores
    return max(1, cores - 1)


def quiet_openmp(environ=os.environ) -> None:
    """OMP_WAIT_POLICY=passive unless the user set a policy: torch's OpenMP workers then sleep after each op
    instead of spinning (libgomp's default), so they do not take the core native.c's pool wants next (issue 27:
    2 threads decoded 1.4 tok/s with spinning workers on the busy 2-core machine, 95 passive; bench/threads.py).
    It acts only before torch loads its OpenMP runtime: the CLI and the app's load thread call it before
    `import torch`."""
    if "OMP_WAIT_POLICY" not in environ:
        environ["OMP_WAIT_POLICY"] = "passive"


def set_threads(torch, threads: int | None = None) -> int:
    """Size torch's intra-op pool and native.c's (which follows torch's count) once, at load: `threads` when given
    (`--threads N`), else an explicit OMP_NUM_THREADS / MKL_NUM_THREADS is left alone, else `default_threads()`.
    Returns the pool's size. Results do not depend on it: the engine's paths are chosen by shape, never by the
    thread count, and native.c splits outputs, never a sum (tests/engine/test_threads.py)."""
    if threads is None:
        if any(os.environ.get(name) for name in THREAD_ENV):
            return torch.get_num_threads()
        threads = min(torch.get_num_threads(), default_threads())  # a pool already made smaller is kept
    if not 1 <= threads <= MAX_THREADS:
        from ..errors import ConfigError

        raise ConfigError(f"--threads {threads}: give 1 to {MAX_THREADS} (this machine has {usable_cores()} cores)")
    torch.set_num_threads(threads)
    from ..quant import native

    lib = native.library()
    if lib is not None:
        native.set_threads(lib, threads)
    return torch.get_num_threads()


def leave_a_core(torch) -> int:
    """Give torch's CPU thread pool every core but one; returns the pool's size (`set_threads` with the default).

    torch runs an op on one thread per core, and an OpenMP op waits at its barrier for its slowest thread: when
    any other thread (the app's UI, another process) takes a core, a descheduled worker stalls every op. On the
    2-core CI machine the demo model decoded at 67-78 tok/s on 1 thread and 7.8-8.1 on 2 with the machine merely
    busy, 2.9-3.5 on 2 with a busy-loop neighbour (1 thread: 26-78); in the app the shown panel cost 11% of decode
    speed on 2 threads and 2% on 1 (bench/tui_overhead.py, bench/startup.py). An explicit OMP_NUM_THREADS or
    MKL_NUM_THREADS is left alone.
    """
    return set_threads(torch)


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


def _norm_uuid(uuid) -> str | None:
    """NVML says 'GPU-8c5f...'; torch says '8c5f...' (a uuid.UUID or str); compare without prefix."""
    if uuid is None:
        return None
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    text = text.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text or None


@dataclass(frozen=True)
class GpuInfo:
    """One GPU. Any number may be None when the driver does not report it (see Hardware.notes)."""

    nvml_index: int | None
    torch_index: int | None  # as torch numbers it in this process; None when not visible to torch
    name: str
    uuid: str | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    pcie_gen: int | None = None  # the fastest generation device and host both support (negotiated max)
    pcie_width: int | None = None
    pcie_gen_current: int | None = None  # often lower at idle (power saving); shown, not planned with
    pcie_width_current: int | None = None
    link_gbps: float | None = None  # usable host->device GB/s (measured or estimated, see link_source)
    link_source: str = "unknown"
    memory_gbps: float | None = None  # device memory bandwidth, peak
    source: str = "nvml"  # nvml | torch | nvml+torch | what-if
    memory_source: str = "NVML: max memory clock x 2 x bus width"  # where memory_gbps comes from

    @property
    def label(self) -> str:
        return f"cuda:{self.torch_index}" if self.torch_index is not None else f"nvml:{self.nvml_index}"

    @property
    def usable(self) -> bool:
        """Planning needs its free memory and a torch index to run on."""
        return self.free_bytes is not None and self.torch_index is not None


@dataclass(frozen=True)
class HostMemory:
    total_bytes: int | None
    available_bytes: int | None  # what a new allocation can get without swapping, after the cgroup clamp
    cgroup_limit_bytes: int | None = None
    cgroup_available_bytes: int | None = None
    source: str = "psutil"
    free_now_bytes: int | None = None  # set by `Hardware.on_total_ram`: what was available at the probe


@dataclass(frozen=True)
class DiskInfo:
    path: str
    free_bytes: int | None
    total_bytes: int | None = None
    source: str = "statvfs"
    what: str = ""  # which disk this is: "the Hugging Face cache, where moechat pull downloads", "given by --disk-gb"

    def describe(self) -> str:
        """"/root/.cache/huggingface/hub (the Hugging Face cache, where moechat pull downloads)"."""
        return f"{self.path} ({self.what})" if self.what else self.path


@dataclass(frozen=True)
class Hardware:
    gpus: tuple[GpuInfo, ...]
    ram: HostMemory
    disk: DiskInfo | None
    notes: tuple[str, ...] = field(default_factory=tuple)  # RAM and disk probe degradations
    what_if: tuple[str, ...] = field(default_factory=tuple)  # the numbers the user supplied instead
    gpu_notes: tuple[str, ...] = field(default_factory=tuple)  # GPU probe degradations (dropped by a vram what-if)

    @property
    def all_notes(self) -> tuple[str, ...]:
        return self.gpu_notes + self.notes

    @property
    def mode(self) -> str:
        usable = [g for g in self.gpus if g.usable]
        if not usable:
            return "gpu-partial" if self.gpus else "cpu"
        partial = any(not g.usable or g.link_gbps is None or g.memory_gbps is None for g in self.gpus)
        return "gpu-partial" if partial else "gpu"

    def gpu(self, torch_index: int) -> GpuInfo | None:
        return next((g for g in self.gpus if g.torch_index == torch_index), None)

    def best_gpu(self) -> GpuInfo | None:
        """The usable GPU with the most free memory (lowest torch index on ties)."""
        usable = [g for g in self.gpus if g.usable]
        return max(usable, key=lambda g: (g.free_bytes, -g.torch_index)) if usable else None

    def with_overrides(self, *, vram_gb: float | None = None, ram_gb: float | None = None,
                       disk_gb: float | None = None, link_gbps: float | None = None,
                       gpu_preset: GpuPreset | None = None, link_preset: LinkPreset | None = None) -> Hardware:
        """The same machine with some numbers replaced (what-ifs): GiB for memory and disk, GB/s for the link.

        `vram_gb` keeps one GPU, the probed best one (for its link and memory bandwidth) or a hypothetical
        one, with that much free memory; 0 means no GPU at all. `gpu_preset` is that hypothetical GPU with its
        spec sheet's memory, bandwidth and PCIe link (`vram_gb` still sets its memory); `link_preset` or
        `link_gbps` (given) replace the link. Each figure's source is kept beside it (`link_source`,
        `memory_source`).
        """
        gpus, ram, disk, what_if = self.gpus, self.ram, self.disk, list(self.what_if)
        gpu_notes = self.gpu_notes
        if gpu_preset is not None and (vram_gb is None or vram_gb > 0):
            gpu_notes = ()
            size = int((gpu_preset.vram_gib if vram_gb is None else vram_gb) * GiB)
            src = f"from --gpu {gpu_preset.name} preset"
            gpus = (GpuInfo(None, 0, gpu_preset.label, total_bytes=size, free_bytes=size, pcie_gen=gpu_preset.pcie_gen,
                            pcie_width=gpu_preset.pcie_width,
                            link_gbps=pcie_link_gbps(gpu_preset.pcie_gen, gpu_preset.pcie_width),
                            link_source=f"{src} (PCIe {gpu_preset.pcie_gen}.0 x{gpu_preset.pcie_width} at "
                                        f"{PCIE_EFFICIENCY:.0%} of raw)",
                            memory_gbps=gpu_preset.memory_gbps,
                            memory_source=f"{src} ({gpu_preset.source}: {gpu_preset.memory_gbps:g} GB/s)",
                            source="what-if"),)
            what_if.append(f"GPU {gpu_preset.label} with {size / GiB:g} GiB free")
        elif vram_gb is not None:
            gpu_notes = ()
            if vram_gb <= 0:
                gpus = ()
                what_if.append("no GPU")
            else:
                size = int(vram_gb * GiB)
                base = self.best_gpu() or (self.gpus[0] if self.gpus else None)
                if base is None:
                    base = GpuInfo(None, 0, "what-if GPU", link_source="assumed", source="what-if",
                                   memory_source="assumed")
                gpus = (replace(base, torch_index=0 if base.torch_index is None else base.torch_index,
                                total_bytes=size, free_bytes=size, source="what-if"),)
                what_if.append(f"GPU with {vram_gb:g} GiB free")
        if link_preset is not None and link_gbps is None:
            gpus = tuple(replace(g, link_gbps=link_preset.gbps, pcie_gen=link_preset.gen, pcie_width=link_preset.width,
                                 link_source=f"from --link {link_preset.name} preset ({link_preset.source})")
                         for g in gpus)
            what_if.append(f"link {link_preset.name}")
        if link_gbps is not None:
            gpus = tuple(replace(g, link_gbps=float(link_gbps), link_source="given (--link-gbs)") for g in gpus)
            what_if.append(f"link {link_gbps:g} GB/s")
        if ram_gb is not None:
            size = int(ram_gb * GiB)
            ram = HostMemory(size, size, source="what-if")
            what_if.append(f"RAM {ram_gb:g} GiB available")
        if disk_gb is not None:
            disk = DiskInfo(disk.path if disk else ".", int(disk_gb * GiB), None, source="what-if",
                            what="given by --disk-gb")
            what_if.append(f"disk {disk_gb:g} GiB free")
        return Hardware(gpus, ram, disk, self.notes, tuple(what_if), gpu_notes)

    def on_total_ram(self) -> Hardware:
        """The same machine planned on all of its RAM (the cgroup limit in a container), not on what is free at this
        instant: other programs come and go (15-22 GiB free within minutes on one 23 GiB machine), so a plan on the
        instant's figure changes from one run to the next. The instant's figure is kept in `ram.free_now_bytes`, for
        a note. A RAM what-if is kept as given."""
        ram = self.ram
        if ram.source == "what-if" or ram.total_bytes is None:
            return self
        return replace(self, ram=replace(ram, available_bytes=ram.total_bytes, free_now_bytes=ram.available_bytes))

    def to_json(self) -> dict:
        return {
            "mode": self.mode,
            "gpus": [{k: getattr(g, k) for k in g.__dataclass_fields__} | {"device": g.label} for g in self.gpus],
            "ram": {k: getattr(self.ram, k) for k in self.ram.__dataclass_fields__},
            "disk": None if self.disk is None else {k: getattr(self.disk, k) for k in self.disk.__dataclass_fields__},
            "notes": list(self.all_notes),
            "what_if": list(self.what_if),
        }


# -- NVML ------------------------------------------------------------------------------------------------

def _default_nvml():
    import pynvml  # nvidia-ml-py; a thin ctypes wrapper, cheap to import, fails only on nvmlInit

    return pynvml


def _err(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def _try(fn, *args):
    """(value, None) or (None, reason): NVML raises on [N/A] fields, unsupported queries, lost GPUs."""
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001 - any driver error degrades one field, never the probe
        return None, _err(e)


def _probe_nvml(nvml, notes: list[str]) -> list[GpuInfo] | None:
    """Every GPU NVML reports, or None when NVML itself is unusable."""
    try:
        nvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, a mismatch...
        notes.append(f"NVML unavailable ({_err(e)}): no NVIDIA driver, or one that does not match the library")
        return None
    try:
        count, why = _try(nvml.nvmlDeviceGetCount)
        if count is None:
            notes.append(f"NVML cannot count GPUs ({why})")
            return None
        gpus = []
        for i in range(count):
            handle, why = _try(nvml.nvmlDeviceGetHandleByIndex, i)
            if handle is None:
                notes.append(f"NVML GPU {i}: cannot open ({why}); skipped")
                continue
            name, _ = _try(nvml.nvmlDeviceGetName, handle)
            name = (name.decode() if isinstance(name, bytes) else name) or f"GPU {i}"
            uuid, _ = _try(nvml.nvmlDeviceGetUUID, handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            mem, why = _try(nvml.nvmlDeviceGetMemoryInfo, handle)
            total = free = None
            if mem is not None:
                total, free = _int_or_none(getattr(mem, "total", None)), _int_or_none(getattr(mem, "free", None))
            if free is None:
                notes.append(f"NVML {name} (GPU {i}): memory not reported ([N/A]: {why or 'no value'}); "
                             "unified-memory board?")
            gen, _ = _try(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle)
            width, _ = _try(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle)
            gen_now, _ = _try(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle)
            width_now, _ = _try(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle)
            gen, width = _int_or_none(gen) or _int_or_none(gen_now), _int_or_none(width) or _int_or_none(width_now)
            link = pcie_link_gbps(gen, width)
            bus, _ = _try(nvml.nvmlDeviceGetMemoryBusWidth, handle)
            clock, _ = _try(nvml.nvmlDeviceGetMaxClockInfo, handle, getattr(nvml, "NVML_CLOCK_MEM", 2))
            bus, clock = _int_or_none(bus), _int_or_none(clock)
            membw = clock * 1e6 * 2 * bus / 8 / GB if bus and clock else None
            gpus.append(GpuInfo(
                nvml_index=i, torch_index=None, name=name, uuid=uuid, total_bytes=total, free_bytes=free,
                pcie_gen=gen, pcie_width=width, pcie_gen_current=_int_or_none(gen_now),
                pcie_width_current=_int_or_none(width_now), link_gbps=link,
                link_source=f"PCIe {gen}.0 x{width} at {PCIE_EFFICIENCY:.0%} of raw" if link else "unknown",
                memory_gbps=membw, source="nvml"))
        return gpus
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001, S110 - nothing to do about a failed shutdown
            pass


def _int_or_none(value) -> int | None:
    """NVML and sysfs report 'not available' as None, 0xFFFFFFFF, or a string like '[N/A]'."""
    try:
        value = int(value)
    except (TypeError, ValueError):
        return None
    return None if value < 0 or value in (0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF) else value


# -- torch.cuda ------------------------------------------------------------------------------------------

def _default_cuda(nvml_ok: bool):
    """torch.cuda if torch is already imported, or as the fallback when NVML failed; else None.

    Importing torch costs seconds, so with NVML working and torch not loaded the probe maps devices
    from CUDA_VISIBLE_DEVICES instead.
    """
    if "torch" not in sys.modules and (nvml_ok or not _torch_build_has_gpu()):
        return None
    try:
        import torch
    except Exception:  # noqa: BLE001 - torch missing or broken: the probe goes on without it
        return None
    return torch.cuda


def _torch_build_has_gpu() -> bool:
    """Whether the installed torch was built for CUDA or ROCm, read from torch/version.py without importing torch
    (2-3 s): a CPU-only build cannot see a GPU, so `moechat fit` on a CPU machine stays torch-free. Unknown: True."""
    import importlib.util
    import re

    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return False
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except (OSError, ImportError, ValueError, StopIteration, UnicodeDecodeError):
        return True
    found = {m.group(1): m.group(2) for m in re.finditer(r"^(cuda|hip)\s*(?::[^=]*)?=\s*(.+)$", text, re.M)}
    if not found:
        return True
    return any(v.strip() not in ("None", "") for v in found.values())


def _probe_torch(cuda, notes: list[str]) -> list[dict] | None:
    """[{index, name, uuid, total}] of the devices torch sees ([] when torch has no CUDA), None on error."""
    try:
        if not cuda.is_available():
            return []
        count = cuda.device_count()
    except Exception as e:  # noqa: BLE001
        notes.append(f"torch.cuda unavailable ({_err(e)})")
        return None
    out = []
    for i in range(count):
        props, why = _try(cuda.get_device_properties, i)
        if props is None:
            notes.append(f"torch cuda:{i}: no properties ({why})")
            out.append(dict(index=i, name=f"cuda:{i}", uuid=None, total=None))
            continue
        out.append(dict(index=i, name=str(getattr(props, "name", f"cuda:{i}")), uuid=getattr(props, "uuid", None),
                        total=_int_or_none(getattr(props, "total_memory", None))))
    return out


def _visible_order(environ: Mapping[str, str], gpus: list[GpuInfo], notes: list[str]) -> list[int | None]:
    """torch index -> NVML index from CUDA_VISIBLE_DEVICES (numbers or UUID prefixes), without torch."""
    pci_order = environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST") == "PCI_BUS_ID"
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        if not pci_order and len(gpus) > 1:
            notes.append("torch device numbers assumed equal to NVML's (CUDA orders fastest first unless "
                         "CUDA_DEVICE_ORDER=PCI_BUS_ID)")
        return [g.nvml_index for g in gpus]
    order: list[int | None] = []
    numbers = False
    for entry in (e.strip() for e in cvd.split(",")):
        if not entry:
            continue
        if entry.lstrip("-").isdigit():
            n = int(entry)
            if n < 0 or n >= len(gpus):
                break  # CUDA stops at the first invalid entry
            numbers = True
            order.append(gpus[n].nvml_index)
            continue
        key = _norm_uuid(entry)
        match = [g for g in gpus if key and _norm_uuid(g.uuid) and _norm_uuid(g.uuid).startswith(key)]
        if len(match) != 1:
            if entry.lower().startswith("mig-"):
                notes.append(f"CUDA_VISIBLE_DEVICES names a MIG instance ({entry}); its memory is not probed")
            break
        order.append(match[0].nvml_index)
    if numbers and not pci_order and len(gpus) > 1:
        notes.append("CUDA_VISIBLE_DEVICES numbers read in NVML (PCI bus) order; set CUDA_DEVICE_ORDER=PCI_BUS_ID "
                     "to make that exact")
    return list(dict.fromkeys(order))


def _probe_gpus(nvml, cuda, environ: Mapping[str, str], notes: list[str]) -> list[GpuInfo]:
    nvml_gpus = None
    if nvml is not None:
        nvml_gpus = _probe_nvml(nvml, notes)
    if cuda == "auto":
        cuda = _default_cuda(nvml_ok=nvml_gpus is not None)
    torch_devs = _probe_torch(cuda, notes) if cuda is not None else None
    if nvml_gpus and torch_devs == []:
        notes.append("torch cannot use CUDA here (a CPU-only torch build, or a driver it does not support): "
                     "the GPUs NVML lists are not usable by moechat")
        return [replace(g, torch_index=None) for g in nvml_gpus]
    if nvml_gpus is not None and torch_devs is not None:
        by_uuid = {_norm_uuid(g.uuid): g for g in nvml_gpus if g.uuid}
        out, seen = [], set()
        for dev in torch_devs:
            g = by_uuid.get(_norm_uuid(dev["uuid"])) if dev["uuid"] is not None else None
            if g is None:
                notes.append(f"torch cuda:{dev['index']} ({dev['name']}) has no NVML match by UUID; "
                             "memory from torch.cuda.mem_get_info")
                out.append(_torch_only(cuda, dev, notes))
                continue
            seen.add(g.nvml_index)
            g = replace(g, torch_index=dev["index"], source="nvml+torch")
            if g.free_bytes is None:
                g = _fill_memory_from_torch(cuda, g, notes)
            out.append(g)
        # GPUs NVML sees that this process cannot use (hidden by CUDA_VISIBLE_DEVICES) stay listed, unusable.
        out += [g for g in nvml_gpus if g.nvml_index not in seen]
        return out
    if nvml_gpus is not None:
        order = _visible_order(environ, nvml_gpus, notes)
        index_of = {nv: t for t, nv in enumerate(order)}
        return [replace(g, torch_index=index_of.get(g.nvml_index)) for g in nvml_gpus]
    if torch_devs:
        notes.append("GPU memory from torch.cuda.mem_get_info; PCIe link and memory bandwidth not known")
        return [_torch_only(cuda, dev, notes) for dev in torch_devs]
    return []


def _torch_only(cuda, dev: dict, notes: list[str]) -> GpuInfo:
    g = GpuInfo(nvml_index=None, torch_index=dev["index"], name=dev["name"],
                uuid=None if dev["uuid"] is None else str(dev["uuid"]), total_bytes=dev["total"], source="torch")
    return _fill_memory_from_torch(cuda, g, notes)


def _fill_memory_from_torch(cuda, g: GpuInfo, notes: list[str]) -> GpuInfo:
    info, why = _try(cuda.mem_get_info, g.torch_index)
    if info is None:
        notes.append(f"{g.label} ({g.name}): torch.cuda.mem_get_info failed too ({why}); memory unknown")
        return g
    free, total = (_int_or_none(v) for v in info)
    src = g.source if "torch" in g.source else f"{g.source}+torch"
    return replace(g, free_bytes=free, total_bytes=total if total is not None else g.total_bytes, source=src)


# -- RAM and cgroups -------------------------------------------------------------------------------------

def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if text == "max":
        return None
    return _int_or_none(text)


def _read_stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return _int_or_none(value) or 0
    except (OSError, UnicodeDecodeError):
        pass
    return 0


def _ancestors(root: Path, rel: str) -> list[Path]:
    """root/rel and each parent up to root, existing ones only (in a container the path may not exist)."""
    parts = [p for p in rel.strip("/").split("/") if p and p != ".."]
    dirs = [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def cgroup_memory(proc_cgroup: Path, cgroup_root: Path) -> tuple[int | None, int | None, str]:
    """(limit, available under it, which file) for the tightest memory limit above this process.

    v2: memory.max (the string 'max' means none) and memory.current minus inactive_file; v1:
    memory/memory.limit_in_bytes (huge means none) and memory.usage_in_bytes minus total_inactive_file.
    Page cache that the kernel can drop is counted as available, as the kernel's own OOM logic does.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None, None, ""
    best: tuple[int, int, str] | None = None
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, rel = fields
        if controllers == "":  # v2 unified hierarchy
            for d in _ancestors(cgroup_root, rel):
                limit = _read_int(d / "memory.max")
                if limit is None:
                    continue
                used = (_read_int(d / "memory.current") or 0) - _read_stat(d / "memory.stat", "inactive_file")
                cand = (limit, max(0, limit - max(0, used)), str(d / "memory.max"))
                best = cand if best is None or cand[1] < best[1] else best
        elif "memory" in controllers.split(","):  # v1
            for d in _ancestors(cgroup_root / "memory", rel):
                limit = _read_int(d / "memory.limit_in_bytes")
                if limit is None or limit >= CGROUP_V1_UNLIMITED:
                    continue
                used = ((_read_int(d / "memory.usage_in_bytes") or 0)
                        - _read_stat(d / "memory.stat", "total_inactive_file"))
                cand = (limit, max(0, limit - max(0, used)), str(d / "memory.limit_in_bytes"))
                best = cand if best is None or cand[1] < best[1] else best
    return (best[0], best[1], best[2]) if best else (None, None, "")


def _meminfo(path: Path) -> tuple[int | None, int | None]:
    values = {}
    try:
        for line in path.read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                values[name] = int(parts[0]) * 1024
    except (OSError, ValueError, UnicodeDecodeError):
        return None, None
    return values.get("MemTotal"), values.get("MemAvailable")


def _probe_ram(virtual_memory, proc_cgroup: Path, cgroup_root: Path, meminfo: Path,
               notes: list[str]) -> HostMemory:
    total = avail = None
    source = "psutil"
    try:
        if virtual_memory is None:
            import psutil

            virtual_memory = psutil.virtual_memory
        vm = virtual_memory()
        total, avail = _int_or_none(vm.total), _int_or_none(vm.available)
    except Exception as e:  # noqa: BLE001
        total, avail = _meminfo(meminfo)
        source = "/proc/meminfo"
        notes.append(f"psutil failed ({_err(e)}); RAM from /proc/meminfo" if avail is not None else
                     f"RAM size unknown (psutil: {_err(e)}); pass --ram-gb")
    limit, cg_avail, where = cgroup_memory(proc_cgroup, cgroup_root)
    if limit is not None:
        if total is None or limit < total:
            total = limit
            source += " + cgroup"
        if avail is None or cg_avail < avail:
            avail = cg_avail
            notes.append(f"RAM clamped to the container's cgroup limit ({limit / GiB:.1f} GiB, {where})")
    return HostMemory(total, avail, limit, cg_avail, source)


def _probe_disk(model_path, disk_usage, notes: list[str]) -> DiskInfo | None:
    path = Path(model_path) if model_path is not None else Path.cwd()
    path = path.expanduser().resolve()
    while not path.exists() and path.parent != path:
        path = path.parent  # not downloaded yet: the free space of where it would go
    try:
        usage = disk_usage(str(path))
    except Exception as e:  # noqa: BLE001
        notes.append(f"free disk on {path} unknown ({_err(e)})")
        return DiskInfo(str(path), None)
    return DiskInfo(str(path), int(usage.free), int(usage.total))


def probe(model_path: str | os.PathLike | None = None, *, nvml="auto", cuda="auto",
          virtual_memory: Callable | None = None, environ: Mapping[str, str] | None = None,
          proc_cgroup: Path = Path("/proc/self/cgroup"), cgroup_root: Path = Path("/sys/fs/cgroup"),
          meminfo: Path = Path("/proc/meminfo"), disk_usage: Callable = shutil.disk_usage) -> Hardware:
    """Probe GPUs, RAM and disk. Never raises; every failure is a note and a weaker mode.

    `nvml`: a pynvml-like module ("auto": import pynvml; None: skip). `cuda`: a torch.cuda-like object
    ("auto": torch.cuda when torch is loaded or NVML failed; None: skip). `virtual_memory`: psutil's.
    """
    notes: list[str] = []
    gpu_notes: list[str] = []
    if nvml == "auto":
        try:
            nvml = _default_nvml()
        except Exception as e:  # noqa: BLE001
            gpu_notes.append(f"NVML unavailable (nvidia-ml-py: {_err(e)})")
            nvml = None
    gpus = _probe_gpus(nvml, cuda, os.environ if environ is None else environ, gpu_notes)
    ram = _probe_ram(virtual_memory, proc_cgroup, cgroup_root, meminfo, notes)
    disk = _probe_disk(model_path, disk_usage, notes)
    if not any(g.usable for g in gpus):
        gpu_notes.append("no usable GPU: the compute device is the CPU and its RAM")
    return Hardware(tuple(gpus), ram, disk, tuple(notes), (), tuple(gpu_notes))
