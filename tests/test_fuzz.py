"""Fuzz: damaged variants of a tiny checkpoint, and random command lines (issue 19).

A seeded generator (MOECHAT_FUZZ_SEED to try others; MOECHAT_FUZZ_CASES for more) damages a copy of a tiny chat
model per case: config.json values of every type, deleted keys, generation_config.json and tokenizer_config.json
values, safetensors header entries (dtype, shape, offsets: overlapping, negative, past the end), raw header
bytes (length, truncation, deep nesting), index tricks (lists, numbers, paths, missing and duplicate shards),
NaN/Inf in weights, re-saved dtypes and shapes. Each case loads the model (resident, or through the expert
cache streaming from disk), renders a chat prompt and generates two tokens. The contract: a typed MoechatError
or a correct run; any other exception, or a case running past its time cap, fails the test with the seed and
the damage that caused it. The CLI's flags get the same treatment: random values for every flag of
`moechat run` and `moechat fit`, exit 0, 1, a usage error (or fit's 3), never an "unexpected" error or a traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import struct
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from moechat.engine.errors import MoechatError

SEED = int(os.environ.get("MOECHAT_FUZZ_SEED", "19"))
CASES = int(os.environ.get("MOECHAT_FUZZ_CASES", "240"))
CLI_CASES = int(os.environ.get("MOECHAT_FUZZ_CLI_CASES", "120"))
CASE_SECONDS = 20.0  # one case's cap; a case takes ~50 ms

VALUES = [0, -1, 1, 2, 3, 7, 64, 10**9, 2**31, 2**63, -(2**63), 10**30, 0.5, 1.5, -0.0, float("nan"), float("inf"),
          -float("inf"), 1e-45, 1e308, "x", "", "16", "qwen3_moe", True, False, None, [], [0], [1, 2], ["a"], [-1],
          [[[[[]]]]], {}, {"a": 1}, {"rope_type": "yarn"}, {"rope_type": "default", "rope_theta": 0},
          {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "rope_theta": 1e4},
          "<|im_end|>", {"content": 5}, {"content": "<|im_end|>"}, "x" * 5000]
CONFIG_EXTRA = ["head_dim", "sliding_window", "use_sliding_window", "mlp_only_layers", "decoder_sparse_step",
                "rope_scaling", "rope_parameters", "quantization_config", "num_local_experts", "tie_word_embeddings",
                "dtype", "torch_dtype", "model_type", "hidden_act", "auto_map", "text_config", "attention_bias"]
GEN_KEYS = ["eos_token_id", "bos_token_id", "max_new_tokens", "temperature", "top_k", "top_p", "min_p",
            "repetition_penalty", "do_sample", "pad_token_id"]
TOK_KEYS = ["eos_token", "bos_token", "pad_token", "chat_template", "added_tokens_decoder", "add_bos_token",
            "extra_special_tokens", "additional_special_tokens", "model_max_length"]
DTYPES = ["F32", "F16", "BF16", "F64", "I32", "I8", "U8", "BOOL", "F8_E4M3", "F4", "Q4", "", 5, None]


# -- the base model and the damage --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bases(tiny_chat_model, tmp_path_factory):
    """The tiny chat model as one shard, and as two shards with an index."""
    src = Path(tiny_chat_model[0])
    single = tmp_path_factory.mktemp("fuzz_single")
    shutil.copytree(src, single, dirs_exist_ok=True)
    sharded = tmp_path_factory.mktemp("fuzz_sharded")
    shutil.copytree(src, sharded, dirs_exist_ok=True)
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, sharded / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return single, sharded


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _shards(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def _read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n:]


def _write_header(path: Path, header, data: bytes) -> None:
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def _value(rng: random.Random):
    return rng.choice(VALUES)


def damage_config(rng, d):
    path = d / "config.json"
    config = _json(path)
    key = rng.choice(sorted(config) + CONFIG_EXTRA)
    if rng.random() < 0.15:
        config.pop(key, None)
        return f"config.json: delete {key}"
    if key in ("rope_parameters", "rope_scaling") and isinstance(config.get(key), dict) and rng.random() < 0.6:
        sub = rng.choice(["rope_theta", "rope_type", "factor", "original_max_position_embeddings", "beta_fast"])
        config[key][sub] = _value(rng)
        path.write_text(json.dumps(config))
        return f"config.json: {key}.{sub} = {config[key][sub]!r}"[:160]
    config[key] = _value(rng)
    path.write_text(json.dumps(config))
    return f"config.json: {key} = {config[key]!r}"[:160]


def damage_generation_config(rng, d):
    path = d / "generation_config.json"
    config = _json(path) if path.exists() else {}
    key = rng.choice(GEN_KEYS)
    config[key] = _value(rng)
    path.write_text(json.dumps(config) if rng.random() < 0.9 else json.dumps([config]))
    return f"generation_config.json: {key} = {config[key]!r}"[:160]


def damage_tokenizer_config(rng, d):
    path = d / "tokenizer_config.json"
    config = _json(path)
    key = rng.choice(TOK_KEYS)
    config[key] = _value(rng)
    path.write_text(json.dumps(config))
    return f"tokenizer_config.json: {key} = {config[key]!r}"[:160]


def damage_header_entry(rng, d):
    shard = rng.choice(_shards(d))
    header, data = _read_header(shard)
    names = [n for n in header if n != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    what = rng.choice(["dtype", "shape", "offsets", "overlap", "delete", "add", "negative", "past_end", "metadata"])
    if what == "dtype":
        entry["dtype"] = rng.choice(DTYPES)
    elif what == "shape":
        shape = list(entry["shape"])
        op = rng.choice(["swap", "add", "drop", "neg", "str", "zero", "big"])
        if op == "swap":
            shape.reverse()
        elif op == "add":
            shape.append(1)
        elif op == "drop" and shape:
            shape.pop()
        elif op == "neg" and shape:
            shape[0] = -shape[0]
        elif op == "str" and shape:
            shape[0] = str(shape[0])
        elif op == "zero" and shape:
            shape[0] = 0
        elif op == "big" and shape:
            shape[0] = 2**40
        entry["shape"] = shape
    elif what == "offsets":
        a, b = entry["data_offsets"]
        shift = rng.choice([-8, -4, 4, 8, 1])
        entry["data_offsets"] = [a + shift, b + shift]
    elif what == "overlap":  # another tensor's bytes (an experts-only shard: only preadv reads them)
        other = header[rng.choice(names)]
        entry["data_offsets"] = list(other["data_offsets"])
        entry["dtype"], entry["shape"] = other["dtype"], other["shape"]
    elif what == "delete":
        del header[name]
    elif what == "add":
        header[name + ".extra"] = dict(entry)
    elif what == "negative":  # header bytes as weights
        a, b = entry["data_offsets"]
        entry["data_offsets"] = [a - 64, b - 64]
    elif what == "past_end":
        a, b = entry["data_offsets"]
        entry["data_offsets"] = [a + 10**6, b + 10**6]
    elif what == "metadata":
        header["__metadata__"] = rng.choice([{"format": 1}, [], "pt", {"format": "pt"}])
    _write_header(shard, header, data)
    return f"{shard.name}: header {what} of {name}"


def damage_raw(rng, d):
    shard = rng.choice(_shards(d))
    raw = bytearray(shard.read_bytes())
    what = rng.choice(["truncate", "extend", "hlen", "garbage", "deep", "not_object", "empty", "flip"])
    if what == "truncate":
        raw = raw[: rng.randrange(0, len(raw))]
    elif what == "extend":
        raw += bytes(rng.randrange(1, 4096))
    elif what == "hlen":
        raw[:8] = struct.pack("<Q", rng.choice([0, 1, len(raw), 2**63, 2**40, 7]))
    elif what == "garbage":
        n = struct.unpack("<Q", raw[:8])[0]
        for _ in range(8):
            raw[8 + rng.randrange(n)] = rng.randrange(256)
    elif what == "deep":
        deep = b"[" * 50_000 + b"]" * 50_000
        shard.write_bytes(struct.pack("<Q", len(deep)) + deep)
        return f"{shard.name}: header nested 50k deep"
    elif what == "not_object":
        _write_header(shard, rng.choice([[1], "x", 5, None]), b"")
        return f"{shard.name}: header not an object"
    elif what == "empty":
        raw = bytearray()
    elif what == "flip":  # a bit in the weights: still a correct run (other numbers)
        n = struct.unpack("<Q", raw[:8])[0]
        i = 8 + n + rng.randrange(len(raw) - 8 - n)
        raw[i] ^= 1 << rng.randrange(7)
    shard.write_bytes(bytes(raw))
    return f"{shard.name}: raw {what}"


def damage_index(rng, d):
    path = d / "model.safetensors.index.json"
    if not path.exists():
        return damage_header_entry(rng, d)
    index = _json(path)
    wm = index["weight_map"]
    name = rng.choice(sorted(wm))
    what = rng.choice(["list", "number", "path", "missing", "extra", "empty", "duplicate", "not_dict", "swap",
                       "metadata", "deep"])
    if what == "list":
        index["weight_map"] = list(wm.values())
    elif what == "number":
        wm[name] = 1
    elif what == "path":
        wm[name] = rng.choice(["../model.safetensors", "/etc/passwd", "sub/x.safetensors", ".hidden.safetensors",
                               "model.bin"])
    elif what == "missing":
        wm[name] = "model-00009-of-00009.safetensors"
    elif what == "extra":
        wm["model.layers.99.ghost.weight"] = sorted(set(wm.values()))[0]
    elif what == "empty":
        index["weight_map"] = {}
    elif what == "duplicate":  # the tensor in both shards: the index says which one owns it
        shards = _shards(d)
        header, data = _read_header(shards[1])
        other_header, _ = _read_header(shards[0])
        first = next(n for n in other_header if n != "__metadata__")
        header[first] = dict(header[next(n for n in header if n != "__metadata__")])
        _write_header(shards[1], header, data)
    elif what == "not_dict":
        index = rng.choice([[1], "x", None])
    elif what == "swap":
        shards = sorted(set(wm.values()))
        wm[name] = shards[1] if wm[name] == shards[0] else shards[0]
    elif what == "metadata":
        index["metadata"] = rng.choice([{"total_size": "x"}, [], {"total_size": -5}])
    elif what == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
        return "index nested 100k deep"
    path.write_text(json.dumps(index))
    return f"index: {what} ({name})"


def damage_nonfinite(rng, d):
    shard = rng.choice(_shards(d))
    header, data = _read_header(shard)
    name = rng.choice([n for n in header if n != "__metadata__"])
    entry = header[name]
    start = entry["data_offsets"][0]
    patterns = {"F32": [b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x00\x80\xff"],
                "F16": [b"\x00\x7e", b"\x00\x7c"], "BF16": [b"\xc0\x7f", b"\x80\x7f"]}
    if entry["dtype"] not in patterns or entry["data_offsets"][1] == start:
        return damage_config(rng, d)
    bad = rng.choice(patterns[entry["dtype"]])
    n = (entry["data_offsets"][1] - start) // len(bad)
    at = start + len(bad) * rng.randrange(n)
    data = data[:at] + bad + data[at + len(bad):]
    _write_header(shard, header, data)
    return f"{shard.name}: NaN/Inf in {name}"


def damage_resave(rng, d):
    import torch

    shard = rng.choice(_shards(d))
    tensors = load_file(shard)
    name = rng.choice(sorted(tensors))
    t = tensors[name]
    what = rng.choice(["dtype", "shape", "drop"])
    if what == "dtype":
        tensors[name] = t.to(rng.choice([torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int8]))
    elif what == "shape":
        tensors[name] = t.reshape(-1)[: max(1, t.numel() - rng.randrange(1, 3))].clone()
    else:
        del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    return f"{shard.name}: re-saved {name} with another {what}"


DAMAGE = [(damage_config, 30), (damage_generation_config, 8), (damage_tokenizer_config, 8),
          (damage_header_entry, 18), (damage_raw, 8), (damage_index, 12), (damage_nonfinite, 8), (damage_resave, 8)]


# -- running a case -------------------------------------------------------------------------------------------

def _run_case(d: Path, cached: bool) -> str:
    from moechat.engine.cache.provider import CacheConfig
    from moechat.engine.runtime.generate import Engine

    cache = CacheConfig(expert_slots=3, ram_cache_bytes=0, warm_start=False) if cached else None
    engine = Engine.load(d, dtype="float32", context=64, cache=cache)
    try:
        ids = engine.encode_chat([{"role": "user", "content": "hi there"}])
        chunks = list(engine.generate(ids, max_tokens=2))
        assert chunks and chunks[-1].finish_reason in ("stop", "length"), chunks
        return "ran"
    finally:
        engine.close()


def _within(fn, seconds: float):
    """(result, exception) of fn run in a thread; a thread still running after `seconds` is a failed case."""
    out: dict = {}

    def target():
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - classified by the caller
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        return None, TimeoutError(f"still running after {seconds:g} s")
    return out.get("result"), out.get("error")


def test_damaged_checkpoints_give_a_typed_error_or_a_correct_run(bases, tmp_path):
    rng = random.Random(SEED)
    kinds = [k for k, w in DAMAGE for _ in range(w)]
    outcomes: dict[str, int] = {}
    failures = []
    t_start = time.monotonic()
    for case in range(CASES):
        base = bases[1] if rng.random() < 0.35 else bases[0]
        d = tmp_path / f"case{case}"
        shutil.copytree(base, d)
        what = []
        for _ in range(1 if rng.random() < 0.85 else 2):
            try:
                what.append(rng.choice(kinds)(rng, d))
            except Exception:  # noqa: BLE001 - the first damage left nothing this one can parse: the case keeps it
                pass
        cached = rng.random() < 0.4
        result, error = _within(lambda d=d, cached=cached: _run_case(d, cached), CASE_SECONDS)
        if error is None:
            outcomes["ran"] = outcomes.get("ran", 0) + 1
        elif isinstance(error, MoechatError):
            outcomes[type(error).__name__] = outcomes.get(type(error).__name__, 0) + 1
            if "\n" in str(error):
                failures.append((case, what, f"multi-line message: {error!r}"))
        else:
            failures.append((case, what, f"{type(error).__name__}: {error}"))
        shutil.rmtree(d, ignore_errors=True)
    elapsed = time.monotonic() - t_start
    assert not failures, (f"seed {SEED}: {len(failures)} of {CASES} cases failed:\n"
                          + "\n".join(f"  case {c} [{'; '.join(w)}]: {e}" for c, w, e in failures[:30]))
    assert CASES < 200 or (outcomes.get("ran", 0) >= 10 and len(outcomes) >= 3), outcomes
    print(f"\nfuzz seed {SEED}: {CASES} damaged checkpoints in {elapsed:.1f} s: {outcomes}")


# -- the command line ---------------------------------------------------------------------------------------

FLAG_VALUES = {
    "--temperature": ["0", "0.7", "1e-45", "-1", "nan", "inf", "x", "1e308", "0.001"],
    "--top-k": ["0", "5", "-3", "1.5", "x", "99999999999"],
    "--top-p": ["1", "0.5", "1.5", "-0.1", "nan", "x"],
    "--min-p": ["0", "0.1", "2", "inf"],
    "--repetition-penalty": ["1", "1.2", "0", "-1", "nan"],
    "--seed": ["0", "42", "-1", "x", str(2**70)],
    "--max-tokens": ["1", "2", "0", "-5", "x"],
    "--context": ["8", "64", "0", "1", "99999999", "x"],
    "--device": ["cpu", "cuda", "cuda:7", "foo", "", "meta", "mps"],
    "--dtype": ["float32", "bfloat16", "float16", "int8"],
    "--expert-slots": ["1", "3", "0", "-1", "1000"],
    "--ram-cache-mb": ["0", "1", "-1", "x"],
    "--policy": ["lru", "lfu", "nope"],
    "--prefetch": ["off", "next-layer", "both", "x"],
    "--prefetch-depth": ["1", "4", "0", "9"],
    "--expert-format": ["native", "int8", "int4", "fp3"],
    "--reasoning-effort": ["low", "extreme"],
}
BOOLEAN_FLAGS = ["--raw", "--json", "--no-warm-start", "--show-thinking"]
PROMPTS = ["hi", "", "\udcff\udcfe", "caf\udce9", "x" * 20_000, "<|im_end|>", "\x00", "😀" * 50]


FIT_VALUES = {
    "--vram-gb": ["0", "8", "-1", "nan", "1e308", "x"], "--ram-gb": ["0", "0.001", "64", "inf"],
    "--disk-gb": ["0", "1", "-2"], "--link-gbps": ["0", "25", "x"], "--disk-read-gbps": ["0", "3"],
    "--context": ["1", "4096", "0", str(2**40)], "--margin": ["0", "0.5", "1", "7", "-1"],
    "--device": ["cpu", "cuda", "cuda:3", "foo"], "--dtype": ["float16", "int8"],
    "--expert-format": ["native", "int8", "int4", "x"], "--prefer": ["speed", "context", "x"],
    "--hit-curve": ["/nonexistent.json", "/dev/null", "/etc/hostname"],
}


def _fit_argv(rng: random.Random, model: str, tmp: Path) -> list[str]:
    argv = ["fit", rng.choice([model, model, str(tmp / "nope"), "org/not-downloaded", "not a repo"])]
    for flag in rng.sample(sorted(FIT_VALUES), rng.randrange(0, 5)):
        argv += [flag, rng.choice(FIT_VALUES[flag])]
    return argv + rng.sample(["--json", "--force"], rng.randrange(0, 3))


def _cli_argv(rng: random.Random, model: str, tmp: Path) -> list[str]:
    if rng.random() < 0.3:
        return _fit_argv(rng, model, tmp)
    argv = ["run", rng.choice([model, model, model, str(tmp / "nope"), "org/not-downloaded"])]
    source = rng.random()
    if source < 0.7:
        argv += ["--prompt", rng.choice(PROMPTS)]
    elif source < 0.95:
        argv += ["--prompt-ids", rng.choice(["1,2,3", "1", "x", "", "-1", "99999", "1,,2"])]
    if rng.random() < 0.2:
        argv += ["--system", rng.choice(PROMPTS)]
    for flag in rng.sample(sorted(FLAG_VALUES), rng.randrange(0, 5)):
        argv += [flag, rng.choice(FLAG_VALUES[flag])]
    argv += rng.sample(BOOLEAN_FLAGS, rng.randrange(0, 3))
    if rng.random() < 0.15:
        argv += ["--record-trace", rng.choice([str(tmp / "t.npz"), str(tmp / "no" / "dir" / "t.npz"), str(tmp)])]
    if rng.random() < 0.05:
        argv += ["--repack-dir", rng.choice([str(tmp / "repack"), "/proc/nope"])]
    if "--max-tokens" not in argv:
        argv += ["--max-tokens", "2"]
    return argv


def test_random_command_lines_end_in_one_clear_line(bases, tmp_path, monkeypatch):
    from moechat.app.cli import main as cli

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a repo id is looked up in the local cache only

    rng = random.Random(SEED + 1)
    model = str(bases[0])
    failures, codes = [], {}
    for case in range(CLI_CASES):
        argv = _cli_argv(rng, model, tmp_path)
        out, err = io.StringIO(), io.StringIO()

        def run(argv=argv, out=out, err=err):
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    return cli.main(argv)
                except SystemExit as e:  # argparse: usage errors exit 2
                    return e.code

        code, error = _within(run, CASE_SECONDS)
        text = err.getvalue()
        codes[code] = codes.get(code, 0) + 1
        allowed = (0, 1, 2, 3) if argv[0] == "fit" else (0, 1, 2)  # fit: 3 when the model does not fit
        if error is not None or code not in allowed or "Traceback" in text or "unexpected" in text:
            failures.append((case, argv, error, code, text.strip()[-300:]))
        elif code == 1 and len([ln for ln in text.splitlines() if ln.startswith("moechat: error")]) != 1:
            failures.append((case, argv, error, code, text.strip()[-300:]))
    assert not failures, f"seed {SEED + 1}:\n" + "\n".join(
        f"  case {c}: {repr(a)[:400]} -> {code} {e!r} {t!r}" for c, a, e, code, t in failures[:20])
    assert set(codes) <= {0, 1, 2, 3} and len(codes) >= 2, codes
