"""The one door to the Hub's HTTP: every request moechat makes to a Hub endpoint goes through here (model info,
the tree listing, search, a file's HEAD, safetensors headers, small JSON files, and the weight downloads'
connections), over huggingface_hub's HTTP client (its proxy settings and headers), with bounds that a broken or
hostile server cannot stretch:

- time: connect CONNECT_TIMEOUT_S and READ_TIMEOUT_S per socket operation, and a metadata request (API JSON, a
  HEAD, a header read, config.json) METADATA_DEADLINE_S in all, checked between the pieces of its body (so at
  most the deadline plus one read timeout): a server dripping a byte every 0.5 s fails after a minute, not
  hours. Downloads keep hub.py's progress rule instead (a slow file that moves is never killed).
- size: a metadata body is read raw, one network read at a time, and inflated here with zlib's max_length, so
  it stops past MAX_METADATA_BYTES decompressed having held no more: a 2 MB gzip body that inflates to 2 GiB
  costs 16 MiB, not 3 GB (httpx's iter_bytes inflates a whole read at once: up to ~1000x of 64 KiB).
- pages: a tree listing follows at most MAX_PAGES `Link: rel="next"` pages, on the endpoint's origin only (the
  token is never sent elsewhere), ends at an empty page, and refuses a next URL it has already fetched.
- shape: every JSON answer is checked against the fields moechat reads (model info, tree entries, search hits,
  safetensors headers); anything else is one UnsafeHubResponseError line naming the endpoint and the field.

Errors are typed and one line: NetworkError (too slow, unreachable, redirect loop), UnsafeHubResponseError (too
big, endless or foreign pages, wrong shape, not JSON) and the HTTP statuses, read through huggingface_hub's
error types (gated, not found, bad token, 5xx) and translated by `translate`.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urljoin, urlparse

from ..errors import (
    ConfigError,
    HubAuthError,
    HubError,
    HubOfflineError,
    MoechatError,
    NetworkError,
    RepoGatedError,
    RepoNotFoundError,
    UnsafeHubResponseError,
)
from ..units import KiB, MiB

CONNECT_TIMEOUT_S = 10.0  # a server that never accepts (huggingface_hub's client has no timeout)
READ_TIMEOUT_S = 30.0  # a silent connection is dropped after this (a download resumes)
METADATA_DEADLINE_S = 60.0  # one metadata request in all, however its bytes trickle in
MAX_REDIRECTS = 10  # a CDN or proxy that redirects more is in a loop
MAX_METADATA_BYTES = 16 * MiB  # decompressed; model info of a 5,000-file repo is ~1.5 MB, a tree page ~0.3 MB
MAX_ERROR_BYTES = 64 * KiB  # an error answer's body, read for its message only
MAX_PAGES = 100  # tree listing pages (the Hub sends 1,000 entries a page: 100,000 files)
HEADER_PROBE_BYTES = 100_001  # the first read of a safetensors file (huggingface_hub's 100 kB; most headers fit)
MAX_SAFETENSORS_HEADER = 100 * MiB  # the safetensors format's own limit
GGUF_PROBE_BYTES = 4 * MiB  # the first read of a GGUF file: the header of a 150k-token vocabulary fits
MAX_GGUF_HEADER = 256 * MiB  # past any real GGUF header (the largest vocabularies take ~20 MB)
MAX_PATH_BYTES = 4096  # PATH_MAX on Linux
MAX_NAME_BYTES = 255  # NAME_MAX on every common file system
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


# -- who and what an error is about ---------------------------------------------------------------------------

class Ctx:
    """Who and what an error is about, for its message: the repo (or search query), the revision, the Hub."""

    def __init__(self, hub, repo_id: str, revision: str | None = None):
        self.hub, self.repo_id, self.revision = hub, repo_id, revision

    def token_hint(self) -> str:
        return ("the token in use (HF_TOKEN or `hf auth login`)" if self.hub.token_in_use()
                else "no token is set (set HF_TOKEN to a read token)")


def _where(url: str) -> str:
    return str(url).split("?", 1)[0]


def _trust_hint() -> str:
    return "check HF_ENDPOINT points at the real Hub or a mirror you trust"


def unusable(ctx: Ctx, what: str, url: str, problem: str) -> UnsafeHubResponseError:
    """The one line for an answer moechat refuses: which endpoint, what was wrong, what to do."""
    problem = " ".join(str(problem).split())
    return UnsafeHubResponseError(f"{ctx.repo_id}: the Hub's {what} ({_where(url)}) is not usable: {problem}; nothing "
                                  f"was written: {_trust_hint()}", repo_id=ctx.repo_id)


# -- the client and its errors ----------------------------------------------------------------------------------

def session():
    """huggingface_hub's shared HTTP client (httpx in huggingface_hub 1.x, httpx2 in 2.x), with a redirect limit."""
    from huggingface_hub.utils import get_session

    client = get_session()
    if getattr(client, "max_redirects", MAX_REDIRECTS) != MAX_REDIRECTS:
        client.max_redirects = MAX_REDIRECTS
    return client


