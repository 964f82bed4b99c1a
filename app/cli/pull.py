"""`moechat pull REPO`: download a model from the Hugging Face Hub into the standard cache, pinned to its commit.

Says first what it will do (files already cached, partial files it resumes, what is left), then a progress bar
on stderr; the snapshot's path goes to stdout (or one JSON object with `--json`). Ctrl-C keeps what arrived:
the next pull resumes it. `REPO:QUANT` (or `--quant`) fetches one GGUF quant, a split set whole, and prints the path of
its first file; a GGUF-only repo pulled without one lists its quants with their sizes and exits 1 saying how to
pick. HF_TOKEN, HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE are honoured. Also here:
`resolve_model_arg`, which turns the MODEL of `run`, `chat` and `fit` into a local folder when it is a repo id.
No torch at start-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

EXIT_INTERRUPTED = 130


def add_pull_parser(subparsers) -> argparse.ArgumentParser:
    pull = subparsers.add_parser(
        "pull", help="download a model from the Hugging Face Hub (safetensors with config and tokenizer files, "
             "or one GGUF quant)",
        description="Download a Hub model into the Hugging Face cache (HF_HOME), pinned to the commit of REVISION: "
                    "safetensors weights, JSON and tokenizer files, never pickle weights; or, for REPO:QUANT, that "
                    "GGUF quant's files (and the repo's imatrix). Checks free disk first, "
                    "verifies every file's checksum, resumes interrupted downloads. Gated models need HF_TOKEN.")
    pull.add_argument("repo", metavar="REPO", help="Hub repo id, e.g. allenai/OLMoE-1B-7B-0125-Instruct; a GGUF "
                      "repo with its quant: unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M")
    pull.add_argument("--quant", metavar="QUANT", help="the GGUF quant to fetch (Q4_K_M, UD-Q4_K_XL, Q8_0...): only "
                      "its file(s), a split set whole; without it a GGUF-only repo lists its quants and sizes")
    pull.add_argument("--revision", metavar="REV", help="branch, tag or commit (default: main)")
    pull.add_argument("--json", action="store_true", help="print one JSON object at the end (path, revision, "
                      "bytes) instead of the path")
    return pull


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class ProgressBar:
    """The progress sink of `moechat pull`: the plan, then one line redrawn in place (a tty) or a line per file."""

    def __init__(self, stream=None, *, show_plan: bool = True):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.show_plan = show_plan
        self.last = 0.0
        self.drawn = False
        self.files_done = -1
        self.plan = None
        self.transferred_rate = 0.0

    def __call__(self, e) -> None:
        if e.plan is not None:
            self.plan = e.plan
            if self.show_plan:
                for line in e.plan.describe():
                    self._line(line)
        if e.note:
            self._line(e.note)
        self.transferred_rate = e.bytes_per_s
        now = time.monotonic()
        if self.tty:
            if now - self.last >= 0.1 or e.stage == "done":
                self.last = now
                name = (e.file or "")[-40:]
                self.stream.write(f"\r\x1b[2K{e.fraction:6.1%}  {_size(e.done)} / {_size(e.total)}  "
                                  f"{e.bytes_per_s / 1e6:6.1f} MB/s  {e.files_done}/{e.files_total} files  {name}")
                self.stream.flush()
                self.drawn = True
        elif e.files_done != self.files_done and e.stage != "plan":
            self.files_done = e.files_done
            self._line(f"{e.files_done}/{e.files_total} files, {_size(e.done)} / {_size(e.total)}")

    def _line(self, text: str) -> None:
        if self.drawn:
            self.stream.write("\r\x1b[2K")
            self.drawn = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


def run_pull(args: argparse.Namespace) -> int:
    """With --json, stdout is one JSON object whatever happens: the snapshot, or {"error": ..., "exit_status": ...}
    (the same line as on stderr), so a script never has to parse text."""
    from moechat.engine.errors import MoechatError

    if not args.json:
        return _pull(args)
    try:
        return _pull(args)
    except KeyboardInterrupt:
        _json_error(args, "stopped", "KeyboardInterrupt", EXIT_INTERRUPTED)
        raise
    except MoechatError as e:
        quants = [{"quant": name, "bytes": size} for name, size in getattr(e, "quants", ())]
        _json_error(args, str(e), type(e).__name__, 1, **({"quants": quants} if quants else {}))
        raise


def _json_error(args: argparse.Namespace, message: str, kind: str, status: int, **extra) -> None:
    from .guard import one_line

    print(json.dumps({"repo_id": args.repo, "revision": args.revision, "error": one_line(message), "error_type": kind,
                      "exit_status": status, **extra}))
    sys.stdout.flush()


def _repo_and_quant(args: argparse.Namespace) -> tuple[str, str | None]:
    from moechat.engine.errors import ConfigError
    from moechat.engine.plan.hub import looks_like_repo_id, split_quant

    repo, quant = split_quant(args.repo)
    if quant is not None and getattr(args, "quant", None) and quant.upper() != args.quant.upper():
        raise ConfigError(f"{args.repo} names quant {quant} and --quant says {args.quant}: give one of them")
    quant = getattr(args, "quant", None) or quant
    if not looks_like_repo_id(repo):
        raise ConfigError(f"{args.repo}: not a Hub repo id; pass org/name, e.g. allenai/OLMoE-1B-7B-0125-Instruct "
                          "(org/name:Q4_K_M for a GGUF quant)")
    return repo, quant


def print_quants(error, stream=None) -> None:
    """The quants a GGUF repo offers, a line each with its size, before the error that says how to pick one."""
    stream = stream or sys.stderr
    if not error.quants:
        return
    print(f"{error.repo_id}: GGUF quants", file=stream)
    for name, size in error.quants:
        print(f"  {name:<14} {_size(size):>11}", file=stream)
    stream.flush()


def _pull(args: argparse.Namespace) -> int:
    from moechat.engine.errors import QuantChoiceError
    from moechat.engine.plan.hub import Hub

    repo, quant = _repo_and_quant(args)
    args.repo = repo  # what the messages and --json name
    hub = Hub()
    bar = ProgressBar()  # on stderr: stdout keeps the path (or the JSON) alone
    cancel = threading.Event()
    start = time.monotonic()
    try:
        if quant is not None:
            path = hub.download_quant(args.repo, quant, args.revision, progress=bar, cancel=cancel)
        else:
            path = hub.download(args.repo, args.revision, progress=bar, cancel=cancel)
    except QuantChoiceError as e:
        bar.finish()
        print_quants(e)
        raise
    except KeyboardInterrupt:
        cancel.set()
        bar.finish()
        again = args.repo + (f":{quant}" if quant else "")
        print(f"moechat: stopped; what arrived is kept: moechat pull {again} resumes it", file=sys.stderr)
        if args.json:
            _json_error(args, f"stopped; what arrived is kept: moechat pull {again} resumes it",
                        "KeyboardInterrupt", EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
    finally:
        bar.finish()
    if args.json:
        plan = bar.plan.to_json() if bar.plan is not None else None  # None: HF_HUB_OFFLINE and already cached
        print(json.dumps({"repo_id": args.repo, "revision": _revision_of(path), "path": str(path), "quant": quant,
                          "seconds": round(time.monotonic() - start, 3), "plan": plan}))
    else:
        print(path)
    return 0


def _revision_of(path: Path) -> str:
    """The commit of a snapshot folder, or of the snapshot a GGUF file of it lies in (snapshots/<sha>/...)."""
    parts = path.parts
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts[:-1] else path.name


DEMO_MODEL = Path(__file__).resolve().parents[2] / "assets" / "demo-moe"  # the source tree's, or the wheel's copy


def resolve_model_arg(model: str | None) -> str:
    """MODEL as `run` and `chat` take it: None is the bundled demo model; a local folder as is; a Hub repo id as its
    complete cached snapshot (no network). A name that is neither is one error that says which it could have been:
    `assets/demo-moe` run from /tmp is a relative path that does not exist there, and also a well-formed repo id that
    is not downloaded; the message says both, and what would do."""
    from moechat.engine.errors import ConfigError, NotDownloadedError

    if model is None:
        if not (DEMO_MODEL / "config.json").is_file():
            raise ConfigError(f"the bundled demo model is not at {DEMO_MODEL} (a partial install?); pass MODEL_DIR, "
                              "or reinstall moechat")
        return str(DEMO_MODEL)
    path = Path(model).expanduser()
    if path.exists():
        return model
    from moechat.engine.plan.hub import Hub, looks_like_repo_id  # (0.1 s of imports: only for what may be a repo id)

    where = "" if path.is_absolute() else f" in {Path.cwd()}"
    demo = (f"; the bundled demo model is what `moechat run` and `moechat chat` open without MODEL ({DEMO_MODEL})"
            if path.name == DEMO_MODEL.name else "")
    from moechat.engine.plan.hub import split_quant

    repo, quant = split_quant(model)
    if quant is not None and looks_like_repo_id(repo):
        return str(_cached_quant(repo, quant))
    if not looks_like_repo_id(model):
        raise ConfigError(f"{model}: no such model directory{where}; pass a directory with config.json and "
                          f"*.safetensors{demo}")
    try:
        return str(Hub().resolve(model))
    except NotDownloadedError as e:
        if "partly downloaded" in str(e):
            raise
        raise NotDownloadedError(f"{model} is not downloaded, and no such directory is{where or ' there'}: run "
                                 f"moechat pull {model} if it is a Hub repo id, or pass the model's directory (an "
                                 f"absolute path works from anywhere){demo}", repo_id=model) from None


def _cached_quant(repo: str, quant: str) -> Path:
    """The first file of a GGUF quant pulled before (org/name:Q4_K_M), without the network."""
    from moechat.engine.errors import NotDownloadedError, QuantChoiceError
    from moechat.engine.plan.hub import Hub, choose_quant, gguf_quants

    hub = Hub()
    snapshot = hub.local_snapshot(repo)
    if snapshot is not None:
        try:
            return snapshot / choose_quant(repo, gguf_quants(hub.local_listing(repo, snapshot)), quant).first
        except QuantChoiceError:
            pass
    raise NotDownloadedError(f"{repo}:{quant} is not downloaded: run moechat pull {repo}:{quant}", repo_id=repo)


def fit_spec(model: str):
    """The ModelSpec `moechat fit` plans: a folder's own files; for a repo id the complete cached snapshot, else
    config.json + safetensors headers from the Hub (no weight bytes), else (offline) the cached config.json."""
    from dataclasses import replace

    from moechat.engine.plan import read_model_spec
    from moechat.engine.plan.hub import Hub, is_offline, looks_like_repo_id

    if Path(model).expanduser().exists() or not looks_like_repo_id(model):
        return read_model_spec(model)
    hub = Hub()
    local = hub.local_snapshot(model)
    if local is not None:
        return replace(read_model_spec(local), name=model)
    if is_offline():
        return read_model_spec(model)  # config.json from the cache: estimates, or a ConfigError saying what to do
    return hub.remote_spec(model)
