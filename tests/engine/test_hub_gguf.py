"""GGUF repos on the Hub: the quants a repo offers (from its listing: single files, split sets, subfolders),
`moechat pull org/repo:QUANT` fetching only the chosen files with the same resume and checksum checks, and a
GGUF-only repo pulled without a quant listing them. Against the local Hub (tests/hubserver.py)."""

from __future__ import annotations

import hashlib
import json

import pytest

from moechat.app.cli.main import main
from moechat.engine.errors import DownloadIntegrityError, QuantChoiceError, UnsafeHubResponseError
from moechat.engine.plan import hub as hubmod

REPO = "gguf-org/tiny-moe-GGUF"
SPLIT1 = "UD-Q4_K_XL/tiny-moe-UD-Q4_K_XL-00001-of-00002.gguf"
SPLIT2 = "UD-Q4_K_XL/tiny-moe-UD-Q4_K_XL-00002-of-00002.gguf"


def _bytes(tag: str, n: int) -> bytes:
    return (hashlib.sha256(tag.encode()).digest() * (n // 32 + 1))[:n]


FILES = {
    "README.md": b"# tiny moe GGUF\n",
    "tiny-moe-Q4_K_M.gguf": _bytes("q4", 150_000),
    "tiny-moe-Q8_0.gguf": _bytes("q8", 260_000),
    SPLIT1: _bytes("ud1", 120_000),
    SPLIT2: _bytes("ud2", 90_000),
    "BF16/tiny-moe-BF16-00001-of-00003.gguf": _bytes("bf1", 200_000),
    "BF16/tiny-moe-BF16-00002-of-00003.gguf": _bytes("bf2", 200_000),  # part 3 is missing from the repo
    "mmproj-F16.gguf": _bytes("mm", 5_000),
    "imatrix_unsloth.dat": _bytes("imat", 3_000),
}


@pytest.fixture
def repo(hub):
    r = hub.module.Repo(REPO, dict(FILES), "a" * 40)
    hub.server.add(r)
    return r


def _gets(hub) -> set[str]:
    return {r.file for r in hub.server.requests if r.method == "GET" and r.file}


def test_quants_from_the_listing(hub, repo):
    _, quants = hub.client.quants(REPO)
    by_name = {q.name: q for q in quants}
    assert list(by_name) == ["Q4_K_M", "UD-Q4_K_XL", "Q8_0", "BF16"]  # smallest first
    assert by_name["UD-Q4_K_XL"].size == 210_000 and by_name["UD-Q4_K_XL"].first == SPLIT1
    assert [f.path for f in by_name["UD-Q4_K_XL"].files] == [SPLIT1, SPLIT2]
    assert by_name["Q8_0"].complete and not by_name["BF16"].complete
    assert "only 2 of 3 parts" in by_name["BF16"].describe()
    assert _gets(hub) == set()  # listing only: no file bytes


@pytest.mark.parametrize("name, quant", [
    ("Qwen3-30B-A3B-Q4_K_M.gguf", "Q4_K_M"), ("model.q8_0.gguf", "Q8_0"), ("gpt-oss-20b-MXFP4.gguf", "MXFP4"),
    ("Q6_K/Qwen3-30B-A3B-Q6_K-00001-of-00002.gguf", "Q6_K"), ("IQ4_XS/model-00001-of-00002.gguf", "IQ4_XS"),
    ("Qwen3-30B-A3B-UD-IQ2_XXS.gguf", "UD-IQ2_XXS"), ("x-BF16.gguf", "BF16"), ("plain.gguf", "plain"),
])
def test_quant_names(name, quant):
    (q,) = hubmod.gguf_quants([hubmod.LocalFile(name, 1)])
    assert q.name == quant


def test_pull_one_quant_fetches_only_its_file_and_the_imatrix(hub, repo):
    path = hub.client.download_quant(REPO, "q4_k_m")
    assert path.name == "tiny-moe-Q4_K_M.gguf" and path.read_bytes() == FILES["tiny-moe-Q4_K_M.gguf"]
    assert (path.parent / "imatrix_unsloth.dat").read_bytes() == FILES["imatrix_unsloth.dat"]
    assert _gets(hub) == {"tiny-moe-Q4_K_M.gguf", "imatrix_unsloth.dat"}
    assert hubmod.snapshot_problems(path.parent) == []
    assert hub.client.local_snapshot(REPO) == path.parent
    # again: nothing fetched
    hub.server.requests.clear()
    assert hub.client.download_quant(REPO, "Q4_K_M") == path
    assert _gets(hub) == set()


def test_pull_a_split_quant_in_a_subfolder_resumes_a_dropped_part(hub, repo):
    hub.server.faults.drop_at[SPLIT2] = 40_000
    notes = []
    path = hub.client.download_quant(REPO, "Q4_K_XL", progress=lambda e: e.note and notes.append(e.note))
    assert path.as_posix().endswith(SPLIT1)
    assert path.read_bytes() == FILES[SPLIT1]
    assert (path.parent / SPLIT2.rsplit("/", 1)[1]).read_bytes() == FILES[SPLIT2]
    assert any("connection dropped" in n for n in notes)
    ranges = [r.range for r in hub.server.file_requests(SPLIT2, "GET")]
    assert ranges[0] is None and ranges[1] == "bytes=40000-"
    assert _gets(hub) == {SPLIT1, SPLIT2, "imatrix_unsloth.dat"}
    # one part gone from the snapshot: it is not complete any more
    (path.parent / SPLIT2.rsplit("/", 1)[1]).unlink()
    assert hubmod.snapshot_problems(path.parents[1]) == ["tiny-moe-UD-Q4_K_XL: 1 of 2 parts missing"]


def test_a_corrupt_quant_is_refused(hub, repo):
    hub.server.faults.corrupt.add("tiny-moe-Q8_0.gguf")
    with pytest.raises(DownloadIntegrityError):
        hub.client.download_quant(REPO, "Q8_0")
    assert hub.client.local_snapshot(REPO) is None


def test_no_quant_named_lists_them(hub, repo):
    with pytest.raises(QuantChoiceError) as info:
        hub.client.download(REPO)
    message = str(info.value)
    assert "offers 4 GGUF quants" in message and f"moechat pull {REPO}:Q4_K_M" in message and "\n" not in message
    assert dict(info.value.quants)["Q8_0"] == 260_000
    with pytest.raises(QuantChoiceError, match="has no Q3_K_S quant"):
        hub.client.download(REPO, quant="Q3_K_S")
    with pytest.raises(QuantChoiceError, match="split into 3 parts but the repo lists 2"):
        hub.client.download(REPO, quant="BF16")
    assert _gets(hub) == set()


def test_a_traversal_in_a_gguf_path_is_refused(hub, repo):
    hub.server.faults.listing_patch["tiny-moe-Q8_0.gguf"] = {"rfilename": "../../escape/x-Q8_0.gguf"}
    with pytest.raises(UnsafeHubResponseError, match="nothing was written"):
        hub.client.download(REPO, quant="Q8_0")
    assert hubmod.unsafe_repo_path("a/b/c.gguf") is None
    for bad in ("a//b.gguf", "/a.gguf", "a/../b.gguf", "a\\b.gguf", "a/b/c/d/e/f.gguf"):
        assert hubmod.unsafe_repo_path(bad) is not None, bad
    with pytest.raises(ValueError):
        hubmod.RepoFile("a/b.json", 3, None, "a" * 40)  # folders only for GGUF files


def _main(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_pull_with_quant(hub, repo, capsys):
    code, out, err = _main(capsys, "pull", f"{REPO}:Q8_0", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["quant"] == "Q8_0" and data["path"].endswith("/tiny-moe-Q8_0.gguf")
    assert data["revision"] == "a" * 40
    assert {f["path"] for f in data["plan"]["files"]} == {"tiny-moe-Q8_0.gguf", "imatrix_unsloth.dat"}
    code, out, err = _main(capsys, "pull", REPO, "--quant", "UD-Q4_K_XL")
    assert code == 0, err
    assert out.strip().endswith(SPLIT1)
    code, out, err = _main(capsys, "pull", f"{REPO}:Q8_0", "--quant", "Q4_K_M")
    assert code == 1 and "give one of them" in err


def test_cli_pull_without_quant_lists_them(hub, repo, capsys):
    code, out, err = _main(capsys, "pull", REPO)
    assert code == 1 and out == ""
    lines = err.splitlines()
    assert lines[0] == f"{REPO}: GGUF quants"
    assert [line.split() for line in lines[1:5]] == [["Q4_K_M", "0.1", "MiB"], ["UD-Q4_K_XL", "0.2", "MiB"],
                                                    ["Q8_0", "0.2", "MiB"], ["BF16", "0.4", "MiB"]]
    assert lines[-1].startswith("moechat: error: ") and f"moechat pull {REPO}:Q4_K_M" in lines[-1]
    code, out, err = _main(capsys, "pull", REPO, "--json")
    data = json.loads(out)
    assert data["error_type"] == "QuantChoiceError"
    assert [q["quant"] for q in data["quants"]] == ["Q4_K_M", "UD-Q4_K_XL", "Q8_0", "BF16"]


def test_a_pulled_quant_resolves_offline(hub, repo, monkeypatch):
    from moechat.app.cli.pull import resolve_model_arg
    from moechat.engine.errors import NotDownloadedError

    path = hub.client.download_quant(REPO, "Q4_K_M")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.server.requests.clear()
    assert resolve_model_arg(f"{REPO}:Q4_K_M") == str(path)
    with pytest.raises(NotDownloadedError, match=f"run moechat pull {REPO}:Q8_0"):
        resolve_model_arg(f"{REPO}:Q8_0")
    assert hub.server.requests == []


@pytest.mark.parametrize("name, kind", [
    ("imatrix.dat", "imatrix"), ("imatrix_unsloth.gguf", "imatrix"), ("Qwen3-30B-A3B.imatrix", "imatrix"),
    ("x.imatrix.gguf", "imatrix"), ("Qwen3-imatrix-Q4_K_M.gguf", "model"), ("mmproj-F16.gguf", "neither"),
    ("BF16/x-BF16-00001-of-00002.gguf", "model"),
])
def test_imatrix_and_model_files_are_told_apart(name, kind):
    assert hubmod.is_imatrix_path(name) == (kind == "imatrix")
    assert hubmod.is_gguf_path(name) == (kind == "model")
