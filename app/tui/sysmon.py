"""RAM and VRAM in use and free, for the live panel; sampled once a second off the UI thread.

RAM comes from psutil (system used/available and this process's resident set). VRAM comes from NVML
when an NVIDIA driver is there; NVML is optional: the first failure (no library, no driver, a
mismatched driver) is kept as a one-line note and NVML is not tried again, so a CPU-only machine pays
for one failed `nvmlInit` and shows "VRAM: n/a (no NVIDIA driver)".
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class GpuMemory:
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class MemoryReading:
    ram_total_bytes: int
    ram_used_bytes: int
    ram_available_bytes: int
    process_rss_bytes: int
    gpus: tuple[GpuMemory, ...] = ()
    vram_note: str | None = None  # why there is no VRAM figure


def _nvml_reason(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if "LibraryNotFound" in type(e).__name__ or "not found" in text.lower() or isinstance(e, ImportError):
        return "no NVIDIA driver"
    return f"NVML: {text}"


class MemoryProbe:
    def __init__(self):
        self._nvml = None
        self._nvml_note: str | None = None
        self._nvml_tried = False
        self._lock = threading.Lock()
        self._process = psutil.Process(os.getpid())

    def _init_nvml(self) -> None:
        self._nvml_tried = True
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception as e:  # any NVML failure is a note, never a crash
            self._nvml_note = _nvml_reason(e)

    def _gpus(self) -> tuple[GpuMemory, ...]:
        nv = self._nvml
        out = []
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                mem = nv.nvmlDeviceGetMemoryInfo(handle)
                name = nv.nvmlDeviceGetName(handle)
                out.append(GpuMemory(name.decode() if isinstance(name, bytes) else str(name), int(mem.total),
                                     int(mem.used), int(mem.free)))
        except Exception as e:
            self._nvml_note = _nvml_reason(e)
            self._nvml = None
            return ()
        if not out:
            self._nvml_note = "no NVIDIA GPU"
        return tuple(out)

    def read(self) -> MemoryReading:
        with self._lock:
            if not self._nvml_tried:
                self._init_nvml()
            vm = psutil.virtual_memory()
            try:
                rss = self._process.memory_info().rss
            except psutil.Error:
                rss = 0
            gpus = self._gpus() if self._nvml is not None else ()
            return MemoryReading(vm.total, vm.total - vm.available, vm.available, rss, gpus,
                                 None if gpus else self._nvml_note or "no NVIDIA GPU")
