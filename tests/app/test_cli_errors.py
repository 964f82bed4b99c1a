"""Every CLI path ends in one line and exit status 1 (app/cli/guard.py); bad flag values are clear errors before a
model loads; --debug / MOECHAT_DEBUG=1 add the traceback of an unexpected error."""

from __future__ import annotations

import os
import shutil

import pytest

from moechat.app.cli import main as cli
from moechat.app.cli.guard import guarded, take_debug_flag
from moechat.engine.errors import MoechatError, UnexpectedError, typed_errors


def _main(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if a model starts loading: these errors must come first."""
    from moechat.engine.runtime.generate import Engine

    monkeypatch.setattr(Engine, "load", classmethod(lambda *a, **k: pytest.fail("the model was loaded")))


@pytest.mark.parametrize("flags, message", [
    (["--device", "foo"], "device 'foo' is not a device: use cpu, cuda or cuda:N"),
    (["--device", "tpu"], "device 'tpu'"),
    (["--record-trace", "/nonexistent/dir/trace.npz"], "the folder /nonexistent/dir does not exist"),
])
def test_bad_values_fail_before_loading(tiny_models, capsys, no_load, flags, message):
    code, _, err = _main(capsys, "run", str(tiny_models["qwen3_moe"][0]), "--prompt-ids", "1,2", *flags)
    assert code == 1 and message in _one_line(err)


def test_cuda_without_cuda(tiny_models, capsys, no_load):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = _main(capsys, "run", str(tiny_models["qwen3_moe"][0]), "--prompt-ids", "1", "--device", "cuda")
    assert code == 1 and "CUDA is not available here" in _one_line(err)


def test_record_trace_into_a_read_only_folder(tiny_models, tmp_path, capsys, no_load, monkeypatch):
    import errno

    from moechat.engine.io import files

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.geteuid() == 0:  # root writes anywhere: a read-only mount, as the kernel would answer it

        def read_only(*a, **k):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))

        monkeypatch.setattr(files.tempfile, "mkstemp", read_only)
    code, _, err = _main(capsys, "run", str(tiny_models["qwen3_moe"][0]), "--prompt-ids", "1",
                         "--record-trace", str(ro / "t.npz"))
    assert code == 1 and "cannot write the routing trace there" in _one_line(err)


@pytest.mark.parametrize("flags, message", [
    (["--prompt", "caf\udce9"], "not valid UTF-8 text (byte 0xe9 at character 3)"),
    (["--prompt", "hi", "--system", "\udcff"], "not valid UTF-8 text (byte 0xff at character 0)"),
    (["--prompt-ids", "1", "--temperature", "nan"], "expected a finite number"),
    (["--prompt-ids", "1", "--top-k", "-3"], "expected an integer >= 0"),
])
def test_usage_errors(tiny_models, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["run", str(tiny_models["qwen3_moe"][0]), *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_non_utf8_argv_from_a_real_shell(tiny_models):
    """Bytes that are not UTF-8 reach Python as surrogates; the subprocess proves the whole path."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable.encode(), b"-m", b"moechat.app.cli.main", b"run",
                             str(tiny_models["qwen3_moe"][0]).encode(), b"--raw", b"--prompt", b"\xff\xfe"],
                            capture_output=True, timeout=120)
    assert result.returncode == 2 and b"not valid UTF-8" in result.stderr and b"Traceback" not in result.stderr


def test_unexpected_error_is_one_line_and_debug_shows_the_traceback(capsys, monkeypatch):
    import moechat.app.cli.fit as fit

    def boom(args):
        raise RuntimeError("something\nbroke")

    monkeypatch.setattr(fit, "run_fit", boom)
    code, _, err = _main(capsys, "fit", "x")
    assert code == 1
    assert _one_line(err) == ("moechat: error: unexpected RuntimeError: something broke (run again with --debug or "
                              "MOECHAT_DEBUG=1 for the traceback)")
    code, _, err = _main(capsys, "fit", "x", "--debug")
    assert code == 1 and "Traceback" in err and err.rstrip().endswith("moechat: error: unexpected RuntimeError: "
                                                                      "something broke")
    monkeypatch.setenv("MOECHAT_DEBUG", "1")
    code, _, err = _main(capsys, "fit", "x")
    assert code == 1 and "Traceback" in err


def test_engine_entry_points_type_what_they_did_not_expect(tiny_models, monkeypatch, capsys):
    from moechat.engine.runtime import generate

    monkeypatch.setattr(generate, "load_model", lambda *a, **k: (_ for _ in ()).throw(KeyError("boom")))
    with pytest.raises(UnexpectedError, match=r"loading the model failed: unexpected KeyError: 'boom'") as e:
        generate.Engine.load(tiny_models["qwen3_moe"][0])
    assert isinstance(e.value.__cause__, KeyError)
    code, _, err = _main(capsys, "run", str(tiny_models["qwen3_moe"][0]), "--prompt-ids", "1")
    assert code == 1 and "loading the model failed: unexpected KeyError" in _one_line(err)


def test_typed_errors_on_generators():
    @typed_errors("streaming")
    def stream(fail):
        yield 1
        if fail == "typed":
            raise MoechatError("typed")
        raise ValueError("bad")

    with pytest.raises(UnexpectedError, match="streaming failed: unexpected ValueError: bad"):
        list(stream("x"))
    with pytest.raises(MoechatError, match="^typed$"):
        list(stream("typed"))
    g = stream("x")
    next(g)
    g.close()  # closing is not an error


def test_guard_basics(capsys):
    assert guarded(lambda: 0) == 0
    assert guarded(lambda: (_ for _ in ()).throw(KeyboardInterrupt())) == 130
    assert "stopped" in capsys.readouterr().err
    assert guarded(lambda: (_ for _ in ()).throw(MemoryError())) == 1
    assert "out of memory" in capsys.readouterr().err
    assert take_debug_flag(["run", "--debug", "m"]) == (True, ["run", "m"])
    assert take_debug_flag(["run", "--", "--debug"])[1] == ["run", "--", "--debug"]


def test_fit_on_a_fifo_config(tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    os.mkfifo(model / "config.json")
    code, _, err = _main(capsys, "fit", str(model))
    assert code == 1 and "FIFO" in _one_line(err)


def test_trace_written_whole_or_not_at_all(tiny_models, tmp_path, capsys, monkeypatch):
    """The trace is saved after the reply; a write that fails then is an error line and exit 1, the reply printed,
    and no partial file."""
    import numpy as np

    path = tmp_path / "trace.npz"

    def full_disk(f, *a, **k):
        f.write(b"PK partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez_compressed", full_disk)
    code, out, err = _main(capsys, "run", str(tiny_models["qwen3_moe"][0]), "--prompt-ids", "1,2", "--max-tokens",
                           "2", "--record-trace", str(path), "--json")
    assert code == 1 and '"token_ids"' in out
    assert "cannot write the routing trace: No space left on device" in err
    assert list(tmp_path.iterdir()) == []
    shutil.rmtree(tmp_path, ignore_errors=True)
