"""Packaging and architecture boundaries: import names, package list, lazy imports."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

import moechat.app
import moechat.engine

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_every_package_folder_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    data_only = {name for name, folder in mapping.items() if not any((ROOT / folder).rglob("*.py"))}
    assert data_only == {"moechat.assets"} and set(config["package-data"]) >= data_only  # the demo model
    found = set(data_only)
    for name, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert found == listed, f"not listed: {sorted(found - listed)}, listed but absent: {sorted(listed - found)}"
    # every folder holding Python modules is a package (else it would silently not be installed)
    for folder in mapping.values():
        for py in (ROOT / folder).rglob("*.py"):
            assert (py.parent / "__init__.py").exists(), f"{py.parent} has modules but no __init__.py"


def test_triton_is_installed_only_where_it_is_used():
    """A CPU-only install never loads triton (engine/quant/kernels imports it for CUDA tensors): not a dependency of
    every install, but the gpu extra's and the tests' (the interpreter runs the kernels on the CPU)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("triton")]
    for extra in ("gpu", "test"):
        assert [d for d in project["optional-dependencies"][extra] if d.startswith("triton")], extra


def test_the_readme_installs_the_cpu_torch_with_pipx_and_uv():
    text = (ROOT / "README.md").read_text()
    pipx = [line for line in text.splitlines() if line.startswith("pipx install")]
    uv = [line for line in text.splitlines() if line.startswith("uv tool install")]
    assert pipx and "download.pytorch.org/whl/cpu" in pipx[0]
    assert uv and "--torch-backend cpu" in uv[0]


def test_import_names_map_to_the_top_level_folders():
    assert Path(moechat.engine.__file__).parent == ROOT / "engine"
    assert Path(moechat.app.__file__).parent == ROOT / "app"


def test_bare_engine_and_app_are_not_importable(tmp_path):
    for name in ("engine", "app"):
        result = _run(f"import {name}", cwd=tmp_path)
        assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr, name


def test_engine_never_imports_textual(tmp_path):
    code = ("import sys, moechat.engine.runtime.generate, moechat.engine.load.loader, moechat.engine.models\n"
            "assert 'textual' not in sys.modules, 'engine imported textual'")
    result = _run(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_cli_start_up_does_not_import_torch(tmp_path):
    code = ("import sys\nfrom moechat.app.cli.main import build_parser\nbuild_parser().parse_args(['run', 'x', "
            "'--prompt', 'hi'])\nassert 'torch' not in sys.modules, 'torch imported at start-up'")
    result = _run(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_model_files_never_import_the_cache():
    """Boundary 2 of docs/architecture.md: a model asks the provider contract (engine/layers/moe.py) for experts;
    the import walk of tests/test_import_graph.py sees every import, lazy ones too."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("_import_graph", ROOT / "tests" / "test_import_graph.py")
    walk = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("_import_graph", walk)
    spec.loader.exec_module(walk)
    graph = walk.import_graph()
    into_cache = sorted((m, d) for m, deps in graph.items() if m.startswith("moechat.engine.models") for d in deps
                        if d.startswith("moechat.engine.cache"))
    assert into_cache == []
    for path in (ROOT / "engine" / "models").glob("*.py"):
        assert "CachedProvider" not in path.read_text(), path.name


# -- the wheel ------------------------------------------------------------------------------------------------

DEMO_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "routing_trace.npz", "README.md"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip install .` would install, built offline from a copy of the sources (no build isolation: the
    setuptools of this environment; the copy keeps build/ and *.egg-info out of the shared tree)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("app", "engine", "assets"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (whl,) = out.glob("moechat-*.whl")
    return whl


def test_the_wheel_holds_every_module_the_stylesheet_and_the_demo_model(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("app", "engine"):
        for py in (ROOT / folder).rglob("*.py"):
            if "__pycache__" not in py.parts:
                assert f"moechat/{py.relative_to(ROOT).as_posix()}" in names, py
    assert "moechat/app/tui/moechat.tcss" in names
    assert "moechat/engine/quant/native.c" in names  # the native CPU kernels are built from it at first use
    demo = {n.removeprefix("moechat/assets/demo-moe/") for n in names if n.startswith("moechat/assets/demo-moe/")}
    assert demo >= DEMO_FILES and not {n for n in demo if n.endswith((".png", ".csv"))}
    # where the code looks for it (app/cli/pull.py: the folder above the app package), inside the wheel too
    from moechat.app.cli.pull import DEMO_MODEL

    assert DEMO_MODEL.relative_to(Path(moechat.app.__file__).parents[1]) == Path("assets/demo-moe")
    assert not {n for n in names if n.startswith(("tests/", "bench/", "packaging/", "moechat/tests"))}
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "moechat = moechat.app.cli.main:main" in meta


@pytest.mark.slow
def test_the_installed_wheel_runs_the_demo_model_from_anywhere(wheel, tmp_path):
    """`pip install` of the wheel into a fresh venv, then `cd /tmp && moechat run --prompt hi`: the bundled model,
    no network. The venv takes its dependencies (torch...) from this environment through a .pth line (offline)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    site = next(venv.glob("lib/python3*/site-packages"))
    done = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    deps = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    (site / "zz_dependencies.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import moechat.app; print(moechat.app.__file__)"],
                           cwd=elsewhere, capture_output=True, text=True, timeout=120, env=env)
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr  # the wheel, not the tree
    script = venv / "bin" / "moechat"
    run = subprocess.run([str(script), "run", "--prompt", "What does math.sqrt do?", "--temperature", "0",
                          "--max-tokens", "12", "--json"],
                         cwd=elsewhere, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["model"].startswith(str(site)) and out["generated_tokens"] > 0
    version = subprocess.run([str(script), "--version"], cwd=elsewhere,
                             capture_output=True, text=True, timeout=120, env=env)
    assert version.stdout.splitlines()[0] == "moechat 0.1.0"  # first: the CPU paths follow it
