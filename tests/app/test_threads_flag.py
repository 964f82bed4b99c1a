"""--threads N on run, serve and chat (issue 27): parsed and checked at parse time, carried to the load (the chat's
LoadOptions), and applied once there with the native pool (`hardware.set_threads`)."""

from __future__ import annotations

import pytest

from moechat.app.cli.main import build_parser
from moechat.app.tui.launch import options_from_args


@pytest.mark.parametrize("command", ["run", "serve", "chat"])
def test_threads_parsed_on_every_command_that_computes(command):
    extra = ["--prompt", "hi"] if command == "run" else []
    assert build_parser().parse_args([command, *extra, "--threads", "3"]).threads == 3
    assert build_parser().parse_args([command, *extra]).threads is None  # the default: set_threads decides at load


@pytest.mark.parametrize("value", ["0", "-1", "two", "100000"])
def test_bad_threads_is_a_usage_error(command_line_error, value):
    out = command_line_error(["run", "--prompt", "hi", "--threads", value])
    assert "--threads" in out


@pytest.fixture
def command_line_error(capsys):
    def parse(argv):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2
        return capsys.readouterr().err.strip().splitlines()[-1]
    return parse


def test_chat_threads_reach_the_load_options():
    assert options_from_args(build_parser().parse_args(["chat", "--threads", "2"])).threads == 2


def test_run_loads_with_the_threads_asked(capsys):
    import torch

    from moechat.app.cli.main import main
    from moechat.engine.quant import native

    before = torch.get_num_threads()
    try:
        assert main(["run", "--threads", "2", "--prompt-ids", "5,6,7", "--max-tokens", "2", "--temperature", "0"]) == 0
        assert torch.get_num_threads() == 1  # up to 2 threads torch's ops run on one, the native pool on both
        lib = native.library()
        assert lib is None or lib.moechat_threads == 2
    finally:
        torch.set_num_threads(before)
