"""Command-line values are checked before the model loads, in one line that says what to do (issue 26).

Every sampling flag is checked at parse time, by the engine's own rules, in run, chat and serve alike (exit 2);
MODEL is one metavar with one help; a usage error is one line; `--version` lists the CPU compute paths; a
--prefetch that could do nothing is refused from the arguments before the weights are read.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moechat.app.cli import main as cli

BAD = [  # flag, value, what the usage line must say
    ("--temperature", "1e-45", "expected 0 (greedy) or at least 0.001"),
    ("--temperature", "-1", "expected a number >= 0"),
    ("--temperature", "nan", "expected a finite number"),
    ("--top-p", "1.5", "expected a number in (0, 1], got 1.5"),
    ("--top-p", "0", "expected a number in (0, 1] (0 would keep only the likeliest token: for that, pass "
                     "--temperature 0), got 0"),
    ("--top-k", "2.5", "expected a whole number, got '2.5'"),
    ("--top-k", "-3", "expected an integer >= 0"),
    ("--min-p", "1.5", "expected a number in [0, 1], got 1.5"),
    ("--repetition-penalty", "0", "expected a number > 0 (1.0 turns it off), got 0"),
    ("--repetition-penalty", "inf", "expected a finite number"),
    ("--seed", "-1", "expected an integer in [0, 2**64), got -1"),
    ("--seed", str(2**64), "expected an integer in [0, 2**64)"),
    ("--max-tokens", "0", "expected a number > 0, got 0"),
]
COMMANDS = {"run": ["run", "--prompt-ids", "1"], "chat": ["chat"], "serve": ["serve"]}


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if anything past parsing runs: a model load, the app, the server."""
    from moechat.app.serve import server as serve
    from moechat.app.tui import launch
    from moechat.engine.runtime.generate import Engine

    monkeypatch.setattr(Engine, "load", classmethod(lambda *a, **k: pytest.fail("the model was loaded")))
    monkeypatch.setattr(launch, "run_chat", lambda args: pytest.fail("the app was started"))
    monkeypatch.setattr(serve, "run_serve", lambda args: pytest.fail("the server was started"))


def _usage_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("flag, value, message", BAD)
def test_every_sampling_flag_is_checked_at_parse_time_in_every_command(capsys, no_load, command, flag, value,
                                                                       message):
    line = _usage_line(capsys, [*COMMANDS[command], f"{flag}={value}"])
    head, tail = f"moechat {command}: error: argument {flag}: ", f" (see moechat {command} --help)"
    assert line.startswith(head) and line.endswith(tail) and message in line


@pytest.mark.parametrize("command", list(COMMANDS))
def test_good_sampling_values_reach_every_command(command):
    from moechat.app.cli.engine_args import sampling_overrides

    args = cli.build_parser().parse_args([*COMMANDS[command], "--temperature", "0.7", "--top-k", "20", "--top-p",
                                          "0.95", "--min-p", "0.05", "--repetition-penalty", "1.1", "--seed", "7",
                                          "--max-tokens", "64"])
    assert sampling_overrides(args) == {"temperature": 0.7, "top_k": 20, "top_p": 0.95, "min_p": 0.05,
                                        "repetition_penalty": 1.1, "seed": 7}
    assert args.max_tokens == 64
    bare = cli.build_parser().parse_args(COMMANDS[command])
    assert sampling_overrides(bare) == {} and bare.max_tokens is None  # left out: the model's own


