"""int8 / int4 experts made by moechat (`--expert-format`): packers against the torch reference, every tier
holding the small form, the repacked store reused, rebuilt when stale, and a damaged file caught."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moechat.engine.cache import slots as slots_mod
from moechat.engine.cache.provider import CacheConfig
from moechat.engine.errors import CheckpointError, ConfigError
from moechat.engine.quant import get_format
from moechat.engine.quant.intq import INT4, INT8, int4_group
from moechat.engine.runtime.generate import Engine
from moechat.engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, do_sample=False)


@pytest.mark.parametrize("fmt", [INT8, INT4])
@pytest.mark.parametrize("shape", [(96, 64), (40, 112), (8, 24)])
def test_packer_round_trip_and_linear_against_the_reference(fmt, shape):
    torch.manual_seed(0)
    w = torch.randn(*shape) * torch.rand(shape[0], 1) * 3  # rows of different scales
    parts = {f"w13_{k}": v for k, v in fmt.quantize(w).items()}
    ref = fmt.weight(parts, "w13", torch.float32)  # the slow obvious decoding
    if fmt is INT8:
        step = parts["w13_scale"][:, None]  # [out, 1]
        assert parts["w13_q"].dtype == torch.int8 and parts["w13_q"].abs().max() <= 127
    else:
        g = int4_group(shape[1])
        step = parts["w13_scale"].repeat_interleave(g, dim=1)  # [out, in]
        assert parts["w13_q"].shape == (shape[0], shape[1] // 2) and parts["w13_scale"].shape[1] == shape[1] // g
    # round to nearest: every weight within half a step (int8; int4's +7.5 steps clamps to +7), plus for int4 7.5 x
    # its fp16 scale's rounding down (under 2^-10 of it in fp16's normal range)
    slack = 7.5 * 2.0**-10 if fmt is INT4 else 0.0
    assert ((ref - w.float()).abs() <= step.float() * (0.5 + slack + 1e-5)).all()
    if fmt is INT8:  # re-packing the decoded weights gives them back (to float rounding of the new scale)
        again = {f"w13_{k}": v for k, v in fmt.quantize(ref).items()}
        torch.testing.assert_close(fmt.weight(again, "w13", torch.float32), ref, rtol=1e-5, atol=1e-6)
    x = torch.randn(5, shape[1])
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        ours = fmt.linear(x.to(dtype), parts, "w13").float()
        theirs = x.to(dtype).float() @ ref.t()
        torch.testing.assert_close(ours, theirs, atol=tol * theirs.abs().max().item(), rtol=0)


@settings(max_examples=60, deadline=2000, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(-40, 16), st.integers(0, 2**31 - 1), st.sampled_from([64, 48, 40]))
def test_int4_fp16_scale_is_the_largest_fp16_at_or_below_amax_over_7_5(exp2, seed, cols):
    """Groups from 2^-40 (scales below fp16's subnormals: 2^-24) through the subnormal and normal range to 2^16 (|w|
    up to ~300,000, under the 491,280 limit, whose refusal the next test checks; 2^18 drew |w| past it): the stored scale is the largest fp16 <= max(amax / 7.5, 2^-24), every code within half
    a stored step of its weight plus 7.5 x the scale's rounding (the positive extreme clamped at +7), and weight() =
    code x stored scale."""
    g = torch.Generator().manual_seed(seed)
    rows = 6
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 2.0**exp2  # [rows, cols]
    w[0, : int4_group(cols)] = 0.0  # an all-zero group
    parts = {f"w2_{k}": v for k, v in INT4.quantize(w).items()}
    scale, group = parts["w2_scale"], int4_group(cols)
    assert scale.dtype == torch.float16 and scale.shape == (rows, cols // group)
    exact = w.reshape(rows, -1, group).abs().amax(dim=-1) / 7.5  # [rows, G] fp32
    want = exact.clamp(min=2.0**-24)
    above = (scale.view(torch.int16) + 1).view(torch.float16).float()  # the next fp16 up
    assert (scale.float() <= want).all() and (above > want).all() and (scale > 0).all() and torch.isfinite(scale).all()
    # in fp16's normal range the rounding is under 2^-10 of the scale: every weight within 0.51 stored steps
    normal = exact >= 2.0**-14
    assert ((exact - scale.float())[normal] <= scale.float()[normal] * 2.0**-10).all()
    step = scale.float().repeat_interleave(group, dim=1)  # [rows, cols]
    excess = (exact - scale.float()).clamp(min=0).repeat_interleave(group, dim=1) * 7.5
    ref = INT4.weight(parts, "w2", torch.float32)
    assert ((ref - w).abs() <= (step * 0.5 + excess) * (1 + 1e-6)).all()
    codes = torch.stack([parts["w2_q"] & 15, parts["w2_q"] >> 4], -1).reshape(rows, cols).float() - 8
    assert torch.equal(ref, codes * step) and (ref[0, :group] == 0).all()


def test_int4_scale_past_fp16_is_a_typed_error_naming_int8():
    ok = torch.full((2, 32), 7.5 * 65504.0)  # the largest |w| an fp16 scale holds: 65504 exactly
    assert INT4.quantize(ok)["scale"].float().eq(65504.0).all()
    for big in (7.5 * 65504.0 * 1.001, float("inf")):
        w = torch.ones(2, 64)
        w[1, 40] = -big
        with pytest.raises(CheckpointError, match="past int4's fp16 group scales .*use --expert-format int8"):
            INT4.quantize(w)


def test_int4_is_4_5_bits_a_weight_in_groups_of_32():
    H, I = 2048, 768  # Qwen3-30B-A3B's expert: codes + fp16 scales (5.0 bits with fp32 scales)
    assert 8 * INT4.expert_bytes(H, I, torch.bfloat16, bias=False) / (3 * H * I) == 4.5
    assert INT4.layout(H, I, torch.bfloat16, False)["w2_scale"] == ((H, I // 32), torch.float16)


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def _greedy(engine, ids, n=16):
    return [t for c in engine.generate(ids, sampling=GREEDY, max_tokens=n) for t in c.token_ids]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_every_tier_holds_the_small_form_and_cached_equals_resident(tiny_models, fmt, tmp_path):
    path, _ = tiny_models["qwen3_moe"]
    ids = _prompt(9, seed=2)
    resident = Engine.load(path, dtype="float32", expert_format=fmt)
    batch = resident.loaded.provider.prepare(0, torch.zeros(1, 2, dtype=torch.long))
    assert batch.format.name == fmt and "w13" not in batch.tensors
    want = _greedy(resident, ids)
    layout = get_format(fmt)
    args = resident.loaded.args
    expert_bytes = layout.expert_bytes(args.hidden_size, args.moe_intermediate, torch.float32, bias=False)
    for slots, ram in ((1, 0), (2, None), (5, 3 * expert_bytes)):
        engine = Engine.load(path, dtype="float32", expert_format=fmt,
                             cache=CacheConfig(expert_slots=slots, ram_cache_bytes=ram))
        assert _greedy(engine, ids) == want, (slots, ram)
        snap = engine.provider.snapshot()
        loads = snap.expert_loads_prefill + snap.expert_loads_decode
        assert snap.bytes_from_ram + snap.bytes_from_disk == loads * expert_bytes
        # a slot is the expert's bytes with each named tensor at a 256-byte offset (slots.SlotLayout)
        pool = engine.provider.pool
        assert expert_bytes <= pool.slot_bytes < expert_bytes + slots_mod.ALIGN * len(pool.buffers)
        engine.close()


def test_int8_stays_close_to_native(tiny_models):
    path, _ = tiny_models["mixtral"]
    ids = _prompt(12, seed=3)
    native, int8 = Engine.load(path, dtype="float32"), Engine.load(path, dtype="float32", expert_format="int8")
    with torch.inference_mode():
        a = native._forward(native.new_sequence(), ids)
        b = int8._forward(int8.new_sequence(), ids)
    assert torch.softmax(a, -1).sub(torch.softmax(b, -1)).abs().max().item() < 0.02


def _repacked(tmp_path):
    return tmp_path / "repack" / "experts.bin"


def test_repacked_store_reused_rebuilt_when_stale_and_damage_caught(tiny_models, tmp_path):
    import shutil

    src, _ = tiny_models["olmoe"]
    path = tmp_path / "model"
    shutil.copytree(src, path)
    config = CacheConfig(expert_slots=2, ram_cache_bytes=0, repack_dir=str(tmp_path / "repack"))
    ids = _prompt(6, seed=1)
    want = _greedy(Engine.load(path, dtype="float32", expert_format="int4"), ids)
    first = Engine.load(path, dtype="float32", expert_format="int4", cache=config)
    assert _greedy(first, ids) == want
    first.close()
    stamp = _repacked(tmp_path).stat().st_mtime_ns
    # reused: the next start writes nothing
    again = Engine.load(path, dtype="float32", expert_format="int4", cache=config)
    assert _greedy(again, ids) == want and _repacked(tmp_path).stat().st_mtime_ns == stamp
    again.close()
    # another format in the same directory: rebuilt (its sidecar names the format)
    int8 = Engine.load(path, dtype="float32", expert_format="int8", cache=config)
    assert _repacked(tmp_path).stat().st_mtime_ns != stamp
    int8.close()
    # a same-size overwrite by another program (new mtime): rebuilt at start, output unchanged
    Engine.load(path, dtype="float32", expert_format="int4", cache=config).close()
    data = _repacked(tmp_path).read_bytes()
    _repacked(tmp_path).write_bytes(bytes(len(data)))
    fresh = Engine.load(path, dtype="float32", expert_format="int4", cache=config)
    assert _repacked(tmp_path).read_bytes() == data and _greedy(fresh, ids) == want
    fresh.close()
    # damage that keeps size and mtime: caught on the expert's first read, and the next start rebuilds
    st = _repacked(tmp_path).stat()
    with open(_repacked(tmp_path), "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(_repacked(tmp_path), ns=(st.st_atime_ns, st.st_mtime_ns))
    damaged = Engine.load(path, dtype="float32", expert_format="int4",
                          cache=CacheConfig(expert_slots=1, ram_cache_bytes=0, repack_dir=str(tmp_path / "repack")))
    with pytest.raises(CheckpointError, match="does not match the checksum written with it"):
        for layer in range(damaged.loaded.args.num_hidden_layers):  # touch every expert once
            for e in range(damaged.loaded.args.num_experts):
                damaged.provider.store.read_into(layer, e, damaged.provider.pool.views(0))
    healed = Engine.load(path, dtype="float32", expert_format="int4", cache=config)
    assert _repacked(tmp_path).read_bytes() == data and _greedy(healed, ids) == want
    healed.close()
    # the source changed (a shard rewritten): rebuilt
    shard = next(path.glob("*.safetensors"))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    Engine.load(path, dtype="float32", expert_format="int4", cache=config).close()
    assert _repacked(tmp_path).stat().st_mtime_ns > st.st_mtime_ns


def test_an_int4_file_with_fp32_scales_is_stale_and_rebuilt(tiny_models, tmp_path):
    """A repacked int4 file from before fp16 scales (fp32 `*_scale`, its own sidecar, CRCs right) is not read as
    fp16: its sidecar names the old tensor dtypes and sizes, so the next start rebuilds it."""
    import json
    import zlib

    path, _ = tiny_models["olmoe"]
    config = CacheConfig(expert_slots=2, ram_cache_bytes=0, repack_dir=str(tmp_path / "repack"))
    ids = _prompt(6, seed=4)
    engine = Engine.load(path, dtype="float32", expert_format="int4", cache=config)
    want = _greedy(engine, ids)
    engine.close()
    new_data = _repacked(tmp_path).read_bytes()
    sidecar = _repacked(tmp_path).with_suffix(".json")
    found = json.loads(sidecar.read_text())
    meta = found["meta"]
    tensors = meta["tensors"]
    assert [tensors[f"{w}_scale"][1] for w in ("w13", "w2")] == ["torch.float16"] * 2
    # the same experts in the old layout: each expert's tensors back to back, the scales widened to fp32
    sizes = [(name, torch.Size(shape).numel(), torch.Size(shape).numel() * (1 if dt == "torch.uint8" else
                                                                            2 if dt == "torch.float16" else 4))
             for name, (shape, dt) in tensors.items()]
    per_expert = sum(n for *_, n in sizes)
    old, crc = bytearray(), []
    for e in range(len(new_data) // per_expert):
        at, c = e * per_expert, 0
        for name, count, nbytes in sizes:
            chunk = new_data[at: at + nbytes]
            at += nbytes
            if name.endswith("_scale"):
                chunk = torch.frombuffer(bytearray(chunk), dtype=torch.float16).float().numpy().tobytes()
            old += chunk
            c = zlib.crc32(chunk, c)
        crc.append(c)
    for w in ("w13", "w2"):
        tensors[f"{w}_scale"][1] = "torch.float32"
    meta["expert_bytes"] = len(old) // len(crc)
    _repacked(tmp_path).write_bytes(bytes(old))
    st = _repacked(tmp_path).stat()
    sidecar.write_text(json.dumps({"meta": meta, "file": [st.st_size, st.st_ino, st.st_mtime_ns], "crc": crc}))
    again = Engine.load(path, dtype="float32", expert_format="int4", cache=config)
    assert _repacked(tmp_path).read_bytes() == new_data and _greedy(again, ids) == want
    again.close()


def test_repacking_onto_a_full_disk_is_a_typed_error(tiny_models, tmp_path, monkeypatch):
    import shutil as sh

    path, _ = tiny_models["qwen3_moe"]
    real = sh.disk_usage
    monkeypatch.setattr(sh, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(CheckpointError, match="repacking the experts needs .* GiB free: free"):
        Engine.load(path, dtype="float32", expert_format="int8",
                    cache=CacheConfig(expert_slots=2, repack_dir=str(tmp_path / "r")))
    assert not list((tmp_path / "r").glob("*.partial"))


@pytest.mark.parametrize("name", ["fp8", "mxfp4", "int3", "bf16"])
def test_unsupported_targets_say_what_is(tiny_models, name):
    path, _ = tiny_models["qwen3_moe"]
    with pytest.raises(ConfigError, match="use native .* or one of int8, int4"):
        Engine.load(path, dtype="float32", expert_format=name)


def test_cli_expert_format_counts_packed_bytes_per_miss(tiny_models, capsys):
    import json

    from moechat.app.cli.main import main

    path, _ = tiny_models["qwen3_moe"]
    rc = main(["run", str(path), "--prompt-ids", "1,2,3,4", "--max-tokens", "3", "--temperature", "0", "--dtype",
               "float32", "--expert-slots", "2", "--ram-cache-mb", "0", "--expert-format", "int4", "--json"])
    assert rc == 0
    cache = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cache"]
    loads = cache["expert_loads_prefill"] + cache["expert_loads_decode"]
    assert loads > 0
    assert cache["bytes_from_disk"] + cache["bytes_from_ram"] == loads * INT4.expert_bytes(64, 32, torch.float32,
                                                                                           bias=False)
