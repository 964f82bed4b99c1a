"""Fixtures shared by the engine tests: the native CPU kernels (engine/quant/native.py), as built for this CPU and
as the scalar build a CPU without AVX2 would get."""

from __future__ import annotations

import pytest
import torch

from moechat.engine.quant import native


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny models (the fastest on a busy machine, and every test of the module
    at the same count); the count restored after. A module asks for it with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def lib():
    lib = native.library()
    assert lib is not None, native.status()
    return lib


@pytest.fixture(scope="module")
def scalar_lib(tmp_path_factory):
    """The same source built without SIMD (what a CPU without AVX2 would run, were it enabled there)."""
    lib = native.build_and_load(native.FLAGS + ("-DMOECHAT_SCALAR",), tmp_path_factory.mktemp("scalar"))
    assert lib.moechat_simd() == 0
    return lib


@pytest.fixture(params=["simd", "scalar"])
def any_lib(request, lib, scalar_lib):
    return lib if request.param == "simd" else scalar_lib
