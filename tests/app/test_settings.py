"""Settings: the TOML writer round-trips through tomllib; bad files fall back to defaults with a reason."""

from __future__ import annotations

import math
import os
import tomllib

import pytest

from moechat.app.tui.settings import Settings, config_dir, data_dir, dumps


def test_dumps_round_trips_through_tomllib():
    data = {"name": 'quote " back\\slash\nnew\ttab \x01 \x7f ünï 漢字', "n": 3, "x": 0.1, "big": 1e300,
            "flag": False, "items": ["a", "b c"], "empty": [],
            "table": {"key with space": "v", "inf": math.inf, "neg": -2.5, "none": None}}
    back = tomllib.loads(dumps(data))
    expected = {**data, "table": {"key with space": "v", "inf": math.inf, "neg": -2.5}}
    assert back == expected


def test_settings_save_and_load(app_env):
    path = app_env / "cfg" / "settings.toml"
    s = Settings(path=path)
    s.remember_model("/m/a")
    s.remember_model("/m/b")
    s.remember_model("/m/a")
    s.system_prompt = 'Answer in "French".\nBriefly.'
    s.sampling = {"temperature": 0.2, "top_k": 5}
    s.max_tokens = 300
    s.show_dashboard = False
    assert s.save() is None
    t = Settings.load(path)
    assert t.recent_models == ["/m/a", "/m/b"] and t.last_model == "/m/a"
    assert (t.system_prompt, t.sampling, t.max_tokens, t.show_dashboard) == (
        s.system_prompt, {"temperature": 0.2, "top_k": 5}, 300, False)
    assert t.problem is None


def test_bad_or_missing_file_gives_defaults(app_env):
    assert Settings.load(app_env / "missing.toml").recent_models == []
    bad = app_env / "bad.toml"
    bad.write_text("recent = [unclosed")
    s = Settings.load(bad)
    assert s.recent_models == [] and "cannot read the settings" in s.problem
    wrong_types = app_env / "types.toml"
    wrong_types.write_text('[sampling]\ntemperature = "hot"\ntop_k = 3\n[ui]\nshow_dashboard = 1\n')
    s = Settings.load(wrong_types)
    assert s.sampling == {"top_k": 3} and s.show_dashboard is True


def test_xdg_dirs(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "d"))
    assert config_dir() == tmp_path / "c" / "moechat" and data_dir() == tmp_path / "d" / "moechat"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert config_dir() == tmp_path / "home" / ".config" / "moechat"


def test_reasoning_effort_round_trips_and_bad_values_are_dropped(app_env):
    path = app_env / "settings.toml"
    s = Settings(path=path, reasoning_effort="low")
    assert s.save() is None
    assert '[chat]' in path.read_text() and 'reasoning_effort = "low"' in path.read_text()
    assert Settings.load(path).reasoning_effort == "low"
    assert Settings(path=path).save() is None
    assert Settings.load(path).reasoning_effort is None and "reasoning_effort" not in path.read_text()
    for bad in ('"extreme"', "3", '["low"]'):
        path.write_text(f"[chat]\nreasoning_effort = {bad}\n")
        s = Settings.load(path)  # dropped, and the file set aside (tests/app/test_state_files.py)
        assert s.reasoning_effort is None and "chat.reasoning_effort" in s.problem


def test_thinking_switch_round_trips_and_bad_values_are_dropped(app_env):
    path = app_env / "settings.toml"
    for value, written in ((False, "thinking = false"), (True, "thinking = true")):
        assert Settings(path=path, thinking=value).save() is None
        assert written in path.read_text() and Settings.load(path).thinking is value
    assert Settings(path=path).save() is None
    assert Settings.load(path).thinking is None and "thinking" not in path.read_text()
    for bad in ('"off"', "0", "[true]"):
        path.write_text(f"[chat]\nthinking = {bad}\n")
        s = Settings.load(path)
        assert s.thinking is None and "chat.thinking" in s.problem