def test_the_parse_time_checks_are_the_engines_rules():
    """Whatever the CLI accepts, SamplingParams accepts (top_p 0 aside, which only the CLI refuses)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from moechat.app.cli import argtypes
    from moechat.engine.errors import ConfigError
    from moechat.engine.runtime.sampling import SamplingParams

    types = {"temperature": argtypes.temperature, "top_p": argtypes.top_p, "min_p": argtypes.min_p,
             "repetition_penalty": argtypes.repetition_penalty}

    @settings(max_examples=200, deadline=None)
    @given(st.sampled_from(sorted(types)), st.floats(allow_nan=True, allow_infinity=True, width=32))
    def check(name, value):
        import argparse

        try:
            parsed = types[name](repr(value))
        except argparse.ArgumentTypeError:
            parsed = None
        try:
            SamplingParams(**{name: value})
            engine_ok = True
        except ConfigError:
            engine_ok = False
        if parsed is not None:
            assert engine_ok and parsed == value
        else:
            assert not engine_ok or (name == "top_p" and value == 0)

    check()


def test_usage_errors_are_one_line_from_the_real_command():
    """The process itself: no usage block, exit 2, and the parse never imports torch."""
    code = ("import sys; from moechat.app.cli import main as cli\n"
            "try:\n    cli.build_parser().parse_args(['run', '--prompt-ids', '1', '--top-p', '0.5', '--seed', '3'])\n"
            "finally:\n    print('torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr
    for argv in (["run", "--prompt-ids", "1", "--repetition-penalty", "0"], ["serve", "--top-p", "0"],
                 ["chat", "--nope"], ["run"]):
        result = subprocess.run([sys.executable, "-m", "moechat.app.cli.main", *argv], capture_output=True, text=True,
                                timeout=120)
        lines = result.stderr.splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert lines[0].startswith(f"moechat {argv[0]}: error: ") and lines[0].endswith(f"(see moechat {argv[0]} "
                                                                                        "--help)")


def test_one_model_metavar_and_help_everywhere():
    from moechat.app.cli.engine_args import MODEL_HELP

    parser = cli.build_parser()
    subs = parser._subparsers._group_actions[0].choices
    for name in ("run", "chat", "serve"):
        (positional,) = [a for a in subs[name]._actions if not a.option_strings]
        assert positional.metavar == "MODEL" and positional.help == MODEL_HELP
        assert "MODEL_DIR" not in subs[name].format_help()
    assert "directory" in MODEL_HELP and "Hub repo id" in MODEL_HELP
    fit = [a for a in subs["fit"]._actions if not a.option_strings]
    assert fit[0].metavar == "MODEL"


def test_version_first_then_the_cpu_paths(capsys):
    from importlib.metadata import version

    from moechat.engine.quant import native, torch_paths

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    out = capsys.readouterr().out.splitlines()
    assert e.value.code == 0
    assert out[0] == f"moechat {version('moechat')}"  # first and unchanged: scripts compare it
    assert out[1:] == [f"cpu: native kernels: {native.status()}"] + [f"cpu: {s}" for s in torch_paths.status()]


def test_run_json_says_the_cpu_paths(tiny_models, capsys):
    from moechat.engine.quant import native, torch_paths

    code = cli.main(["run", str(tiny_models["qwen3_moe"][0]), "--prompt-ids", "1,2", "--max-tokens", "2",
                     "--temperature", "0", "--device", "cpu", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["cpu_paths"] == {"native": native.status(), "torch": torch_paths.status()}


def test_a_prefetch_with_nothing_to_do_is_refused_before_the_load(tiny_models, capsys, no_load):
    from moechat.engine.cache.prefetch import nothing_to_prefetch

    path = str(tiny_models["qwen3_moe"][0])
    for on_miss in ("auto", "host"):
        code = cli.main(["run", path, "--prompt-ids", "1", "--device", "cpu", "--expert-slots", "6", "--on-miss",
                         on_miss, "--prefetch", "next-layer"])
        lines = capsys.readouterr().err.splitlines()
        assert code == 1 and lines == [f"moechat: error: {nothing_to_prefetch('next-layer')}"]


@pytest.mark.parametrize("flags", [["--on-miss", "load"], ["--ram-cache-mb", "1"], ["--prefetch", "off"]])
def test_a_prefetch_with_something_to_do_is_not_refused(tiny_models, flags):
    from moechat.app.cli.engine_args import cache_config_from_args

    args = cli.build_parser().parse_args(["run", str(tiny_models["qwen3_moe"][0]), "--prompt-ids", "1",
                                          "--expert-slots", "6", "--prefetch", "next-layer", *flags])
    config = cache_config_from_args(args, "cpu")
    assert config is not None and config.prefetch == ("off" if flags == ["--prefetch", "off"] else "next-layer")


def test_values_past_the_models_config_are_said_before_a_weight_is_read(tiny_models, capsys, monkeypatch):
    """--host-layers 99 on a 3-MoE-layer model, --expert-slots 100000: lowered and said from config.json, before
    the load starts (it is stopped here, to prove the order)."""
    from moechat.engine.errors import ConfigError
    from moechat.engine.runtime.generate import Engine

    asked = {}

    def stopped(cls, model_dir, **kw):
        asked.update(kw)
        raise ConfigError("the load started here")

    monkeypatch.setattr(Engine, "load", classmethod(stopped))
    code = cli.main(["run", str(tiny_models["qwen3_moe"][0]), "--prompt-ids", "1", "--device", "cpu", "--context",
                     "8192", "--expert-slots", "100000", "--host-layers", "99"])
    lines = capsys.readouterr().err.splitlines()
    assert code == 1 and lines == [
        "moechat: warning: --context 8192: using 512: the model has 512 positions (max_position_embeddings)",
        "moechat: warning: --expert-slots 100000: using 24: the model has 24 routed experts, and a slot holds one",
        "moechat: warning: --host-layers 99: using 3: the model has 3 MoE layers",
        "moechat: error: the load started here"]
    assert asked["context"] == 512 and asked["cache"].expert_slots == 24 and asked["cache"].host_layers == 3
