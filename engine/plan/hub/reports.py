"""Progress, plans and verdicts: the immutable values the CLI and the wizard show (`DownloadPlan`,
`DownloadProgress`, `FitVerdict`, `CatalogStatus`, `SearchHit`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..catalog import CatalogEntry
from .names import _fmt


@dataclass(frozen=True)
class FilePlan:
    path: str
    size: int
    action: str  # "cached" (verified blob present) | "resume" (partial kept) | "download"
    kept_bytes: int = 0
    note: str | None = None


@dataclass(frozen=True)
class DownloadPlan:
    """What a pull will do, said before it starts: cached files, partial files resumed, bytes to fetch."""

    repo_id: str
    sha: str
    files: tuple[FilePlan, ...]
    skipped: tuple[str, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def cached_bytes(self) -> int:
        return sum(f.size for f in self.files if f.action == "cached")

    @property
    def kept_bytes(self) -> int:
        return sum(f.kept_bytes for f in self.files if f.action == "resume")

    @property
    def to_download_bytes(self) -> int:
        return self.total_bytes - self.cached_bytes - self.kept_bytes

    def describe(self) -> list[str]:
        """The honest account: what is reused, what resumes where, what starts over and why."""
        def files(n: int) -> str:
            return f"{n} file" + ("" if n == 1 else "s")

        lines = [f"{self.repo_id} at {self.sha[:12]}: {files(len(self.files))}, {_fmt(self.total_bytes)}"
                 + (f" ({files(len(self.skipped))} not needed: {', '.join(self.skipped[:4])}"
                    + (", ..." if len(self.skipped) > 4 else "") + ")" if self.skipped else "")]
        cached = [f for f in self.files if f.action == "cached"]
        if cached:
            lines.append(f"already in the cache: {files(len(cached))}, {_fmt(self.cached_bytes)}")
        for f in self.files:
            if f.action == "resume":
                lines.append(f"resuming {f.path} at {_fmt(f.kept_bytes)} of {_fmt(f.size)} "
                             f"({_fmt(f.size - f.kept_bytes)} left)")
            elif f.note:
                lines.append(f"{f.path}: {f.note}")
        lines.append(f"to download: {_fmt(self.to_download_bytes)}")
        return lines

    def to_json(self) -> dict:
        return {"repo_id": self.repo_id, "revision": self.sha, "total_bytes": self.total_bytes,
                "cached_bytes": self.cached_bytes, "kept_bytes": self.kept_bytes,
                "to_download_bytes": self.to_download_bytes, "skipped": list(self.skipped),
                "files": [{"path": f.path, "size": f.size, "action": f.action, "kept_bytes": f.kept_bytes,
                           "note": f.note} for f in self.files]}


@dataclass(frozen=True)
class DownloadProgress:
    """One report to the caller's progress sink. `note` carries one-off events (resume, retry, restart)."""

    repo_id: str
    sha: str
    stage: str  # "plan" | "download" | "verify" | "done"
    file: str | None
    file_done: int
    file_total: int
    done: int  # bytes of all needed files present and verified, plus the current file's bytes so far
    total: int
    files_done: int
    files_total: int
    bytes_per_s: float = 0.0  # over this session's transfer (kept and cached bytes not counted)
    note: str | None = None
    plan: DownloadPlan | None = None  # on the first report

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 1.0


ProgressSink = Callable[[DownloadProgress], None]


@dataclass(frozen=True)
class FitVerdict:
    """Will this repo run here, how fast, and how much to download: `plan` is the engine's MemoryPlan."""

    repo_id: str
    sha: str | None
    spec: object  # plan.ModelSpec
    plan: object  # plan.MemoryPlan
    hardware: object  # hardware.Hardware
    supported: bool
    why_unsupported: str | None
    download_bytes: int
    cached_bytes: int
    source: str  # "local snapshot" | "Hub safetensors headers" | "Hub config.json (estimate)"
    formats: object | None = None  # format_plan.FormatAdvice: every expert format planned, the one to run

    @property
    def expert_format(self) -> str:
        """The --expert-format to run it with: the recommended one ("native" when none fits)."""
        return getattr(self.formats, "recommended", None) or "native"

    @property
    def best_plan(self):
        """The plan in the recommended expert format (the native `plan` when none is recommended)."""
        return self.formats.best.plan if self.formats is not None else self.plan

    @property
    def fits(self) -> bool:
        return bool(self.best_plan.ok)

    @property
    def verdict(self) -> str:
        if not self.supported:
            return "unsupported"
        return "fits" if self.fits else "does not fit"

    @property
    def decode_tok_s(self) -> tuple[float, float] | None:
        d = self.best_plan.decode
        return None if d is None else (d.low, d.high)

    def summary(self) -> str:
        parts = []
        if not self.supported:
            parts.append(f"not supported yet ({self.why_unsupported})")
        plan = self.best_plan
        if plan.ok:
            from .. import rate_range

            d = plan.decode
            how = "" if self.expert_format == "native" else f" with --expert-format {self.expert_format}"
            parts.append(f"fits{how}" + (f", {rate_range(d.low, d.high)} tok/s predicted" if d is not None else ""))
        else:
            parts.append(f"does not fit: {plan.refusal.message}")
        left = self.download_bytes - self.cached_bytes
        parts.append(f"{_fmt(left)} to download" if left > 0 else "downloaded")
        return "; ".join(parts)

    def to_json(self) -> dict:
        return {"repo_id": self.repo_id, "revision": self.sha, "verdict": self.verdict, "fits": self.fits,
                "supported": self.supported, "why_unsupported": self.why_unsupported,
                "download_bytes": self.download_bytes, "cached_bytes": self.cached_bytes, "source": self.source,
                "decode_tok_s": self.decode_tok_s, "plan": self.plan.to_json(), "spec": self.spec.to_json(),
                "expert_format": self.expert_format,
                "formats": None if self.formats is None else self.formats.to_json()}


@dataclass(frozen=True)
class CatalogStatus:
    """A catalog entry with what the Hub says now and its verdict on this machine (None when unknown)."""

    entry: CatalogEntry
    sha: str | None = None
    gated: bool | None = None
    download_bytes: int | None = None
    downloaded: bool = False  # a complete snapshot is in the local cache
    verdict: FitVerdict | None = None
    error: str | None = None  # why the live part is missing (offline, gated, network...)


@dataclass(frozen=True)
class SearchHit:
    repo_id: str
    model_type: str | None
    supported: bool
    why_unsupported: str | None
    downloads: int | None = None
    likes: int | None = None
    gated: bool | None = None
    params: int | None = None  # from the Hub's safetensors summary
    in_catalog: bool = False
