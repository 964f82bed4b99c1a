"""Fuzzing the bounded Hub HTTP layer (engine/plan/hubhttp.py) through the local Hub (tests/hubserver.py): hypothesis
draws hostile answers for model info, the tree listing, search and a safetensors header read (random JSON shapes
near and far from the real ones, any status, encodings, links, truncated and compressed bodies), and every call must
end in a correct result or one typed line, within a bounded time."""

from __future__ import annotations

import json
import string
import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from moechat.engine.errors import MoechatError
from moechat.engine.plan import hubhttp

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
DEADLINE_S = 1.0
BOUND_S = 2 * DEADLINE_S + 2.0  # the deadline, one read timeout (capped at the deadline), and slack

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
hex40 = st.text("0123456789abcdef", min_size=40, max_size=40)
hex64 = st.text("0123456789abcdef", min_size=64, max_size=64)
names = st.sampled_from(["config.json", "model.safetensors", "tokenizer.json", "README.md", "..", "a/b.json",
                         "x" * 300 + ".json", "é.json", "\udc80.json", ""]) | st.text(string.printable, max_size=20)


def near(real, strategy):
    """Mostly the real field's kind, sometimes anything at all."""
    return st.one_of(real, strategy, json_values)


lfs = st.fixed_dictionaries({}, optional={"sha256": near(hex64, st.text(max_size=70)), "oid": near(hex64, st.text()),
                                          "size": near(st.integers(0, 10**6), st.integers())})
sibling = st.fixed_dictionaries({"rfilename": near(names, st.integers())}, optional={
    "size": near(st.integers(0, 10**6), st.integers()), "blobId": near(hex40, st.text()), "lfs": near(lfs, lfs)})
info = st.fixed_dictionaries({}, optional={
    "sha": near(hex40, st.text(max_size=41)), "siblings": near(st.lists(sibling, max_size=5), st.lists(json_values)),
    "gated": near(st.sampled_from([False, "auto", "manual"]), st.integers()),
    "config": near(st.fixed_dictionaries({}, optional={"model_type": near(st.sampled_from(["qwen3_moe", "llama"]),
                                                                               st.integers())}), st.text())})
tree_entry = st.fixed_dictionaries({"type": near(st.sampled_from(["file", "directory"]), st.integers())}, optional={
    "path": near(names, st.integers()), "size": near(st.integers(0, 10**6), st.floats()),
    "oid": near(hex40, st.text()), "lfs": near(lfs, lfs)})
hit = st.fixed_dictionaries({"id": near(st.sampled_from(["tiny-org/x-moe", "gpt2", "a/../b"]), st.integers())},
                            optional={"config": near(st.fixed_dictionaries({"model_type": st.sampled_from(
                                ["qwen3_moe", "gpt_oss", "llama", "qwen3_next"])}), st.text()),
                                "downloads": near(st.integers(0, 10**9), st.text()), "likes": st.integers(),
                                "gated": json_values, "safetensors": near(st.fixed_dictionaries(
                                    {"total": st.integers(-5, 10**12)}), json_values)})


@st.composite
def answers(draw, document):
    """A whole HTTP answer: the document as JSON (or raw bytes), a status, headers, maybe truncated or gzipped."""
    value = draw(document)
    body = draw(st.one_of(st.just(json.dumps(value).encode()), st.binary(max_size=64),
                          st.just(json.dumps(value).encode()[:-1]))) if draw(st.booleans()) else json.dumps(
                              value).encode()
    status = draw(st.sampled_from([200] * 6 + [204, 206, 301, 304, 400, 401, 403, 404, 416, 429, 500, 502, 503]))
    headers = draw(st.dictionaries(st.sampled_from(["X-Error-Code", "Content-Encoding", "Link", "X-Error-Message"]),
                                   st.sampled_from(["RepoNotFound", "GatedRepo", "RevisionNotFound", "EntryNotFound",
                                                    "gzip", "br", "identity", "deflate", "x", '<?cursor=1>; rel="next"',
                                                    "<http://127.0.0.1:9/x>; rel=\"next\"", "Access denied"]),
                                   max_size=2))
    length = draw(st.none() | st.integers(len(body) + 1, len(body) + 100))
    gz = draw(st.booleans()) and "Content-Encoding" not in headers
    return value, dict(status=status, headers=headers, body=body, length=length, gzip=gz)  # a hubserver.Canned


