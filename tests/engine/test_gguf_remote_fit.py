"""`moechat fit org/repo:QUANT` on a GGUF repo reads only the header of the quant's file(s) (ranged reads, no
tensor data) and plans it as it plans the downloaded file. Also the header scanner (engine/io/gguf_header.py) on
real files, every prefix of them, and hostile headers. Against the local Hub (tests/hubserver.py)."""

from __future__ import annotations

import json
import struct

import pytest

from moechat.app.cli.main import main
from moechat.engine.errors import CheckpointError, QuantChoiceError
from moechat.engine.io.gguf_header import header_length
from moechat.engine.plan import read_model_spec

from .test_gguf_load import tiny_qwen3moe, write_gguf

REPO = "gguf-org/tiny-qwen3moe-GGUF"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two quants of one tiny qwen3moe, and the offset where each one's tensor data starts."""
    import gguf

    folder = tmp_path_factory.mktemp("gguf_remote")
    model = tiny_qwen3moe(hidden_size=256, moe_intermediate_size=256, num_experts=4)
    out = {}
    for name, types in {"Q8_0": ("Q8_0", "Q8_0", "Q8_0"), "Q4_K_M": ("Q4_K", "Q4_K", "Q6_K")}.items():
        path = folder / f"tiny-qwen3moe-{name}.gguf"
        write_gguf(path, model, types, "Q8_0", "Q8_0")
        out[name] = (path, gguf.GGUFReader(path).data_offset)
    return out


@pytest.fixture
def repo(hub, files):
    content = {"README.md": b"# tiny\n", **{p.name: p.read_bytes() for p, _ in files.values()}}
    r = hub.module.Repo(REPO, content, "b" * 40)
    hub.server.add(r)
    return r


def test_the_header_length_is_where_the_tensor_data_starts_less_its_padding(files):
    for path, data_offset in files.values():
        raw = path.read_bytes()
        n = header_length(raw)
        assert n is not None and data_offset - 32 < n <= data_offset  # the alignment is 32
        assert header_length(raw[:n]) == n
        for cut in (0, 3, 4, 24, n // 3, n - 1):  # every prefix that ends inside the header asks for more
            assert header_length(raw[:cut]) is None


def test_a_hostile_header_is_one_typed_line():
    start = b"GGUF" + struct.pack("<IQQ", 3, 1, 1)
    with pytest.raises(CheckpointError, match="claims"):
        header_length(start + struct.pack("<Q", 1 << 40))  # a key 1 TB long
    with pytest.raises(CheckpointError, match="value type 77"):
        header_length(start + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 77))
    with pytest.raises(CheckpointError, match="elements"):
        header_length(start + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 4, 1 << 40))
    with pytest.raises(CheckpointError, match="tensors"):
        header_length(b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 0))
    with pytest.raises(CheckpointError, match="not b'GGUF'"):
        header_length(b"PK\x03\x04" + bytes(40))
    with pytest.raises(CheckpointError, match="version 9"):
        header_length(b"GGUF" + struct.pack("<IQQ", 9, 0, 0))
    assert header_length(b"GGUF" + struct.pack(">IQQ", 3, 0, 0)) == 24  # big-endian, empty


def test_fit_on_a_hub_quant_reads_its_header_only_and_plans_as_the_downloaded_file(hub, repo, files, monkeypatch):
    from moechat.engine.plan import hubhttp

    monkeypatch.setattr(hubhttp, "GGUF_PROBE_BYTES", 1000)  # the tiny file's header is 2 KB: a second read, x4
    path, data_offset = files["Q4_K_M"]
    verdict = hub.client.fit(REPO, quant="Q4_K_M")
    local = read_model_spec(path)
    spec = verdict.spec
    for field in ("dense_parts", "expert_bytes", "expert_tensors", "num_experts", "num_moe_layers", "expert_format",
                  "kv_elems_full", "embedding_bytes", "max_context"):
        assert getattr(spec, field) == getattr(local, field), field
    assert spec.checkpoint_bytes == path.stat().st_size and verdict.download_bytes == path.stat().st_size
    assert spec.source == "GGUF headers (Hub)" and spec.name == f"{REPO}:Q4_K_M" and not spec.weights_present
    reads = hub.server.file_requests(path.name, "GET")
    assert reads and all(r.range for r in reads)  # ranged reads only
    sent = [r for r in reads if r.body_bytes]  # (the Hub's 302 to its CDN carries no body)
    assert [r.range for r in sent] == ["bytes=0-999", "bytes=1000-3999"]
    assert sum(r.body_bytes for r in sent) == 4000 < path.stat().st_size


def test_fit_names_the_quants_when_the_one_asked_for_is_not_there(hub, repo):
    with pytest.raises(QuantChoiceError, match="Q4_K_M") as e:
        hub.client.fit(REPO, quant="Q2_K")
    assert {name for name, _ in e.value.quants} == {"Q8_0", "Q4_K_M"}


def test_moechat_fit_repo_colon_quant_and_the_quant_flag(hub, repo, files, capsys):
    assert main(["fit", f"{REPO}:Q8_0", "--json", "--ram-gb", "8", "--vram-gb", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["spec"]["expert_format"] == "GGUF Q8_0/Q8_0/Q8_0"
    assert main(["fit", REPO, "--quant", "q4_k_m", "--json", "--ram-gb", "8", "--vram-gb", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["expert_format"] == "GGUF Q4_K/Q4_K/Q6_K"


def test_a_truncated_hub_file_is_one_typed_line(hub, files):
    path, _ = files["Q8_0"]
    raw = path.read_bytes()
    r = hub.module.Repo(REPO + "-cut", {"m-Q8_0.gguf": raw[: header_length(raw) // 2]}, "c" * 40)
    hub.server.add(r)
    with pytest.raises(Exception, match="truncated"):
        hub.client.fit(REPO + "-cut", quant="Q8_0")
