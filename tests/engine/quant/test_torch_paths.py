"""torch's packed kernels behind a guard and a per-machine check (quant/torch_paths.py): a wrong or crashing
kernel is caught in a child process and not used; int8 experts stay right at every width on every CPU (torch
2.13's `_weight_int8pack_mm` crashed this suite on AVX-512 machines for widths not a multiple of 16)."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch
import torch.nn.functional as F

from moechat.engine.quant import get_format, torch_paths


@pytest.fixture
def fresh():
    torch_paths.reset()
    yield
    torch_paths.reset()


def _ops_module(tmp_path) -> dict[str, str]:
    (tmp_path / "faulty_ops.py").write_text(textwrap.dedent("""
        import os, signal
        import torch
        from moechat.engine.quant.torch_paths import int8_reference

        def off_by_one_percent(x, q, s):
            return (int8_reference(x, q, s) * 1.01).to(x.dtype)

        def crashes_in_bf16(x, q, s):
            if x.dtype == torch.bfloat16:
                os.kill(os.getpid(), signal.SIGSEGV)
            return int8_reference(x, q, s).to(x.dtype)

        def garbage_for_one_row(x, q, s):
            y = int8_reference(x, q, s)
            return (y * 1e30 if x.shape[0] == 1 else y).to(x.dtype)
    """))
    return {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_the_real_kernel_passes_or_is_refused_with_a_reason():
    got = torch_paths.run_check()
    assert set(got) == set(torch_paths.DTYPES)
    assert all(v == "ok" or len(v) > 10 for v in got.values())
    assert got["float32"] == "ok"  # exact on every CPU seen so far; a wrong fp32 kernel would be news


def test_a_wrong_kernel_is_caught_in_every_dtype(tmp_path):
    got = torch_paths.run_check("faulty_ops:off_by_one_percent", env=_ops_module(tmp_path))
    assert all(v.startswith("wrong results") for v in got.values()), got


def test_a_crashing_kernel_marks_its_dtype_and_the_rest_go_on(tmp_path):
    got = torch_paths.run_check("faulty_ops:crashes_in_bf16", env=_ops_module(tmp_path))
    assert got["bfloat16"].startswith("the check crashed (signal 11)"), got
    assert got["float16"] == "ok" and got["float32"] == "ok"


def test_garbage_for_one_row_is_caught(tmp_path):
    got = torch_paths.run_check("faulty_ops:garbage_for_one_row", env=_ops_module(tmp_path))
    assert all("wrong results at 1x" in v for v in got.values()), got


def test_a_missing_kernel_is_not_trusted(tmp_path):
    got = torch_paths.run_check("faulty_ops:no_such_function", env=_ops_module(tmp_path))
    assert all(v.startswith("the check could not run") for v in got.values()), got


def test_the_verdict_is_cached_and_a_refused_dtype_is_not_used(fresh, monkeypatch):
    monkeypatch.delenv(torch_paths.ENV, raising=False)
    torch_paths.verdict()
    path = torch_paths._cache_path()
    assert path.is_file()
    path.write_text(json.dumps({"int8pack_mm": {"bfloat16": "wrong results (planted)", "float16": "ok",
                                                "float32": "ok"}}))
    torch_paths.reset()
    assert not torch_paths.int8pack_usable(torch.bfloat16, 64)
    assert torch_paths.int8pack_usable(torch.float32, 64)
    assert "not used for bfloat16: wrong results (planted)" in torch_paths.status()[0]


def test_a_damaged_cache_is_checked_again(fresh):
    path = torch_paths._cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"int8pack_mm": {"bfloat16": 3}}')
    v = torch_paths.verdict()
    assert set(v) == set(torch_paths.DTYPES) and v["float32"] == "ok"
    assert json.loads(path.read_text())["int8pack_mm"] == v


def test_the_known_guard_holds_whatever_the_check_says(fresh):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for cols in (8, 24, 40, 100):
            assert not torch_paths.int8pack_usable(dtype, cols)


def test_switched_off_by_environment(fresh, monkeypatch):
    monkeypatch.setenv(torch_paths.ENV, "0")
    assert not torch_paths.int8pack_usable(torch.float32, 64)
    assert "not used" in torch_paths.status()[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("cols", [8, 40, 48, 64])
def test_int8_linear_is_right_at_every_width_without_the_native_kernels(monkeypatch, dtype, rows, cols):
    """The torch path of int8 (no C compiler, or several tokens): before the guard, bf16 at width 40 crashed
    (rows > 1) or returned 1e33 (one row) on AVX-512."""
    monkeypatch.setenv("MOECHAT_NATIVE", "0")
    g = torch.Generator().manual_seed(rows * 100 + cols)
    fmt = get_format("int8")
    w = torch.randn(96, cols, generator=g) * 0.1
    t = {f"w2_{k}": v for k, v in fmt.quantize(w).items()}
    x = torch.randn(rows, cols, generator=g).to(dtype)
    got = fmt.linear(x, t, "w2").float()
    want = F.linear(x.float(), fmt.weight(t, "w2", torch.float32))
    bound = (x.float().abs() @ fmt.weight(t, "w2", torch.float32).abs().T) * (1e-5 if dtype == torch.float32
                                                                            else 1 / 64) + 1e-6
    assert ((got - want).abs() <= bound).all()