def _run(hub, monkeypatch, kind, canned, call):
    hub.server.reset()
    hub.server.faults.info_without_sizes = kind == "tree"
    hub.server.faults.canned[kind] = hub.module.Canned(**canned)
    start = time.monotonic()
    try:
        result = call()
    except MoechatError as e:
        text = str(e)
        assert text and "\n" not in text and "Traceback" not in text, text
        result = e
    assert time.monotonic() - start < BOUND_S
    event(type(result).__name__)
    return result


@pytest.fixture
def bounded(hub, monkeypatch):
    monkeypatch.setattr(hubhttp, "METADATA_DEADLINE_S", DEADLINE_S)
    monkeypatch.setattr(hubhttp, "READ_TIMEOUT_S", DEADLINE_S)
    monkeypatch.setattr(hubhttp, "MAX_PAGES", 3)
    return hub


@SETTINGS
@given(answers(info))
def test_model_info_ends_in_a_listing_or_a_typed_error(bounded, monkeypatch, drawn):
    value, canned = drawn
    result = _run(bounded, monkeypatch, "info", canned, lambda: bounded.client.listing(bounded.repo))
    if not isinstance(result, Exception):  # then the answer was a real one, and the listing says what it said
        assert canned["status"] < 300 and isinstance(value, dict) and result.sha == value["sha"]
        listed = {s["rfilename"] for s in value.get("siblings") or []}
        assert {f.path for f in result.files} <= listed and set(result.skipped) <= listed


@SETTINGS
@given(answers(st.one_of(st.lists(tree_entry, max_size=5), json_values)))
def test_the_tree_listing_ends_in_a_listing_or_a_typed_error(bounded, monkeypatch, drawn):
    value, canned = drawn
    result = _run(bounded, monkeypatch, "tree", canned, lambda: bounded.client.listing(bounded.repo))
    if not isinstance(result, Exception):
        assert isinstance(value, list)
        files = {e["path"] for e in value if e.get("type") == "file"}
        assert {f.path for f in result.files} <= files


@SETTINGS
@given(answers(st.one_of(st.lists(hit, max_size=5), json_values)))
def test_search_ends_in_hits_or_a_typed_error(bounded, monkeypatch, drawn):
    value, canned = drawn
    result = _run(bounded, monkeypatch, "search", canned, lambda: bounded.client.search("moe", supported_only=False))
    if not isinstance(result, Exception):
        assert isinstance(value, list)
        served = {m["id"] for m in value}
        assert all(h.repo_id in served and "/" in h.repo_id and ".." not in h.repo_id for h in result)


header_values = st.dictionaries(st.sampled_from(["w", "__metadata__", "x.weight"]), st.one_of(
    st.fixed_dictionaries({"dtype": near(st.just("F32"), st.integers()),
                           "shape": near(st.lists(st.integers(0, 8), max_size=3), st.lists(json_values)),
                           "data_offsets": near(st.lists(st.integers(0, 64), min_size=2, max_size=2),
                                                st.lists(st.integers(), max_size=3))}), json_values), max_size=3)


@SETTINGS
@given(header_values, st.sampled_from([0, 1, -3, 10**9]), st.sampled_from([200, 206, 206, 404, 500]))
def test_a_safetensors_header_read_ends_in_tensors_or_a_typed_error(bounded, monkeypatch, header, skew, status):
    listing = bounded.client.listing(bounded.repo)
    raw = json.dumps(header).encode()
    body = max(0, len(raw) + skew).to_bytes(8, "little") + raw
    canned = dict(status=status, headers={}, body=body, length=None, gzip=False)
    result = _run(bounded, monkeypatch, "cdn", canned, lambda: bounded.client.headers(bounded.repo, listing))
    if not isinstance(result, Exception):
        assert status < 300 and skew == 0
        assert set(result) == {k for k in header if k != "__metadata__"}