def test_chat_thinking_flag_is_checked_and_read():
    import argparse

    from moechat.app.tui.launch import add_chat_parser, thinking_arg

    parser = argparse.ArgumentParser()
    add_chat_parser(parser.add_subparsers(dest="command"))
    assert thinking_arg(parser.parse_args(["chat", "--thinking", "off"])) is False
    assert thinking_arg(parser.parse_args(["chat", "--thinking", "on"])) is True
    assert thinking_arg(parser.parse_args(["chat"])) is None
    with pytest.raises(SystemExit):
        parser.parse_args(["chat", "--thinking", "maybe"])


def test_expert_format_per_model_round_trips_and_bad_values_are_dropped(app_env):
    path = app_env / "settings.toml"
    s = Settings(path=path)
    assert s.expert_format("/models/qwen") == "native"
    s.set_expert_format("/models/qwen", "int4")
    s.set_expert_format('/models/with "quotes" and spaces', "int8")
    s.set_expert_format("/models/oss", "int8")
    s.set_expert_format("/models/oss", "native")  # native is the default: nothing kept
    assert s.save() is None
    t = Settings.load(path)
    assert t.expert_formats == {"/models/qwen": "int4", '/models/with "quotes" and spaces': "int8"}
    assert t.expert_format("/models/qwen") == "int4" and t.expert_format("/models/oss") == "native"
    path.write_text('[expert_format]\n"/a" = "int3"\n"/b" = 4\n"/c" = "int8"\n"/d" = "native"\n')
    s = Settings.load(path)
    assert s.expert_formats == {"/c": "int8"} and "expert_format.'/a' = 'int3' is not allowed" in s.problem
    path.write_text('expert_format = "int8"\n')  # not a table: ignored
    assert Settings.load(path).expert_formats == {}
    with pytest.raises(ValueError, match="native, int8, int4"):
        s.set_expert_format("/m", "fp4")


# -- a symlinked settings.toml (dotfiles) stays a link (issue 25) --------------------------------------------

def test_a_symlinked_settings_file_is_saved_through_the_link(tmp_path):
    dotfile = tmp_path / "dotfiles" / "moechat.toml"
    dotfile.parent.mkdir()
    dotfile.write_text('[chat]\nsystem_prompt = "old"\n')
    dotfile.chmod(0o600)
    link = tmp_path / "cfg" / "settings.toml"
    link.parent.mkdir()
    link.symlink_to(dotfile)
    s = Settings.load(link)
    assert s.system_prompt == "old" and s.problem is None
    s.system_prompt = "new"
    assert s.save() is None
    assert link.is_symlink() and os.readlink(link) == str(dotfile)  # the link stays
    assert Settings.load(dotfile).system_prompt == "new"  # the dotfile holds the new settings
    assert oct(dotfile.stat().st_mode & 0o777) == "0o600"
    assert sorted(p.name for p in link.parent.iterdir()) == ["settings.toml"]


def test_a_bad_symlinked_settings_file_is_set_aside_beside_its_target(tmp_path):
    dotfile = tmp_path / "dotfiles" / "moechat.toml"
    dotfile.parent.mkdir()
    dotfile.write_text("[chat\n")
    link = tmp_path / "settings.toml"
    link.symlink_to(dotfile)
    s = Settings.load(link)
    assert "the file was kept as " + str(dotfile.parent / "moechat.toml.bad-") in s.problem
    assert link.is_symlink() and not dotfile.exists()  # the link stays; the bad bytes moved beside the target
    assert [p.read_text() for p in dotfile.parent.iterdir()] == ["[chat\n"]
    s.system_prompt = "fresh"
    assert s.save() is None and link.is_symlink() and Settings.load(dotfile).system_prompt == "fresh"


def test_settings_onto_a_directory_is_refused_not_replaced(tmp_path):
    path = tmp_path / "settings.toml"
    path.mkdir()
    problem = Settings(path=path, system_prompt="x").save()
    assert "would replace a directory" in problem and path.is_dir()
