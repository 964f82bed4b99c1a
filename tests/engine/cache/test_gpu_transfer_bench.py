"""bench/gpu_transfer.py: parses, its CPU dry run builds the pool and the pinned-layout rows and moves the bytes
exactly; on CUDA (`gpu`) it measures and reports one copy per miss."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[3] / "bench" / "gpu_transfer.py"


def _run(*argv: str) -> dict:
    out = subprocess.run([sys.executable, "-P", str(BENCH), *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_it_parses_and_the_dry_run_moves_an_expert_in_one_copy():
    ast.parse(BENCH.read_text())
    r = _run("--dry-run", "--json")
    assert r["expert_bytes"] == 13_236_480 and r["slot_bytes"] == 13_236_736 and r["tensors"] == 6
    assert r["bytes_match"] is True
    assert [e[0] for e in r["protocol"]] == ["begin", "copy", "record", "wait"]
    assert r["protocol"][1][1] == str(r["slot_bytes"])  # ONE copy of the whole slot


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_it_measures_the_link():
    r = _run("--reps", "3", "--json")
    assert r["one_copy_gbps"] > 0 and r["six_copies_gbps"] > 0 and r["d2d_gbps"] > 0
    assert 0.0 <= r["hidden_fraction"] <= 1.0
