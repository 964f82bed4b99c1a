"""CPU cores and compute threads: how many cores this process may use, and the thread pools sized from them
(torch's intra-op pool and native.c's, every core but one by default)."""

from __future__ import annotations

import math
import os
from pathlib import Path

from .cgroups import cgroup_cpu_quota


def usable_cores(proc_cgroup: Path = Path("/proc/self/cgroup"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPU cores this process may run on: its affinity mask where the OS has one, lowered to a container's CPU
    quota (`docker --cpus 2` on a 64-core host sets a quota, not an affinity: 63 torch threads on 2 cores' time)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(proc_cgroup, cgroup_root)
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


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


def default_threads_help(cores: int | None = None) -> str:
    """The default of `--threads`, as --help states it: the rule per core count and what it is on this machine
    (from `usable_cores`, no torch: the parsers are built at start-up)."""
    cores = usable_cores() if cores is None else cores
    return (f"every core but one (1 on 1 or 2 cores, C-1 on C; here {default_threads(cores)} of {cores} usable "
            f"core{'s' if cores != 1 else ''})")


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
        from ...errors import ConfigError

        raise ConfigError(f"--threads {threads}: give 1 to {MAX_THREADS} (this machine has {usable_cores()} cores)")
    torch.set_num_threads(threads)
    from ...quant import native

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
