"""Issue 27's load path: NaN/Inf found by native_check.c's exponent-bit scan (alone and fused with the read) exactly
where torch finds them, the typed error as before, and the resident experts bit for bit the checkpoint's whatever
the thread count or check path."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from moechat.engine.cache import store
from moechat.engine.errors import CheckpointError
from moechat.engine.load.loader import load_model
from moechat.engine.quant import native

LIB = native.library()
needs_native = pytest.mark.skipif(LIB is None, reason=f"no native kernels here ({native.status()})")
FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]


def reference_first_bad(t: torch.Tensor) -> int:
    """The first non-finite element by torch (FP8 by its bit patterns: E4M3 has only NaN, S.1111.111)."""
    if t.dtype == torch.float8_e4m3fn:
        bad = (t.view(torch.uint8) & 0x7F) == 0x7F
    elif t.dtype == torch.float8_e5m2:
        bad = (t.view(torch.uint8) & 0x7C) == 0x7C
    else:
        bad = ~torch.isfinite(t)
    hits = bad.nonzero()
    return int(hits[0]) if len(hits) else -1


def poison(t: torch.Tensor, i: int, kind: str) -> None:
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8)[i] = 0xFF if kind == "-inf" else 0x7F  # NaN, its two signs (E4M3 has no Inf)
    else:
        t[i] = {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf")}[kind]


@needs_native
@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(FLOATS), n=st.integers(1, 20_000), data=st.data())
def test_scan_finds_the_first_bad_element_as_torch_does(dtype, n, data):
    t = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 100).to(dtype)
    if dtype.is_floating_point and dtype.itemsize > 1:
        t[0] = torch.finfo(dtype).max  # the largest finite values are not Inf
        t[-1] = -torch.finfo(dtype).max
    for i in data.draw(st.lists(st.integers(0, n - 1), max_size=3)):
        poison(t, i, data.draw(st.sampled_from(["nan", "inf", "-inf"])))
    assert native.first_nonfinite(LIB, t) == reference_first_bad(t)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_read_checked_across_chunks_at_odd_file_offsets(tmp_path, dtype):
    n = (1 << 20) // dtype.itemsize + 3  # past two 512 KB chunks, a ragged tail
    t = torch.randn(n).to(dtype)
    path = tmp_path / "w.bin"
    path.write_bytes(b"abc" + t.view(torch.uint8).numpy().tobytes())  # the data 3 bytes in: no alignment
    fd = os.open(path, os.O_RDONLY)
    try:
        out = torch.empty_like(t)
        assert native.read_checked(LIB, fd, out, 3, True) == (t.nbytes, -1)
        assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))
        chunk = (512 << 10) // dtype.itemsize
        for i in (chunk, chunk - 1, n - 1):  # right after and before a chunk's edge, the last element
            bad = t.clone()
            bad[i] = float("nan") if i % 2 else float("inf")
            path.write_bytes(b"abc" + bad.view(torch.uint8).numpy().tobytes())
            assert native.read_checked(LIB, fd, out, 3, True) == (t.nbytes, i)
            assert native.read_checked(LIB, fd, out, 3, False) == (t.nbytes, -1)  # unchecked: the bytes only
        assert native.read_checked(LIB, fd, out, 3 + 10, True)[0] == t.nbytes - 10  # the file ends first
    finally:
        os.close(fd)


@pytest.fixture
def model_dir(tiny_models, tmp_path):
    src, _ = tiny_models["qwen3_moe"]
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _poison_file(model_dir, name, flat_indices, values):
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    flat = tensors[name].view(-1)
    for i, v in zip(flat_indices, values, strict=True):
        flat[i] = v
    save_file(tensors, path, metadata={"format": "pt"})
    return tensors[name].numel()


def _paths(monkeypatch, path: str, threads: int) -> None:
    """`native`: the build's checked pread; `torch`: MOECHAT_NATIVE=0 (torch's aminmax check, Python's preadv)."""
    monkeypatch.setenv(native.ENV, "1" if path == "native" else "0")
    if path == "native" and LIB is None:
        pytest.skip(f"no native kernels here ({native.status()})")
    monkeypatch.setattr(store, "read_threads", lambda: threads)


@pytest.mark.parametrize("path, threads", [("native", 1), ("native", 2), ("torch", 2)])
def test_nan_and_inf_at_odd_offsets_and_the_last_element(model_dir, monkeypatch, path, threads):
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    numel = _poison_file(model_dir, name, [0, 0], [0.0, 0.0])
    _poison_file(model_dir, name, [7, 1001, numel - 1], [float("nan"), float("inf"), -float("inf")])
    _paths(monkeypatch, path, threads)
    with pytest.raises(CheckpointError, match=rf"'{name}' \(expert 3 of layer 1\) holds NaN or Inf \(3 of "
                                              rf"{numel:,} values\).*download the model again") as e:
        load_model(model_dir)
    assert e.value.tensor == name and e.value.path.endswith("model.safetensors")


def test_the_first_bad_expert_in_order_is_named_whatever_the_threads(model_dir, monkeypatch):
    for expert in (5, 2, 6):
        _poison_file(model_dir, f"model.layers.0.mlp.experts.{expert}.gate_proj.weight", [3], [float("nan")])
    _paths(monkeypatch, "native", 2)
    with pytest.raises(CheckpointError, match=r"experts\.2\.gate_proj\.weight' \(expert 2 of layer 0\)"):
        load_model(model_dir)


