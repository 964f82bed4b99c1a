"""A local stand-in for the Hugging Face Hub that speaks enough of its protocol for huggingface_hub (1.x/2.x).

Two origins: the Hub (`url`) answers the API and `/{repo}/resolve/{rev}/{file}`, and redirects LFS files
(weights) to the CDN (`cdn_url`, another port, so the token must not follow), as huggingface.co does:

    GET  /api/models?search=...                        search (config, downloads, likes, gated, safetensors)
    GET  /api/models/{repo}[/revision/{rev}][?blobs=1]  sha, siblings (+ size, blobId, lfs), gated, config
    GET  /api/models/{repo}/tree/{rev}[?cursor=N]      files with oid, size, lfs (pages linked by Link: next)
    HEAD/GET /{repo}/resolve/{rev}/{file}              X-Repo-Commit, ETag / X-Linked-Etag, Content-Length /
                                                       X-Linked-Size; small files served here, LFS -> 302 CDN
    GET  /blobs/{sha256}  (CDN)                        the LFS file, with Range

Errors as the Hub sends them (X-Error-Code RepoNotFound / RevisionNotFound / GatedRepo, 401 "Invalid
credentials in Authorization header"). `faults` injects what the real world does: drop the connection at a
byte offset, ignore Range, serve wrong bytes or a wrong length, serve slowly; and the API's JSON answers as a
hostile server sends them (endless pages, a dripped body, a gzip bomb, any status, headers and body: `Canned`).
Every request is recorded.

Loaded by tests/engine/conftest.py (tests are not a package).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass
class Repo:
    repo_id: str
    files: dict[str, bytes]
    sha: str
    gated: bool = False
    approved_tokens: set[str] = field(default_factory=set)
    model_type: str | None = None
    downloads: int = 0

    @staticmethod
    def from_folder(repo_id: str, folder: Path, **kw) -> Repo:
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        sha = hashlib.sha1(repo_id.encode() + b"".join(hashlib.sha256(b).digest() for b in files.values())).hexdigest()
        config = json.loads(files["config.json"]) if "config.json" in files else {}
        kw.setdefault("model_type", config.get("model_type"))
        return Repo(repo_id, files, sha, **kw)

    def is_lfs(self, path: str) -> bool:
        return path.endswith(LFS_SUFFIXES)

    def sha256(self, path: str) -> str:
        return hashlib.sha256(self.files[path]).hexdigest()

    def blob_id(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    def etag(self, path: str) -> str:
        return self.sha256(path) if self.is_lfs(path) else self.blob_id(path)

    def entry(self, path: str) -> dict:
        data = self.files[path]
        out = {"rfilename": path, "size": len(data), "blobId": self.blob_id(path)}
        if self.is_lfs(path):
            out["lfs"] = {"size": len(data), "sha256": self.sha256(path), "pointerSize": 134}
        return out


@dataclass
class Faults:
    drop_at: dict[str, int] = field(default_factory=dict)  # file -> close the connection at this byte offset
    drop_times: dict[str, int] = field(default_factory=dict)  # file -> how many times (default once)
    hang_up_from: dict[str, int] = field(default_factory=dict)  # file -> hang up on requests starting at >= offset
    ignore_range: bool = False  # answer 200 with the whole file to a Range request
    corrupt: set[str] = field(default_factory=set)  # flip one byte of the body
    size_delta: dict[str, int] = field(default_factory=dict)  # serve this many bytes more (or fewer) than listed
    slow_s: float = 0.0  # sleep between 16 KiB pieces of LFS bodies
    slow_paths: tuple[str, ...] = LFS_SUFFIXES
    piece: int = 16 * 1024  # bytes written between two slow_s sleeps (1: a trickle)
    redirect_loop: set[str] = field(default_factory=set)  # files whose CDN location redirects to itself forever
    api_hang_s: float = 0.0  # the model API waits this long before answering (an API that never answers)
    listing_patch: dict[str, dict] = field(default_factory=dict)  # file -> fields replaced in its listing entry
    etag: dict[str, str] = field(default_factory=dict)  # file -> the ETag headers a resolve answers with
    # the API's JSON answers ("info", "tree", "search"), as a hostile or broken server sends them:
    info_without_sizes: bool = False  # model info lists names only (as without ?blobs=1): the tree is read
    tree_page: int = 0  # entries per tree page, linked with `Link: <...?cursor=N>; rel="next"` (0: one page)
    tree_endless: str | None = None  # after the files: "empty" pages, "junk" pages of new entries, "same" (a page
    # linking to itself), "foreign" (a next page on another server), for up to `endless_pages` pages
    endless_pages: int = 1000
    drip_s: float = 0.0  # API JSON bodies written one byte at a time, this long apart
    gzip_pad: dict[str, int] = field(default_factory=dict)  # kind -> padded with spaces to this size, then gzipped
    canned: dict[str, Canned] = field(default_factory=dict)  # kind -> this answer instead of the real one


@dataclass
class Canned:
    """Any answer at all: status, headers, body; `length` a Content-Length other than the body's (a truncated
    body when larger); `gzip` compresses the body and says so."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    length: int | None = None
    gzip: bool = False