def _httpx():
    """The HTTP library module huggingface_hub's client comes from."""
    return sys.modules[type(session()).__module__.split(".")[0]]


def transport_errors() -> tuple[type[BaseException], ...]:
    err = getattr(_httpx(), "TransportError", None)
    return (err,) if isinstance(err, type) else ()


def redirect_loop(e: BaseException) -> bool:
    return type(e).__name__ == "TooManyRedirects"


def timeout(limit_s: float | None = None):
    """Per-operation bounds, none longer than `limit_s` (what is left of a deadline)."""
    read = READ_TIMEOUT_S if limit_s is None else max(0.05, min(READ_TIMEOUT_S, limit_s))
    return _httpx().Timeout(connect=min(CONNECT_TIMEOUT_S, read) if limit_s else CONNECT_TIMEOUT_S, read=read,
                            write=read, pool=read)


def _status(e: BaseException) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def translate(e: BaseException, ctx: Ctx) -> MoechatError:
    """An error of huggingface_hub or the HTTP client as a typed error that says what to do."""
    from huggingface_hub import errors as hfe

    repo, url = ctx.repo_id, ctx.hub.endpoint_url
    status = _status(e)
    if isinstance(e, MoechatError):
        return e
    if isinstance(e, hfe.GatedRepoError):
        how = ("accept its conditions on the model page with the account of your token" if ctx.hub.token_in_use()
               else "accept its conditions on the model page, then set HF_TOKEN to a read token of that account")
        return RepoGatedError(f"{repo} is gated ({status}): {how}: {url}/{repo}", repo_id=repo)
    if isinstance(e, hfe.RevisionNotFoundError):
        return RepoNotFoundError(f"{repo} has no revision {ctx.revision!r} (404): check the branch, tag or commit",
                                 repo_id=repo)
    if isinstance(e, hfe.RepositoryNotFoundError):
        return RepoNotFoundError(f"{repo}: no such model on {url} ({status}), or it is private and "
                                 f"{ctx.token_hint()} has no access: check the name", repo_id=repo)
    if isinstance(e, hfe.RemoteEntryNotFoundError if hasattr(hfe, "RemoteEntryNotFoundError")
                  else hfe.EntryNotFoundError) and status == 404:
        return RepoNotFoundError(f"{repo}: a file listed by the Hub is missing (404): {e}".split("\n")[0],
                                 repo_id=repo)
    if isinstance(e, hfe.HfHubHTTPError) and status == 401:
        return HubAuthError(f"{url} rejected the token (401 invalid credentials): create a new read token at "
                            f"{url}/settings/tokens and set HF_TOKEN, or unset it for public models", repo_id=repo)
    if isinstance(e, hfe.HfHubHTTPError) and status == 403:
        return HubAuthError(f"{repo}: access denied (403) for {ctx.token_hint()}: use a token with read access "
                            "(fine-grained tokens need 'read access to public gated repos')", repo_id=repo)
    if isinstance(e, hfe.OfflineModeIsEnabled):
        return HubOfflineError(f"{repo}: HF_HUB_OFFLINE is set and this needs the Hub: unset HF_HUB_OFFLINE, or "
                               "use a model that is already downloaded", repo_id=repo)
    if isinstance(e, hfe.HfHubHTTPError) and status is not None and status >= 500:
        return NetworkError(f"{url} answered {status} for {repo}: the Hub is having trouble; try again later",
                            repo_id=repo)
    if isinstance(e, hfe.HfHubHTTPError):
        return HubError(f"{repo}: the Hub answered {status}: {(str(e).splitlines() or [''])[0]}", repo_id=repo)
    if redirect_loop(e):
        return NetworkError(f"{url} for {repo}: the server redirected more than {MAX_REDIRECTS} times (a redirect "
                            "loop at the Hub's CDN or a proxy); nothing more was written: try again later, or check "
                            "HF_ENDPOINT and the proxy settings", repo_id=repo)
    if isinstance(e, hfe.LocalEntryNotFoundError) or isinstance(e, transport_errors()) or isinstance(
            e, ConnectionError | TimeoutError):
        return NetworkError(f"cannot reach {url} for {repo} ({type(e).__name__}): check the connection or proxy, "
                            "or set HF_HUB_OFFLINE=1 to use only downloaded models", repo_id=repo)
    if isinstance(e, hfe.SafetensorsParsingError | hfe.NotASafetensorsRepoError):
        return ConfigError(f"{repo}: {str(e).splitlines()[0]}")
    text = " ".join(str(e).split())[:300]
    return HubError(f"{repo}: {type(e).__name__}: {text}", repo_id=repo)


