"""GGUF repos: one repo, many quants (Q4_K_M, UD-Q4_K_XL, Q8_0...), each one file or a split set.

A quant is one file or a split set (`-00001-of-00003.gguf`), often one folder per quant: `gguf_quants` groups a
listing into them (sizes summed, parts ordered, a set missing a part flagged), and `choose_quant` picks the one the
user named, or says what the repo offers (QuantChoiceError). The wizard lists them: `QuantFit` is one quant with
its verdict on this machine, `recommend_quant` the one to take (the largest that runs with every expert on the fastest
tier).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from ...errors import QuantChoiceError, UnsupportedModelError
from .names import RepoFile, RepoListing, _fmt, _is_weight, is_gguf_path, is_imatrix_path

_GGUF_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})$")
# A quant's name at the end of a file stem, after '-', '.' or '_' (Qwen3-30B-A3B-UD-Q4_K_XL, model.Q8_0, x-BF16).
_QUANT_NAME = re.compile(r"(?:^|[-._])(?P<quant>(?:UD-)?(?:I?Q\d(?:_[0-9A-Z]+)*|TQ\d_\d|BF16|F16|F32|"
                         r"MXFP4(?:_MOE)?))$", re.IGNORECASE)


@dataclass(frozen=True)
class LocalFile:
    """A file of a cached snapshot: what `gguf_quants` needs of a RepoFile."""

    path: str
    size: int


@dataclass(frozen=True)
class GGUFQuant:
    """One quant of a GGUF repo: its file, or its split set in order (`-00001-of-00003`)."""

    name: str  # as the file names spell it, upper case: Q4_K_M, UD-Q4_K_XL, BF16
    files: tuple[RepoFile | LocalFile, ...]
    expected_parts: int  # what the split names say (1 for a single file)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def complete(self) -> bool:
        return len(self.files) == self.expected_parts

    @property
    def first(self) -> str:
        """The path `moechat run` takes (the first file of a split set)."""
        return self.files[0].path

    def describe(self) -> str:
        parts = f", {len(self.files)} files" if self.expected_parts > 1 else ""
        missing = "" if self.complete else f" (only {len(self.files)} of {self.expected_parts} parts listed)"
        return f"{self.name:<14} {_fmt(self.size):>11}{parts}{missing}  {self.first}"


def _split_parts(path: str) -> tuple[str, int, int]:
    """(path without the split suffix and .gguf, part index, part count); a single file is part 1 of 1."""
    stem = path[: -len(".gguf")]
    m = _GGUF_SPLIT.match(stem)
    if m is None:
        return stem, 1, 1
    return m["stem"], int(m["index"]), int(m["count"])


def _quant_name(stem: str) -> str:
    """Q4_K_M from 'Q4_K_M/Qwen3-30B-A3B-Q4_K_M'; the folder's name when the file's has none; else the stem."""
    folder, _, name = stem.rpartition("/")
    for candidate in (name, folder.rsplit("/", 1)[-1]):
        m = _QUANT_NAME.search(candidate) if candidate else None
        if m is not None:
            return m["quant"].upper()
    return name


def gguf_quants(files: Iterable[RepoFile | LocalFile]) -> list[GGUFQuant]:
    """The quants a repo offers, grouped from its file listing (a split set is one quant), smallest first."""
    groups: dict[str, list[tuple[int, int, RepoFile | LocalFile]]] = {}
    for f in files:
        if not is_gguf_path(f.path):
            continue
        stem, index, count = _split_parts(f.path)
        groups.setdefault(stem, []).append((index, count, f))
    quants = []
    for stem, members in groups.items():
        members.sort(key=lambda m: m[0])
        quants.append(GGUFQuant(_quant_name(stem), tuple(m[2] for m in members), max(m[1] for m in members)))
    return sorted(quants, key=lambda q: (q.size, q.name))


def choose_quant(repo_id: str, quants: Sequence[GGUFQuant], wanted: str | None) -> GGUFQuant:
    """The quant named `wanted` (case-insensitive; 'Q4_K_XL' also finds 'UD-Q4_K_XL' when it is the only one), or
    QuantChoiceError listing what the repo has and how to pick one."""
    listed = tuple((q.name, q.size) for q in quants)
    offer = ", ".join(f"{q.name} {_fmt(q.size)}" for q in quants[:12]) + (", ..." if len(quants) > 12 else "")
    example = next((q.name for q in quants if q.name.endswith("Q4_K_M")), quants[0].name if quants else "Q4_K_M")
    if not quants:
        raise QuantChoiceError(f"{repo_id} has no GGUF model files; pull it without a quant for its safetensors",
                               repo_id=repo_id)
    if wanted is None:
        raise QuantChoiceError(f"{repo_id} offers {len(quants)} GGUF quants ({offer}): pick one with moechat pull "
                               f"{repo_id}:{example} (or --quant {example})", repo_id=repo_id, quants=listed)
    key = wanted.upper()
    found = [q for q in quants if q.name == key] or [q for q in quants if q.name.endswith("-" + key)]
    if len(found) > 1:
        names = ", ".join(q.first for q in found[:4])
        raise QuantChoiceError(f"{repo_id}: {len(found)} file sets are named {wanted} ({names}); this pull cannot "
                               "tell which you mean: download the one you want with another tool, or ask the repo's "
                               "owner", repo_id=repo_id, quants=listed)
    if not found:
        raise QuantChoiceError(f"{repo_id} has no {wanted} quant; it offers {offer}: pick one with moechat pull "
                               f"{repo_id}:{example}", repo_id=repo_id, quants=listed)
    quant = found[0]
    if not quant.complete:
        raise QuantChoiceError(f"{repo_id}: {quant.name} is split into {quant.expected_parts} parts but the repo "
                               f"lists {len(quant.files)}; pick another quant ({offer})", repo_id=repo_id,
                               quants=listed)
    return quant


def split_quant(repo: str) -> tuple[str, str | None]:
    """'org/name:Q4_K_M' -> ('org/name', 'Q4_K_M'); a repo id without ':' -> (repo, None)."""
    repo_id, sep, quant = str(repo).partition(":")
    return (repo_id, quant or None) if sep else (repo_id, None)


def what_to_pull(listing: RepoListing, quant: str | None) -> RepoListing:
    """The listing cut to what this pull fetches: the named quant's files (and the repo's imatrix) for a GGUF
    pull; the safetensors checkpoint otherwise, or QuantChoiceError when the repo has only GGUF files."""
    gguf_side = [f for f in listing.files if is_gguf_path(f.path) or is_imatrix_path(f.path)]
    plain = [f for f in listing.files if f not in gguf_side]
    repo_id = listing.repo_id
    if quant is None and (any(_is_weight(f.path) for f in plain) or not gguf_side):
        if not any(_is_weight(f.path) for f in plain):
            raise UnsupportedModelError(f"{repo_id} has no safetensors weights (only "
                                        f"{', '.join(listing.skipped[:6]) or 'no files'}); moechat runs "
                                        "safetensors checkpoints and GGUF files")
        return replace(listing, files=tuple(plain),
                       skipped=listing.skipped + tuple(f.path for f in gguf_side))
    chosen = choose_quant(repo_id, gguf_quants(listing.files), quant)
    # the imatrix beside the quants seeds the expert cache (--warm-start); one file, shipped once per repo
    imatrix = sorted((f for f in gguf_side if is_imatrix_path(f.path)), key=lambda f: (f.path.count("/"), f.path))
    keep = chosen.files + tuple(imatrix[:1])
    return replace(listing, files=keep, skipped=listing.skipped + tuple(
        f.path for f in listing.files if f not in keep))


@dataclass(frozen=True)
class QuantFit:
    """One quant of a GGUF repo as the wizard lists it: its name and size, and once its header is read, the verdict's
    parts the recommendation needs (`of` takes them from a FitVerdict). Not yet read: `checked` False."""

    name: str
    size: int
    word: str  # "runs", "runs with ...", "does not fit", "unsupported", "checking…", or why it has no verdict
    fits: bool = False  # supported and planned (the memory plan was not refused)
    full: bool = False  # fits with every expert on the compute device: VRAM with a GPU, RAM without (no cache)
    tok_s: tuple[float, float] | None = None  # predicted decode tok/s (low, high)
    checked: bool = False
    verdict: object | None = None  # the FitVerdict, for the screen (its plan, its expert format)
    error: str | None = None

    @classmethod
    def of(cls, quant: GGUFQuant, verdict=None, error: str | None = None) -> QuantFit:
        """`quant` with its FitVerdict (engine/plan/hub/reports.py), or the error that stopped it, or neither yet."""
        if verdict is None:
            word = "checking…" if error is None else error
            return cls(quant.name, quant.size, word, checked=error is not None, error=error)
        plan = verdict.best_plan  # the plan in the recommended expert format
        fits = bool(verdict.supported and plan.ok)
        full = fits and plan.resident
        how = "" if verdict.expert_format == "native" else f" as {verdict.expert_format}"
        if not verdict.supported:
            word = "unsupported"
        elif not plan.ok:
            word = "does not fit"
        elif full:
            word = "runs" + how
        else:
            on = "VRAM" if plan.device != "cpu" else "RAM"
            word = f"runs with {plan.expert_slots}/{plan.total_experts} experts in {on} ({plan.host_tier}){how}"
        return cls(quant.name, quant.size, word, fits, full, verdict.decode_tok_s, True, verdict)


def recommend_quant(fits: Sequence[QuantFit]) -> QuantFit | None:
    """The quant to recommend for this machine, as LM Studio does: the largest that runs fully on the machine's
    fastest tier (supported, planned, and every expert on the compute device: in VRAM with a GPU, in RAM without,
    so no token waits on a cache miss), since a larger quant is closer to the original weights at the same speed
    class. When none runs fully, the one that fits with the fastest predicted decode (the low end of its range; the
    larger on a tie); none fits, or none is read yet: None. Unread quants (`checked` False) never count."""
    full = [f for f in fits if f.checked and f.full]
    if full:
        return max(full, key=lambda f: (f.size, f.name))
    partial = [f for f in fits if f.checked and f.fits]
    if partial:
        return max(partial, key=lambda f: (f.tok_s[0] if f.tok_s else 0.0, f.size, f.name))
    return None