@dataclass
class Request:
    """Logged when the request arrives (so a reset between tests drops late finishers), filled in when done."""

    origin: str  # "hub" | "cdn"
    method: str
    path: str  # URL path, unquoted, no query
    file: str | None  # the repo file it is about, when it is one
    range: str | None
    status: int
    body_bytes: int
    auth: bool  # an Authorization header was sent


class HubServer:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.tokens: set[str] = set()  # valid tokens; any other bearer token gets 401 invalid credentials
        self.faults = Faults()
        self.requests: list[Request] = []
        self.gzipped: dict[tuple[bytes, int], bytes] = {}
        self._lock = threading.Lock()
        self.hub = _serve(self, "hub")
        self.cdn = _serve(self, "cdn")
        self.url = f"http://127.0.0.1:{self.hub.server_address[1]}"
        self.cdn_url = f"http://127.0.0.1:{self.cdn.server_address[1]}"

    def add(self, repo: Repo) -> Repo:
        self.repos[repo.repo_id] = repo
        return repo

    def record(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)

    def reset(self) -> None:
        self.faults = Faults()
        with self._lock:
            self.requests.clear()

    def file_requests(self, file: str, method: str | None = None) -> list[Request]:
        return [r for r in list(self.requests) if r.file == file and (method is None or r.method == method)]

    def by_sha256(self, digest: str) -> tuple[Repo, str] | None:
        for repo in self.repos.values():
            for path in repo.files:
                if repo.is_lfs(path) and repo.sha256(path) == digest:
                    return repo, path
        return None

    def close(self) -> None:
        for srv in (self.hub, self.cdn):
            srv.shutdown()
            srv.server_close()


def _serve(hub: HubServer, origin: str) -> ThreadingHTTPServer:
    handler = type(f"{origin.title()}Handler", (_Handler,), {"hub": hub, "origin": origin})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True, name=f"hubserver-{origin}").start()
    return srv