@contextlib.contextmanager
def hub_errors(ctx: Ctx):
    try:
        yield
    except MoechatError:
        raise
    except Exception as e:  # noqa: BLE001 - everything the HTTP client raises becomes a typed, readable error
        raise translate(e, ctx) from e


# -- one bounded request ---------------------------------------------------------------------------------------

class _Deadline:
    def __init__(self, ctx: Ctx, what: str, url: str, seconds: float):
        self.ctx, self.what, self.url, self.seconds = ctx, what, url, seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def check(self, received: int) -> None:
        if time.monotonic() >= self.end:
            raise NetworkError(f"{self.ctx.repo_id}: the Hub's {self.what} ({_where(self.url)}) took more than "
                               f"{self.seconds:g} s ({received} B received): the server or the connection is too "
                               "slow; try again later, or check HF_ENDPOINT and the proxy settings",
                               repo_id=self.ctx.repo_id)


def _read_body(r, cap: int, deadline: _Deadline, *, truncate: bool = False, ctx: Ctx, what: str) -> bytes:
    """At most `cap` decompressed bytes of the body, inflated here read by read (never more than `cap` + one read
    in memory); past `cap` an error, or with `truncate` the first `cap` bytes."""
    encoding = (r.headers.get("content-encoding") or "identity").strip().lower()
    if encoding in ("", "identity"):
        inflate = None
    elif encoding in ("gzip", "x-gzip", "deflate"):
        inflate = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib header, detected
    else:
        raise unusable(ctx, what, str(r.url), f"the body is compressed as {encoding[:40]!r}, which moechat never "
                       "asks for")
    out = bytearray()

    def too_big():
        return unusable(ctx, what, str(r.url), f"the body is larger than {cap} B"
                        + (" decompressed" if inflate is not None else "") + " (a real answer is far smaller)")

    try:
        for raw in r.iter_raw():  # as the network delivers (a chunk_size would wait for that many bytes)
            deadline.check(len(out))
            if inflate is None:
                out += raw
            else:
                data = raw
                while data and len(out) <= cap:
                    out += inflate.decompress(data, cap + 1 - len(out))  # max_length >= 1 here: never unbounded
                    data = inflate.unconsumed_tail
                    if inflate.eof:  # gzip allows several members; anything after the last one is junk
                        rest = inflate.unused_data + data
                        inflate = zlib.decompressobj(zlib.MAX_WBITS | 32)
                        data = rest
            if len(out) > cap:
                if truncate:
                    return bytes(out[:cap])
                raise too_big()
        if inflate is not None:
            out += inflate.flush()
    except zlib.error as e:
        raise unusable(ctx, what, str(r.url), f"its {encoding} body is corrupt ({e})") from None
    if len(out) > cap:
        if truncate:
            return bytes(out[:cap])
        raise too_big()
    return bytes(out)


def _raise_for_status(r, body: bytes) -> None:
    """huggingface_hub's reading of an error answer (X-Error-Code and friends), on a copy holding the bounded
    body (the answer itself was streamed)."""
    from huggingface_hub.utils import hf_raise_for_status

    skip = {"content-encoding", "content-length", "transfer-encoding"}
    copy = _httpx().Response(r.status_code, headers=[(k, v) for k, v in r.headers.items() if k.lower() not in skip],
                             content=body, request=r.request)
    hf_raise_for_status(copy)
    raise _httpx().HTTPStatusError(f"{r.status_code}", request=r.request, response=copy)  # never reached: >= 400


