"""`moechat pull REPO` and repo ids for `run`, `chat` and `fit`, against the local Hub (tests/hubserver.py)."""

from __future__ import annotations

import io
import json

from moechat.app.cli.main import main
from moechat.app.cli.pull import ProgressBar


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_pull_then_run_and_fit_offline_on_the_repo_id(hub, capsys, monkeypatch):
    code, out, err = _main(capsys, "pull", hub.repo, "--json")
    assert code == 0, err
    data = json.loads(out)
    sha = hub.server.repos[hub.repo].sha
    assert data["revision"] == sha and data["path"].endswith(f"models--tiny-org--chat-moe/snapshots/{sha}")
    assert data["plan"]["to_download_bytes"] == data["plan"]["total_bytes"] > 0
    assert data["plan"]["skipped"] == ["README.md", "pytorch_model.bin"]
    # the pull said what it would do, on stderr
    assert f"{hub.repo} at {sha[:12]}: 10 files" in err and "to download: 0.9 MiB" in err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.server.requests.clear()
    code, out, err = _main(capsys, "run", hub.repo, "--prompt-ids", "1,2,3", "--max-tokens", "3", "--temperature",
                           "0", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["model"] == data["path"] and result["generated_tokens"] == 3
    code, out, err = _main(capsys, "fit", hub.repo, "--json", "--vram-gb", "0", "--ram-gb", "16", "--disk-gb", "10")
    assert code == 0, err
    fit = json.loads(out)
    assert fit["spec"]["source"] == "safetensors headers" and fit["spec"]["weights_present"] and fit["runnable"]
    assert hub.server.requests == []  # offline: not one request
    # a second pull (online) downloads nothing and prints the same path
    monkeypatch.delenv("HF_HUB_OFFLINE")
    code, out, err = _main(capsys, "pull", hub.repo)
    assert code == 0 and out.strip() == data["path"] and "already in the cache: 10 files" in err


def test_fit_on_a_repo_id_not_downloaded_reads_only_config_and_headers(hub, capsys):
    code, out, err = _main(capsys, "fit", hub.repo, "--vram-gb", "0", "--ram-gb", "16", "--disk-gb", "10")
    assert code == 0, err
    assert "moechat fit tiny-org/chat-moe (qwen3_moe): runs" in out and "(exact)" in out
    assert "safetensors headers (Hub)" in out
    assert "run with  moechat run tiny-org/chat-moe " in out and "after the download" in out
    weights = [r for r in hub.server.requests if r.file and r.file.endswith(".safetensors") and r.method == "GET"]
    assert weights and all(r.range == "bytes=0-100000" for r in weights)
    assert not hub.server.file_requests("pytorch_model.bin")


def test_errors_are_one_line_and_name_the_fix(hub, capsys):
    code, out, err = _main(capsys, "pull", hub.gated)
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith("moechat: error: tiny-org/gated-moe is gated (401): accept its conditions")
    for argv in (["run", "nobody/nothing", "--prompt", "hi"], ["chat", "nobody/nothing"]):
        code, out, err = _main(capsys, *argv)
        assert code == 1 and err.count("\n") == 1, argv
        assert "nobody/nothing is not downloaded" in err and "run moechat pull nobody/nothing" in err, argv
    code, out, err = _main(capsys, "pull", "not a repo")
    assert code == 1 and "not a Hub repo id" in err
    code, out, err = _main(capsys, "pull", "nobody/nothing")
    assert code == 1 and "nobody/nothing: no such model on http://127.0.0.1:" in err


def test_progress_bar_draws_in_place_on_a_terminal(hub):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    bar = ProgressBar(stream)
    hub.client.download(hub.repo, progress=bar)
    bar.finish()
    text = stream.getvalue()
    assert "to download: 0.9 MiB" in text and "100.0%" in text and "10/10 files" in text and "\r\x1b[2K" in text


def test_a_hostile_hub_api_is_one_line_for_pull_and_fit(hub, capsys, monkeypatch):
    from moechat.engine.plan import hubhttp

    monkeypatch.setattr(hubhttp, "MAX_PAGES", 5)
    f = hub.server.faults
    f.info_without_sizes, f.tree_page, f.tree_endless = True, 4, "junk"  # a tree listing without end
    for argv in (["pull", hub.repo], ["fit", hub.repo, "--vram-gb", "0", "--ram-gb", "16", "--disk-gb", "10"]):
        code, out, err = _main(capsys, *argv)
        assert code == 1 and out == "" and err.count("\n") == 1, (argv, err)
        assert "the Hub's tree listing (" in err and "it goes on past 5 pages" in err, (argv, err)
    hub.server.reset()
    hub.server.faults.canned["info"] = hub.module.Canned(body=b'{"sha": "' + b"a" * 40 + b'", "siblings": [7]}')
    code, out, err = _main(capsys, "pull", hub.repo)
    assert code == 1 and err.count("\n") == 1
    assert "the Hub's model info (" in err and "siblings[0] is a number, not an object" in err
