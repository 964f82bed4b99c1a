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
    """The compute threads `--threads` defaults to: every core on 1 or 2 cores, every core but one from 3.

    Measured on the 2-core machine with torch's ops on one thread and native.c's pool on both (`set_threads` below;
    interleaved fresh processes, quiet machine, 128-token prompt + 32 greedy tokens on the 2-layer shapes): Qwen3-30B-
    A3B-shaped int4 + int4 dense prefill 532-586 -> 684-836 tok/s and decode 53.5-55.7 -> 55.3-66.2 from 1 thread to
    2, bf16 342-378 -> 519-571 and 22.2-23.1 -> 31.1-31.3, GPT-OSS-20B-shaped MXFP4 287-293 -> 368-397 and 14.6-15.3
    -> 20.1-20.7; the demo model decodes ~400 tok/s either way. With torch's OpenMP pool on both cores instead, the
    demo model fell to ~285 and the busy machine once to 1.4-95 tok/s (an OpenMP op waits at its barrier for its
    slowest thread, where the pool's chunks let a late worker just help less). From 3 cores one is left for the UI
    thread, the transfer worker and the CUDA driver (not measured beyond 2 cores here)."""
    cores = usable_cores() if cores is None else cores
    return max(1, cores if cores <= 2 else cores - 1)


def default_threads_help(cores: int | None = None) -> str:
    """The default of `--threads`, as --help states it: the rule per core count and what it is on this machine
    (from `usable_cores`, no torch: the parsers are built at start-up)."""
    cores = usable_cores() if cores is None else cores
    return (f"every core on 1 or 2 cores, every core but one from 3 (C-1 on C; here {default_threads(cores)} of "
            f"{cores} usable core{'s' if cores != 1 else ''})")


def quiet_openmp(environ=os.environ) -> None:
    """OMP_WAIT_POLICY=passive unless the user set a policy: torch's OpenMP workers then sleep after each op
    instead of spinning (libgomp's default), so they do not take the core native.c's pool wants next (issue 27:
    2 threads decoded 1.4 tok/s with spinning workers on the busy 2-core machine, 95 passive; bench/threads.py).
    It acts only before torch loads its OpenMP runtime: the CLI and the app's load thread call it before
    `import torch`."""
    if "OMP_WAIT_POLICY" not in environ:
        environ["OMP_WAIT_POLICY"] = "passive"


TORCH_ONE_THREAD_UP_TO = 2  # compute threads up to which torch's ops run on one thread and only the pool spreads


def torch_threads(threads: int) -> int:
    """torch's intra-op threads for `threads` compute threads: 1 up to TORCH_ONE_THREAD_UP_TO (native.c's pool takes
    every thread: its kernels are most of a CPU step, and torch's OpenMP ops beside it cost more than they gained on
    2 cores, `default_threads`), else all of them (more cores: torch's prefill GEMMs want them; not measured here)."""
    return 1 if threads <= TORCH_ONE_THREAD_UP_TO else threads


def set_threads(torch, threads: int | None = None) -> int:
    """Size native.c's pool and torch's intra-op pool once, at load: `threads` when given (`--threads N`), else an
    explicit OMP_NUM_THREADS / MKL_NUM_THREADS (torch's count, which the pool then follows), else
    `default_threads()`; torch gets `torch_threads` of them. Returns the compute threads (the pool's size). Results
    do not depend on it: the engine's paths are chosen by shape, never by the thread count, and native.c splits
    outputs, never a sum (tests/engine/test_threads.py)."""
    from ...quant import native

    lib = native.library()
    if threads is None:
        if any(os.environ.get(name) for name in THREAD_ENV):
            if lib is not None:
                native.pin_threads(lib, None)  # the pool follows torch's count, as the user set it
            return torch.get_num_threads()
        # a pool already made smaller is kept (the pinned count where an earlier set_threads pinned it)
        prior = getattr(lib, "moechat_pinned", None) if lib is not None else None
        threads = min(prior or torch.get_num_threads(), default_threads())
    if not 1 <= threads <= MAX_THREADS:
        from ...errors import ConfigError

        raise ConfigError(f"--threads {threads}: give 1 to {MAX_THREADS} (this machine has {usable_cores()} cores)")
    torch.set_num_threads(torch_threads(threads))
    if lib is not None:
        native.pin_threads(lib, threads)
    return threads


def leave_a_core(torch) -> int:
    """The app's default threads (`set_threads` with `default_threads()`: every core on 1-2 cores, torch's ops on
    one of them; every core but one from 3); returns the compute threads.

    torch runs an op on one thread per core, and an OpenMP op waits at its barrier for its slowest thread: when
    any other thread (the app's UI, another process) takes a core, a descheduled worker stalls every op. On the
    2-core CI machine the demo model decoded at 67-78 tok/s on 1 thread and 7.8-8.1 on 2 with the machine merely
    busy, 2.9-3.5 on 2 with a busy-loop neighbour (1 thread: 26-78); in the app the shown panel cost 11% of decode
    speed on 2 threads and 2% on 1 (bench/tui_overhead.py, bench/startup.py). An explicit OMP_NUM_THREADS or
    MKL_NUM_THREADS is left alone.
    """
    return set_threads(torch)
