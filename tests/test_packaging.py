"""Packaging and architecture boundaries: import names, package list, lazy imports."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import moechat.app
import moechat.engine

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_every_package_folder_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    found = set()
    for name, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert found == listed, f"not listed: {sorted(found - listed)}, listed but absent: {sorted(listed - found)}"
    # every folder holding Python modules is a package (else it would silently not be installed)
    for folder in mapping.values():
        for py in (ROOT / folder).rglob("*.py"):
            assert (py.parent / "__init__.py").exists(), f"{py.parent} has modules but no __init__.py"


def test_import_names_map_to_the_top_level_folders():
    assert Path(moechat.engine.__file__).parent == ROOT / "engine"
    assert Path(moechat.app.__file__).parent == ROOT / "app"


def test_bare_engine_and_app_are_not_importable(tmp_path):
    for name in ("engine", "app"):
        result = _run(f"import {name}", cwd=tmp_path)
        assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr, name


def test_engine_never_imports_textual(tmp_path):
    code = ("import sys, moechat.engine.generate, moechat.engine.loader, moechat.engine.models\n"
            "assert 'textual' not in sys.modules, 'engine imported textual'")
    result = _run(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_cli_start_up_does_not_import_torch(tmp_path):
    code = ("import sys\nfrom moechat.app.cli import build_parser\nbuild_parser().parse_args(['run', 'x', "
            "'--prompt', 'hi'])\nassert 'torch' not in sys.modules, 'torch imported at start-up'")
    result = _run(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_model_files_never_import_the_cache():
    for path in (ROOT / "engine" / "models").glob("*.py"):
        text = path.read_text()
        assert ".cache" not in text and "CachedProvider" not in text, path.name
