"""What a new user meets in the first minutes (issue 18): defaults, help, errors that say what would do, start-up."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from moechat.app.cli import main as cli
from moechat.app.cli import pull
from moechat.engine.errors import ConfigError, NotDownloadedError

DEMO = Path(__file__).resolve().parents[2] / "assets" / "demo-moe"


def _parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


def _exit_code(*argv: str) -> int:
    with pytest.raises(SystemExit) as e:
        _parse(*argv)
    return e.value.code


def test_run_and_chat_default_to_the_bundled_demo_model():
    assert _parse("run", "--prompt", "hi").model_dir is None
    assert _parse("chat").model is None
    assert pull.resolve_model_arg(None) == str(pull.DEMO_MODEL) == str(DEMO)


def test_a_bad_prefetch_depth_is_the_same_usage_error_in_run_and_chat(capsys):
    assert _exit_code("run", "--prompt", "hi", "--prefetch-depth", "5") == 2
    assert _exit_code("chat", "--prefetch-depth", "5") == 2
    err = capsys.readouterr().err
    assert err.count("argument --prefetch-depth: expected a number <= 4, got 5") == 2
    assert _parse("run", "--prompt", "hi", "--prefetch-depth", "4").prefetch_depth == 4


def test_version(capsys):
    assert _exit_code("--version") == 0
    out = capsys.readouterr().out
    assert out.startswith("moechat ") and len(out.split()) >= 2


def test_top_level_help_says_bare_moechat_opens_the_app():
    text = " ".join(cli.build_parser().format_help().split())
    assert "`moechat` alone opens the chat app on the bundled demo model" in text


def _every_parser(parser: argparse.ArgumentParser, name: str = "moechat"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _every_parser(p, f"{name} {sub}")


def test_every_flag_has_help_text():
    missing = [f"{name} {'/'.join(a.option_strings) or a.dest}"
               for name, p in _every_parser(cli.build_parser()) for a in p._actions
               if not isinstance(a, argparse._SubParsersAction) and not a.help]
    assert missing == []


def test_a_relative_path_that_does_not_exist_is_not_taken_for_a_repo_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # resolving is local: no network either way
    with pytest.raises(NotDownloadedError) as e:
        pull.resolve_model_arg("assets/demo-moe")
    msg = str(e.value)
    assert msg.startswith(f"assets/demo-moe is not downloaded, and no such directory is in {tmp_path}: run moechat "
                          "pull assets/demo-moe if it is a Hub repo id, or pass the model's directory")
    assert f"without MODEL ({DEMO})" in msg  # the demo's own name: what would open it
    with pytest.raises(ConfigError, match=rf"^\./nope: no such model directory in {tmp_path}; pass a directory"):
        pull.resolve_model_arg("./nope")
    assert pull.resolve_model_arg(str(DEMO)) == str(DEMO)


def test_a_config_saved_under_another_name_is_named(tmp_path):
    from moechat.engine.plan import read_model_spec

    (tmp_path / "config.reserialized.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        read_model_spec(tmp_path)
    assert str(e.value).endswith(f"config.reserialized.json is there: moechat reads only config.json, so copy the "
                                 f"one that describes this model to config.json (cp {tmp_path}/config.reserialized.json"
                                 f" {tmp_path}/config.json)")


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_run_start_up_imports_neither_textual_nor_torch_dynamo():
    # The parser `moechat run` builds (chat's included) without Textual (0.3 s); loading the demo without
    # torch._dynamo (2.4 s: nn.Embedding's init on the meta device went through torch._refs).
    code = "import sys; from moechat.app.cli import main as cli; cli.build_parser(); print('textual' in sys.modules)"
    assert _python(code) == "False"
    assert _python(f"import sys; from moechat.engine.runtime.generate import Engine; Engine.load({str(DEMO)!r}); "
                   "print('torch._dynamo' in sys.modules)") == "False"


def test_pull_json_prints_json_on_error(capsys):
    # (a Hub error takes the same path: tests/app/test_pull.py's local Hub covers the download itself)
    import json

    assert cli.main(["pull", "not-a-repo", "--json"]) == 1
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["repo_id"] == "not-a-repo" and out["exit_status"] == 1 and out["error_type"] == "ConfigError"
    assert out["error"].startswith("not-a-repo: not a Hub repo id")
    assert captured.err.strip() == f"moechat: error: {out['error']}"


def test_chat_refuses_a_bad_device_before_the_app_opens(monkeypatch, capsys):
    from moechat.app.tui import launch

    opened = []
    monkeypatch.setattr(launch, "_run", lambda app: opened.append(app) or 0)
    assert cli.main(["chat", str(DEMO), "--device", "foo"]) == 1
    assert capsys.readouterr().err == "moechat: error: device 'foo' is not a device: use cpu, cuda or cuda:N\n"
    assert opened == []


@pytest.mark.parametrize("flags, said", [
    (["--prefetch", "next-layer"], "moechat: warning: --prefetch next-layer does nothing here: every expert is "
                                   "resident on the cpu"),
    (["--ram-cache-mb", "1"], "moechat: warning: --ram-cache-mb 1 without --expert-slots: 24 slots chosen (on a CPU "
                              "with a bounded RAM tier: two decode steps' worth of experts), and the 1 MiB RAM tier "
                              "holds 6 experts (168 KiB each)"),
    (["--expert-slots", "1"], "[cache: 1 slot, "),
])
def test_run_says_what_a_flag_did(capsys, flags, said):
    assert cli.main(["run", str(DEMO), "--prompt", "hi", "--max-tokens", "2", "--device", "cpu", *flags]) == 0
    assert said in capsys.readouterr().err


def test_the_command_leaves_without_teardown_and_loses_nothing(tmp_path):
    # `moechat run` (argv from the command line) ends with os._exit once torch is loaded: flushed output, its status
    import json

    code = ("import sys; from moechat.app.cli.main import main; sys.argv = ['moechat'] + sys.argv[1:]; main(); "
            "print('not reached', file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code, "run", "--prompt", "What does math.sqrt do?", "--temperature",
                           "0", "--max-tokens", "12", "--json"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0 and "not reached" not in done.stderr, done.stderr
    assert json.loads(done.stdout)["text"].startswith("Return the square root of x")
    done = subprocess.run([sys.executable, "-c", code, "run", "--prompt", "hi", "--record-trace",
                           str(tmp_path / "no" / "t.npz")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.startswith("moechat: error: ") and "not reached" not in done.stderr
