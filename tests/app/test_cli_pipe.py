"""A reader that stops early (`moechat fit X | head -1`) ends moechat quietly with exit 0, as git and ls end, for
every command that prints to stdout (issue 25)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moechat.app.cli.pull import DEMO_MODEL


def _closed_early(argv: list[str], cwd) -> tuple[int, bytes]:
    """Run moechat with its stdout a pipe whose reader is gone before the first byte: the process takes over a
    tenth of a second to start, the pipe closes at once."""
    p = subprocess.Popen([sys.executable, "-m", "moechat.app.cli.main", *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=cwd)
    p.stdout.close()
    err = p.stderr.read()
    return p.wait(timeout=120), err


@pytest.mark.parametrize("argv", [
    ["fit", str(DEMO_MODEL), "--ram-gb", "8", "--vram-gb", "0"],
    ["fit", str(DEMO_MODEL), "--ram-gb", "8", "--vram-gb", "0", "--json"],
    ["--version"],
    ["run", str(DEMO_MODEL), "--prompt-ids", "1,2,3", "--max-tokens", "3", "--temperature", "0", "--device", "cpu"],
])
def test_a_closed_stdout_is_a_quiet_exit_0(argv, tmp_path):
    code, err = _closed_early(argv, tmp_path)
    assert (code, err) == (0, b"")