@contextlib.contextmanager
def open_stream(method: str, url: str, ctx: Ctx, what: str, *, headers: dict, params=None,
                follow_redirects: bool = True, limit_s: float | None = None) -> Iterator[Any]:
    """A streamed response whose status is below 400 (an error status is a typed error, its body read bounded).
    Transport errors are left raw for the caller (a download retries them)."""
    with session().stream(method, url, headers=headers, params=params, follow_redirects=follow_redirects,
                          timeout=timeout(limit_s)) as r:
        if r.status_code >= 400:
            deadline = _Deadline(ctx, what, url, limit_s if limit_s is not None else READ_TIMEOUT_S)
            body = _read_body(r, MAX_ERROR_BYTES, deadline, truncate=True, ctx=ctx, what=what)
            with hub_errors(ctx):
                _raise_for_status(r, body)
        yield r


@dataclass(frozen=True)
class Body:
    status: int
    headers: Any  # the response's headers (case-insensitive)
    content: bytes
    url: str  # after redirects
    links: dict


def fetch(url: str, ctx: Ctx, what: str, *, headers: dict, params=None, max_bytes: int | None = None,
          deadline_s: float | None = None, truncate: bool = False, method: str = "GET",
          follow_redirects: bool = True) -> Body:
    """One metadata request, bounded in time (`deadline_s`, default METADATA_DEADLINE_S) and decompressed size
    (`max_bytes`, default MAX_METADATA_BYTES); every failure typed."""
    seconds = METADATA_DEADLINE_S if deadline_s is None else deadline_s
    cap = MAX_METADATA_BYTES if max_bytes is None else max_bytes
    deadline = _Deadline(ctx, what, url, seconds)
    headers = {**headers, "Accept-Encoding": headers.get("Accept-Encoding", "gzip, deflate")}
    with hub_errors(ctx), open_stream(method, url, ctx, what, headers=headers, params=params,
                                      follow_redirects=follow_redirects, limit_s=seconds) as r:
        if follow_redirects and 300 <= r.status_code < 400:  # a redirect the client could not follow
            raise unusable(ctx, what, url, f"it answered {r.status_code} without a usable Location")
        content = b"" if method == "HEAD" else _read_body(r, cap, deadline, truncate=truncate, ctx=ctx, what=what)
        deadline.check(len(content))
        return Body(r.status_code, r.headers, content, str(r.url), dict(r.links))


