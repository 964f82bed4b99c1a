"""--threads' default, stated in --help of every command that computes (run, chat, serve) as the rule per core count
and this machine's figure, the same one `set_threads` applies at load."""

from __future__ import annotations

import re

import pytest

from moechat.app.cli.main import build_parser
from moechat.engine.plan import hardware
from moechat.engine.plan.hardware.cores import default_threads_help


def _help(command: str) -> str:
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    return " ".join(sub.format_help().split())  # argparse's wrapping undone


@pytest.mark.parametrize("command", ["run", "chat", "serve"])
def test_help_states_the_default_threads(command):
    text = _help(command)
    assert "--threads N" in text
    here = re.search(r"here (\d+) of (\d+) usable cores?\)", text)
    assert here, text
    assert int(here[1]) == hardware.default_threads() and int(here[2]) == hardware.usable_cores()


@pytest.mark.parametrize("command", ["fit", "pull"])
def test_commands_that_do_not_compute_have_no_threads(command):
    assert "--threads" not in _help(command)


@pytest.mark.parametrize("cores, want", [(1, "here 1 of 1 usable core)"), (2, "here 2 of 2 usable cores)"),
                                         (16, "here 15 of 16 usable cores)")])
def test_default_threads_help_per_core_count(cores, want):
    assert default_threads_help(cores).endswith(want)


def test_the_stated_default_is_the_one_applied(monkeypatch):
    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(hardware.cores, "usable_cores", lambda: 3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        stated = int(re.search(r"here (\d+) of 3", default_threads_help())[1])
        assert hardware.set_threads(torch) == stated == 2
    finally:
        torch.set_num_threads(before)
