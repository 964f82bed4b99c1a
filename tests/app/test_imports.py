"""`import moechat.app` (and the app module) must not import torch, nor numpy: the first frame comes before them
(numpy alone was 0.1-0.15 s of a ~1 s first frame; the heatmap and the stats import it when data arrives)."""

from __future__ import annotations

import subprocess
import sys


def test_app_import_does_not_import_torch(tmp_path):
    code = ("import sys\nimport moechat.app, moechat.app.tui.app, moechat.app.tui.launch, moechat.app.tui.bridge\n"
            "from moechat.app.tui.app import make_app\n"
            "mods = ('torch', 'numpy', 'moechat.engine.runtime.generate', 'transformers')\n"
            "parser_mods = [m for m in mods if m in sys.modules]\n"
            "assert not parser_mods, parser_mods")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