@pytest.mark.parametrize("path, threads", [("native", 1), ("native", 2), ("torch", 1)])
def test_resident_experts_are_the_checkpoints_bytes(tiny_models, monkeypatch, path, threads):
    model_dir = tiny_models["qwen3_moe"][0]
    _paths(monkeypatch, path, threads)
    loaded = load_model(model_dir)
    want = load_file(model_dir / "model.safetensors")
    p = "model.layers.{}.mlp.experts.{}.{}_proj.weight"
    for layer in loaded.provider.layers:
        for e in range(loaded.args.num_experts):
            got = loaded.provider.expert_weights(layer, e)
            w13 = torch.cat([want[p.format(layer, e, "gate")], want[p.format(layer, e, "up")]])
            assert torch.equal(got["w13"], w13)
            assert torch.equal(got["w2"], want[p.format(layer, e, "down")])


@needs_native
def test_scan_finite_splits_a_big_tensor_and_still_names_it(monkeypatch):
    monkeypatch.setattr(store, "SCAN_SPLIT", 1 << 10)  # 4 KB of fp32 becomes 2 parts
    monkeypatch.setattr(store, "read_threads", lambda: 2)
    t = torch.randn(1024, 3)
    store.scan_finite(t, "ok", "f")
    t[1023, 2] = float("nan")  # in the second part, the last element
    with pytest.raises(CheckpointError, match=r"f: tensor 'bad' holds NaN or Inf \(1 of 3,072 values\)"):
        store.scan_finite(t, "bad", "f")
    store.scan_finite(torch.full((4096,), 0xFF, dtype=torch.uint8), "codes", "f")  # packed codes: not checked


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    from .test_gpt_oss import write_tiny_gpt_oss

    path = tmp_path_factory.mktemp("gpt_oss_mapped")
    write_tiny_gpt_oss(path, shards=1)
    return path


def test_fused_experts_are_mapped_from_the_shard_not_copied(gpt_oss_dir, monkeypatch):
    """GPT-OSS stores its MXFP4 experts as the format does, [E, ...] per layer: the resident stacks are views of the
    shard's mapping, byte for byte the checkpoint, and the same experts the copying fill gives."""
    mapped = load_model(gpt_oss_dir)
    want = load_file(gpt_oss_dir / "model.safetensors")
    monkeypatch.setattr("moechat.engine.load.loader.mapped_experts", lambda *a: None)
    copied = load_model(gpt_oss_dir)
    names = mapped.cls.expert_naming.packed["mxfp4"]
    for layer in mapped.provider.layers:
        for name, t in mapped.provider._tensors[layer].items():
            assert torch.equal(t, want[names[name].format(layer=layer)])
            assert torch.equal(t, copied.provider._tensors[layer][name])
    t = mapped.provider._tensors[0]["w13_blocks"]
    assert not any(t.data_ptr() == c.data_ptr() for c in copied.provider._tensors[0].values())
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (5,))
    from moechat.engine.layers.kv_cache import KVCache

    outs = [m.model.logits(m.model(ids, KVCache.for_model(m.args, 16, torch.float32), m.provider))
            for m in (mapped, copied)]
    assert torch.equal(outs[0], outs[1])


def test_a_mapped_experts_nan_is_named_with_its_expert(gpt_oss_dir, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(gpt_oss_dir, dst)
    name = "model.layers.2.mlp.experts.down_proj_bias"  # [E, H] fp32
    tensors = load_file(dst / "model.safetensors")
    tensors[name][3, -1] = float("inf")  # expert 3's last element
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"'{name}' \(expert 3 of layer 2\) holds NaN or Inf \(1 of 64 "):
        load_model(dst)


@pytest.mark.parametrize("fmt", ["int4"])  # packed codes with fp16 scales: views at 2-byte offsets
def test_repacked_experts_are_mapped_and_crc_checked(tiny_models, tmp_path, monkeypatch, fmt):
    """--expert-format's file is mapped, not read: the same stacks and logits as the copying fill; a damaged
    expert is the typed CRC error."""
    from moechat.engine.layers.kv_cache import KVCache

    model_dir = tiny_models["qwen3_moe"][0]
    repack = tmp_path / "repack"
    mapped = load_model(model_dir, expert_format=fmt, repack_dir=repack)  # writes the file, then maps it
    with monkeypatch.context() as m:
        m.setattr("moechat.engine.load.loader.mapped_experts", lambda *a: None)
        copied = load_model(model_dir, expert_format=fmt, repack_dir=repack)
    for layer in mapped.provider.layers:
        for name, t in mapped.provider._tensors[layer].items():
            assert t.shape == copied.provider._tensors[layer][name].shape
            assert torch.equal(t, copied.provider._tensors[layer][name])
    ids = torch.tensor([3, 1, 4, 1, 5])
    outs = [m.model.logits(m.model(ids, KVCache.for_model(m.args, 16, torch.float32), m.provider))
            for m in (mapped, copied)]
    assert torch.equal(outs[0], outs[1])
    path = repack / "experts.bin"
    st = path.stat()
    expert_bytes = st.st_size // (len(mapped.provider.layers) * mapped.args.num_experts)
    with open(path, "r+b") as f:  # in place, its mtime kept: the sidecar still vouches for the file
        f.seek(expert_bytes * 5 + 17)
        byte = f.read(1)[0]
        f.seek(expert_bytes * 5 + 17)
        f.write(bytes([byte ^ 0x40]))  # layer 0's expert 5
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(CheckpointError, match=r"expert 5 of layer \d+ does not match the checksum"):
        load_model(model_dir, expert_format=fmt, repack_dir=repack)
