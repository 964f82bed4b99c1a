"""What a machine has, as frozen values: `GpuInfo`, `HostMemory`, `DiskInfo` and `Hardware` (its mode, best GPU,
JSON form), and `Hardware.with_overrides`: the same machine with the user's what-if numbers."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ...units import GiB
from .presets import PCIE_EFFICIENCY, GpuPreset, LinkPreset, pcie_link_gbps


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