def _json(body: Body, ctx: Ctx, what: str):
    try:
        return json.loads(body.content)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, a 5,000-digit integer, [[[[...
        raise unusable(ctx, what, body.url, f"the answer is not JSON ({type(e).__name__}: {str(e)[:120]})") from None


# -- the shapes moechat reads ------------------------------------------------------------------------------------

def _kind(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true/false"
    return {str: "a string", int: "a number", float: "a number", list: "a list", dict: "an object"}.get(
        type(v), type(v).__name__)


class _Shape:
    """Checks one JSON answer; the first surprise is an UnsafeHubResponseError naming the field."""

    def __init__(self, ctx: Ctx, what: str, url: str):
        self.ctx, self.what, self.url = ctx, what, url

    def fail(self, problem: str):
        raise unusable(self.ctx, self.what, self.url, problem)

    def obj(self, v, where: str) -> dict:
        if not isinstance(v, dict):
            self.fail(f"{where} is {_kind(v)}, not an object")
        return v

    def list(self, v, where: str) -> list:
        if not isinstance(v, list):
            self.fail(f"{where} is {_kind(v)}, not a list")
        return v

    def field(self, o: dict, key: str, kind: str, where: str, required: bool = False):
        """`kind`: "str", "count" (an integer >= 0), "int", "obj", "list", "flag" (true/false or a string)."""
        v = o.get(key)
        if v is None:
            if required:
                self.fail(f"{where}.{key} is missing")
            return None
        ok = {"str": isinstance(v, str),
              "count": isinstance(v, int) and not isinstance(v, bool) and v >= 0,
              "int": isinstance(v, int) and not isinstance(v, bool),
              "obj": isinstance(v, dict), "list": isinstance(v, list),
              "flag": isinstance(v, bool | str)}[kind]
        if not ok:
            want = {"str": "a string", "count": "a byte count or count (an integer >= 0)", "int": "an integer",
                    "obj": "an object", "list": "a list", "flag": "true/false or a string"}[kind]
            shown = repr(v)[:60] if not isinstance(v, dict | list) else _kind(v)
            self.fail(f"{where}.{key} is {shown}, not {want}")
        return v


@dataclass(frozen=True)
class Sibling:
    """A file entry as the Hub listed it, its types checked (its name and digests are checked by hub.RepoFile)."""

    path: str
    size: int | None
    sha256: str | None
    blob_id: str | None


@dataclass(frozen=True)
class ModelInfo:
    sha: str
    siblings: tuple[Sibling, ...]
    gated: bool
    model_type: str | None


@dataclass(frozen=True)
class SearchEntry:
    repo_id: str
    model_type: str | None
    downloads: int | None
    likes: int | None
    gated: bool | None
    params: int | None


@dataclass(frozen=True)
class FileMetadata:
    commit: str | None
    etag: str | None
    size: int | None
    location: str


@dataclass(frozen=True)
class Tensor:
    """What plan.spec_from_headers reads from a header entry."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def _model_type(s: _Shape, o: dict, where: str) -> str | None:
    config = s.field(o, "config", "obj", where)
    return None if config is None else s.field(config, "model_type", "str", f"{where}.config")


def _gated(v) -> bool | None:
    return None if v is None else bool(v)  # False, or "auto" / "manual"


# -- the endpoints ---------------------------------------------------------------------------------------------

def model_info(endpoint: str, repo_id: str, revision: str, ctx: Ctx, headers: dict) -> ModelInfo:
    """GET /api/models/{repo}/revision/{rev}?blobs=true: the commit, the files with sizes and digests."""
    url = f"{endpoint}/api/models/{repo_id}/revision/{quote(revision, safe='')}"
    what = "model info"
    body = fetch(url, ctx, what, headers=headers, params={"blobs": "true"})
    s = _Shape(ctx, what, body.url)
    info = s.obj(_json(body, ctx, what), "the answer")
    sha = s.field(info, "sha", "str", "the answer", required=True)
    if not _COMMIT.match(sha):
        s.fail(f"sha {sha[:60]!r} is not a 40-hex commit id")
    siblings = []
    for i, e in enumerate(s.list(info.get("siblings") or [], "siblings")):
        where = f"siblings[{i}]"
        s.obj(e, where)
        lfs = s.field(e, "lfs", "obj", where)
        siblings.append(Sibling(s.field(e, "rfilename", "str", where, required=True),
                                s.field(e, "size", "count", where), _lfs_digest(s, lfs, f"{where}.lfs", "sha256"),
                                s.field(e, "blobId", "str", where)))
    s.field(info, "gated", "flag", "the answer")
    return ModelInfo(sha, tuple(siblings), bool(_gated(info.get("gated"))), _model_type(s, info, "the answer"))


def _lfs_digest(s: _Shape, lfs: dict | None, where: str, key: str) -> str | None:
    if lfs is None:
        return None
    s.field(lfs, "size", "count", where)
    return s.field(lfs, key, "str", where, required=True)


def tree(endpoint: str, repo_id: str, sha: str, ctx: Ctx, headers: dict) -> list[Sibling]:
    """GET /api/models/{repo}/tree/{sha}?recursive=true, every page: the files (folders dropped)."""
    first = f"{endpoint}/api/models/{repo_id}/tree/{quote(sha, safe='')}"
    what = "tree listing"
    origin = _origin(first)
    files: list[Sibling] = []
    seen: set[str] = set()
    url, params = first, {"recursive": "true", "expand": "false"}
    for page in range(1, MAX_PAGES + 1):
        body = fetch(url, ctx, what, headers=headers, params=params)
        seen.add(body.url)
        s = _Shape(ctx, what, body.url)
        entries = s.list(_json(body, ctx, what), f"page {page}")
        for i, e in enumerate(entries):
            where = f"page {page}[{i}]"
            s.obj(e, where)
            if s.field(e, "type", "str", where, required=True) != "file":
                continue
            lfs = s.field(e, "lfs", "obj", where)
            files.append(Sibling(s.field(e, "path", "str", where, required=True),
                                 s.field(e, "size", "count", where, required=True),
                                 _lfs_digest(s, lfs, f"{where}.lfs", "oid"), s.field(e, "oid", "str", where)))
        nxt = (body.links.get("next") or {}).get("url")
        if not entries or not nxt:  # an empty page has nothing after it, whatever its Link says
            return files
        nxt = urljoin(body.url, nxt)
        if _origin(nxt) != origin:
            s.fail(f"page {page} links its next page to another server ({_origin_text(nxt)}), where the token "
                   "would follow")
        if nxt in seen:
            s.fail(f"page {page} links back to a page already fetched (a pagination loop)")
        url, params = nxt, None
    raise unusable(ctx, what, first, f"it goes on past {MAX_PAGES} pages (more than any real repo)")


def search(endpoint: str, query: str, limit: int, ctx: Ctx, headers: dict) -> list[SearchEntry]:
    """GET /api/models?search=...: one page of `limit` repos, most downloaded first, with their config summary."""
    url = f"{endpoint}/api/models"
    what = "search"
    params = [("search", query), ("limit", str(limit)), ("sort", "downloads"),
              *(("expand", e) for e in ("config", "downloads", "likes", "gated", "safetensors"))]
    body = fetch(url, ctx, what, headers=headers, params=params)
    s = _Shape(ctx, what, body.url)
    hits = []
    for i, m in enumerate(s.list(_json(body, ctx, what), "the answer")):
        where = f"result[{i}]"
        s.obj(m, where)
        repo_id = s.field(m, "id", "str", where, required=True)
        safetensors = s.field(m, "safetensors", "obj", where)
        hits.append(SearchEntry(repo_id, _model_type(s, m, where), s.field(m, "downloads", "int", where),
                                s.field(m, "likes", "int", where), _gated(s.field(m, "gated", "flag", where)),
                                None if safetensors is None else s.field(safetensors, "total", "count",
                                                                         f"{where}.safetensors")))
    return hits


def _normalize_etag(value: str | None) -> str | None:
    if value is None:
        return None
    return value.strip().removeprefix("W/").strip('"') or None


def file_metadata(url: str, ctx: Ctx, headers: dict, what: str) -> FileMetadata:
    """HEAD a file at its pinned commit, as huggingface_hub's get_hf_file_metadata: the Hub's relative redirects
    (a renamed repo) followed, an absolute one (the CDN) is the download's location, with the linked ETag and
    size. The whole chain gets one METADATA_DEADLINE_S."""
    headers = {**headers, "Accept-Encoding": "identity"}  # the real size, not a compressed one
    start = time.monotonic()
    current = url
    for _ in range(MAX_REDIRECTS + 1):
        left = METADATA_DEADLINE_S - (time.monotonic() - start)
        if left <= 0:
            raise NetworkError(f"{ctx.repo_id}: the Hub's {what} ({_where(url)}) took more than "
                               f"{METADATA_DEADLINE_S:g} s: try again later", repo_id=ctx.repo_id)
        r = fetch(current, ctx, what, headers=headers, method="HEAD", follow_redirects=False, deadline_s=left)
        location = r.headers.get("location")
        if 300 <= r.status < 400 and location and not urlparse(location).netloc:
            current = urljoin(current, location)  # the Hub's own redirect: follow it
            continue
        break
    else:
        raise NetworkError(f"{ctx.repo_id}: the Hub's {what} ({_where(url)}) redirected more than {MAX_REDIRECTS} "
                           "times (a redirect loop): try again later, or check HF_ENDPOINT", repo_id=ctx.repo_id)
    redirected = 300 <= r.status < 400
    if redirected and not location:
        raise unusable(ctx, what, url, f"a {r.status} redirect without a Location")
    location = urljoin(current, location) if redirected else current
    if urlparse(location).scheme not in ("http", "https"):
        raise unusable(ctx, what, url, f"the file's location {location[:80]!r} is not an http(s) URL")
    size_text = r.headers.get("x-linked-size") or (None if redirected else r.headers.get("content-length"))
    if size_text is not None and not (size_text.strip().isdigit() and size_text.strip().isascii()):
        raise unusable(ctx, what, url, f"its size header {size_text[:40]!r} is not a byte count")
    etag = _normalize_etag(r.headers.get("x-linked-etag") or r.headers.get("etag"))
    return FileMetadata(r.headers.get("x-repo-commit"), etag, None if size_text is None else int(size_text),
                        location)


def safetensors_header(url: str, ctx: Ctx, headers: dict, what: str) -> dict[str, Tensor]:
    """A safetensors file's header from the first HEADER_PROBE_BYTES (a second ranged read when it is longer),
    never more of the file, its entries checked."""
    first = fetch(url, ctx, what, headers={**headers, "Range": f"bytes=0-{HEADER_PROBE_BYTES - 1}"},
                  max_bytes=HEADER_PROBE_BYTES, truncate=True)  # a server that ignores Range: cut off, not read
    s = _Shape(ctx, what, first.url)
    if len(first.content) < 8:
        s.fail(f"the file starts with {len(first.content)} B, less than the 8-byte header length")
    n = int.from_bytes(first.content[:8], "little")
    if n < 2 or n > MAX_SAFETENSORS_HEADER:
        s.fail(f"its header length {n} B is outside 2 B..{MAX_SAFETENSORS_HEADER // MiB} MiB")
    if 8 + n <= len(first.content):
        raw = first.content[8:8 + n]
    else:
        more = fetch(url, ctx, what, headers={**headers, "Range": f"bytes=8-{n + 7}"}, max_bytes=n, truncate=True,
                     deadline_s=METADATA_DEADLINE_S + n / (64 * KiB))
        raw = more.content
        if len(raw) != n:
            s.fail(f"the server sent {len(raw)} B of a {n} B header")
    header = s.obj(_json(Body(first.status, first.headers, raw, first.url, {}), ctx, what), "the header")
    tensors = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        where = f"tensor {name[:60]!r}"
        s.obj(t, where)
        dtype = s.field(t, "dtype", "str", where, required=True)
        shape = s.field(t, "shape", "list", where, required=True)
        offsets = s.field(t, "data_offsets", "list", where, required=True)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            s.fail(f"{where}.shape {str(shape)[:60]} is not a list of sizes")
        if (len(offsets) != 2 or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
                or offsets[0] > offsets[1]):
            s.fail(f"{where}.data_offsets {str(offsets)[:60]} is not [start, end] with 0 <= start <= end")
        tensors[name] = Tensor(dtype, tuple(shape), offsets[1] - offsets[0])
    return tensors


def gguf_header(url: str, ctx: Ctx, headers: dict, what: str, size: int) -> bytes:
    """A GGUF file's header (metadata and tensor infos, engine/io/gguf_header.py), by ranged reads from the start
    of the file: GGUF_PROBE_BYTES first, then four times more at a time, never past the header or `size`."""
    from ..io.gguf_header import header_length

    data = b""
    want = min(GGUF_PROBE_BYTES, size)
    while True:
        got = fetch(url, ctx, what, headers={**headers, "Range": f"bytes={len(data)}-{want - 1}"},
                    max_bytes=want - len(data), truncate=True, deadline_s=METADATA_DEADLINE_S + want / (64 * KiB))
        if len(got.content) != want - len(data):
            _Shape(ctx, what, got.url).fail(f"the server sent {len(got.content)} B for bytes {len(data)}-{want - 1}")
        data += got.content
        n = header_length(data, f"{ctx.repo_id}: {what}")
        if n is not None:
            return data[:n]
        if want >= size:
            _Shape(ctx, what, got.url).fail(f"the file ends ({size} B) inside its GGUF header: it is truncated")
        if want >= MAX_GGUF_HEADER:
            _Shape(ctx, what, got.url).fail(f"its GGUF header goes on past {MAX_GGUF_HEADER // MiB} MiB")
        want = min(4 * want, size, MAX_GGUF_HEADER)


def _origin(url: str) -> tuple[str, str, int | None]:
    p = urlparse(url)
    try:
        port = p.port
    except ValueError:
        port = -1
    return p.scheme, (p.hostname or "").lower(), port


def _origin_text(url: str) -> str:
    scheme, host, port = _origin(url)
    return f"{scheme}://{host[:60]}" + (f":{port}" if port else "")
