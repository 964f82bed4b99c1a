"""A container's limits, read from cgroup v1 and v2 files: the CPU quota (`docker --cpus 2`) and the memory limit.

Both walk from this process's cgroup (/proc/self/cgroup) up to the root and keep the tightest limit, since a limit
set on a parent binds every child. A missing or unreadable file counts as no limit: a machine without cgroups
has none, never an error.
"""

from __future__ import annotations

from pathlib import Path

# cgroup v1 writes "no limit" as a huge page-aligned number (2^63 - 4096 on x86-64).
CGROUP_V1_UNLIMITED = 1 << 62


def _int_or_none(value) -> int | None:
    """NVML and sysfs report 'not available' as None, 0xFFFFFFFF, or a string like '[N/A]'."""
    try:
        value = int(value)
    except (TypeError, ValueError):
        return None
    return None if value < 0 or value in (0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF) else value


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
