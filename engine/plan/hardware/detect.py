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

import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from ...units import GB, GiB
from .cgroups import _int_or_none, cgroup_memory
from .machine import DiskInfo, GpuInfo, Hardware, HostMemory
from .presets import PCIE_EFFICIENCY, pcie_link_gbps


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
