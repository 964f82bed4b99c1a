"""`moechat run`: the flag contract, JSON output, and one-line errors with no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from moechat.app.cli.main import main
from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "moechat.app.cli.main", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


def _json_run(capsys, *args: str) -> dict:
    assert main(["run", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_prompt_ids_json_matches_engine_and_transformers(tiny_models, capsys):
    path, ref = tiny_models["olmoe"]
    out = _json_run(capsys, str(path), "--prompt-ids", "5,17,42,9", "--max-tokens", "12", "--temperature", "0",
                    "--dtype", "float32")
    expected = ref.generate(torch.tensor([[5, 17, 42, 9]]), do_sample=False, max_new_tokens=12)[0, 4:].tolist()
    assert out["token_ids"] == expected
    assert out["finish_reason"] == "length" and out["generated_tokens"] == 12 and out["prompt_tokens"] == 4
    assert out["prefill_tokens_per_s"] > 0 and out["decode_tokens_per_s"] > 0
    assert out["text"] == ""  # this checkpoint has no tokenizer


def test_chat_prompt_streams_text(tiny_chat_model, capsys):
    path, _, fast = tiny_chat_model
    assert main(["run", str(path), "--prompt", "Hello world", "--max-tokens", "10", "--temperature", "0"]) == 0
    streamed = capsys.readouterr().out
    out = _json_run(capsys, str(path), "--prompt", "Hello world", "--max-tokens", "10", "--temperature", "0")
    ids = fast.apply_chat_template([{"role": "user", "content": "Hello world"}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    engine = Engine.load(path)
    expected = [t for c in engine.generate(ids, sampling=SamplingParams(temperature=0.0, do_sample=False),
                                           max_tokens=10) for t in c.token_ids]
    assert out["token_ids"] == expected
    assert out["text"] == fast.decode(expected, skip_special_tokens=True)
    assert streamed.rstrip("\n") == out["text"]


def test_raw_prompt_and_seeded_sampling(tiny_chat_model, capsys):
    path, _, fast = tiny_chat_model
    args = (str(path), "--prompt", "The quick", "--raw", "--max-tokens", "16", "--temperature", "1.0", "--seed")
    a = _json_run(capsys, *args, "7")
    b = _json_run(capsys, *args, "7")
    c = _json_run(capsys, *args, "8")
    assert a["token_ids"] == b["token_ids"]
    assert a["token_ids"] != c["token_ids"]
    assert a["prompt_tokens"] == len(fast("The quick")["input_ids"])


@pytest.mark.parametrize("args, message", [
    (["run", "/no/such/model", "--prompt", "hi"], "no such model directory"),
    (["run", "{dense}", "--prompt-ids", "1,2"], "dense model"),
    (["run", "{moe}", "--prompt-ids", ",".join(["1"] * 40), "--context", "16"], "do not fit the context of 16"),
    (["run", "{moe}", "--prompt", "hi"], "no chat template; use --raw"),
    (["run", "{moe}", "--prompt", "hi", "--raw"], "no tokenizer.json"),
    (["run", "{moe}", "--prompt-ids", "1,99999"], "outside the vocabulary"),
])
def test_errors_are_one_line_without_traceback(tiny_models, tmp_path, args, message):
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"model_type": "llama"}))
    moe = str(tiny_models["mixtral"][0])
    result = _cli(*[a.format(dense=dense, moe=moe) for a in args])
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moechat: error:") and message in lines[0], result.stderr


def test_usage_errors_exit_2():
    result = _cli("run", "somewhere", "--prompt-ids", "1,x")
    assert result.returncode == 2 and "comma-separated token ids" in result.stderr


# -- reasoning models: the thinking is split off the answer ---------------------------------------------------

HARMONY_REPLY = ("<|channel|>analysis<|message|>They greet me. Greet back.<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>Hello there!")


def _harmony_script(fast) -> list[int]:
    return fast.encode(HARMONY_REPLY, add_special_tokens=False) + [fast.convert_tokens_to_ids("<|return|>")]


def test_json_reports_thinking_and_answer_apart(tiny_harmony_model, script_sampler, capsys):
    path, fast = tiny_harmony_model
    ids = _harmony_script(fast)
    script_sampler(ids)
    out = _json_run(capsys, str(path), "--prompt", "hi", "--max-tokens", "100")
    assert out["text"] == "Hello there!" and out["thinking"] == "They greet me. Greet back."
    assert out["token_ids"] == ids and out["finish_reason"] == "stop"


def test_stdout_is_the_answer_and_thinking_is_behind_a_flag(tiny_harmony_model, script_sampler, capsys):
    path, fast = tiny_harmony_model
    script_sampler(_harmony_script(fast))
    assert main(["run", str(path), "--prompt", "hi", "--max-tokens", "100"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "Hello there!\n"
    assert "They greet me" not in captured.err
    assert "[thinking: 26 characters not shown; --show-thinking prints them]" in captured.err
    script_sampler(_harmony_script(fast))
    assert main(["run", str(path), "--prompt", "hi", "--max-tokens", "100", "--show-thinking"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "Hello there!\n"
    assert captured.err.startswith("They greet me. Greet back.\n")  # not a terminal: no colour codes
    assert "not shown" not in captured.err


def test_thinking_is_dimmed_on_a_terminal(tiny_harmony_model, script_sampler, capsys, monkeypatch):
    path, fast = tiny_harmony_model
    script_sampler(_harmony_script(fast))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["run", str(path), "--prompt", "hi", "--max-tokens", "100", "--show-thinking"]) == 0
    assert capsys.readouterr().err.startswith("\x1b[2mThey greet me. Greet back.\x1b[0m\n")


@pytest.mark.parametrize("effort", ["low", "high"])
def test_reasoning_effort_reaches_the_template(tiny_harmony_model, script_sampler, capsys, effort):
    path, fast = tiny_harmony_model
    script_sampler(_harmony_script(fast))
    out = _json_run(capsys, str(path), "--prompt", "hi", "--max-tokens", "100", "--reasoning-effort", effort)
    expected = fast.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False, reasoning_effort=effort)
    assert out["prompt_tokens"] == len(expected)
    assert f"Reasoning: {effort}" in fast.decode(expected)


def test_reasoning_effort_on_a_model_that_ignores_it_is_a_warning(tiny_chat_model, capsys):
    path, _, _ = tiny_chat_model
    assert main(["run", str(path), "--prompt", "hi", "--max-tokens", "2", "--reasoning-effort", "high",
                 "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["generated_tokens"] == 2 and out["thinking"] == ""
    assert "moechat: warning: --reasoning-effort ignored: this model's chat template does not read it" in captured.err


def test_reasoning_effort_choices_are_checked():
    result = _cli("run", "somewhere", "--prompt", "hi", "--reasoning-effort", "max")
    assert result.returncode == 2 and "invalid choice: 'max'" in result.stderr


# -- the thinking switch: --thinking on|off becomes the template's enable_thinking --------------------------

QWEN_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
             "enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")


@pytest.fixture
def switch_model(tiny_chat_model, tmp_path):
    import shutil

    path, _, _ = tiny_chat_model
    copy = shutil.copytree(path, tmp_path / "switch")
    for name in ("chat_template.jinja",):
        (copy / name).unlink(missing_ok=True)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_LIKE
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize(("flag", "tail"), [(None, "<think>\n"), ("on", "<think>\n"),
                                            ("off", "<think>\n\n</think>\n\n")])
def test_thinking_switch_reaches_the_template(switch_model, capsys, flag, tail):
    from moechat.engine.runtime.generate import Engine

    engine = Engine.load(switch_model, dtype="float32")
    kwargs = {} if flag is None else {"enable_thinking": flag == "on"}
    expected = engine.encode_chat([{"role": "user", "content": "hi"}], **kwargs)
    assert engine.tokenizer.decode(expected).endswith("assistant\n" + tail)
    out = _json_run(capsys, str(switch_model), "--prompt", "hi", "--max-tokens", "2",
                    *(() if flag is None else ("--thinking", flag)))
    assert out["prompt_tokens"] == len(expected)
    assert "--thinking ignored" not in capsys.readouterr().err


def test_thinking_on_a_template_without_a_switch_is_a_warning(tiny_chat_model, capsys):
    path, _, _ = tiny_chat_model
    assert main(["run", str(path), "--prompt", "hi", "--max-tokens", "2", "--thinking", "off", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["generated_tokens"] == 2
    assert "moechat: warning: --thinking ignored: this model's chat template has no thinking switch" in captured.err