_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_API_MODEL = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+?)(?:/revision/(?P<rev>[^/]+)|/tree/(?P<tree>[^/]+))?/?$")


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    origin: str
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    # -- plumbing ------------------------------------------------------------------------------------------
    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_GET(self):
        self._dispatch("GET")

    def _dispatch(self, method: str):
        self.method = method
        self._file = None
        self._status = 0
        self._sent = 0
        url = urlparse(self.path)
        self.url_path, self.query = unquote(url.path), parse_qs(url.query)
        req = self._req = Request(self.origin, method, self.url_path, None, self.headers.get("Range"), 0, 0,
                                  "Authorization" in self.headers)
        self.hub.record(req)
        try:
            if self.origin == "cdn":
                self._cdn()
            else:
                self._hub()
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            req.file, req.status, req.body_bytes = self._file, self._status, self._sent
            self.close_connection = True

    def _reply(self, status: int, body: bytes = b"", headers: dict | None = None, content_type="application/json"):
        self._status = status
        # the log knows the file before the client has its answer: a test that reads the log right after its download
        # returned must not race this thread to the `finally` of _dispatch
        self._req.file, self._req.status = self._file, status
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.method != "HEAD" and body:
            self.wfile.write(body)
            self._sent += len(body)

    def _json(self, data, status: int = 200):
        self._reply(status, json.dumps(data).encode())

    def _error(self, status: int, code: str | None, message: str, headers: dict | None = None):
        h = {"X-Error-Message": message, **(headers or {})}
        if code:
            h["X-Error-Code"] = code
        self._reply(status, json.dumps({"error": message}).encode(), h)

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        return auth[7:] if auth.lower().startswith("bearer ") else None

    def _repo(self, repo_id: str, rev: str | None = None) -> Repo | None:
        """The repo if this caller may read it; else the error is sent and None returned."""
        token = self._token()
        if token is not None and token not in self.hub.tokens:
            self._error(401, None, "Invalid credentials in Authorization header")
            return None
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        if repo.gated and token not in repo.approved_tokens:
            status = 401 if token is None else 403
            self._error(status, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access to it "
                        "and be authenticated to access it. Please log in.")
            return None
        if rev is not None and rev not in ("main", repo.sha):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return None
        return repo

    # -- the Hub ---------------------------------------------------------------------------------------------
    def _hub(self):
        p = self.url_path
        if p == "/api/models":
            return self._search()
        m = _API_MODEL.match(p)
        if m and self.hub.faults.api_hang_s:
            time.sleep(self.hub.faults.api_hang_s)
        if m:
            repo = self._repo(m.group("repo"), m.group("rev") or m.group("tree") or "main")
            if repo is None:
                return
            if m.group("tree") is not None:
                return self._tree(repo)
            return self._api("info", self._info(repo, blobs="blobs" in self.query
                                                and not self.hub.faults.info_without_sizes))
        m = _RESOLVE.match(p)
        if m:
            return self._resolve(m.group("repo"), m.group("rev"), m.group("file"))
        self._error(404, None, f"no route {p}")

    def _info(self, repo: Repo, blobs: bool) -> dict:
        patch = self.hub.faults.listing_patch
        siblings = [{**repo.entry(f), **patch.get(f, {})} if blobs else {"rfilename": f} for f in repo.files]
        total = sum(len(d) for f, d in repo.files.items() if f.endswith(".safetensors")) // 4
        return {"id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.sha, "private": False,
                "gated": "manual" if repo.gated else False, "disabled": False, "downloads": repo.downloads,
                "likes": 1, "tags": [repo.model_type] if repo.model_type else [], "lastModified":
                "2025-01-01T00:00:00.000Z", "config": {"model_type": repo.model_type} if repo.model_type else {},
                "safetensors": {"parameters": {"F32": total}, "total": total}, "siblings": siblings}

    def _api(self, kind: str, data, headers: dict | None = None):
        """An API answer, through the faults: canned, padded and gzipped, or dripped."""
        f = self.hub.faults
        canned = f.canned.get(kind)
        if canned is None:
            body = json.dumps(data).encode()
            if kind in f.gzip_pad:
                key = (body, f.gzip_pad[kind])
                if key not in self.hub.gzipped:  # compressed once: a test can measure the client's memory alone
                    self.hub.gzipped[key] = gzip.compress(body + b" " * max(0, key[1] - len(body)), compresslevel=9)
                body = self.hub.gzipped[key]
                headers = {**(headers or {}), "Content-Encoding": "gzip"}
            canned = Canned(200, headers or {}, body)
        elif canned.gzip:
            canned = Canned(canned.status, {**canned.headers, "Content-Encoding": "gzip"}, gzip.compress(canned.body),
                            canned.length)
        self._status = canned.status
        self._req.file = self._file  # logged before the answer (see _reply)
        self.send_response(canned.status)
        sent = {k.lower(): v for k, v in canned.headers.items()}
        sent.setdefault("content-type", "application/json")
        sent.setdefault("content-length", str(len(canned.body) if canned.length is None else canned.length))
        for k, v in {**sent, "connection": "close"}.items():
            self.send_header(k, v)
        self.end_headers()
        if self.method == "HEAD":
            return
        if f.drip_s:
            for i in range(len(canned.body)):
                self.wfile.write(canned.body[i:i + 1])
                self.wfile.flush()
                self._sent += 1
                time.sleep(f.drip_s)
        else:
            self.wfile.write(canned.body)
            self._sent += len(canned.body)
        if canned.length is not None and canned.length > len(canned.body):
            self.wfile.flush()
            self.connection.shutdown(2)  # fewer bytes than announced

    def _tree(self, repo: Repo):
        f = self.hub.faults
        entries = [{"type": "file", "oid": repo.blob_id(p), "size": len(d), "path": p,
                    **({"lfs": {"oid": repo.sha256(p), "size": len(d), "pointerSize": 134}} if repo.is_lfs(p) else {})}
                   for p, d in repo.files.items()]
        entries.insert(0, {"type": "directory", "oid": "0" * 40, "size": 0, "path": "original"})
        cursor = int((self.query.get("cursor") or ["0"])[0])
        size = f.tree_page or len(entries)
        pages = -(-len(entries) // size)
        base = f"{self.hub.url}{self.url_path}"
        if cursor < pages:
            page = entries[cursor * size:(cursor + 1) * size]
            more = cursor + 1 < pages or f.tree_endless is not None
        else:  # past the real listing: the endless kind
            page = [] if f.tree_endless == "empty" else [
                {"type": "file", "oid": "1" * 40, "size": 1, "path": f"junk-{cursor}.txt"}]
            more = True
        if sum(1 for r in list(self.hub.requests) if "/tree/" in r.path) > f.endless_pages:
            more = False  # even an endless listing ends, so a client without a page cap is slow, not hung
        nxt = {"same": f"{base}?cursor={cursor}", "foreign": f"{self.hub.cdn_url}{self.url_path}?cursor={cursor + 1}"
               }.get(f.tree_endless if cursor + 1 >= pages else "", f"{base}?cursor={cursor + 1}")
        return self._api("tree", page, {"Link": f'<{nxt}>; rel="next"'} if more else None)

    def _search(self):
        text = (self.query.get("search") or [""])[0].lower()
        limit = int((self.query.get("limit") or ["1000"])[0])
        hits = [self._info(r, blobs=False) for r in sorted(self.hub.repos.values(), key=lambda r: -r.downloads)
                if text in r.repo_id.lower()]
        for h in hits:
            h.pop("siblings")
        self._api("search", hits[:limit])

    def _resolve(self, repo_id: str, rev: str, file: str):
        self._file = file
        repo = self._repo(repo_id, rev)
        if repo is None:
            return
        if file not in repo.files:
            return self._error(404, "EntryNotFound", f"{file} does not exist", {"X-Repo-Commit": repo.sha})
        common = {"X-Repo-Commit": repo.sha, "Accept-Ranges": "bytes"}
        if repo.is_lfs(file):
            digest = repo.sha256(file)
            size = len(repo.files[file])
            self._status = 302
            self._req.file = self._file  # logged before the answer (see _reply)
            self.send_response(302)
            etag = self.hub.faults.etag.get(file, digest)
            for k, v in {**common, "Location": f"{self.hub.cdn_url}/blobs/{digest}?expires=never",
                         "ETag": f'"{repo.blob_id(file)}"', "X-Linked-Etag": f'"{etag}"',
                         "X-Linked-Size": str(size), "Content-Length": "0", "Connection": "close"}.items():
                self.send_header(k, v)
            self.end_headers()
            return
        self._body(repo, file, {**common, "ETag": f'"{self.hub.faults.etag.get(file, repo.blob_id(file))}"'})

    # -- the CDN ---------------------------------------------------------------------------------------------
    def _cdn(self):
        m = re.match(r"^/blobs/([0-9a-f]{64})$", self.url_path)
        found = self.hub.by_sha256(m.group(1)) if m else None
        if found is None:
            return self._error(404, None, "NoSuchKey")
        repo, file = found
        self._file = file
        if "cdn" in self.hub.faults.canned:  # any answer at all, for a header read or a download
            return self._api("cdn", None)
        if file in self.hub.faults.redirect_loop:  # a misconfigured CDN: the same URL again, forever
            return self._reply(302, headers={"Location": f"{self.hub.cdn_url}{self.path}"})
        self._body(repo, file, {"ETag": f'"{repo.sha256(file)}"'})

    def _body(self, repo: Repo, file: str, headers: dict):
        f = self.hub.faults
        data = repo.files[file]
        if file in f.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        delta = f.size_delta.get(file, 0)
        data = data + b"\0" * delta if delta > 0 else data[:len(data) + delta]
        total = len(data)
        start, end = 0, total - 1
        rng = self.headers.get("Range")
        status = 200
        if rng and not f.ignore_range:
            m = re.match(r"bytes=(\d+)-(\d*)$", rng.strip())
            if m:
                start = int(m.group(1))
                end = min(int(m.group(2)), total - 1) if m.group(2) else total - 1
                if start >= total:
                    return self._error(416, None, "Range Not Satisfiable", {"Content-Range": f"bytes */{total}"})
                status = 206
                headers = {**headers, "Content-Range": f"bytes {start}-{end}/{total}"}
        body = data[start:end + 1]
        if file in f.hang_up_from and start >= f.hang_up_from[file] and self.method == "GET":
            self.connection.shutdown(2)  # the network is gone: no answer at all
            return
        self._status = status
        self._req.file, self._req.status = self._file, status  # logged before the body (see _reply)
        self.send_response(status)
        for k, v in {**headers, "Content-Type": "application/octet-stream", "Content-Length": str(len(body)),
                     "Connection": "close"}.items():
            self.send_header(k, v)
        self.end_headers()
        if self.method == "HEAD":
            return
        drop = f.drop_at.get(file)
        if drop is not None and start < drop <= end and f.drop_times.get(file, 1) > 0:
            f.drop_times[file] = f.drop_times.get(file, 1) - 1
            body = body[:drop - start]
        else:
            drop = None
        slow = f.slow_s if file.endswith(f.slow_paths) else 0.0
        piece = f.piece if slow else 16 * 1024
        for i in range(0, len(body), piece):
            self.wfile.write(body[i:i + piece])
            self.wfile.flush()
            self._sent += len(body[i:i + piece])
            if slow:
                time.sleep(slow)
        if drop is not None:  # hang up mid-file: the client sees fewer bytes than Content-Length
            self.wfile.flush()
            self.connection.shutdown(2)
