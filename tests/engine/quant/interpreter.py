"""The Triton interpreter's test scripts run as side-by-side shards: each such test file, run as a script under
TRITON_INTERPRET=1, computes its cases in one process (the flag is read when a kernel is decorated, so it must never
reach the suite), and the interpreter is single-threaded Python: a file of ~40 cases took 136 s on one core of a
2-core CI machine while the other idled. `run` starts one process per core (at most `MAX_SHARDS`), each taking the
cases `shard(cases)` gives it (every `n`-th, by argv), and returns their printed lines."""

from __future__ import annotations

import os
import subprocess
import sys

MAX_SHARDS = 4


def shard(cases: list) -> list:
    """The cases of the shard this script run was given (argv: index, count; none: all of them)."""
    if len(sys.argv) >= 3:
        i, n = int(sys.argv[1]), int(sys.argv[2])
        return cases[i::n]
    return cases


def first_shard() -> bool:
    """Whether this run computes the script's one-off checks (shard 0, or an unsharded run)."""
    return len(sys.argv) < 3 or sys.argv[1] == "0"


def run(script: str, timeout: int, extra: list[str] | None = None) -> list[str]:
    """`script` under TRITON_INTERPRET=1 as n processes side by side (n = this machine's cores, 1..MAX_SHARDS): the
    lines all of them printed. A failed shard fails the fixture with its stderr's tail."""
    n = max(1, min(MAX_SHARDS, os.cpu_count() or 1))
    env = dict(os.environ, TRITON_INTERPRET="1")
    procs = [subprocess.Popen([sys.executable, script, *(extra or []), str(i), str(n)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
    lines = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-4000:]
            lines += out.splitlines()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return lines
