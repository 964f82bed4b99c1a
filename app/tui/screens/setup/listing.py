"""The wizard's model list: one row per catalog entry or search hit, and the text of each cell.

The screen (screen.py) shows only whole columns: the columns that fit the width, in COLUMNS' order (the rest are in
the detail pane), and under the width of the first four (80 columns) the model's name without its owner and the
speed without its unit (the header says "tok/s"); no column is cut at the edge ("Downl", "~12.8"). Offline, a row
without a verdict gets `catalog_estimate`: what the catalog knows (parameters and expert format -> download size and
the memory a token's weights need), marked "(est.)".
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from textual.widgets import DataTable

from moechat.engine.plan.catalog import CATALOG, CatalogEntry

# The note comes before the family and parameters (also in the detail pane), so a normal terminal shows it whole.
COLUMNS = (("Model", "model"), ("Verdict", "verdict"), ("Predicted", "speed"), ("Download", "download"),
           ("Note", "note"), ("Experts", "format"), ("Family", "family"), ("Params / active", "params"))
NARROW_LABELS = {"speed": "tok/s"}  # the unit in the header when the cells drop it
FIRST_COLUMNS = 4  # Model, Verdict, Predicted, Download: always shown (in their narrow form when need be)
NAME_WIDTH = 30  # a narrow table's model name, cut at a '-' with '…' past this
OFFLINE_SPEED = "? offline"  # a row without a verdict while the Hub cannot be asked: the speed needs config.json
# Bytes per parameter of a checkpoint by how its experts are stored (gpt-oss: MXFP4 experts, bf16 attention: 0.6).
BYTES_PER_PARAM = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "fp8": 1.05, "mxfp4": 0.6}
PICK_HINT = ("Enter on a model: its exact plan for this machine, read from the safetensors headers (no weights "
             "are downloaded). Then D, or the button, downloads it and opens the chat.")

# The engine's error class -> the notice's title (by name: the engine is not imported at start-up).
ERROR_TITLES = {
    "RepoGatedError": "Gated model",
    "RepoNotFoundError": "Not found",
    "HubAuthError": "Token rejected",
    "HubOfflineError": "Offline",
    "NetworkError": "Network problem",
    "DiskSpaceError": "Not enough disk",
    "DownloadIntegrityError": "Download discarded",
    "DownloadBusyError": "Already downloading",
    "DownloadCancelled": "Download cancelled",
    "UnsupportedModelError": "Not supported",
}



@dataclass(frozen=True)
class HubOptions:
    """The wizard's Hub and what it lists. The defaults follow huggingface_hub's environment (HF_ENDPOINT,
    HF_TOKEN, HF_HOME, HF_HUB_OFFLINE); tests point `endpoint` and `cache_dir` at a local Hub."""

    endpoint: str | None = None
    token: str | bool | None = None
    cache_dir: str | os.PathLike | None = None
    free_space: Callable[[str], int] | None = None  # bytes free at a path (tests: a small disk)
    entries: tuple[CatalogEntry, ...] = CATALOG
    hardware: object | None = None  # engine.hardware.Hardware (what-ifs); None: probe this machine
    prefs: object | None = None  # engine.plan.Preferences; None: the planner's defaults

    def client(self):
        from moechat.engine.plan.hub import Hub

        return Hub(self.endpoint, self.token, self.cache_dir, self.free_space)


def _size(n: float | None) -> str:
    if n is None:
        return "?"
    if n >= 1 << 40:
        return f"{n / (1 << 40):.2f} TiB"
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def _params(entry: CatalogEntry) -> str:
    """Total / active parameters per token, in billions ("30.5B / 3.3B")."""
    if not entry.total_params_b:
        return "?"
    total = f"{entry.total_params_b:.3g}B"
    return f"{total} / {entry.active_params_b:.3g}B" if entry.active_params_b else total


def _rate(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _tok_s(verdict) -> str:
    speed = verdict.decode_tok_s if verdict is not None else None
    if speed is None:
        return ""
    low, high = (_rate(x) for x in speed)
    return f"{low} tok/s" if low == high else f"{low}-{high} tok/s"


def _format(verdict) -> str:
    """The expert format a row's speed is predicted in: the recommended one ("native" is shown as stored)."""
    formats = getattr(verdict, "formats", None) if verdict is not None else None
    if formats is None or not verdict.fits:
        return ""
    if formats.recommended == "native":
        return f"native {verdict.spec.expert_format_name}"
    return formats.recommended


def format_lines(verdict) -> list[str]:
    """The plan's expert formats: the recommended one with why, then each format's line (engine/plan/format_plan.py)."""
    formats = getattr(verdict, "formats", None)
    if formats is None:
        return []
    best = formats.option(formats.recommended) if formats.recommended else None
    if best is None:
        lines = [f"expert format: {formats.reason}"]
    elif best.name == "native":
        lines = [f"expert format: native {verdict.spec.expert_format_name}, recommended ({formats.reason})"]
    else:
        lines = [f"expert format: {best.headline()}, recommended: {formats.reason}. Download and chat loads it in "
                 f"{best.name} (the first start converts the experts; the panel changes it)"]
    lines += [f"  {'*' if o.name == formats.recommended else '-'} {o.name}: {o.describe()}" for o in formats.options]
    return lines


def short_name(repo_id: str, width: int = NAME_WIDTH) -> str:
    """A narrow table's model name: without its owner, and past `width` cut after a '-' with '…'."""
    name = repo_id.split("/", 1)[-1]
    if len(name) <= width:
        return name
    cut = name.rfind("-", 0, width - 1)
    return name[:cut if cut > 0 else width - 1] + "…"


def matches(entry: CatalogEntry, query: str) -> bool:
    """An offline search: every word of `query` in the entry's repo id, family, format or note (any case)."""
    text = " ".join((entry.repo_id, entry.family, entry.format, entry.note)).lower()
    return all(word in text for word in query.lower().split())


def offline_search_text(offline: str, query: str) -> str:
    return (f"Hub search needs the Hub ({offline}); the list shows the catalog's models matching {query!r}, which "
            "moechat knows without it")


def strip_repo(text: str, repo_id: str) -> str:
    """`text` without the repo id it starts with (the line naming the repo already says it)."""
    return text[len(repo_id):].lstrip(":").strip() if repo_id and text.startswith(repo_id) else text


def _short(text: str, repo_id: str = "", limit: int = 60) -> str:
    """An error or reason cut for a table cell: without the repo id it starts with, up to the first ';'."""
    if repo_id and text.startswith(repo_id):
        text = text[len(repo_id):].lstrip(":").strip()
    text = text.split(";")[0]
    return text if len(text) <= limit else text[:limit - 1] + "…"


def error_title(e: BaseException, default: str) -> str:
    return ERROR_TITLES.get(type(e).__name__, default)


def hardware_summary(hw) -> str:
    """Three lines: the GPU (free VRAM, link), RAM, disk; what-ifs marked."""
    gpu = hw.best_gpu()
    if gpu is not None:
        link = "link unknown" if gpu.link_gbps is None else f"link {gpu.link_gbps:.1f} GB/s"
        if gpu.pcie_gen and gpu.pcie_width:
            link += f" (PCIe {gpu.pcie_gen}.0 x{gpu.pcie_width})"
        others = sum(1 for g in hw.gpus if g.usable) - 1
        gpu_line = (f"GPU   {gpu.name} ({gpu.label}): {_size(gpu.free_bytes)} free VRAM of {_size(gpu.total_bytes)}"
                    f", {link}" + (f"; {others} more GPU(s)" if others > 0 else ""))
    else:
        gpu_line = "GPU   none usable: the CPU computes from RAM"
    ram = hw.ram
    ram_line = f"RAM   {_size(ram.available_bytes)} available" + (
        f" of {_size(ram.total_bytes)}" if ram.total_bytes and ram.total_bytes != ram.available_bytes else "")
    disk = hw.disk
    disk_line = "disk  unknown" if disk is None else f"disk  {_size(disk.free_bytes)} free on {disk.path}"
    lines = [gpu_line, ram_line, disk_line]
    if hw.what_if:
        lines.append("what-if: " + ", ".join(hw.what_if))
    return "\n".join(lines)



def catalog_estimate(entry: CatalogEntry, hw) -> tuple[str, str, int | None]:
    """(verdict word, note, download bytes) from what the catalog knows, for a supported entry without the Hub.

    The download is the parameters at the format's bytes per parameter; a token needs about its active
    parameters' bytes in RAM + VRAM (the dense part and its top-k experts; the other experts stream from disk)
    and 1 GiB of working room."""
    bpp = BYTES_PER_PARAM.get(entry.format.split()[0].lower() if entry.format else "")
    if bpp is None or not entry.total_params_b:
        return "unknown (offline)", "offline, and the catalog does not give its size", None
    total = int(entry.total_params_b * 1e9 * bpp)
    active = int((entry.active_params_b or entry.total_params_b) * 1e9 * bpp)
    gpu = hw.best_gpu() if hw is not None else None
    ram = hw.ram.total_bytes or hw.ram.available_bytes if hw is not None else None
    memory = (ram or 0) + (gpu.free_bytes or 0 if gpu is not None else 0)
    disk = hw.disk.free_bytes if hw is not None and hw.disk is not None else None
    need = active + (1 << 30)  # a token's weights (the dense part and its top-k experts) and working room
    disk_short = disk is not None and total > disk
    if memory and need > memory:
        note = f"estimate: needs ~{_size(need)} of RAM + VRAM, {_size(memory)} here"
        return "too big (est.)", note + (f"; and {_size(disk)} free on disk" if disk_short else ""), total
    if disk_short:  # it would run here: the download does not fit
        return "disk short (est.)", f"estimate: the download needs ~{_size(total)}, {_size(disk)} free on disk", total
    return "fits (est.)", "estimate from the catalog's sizes" + (f"; {entry.note}" if entry.note else ""), total


@dataclass
class _Row:
    entry: CatalogEntry
    status: object | None = None  # CatalogStatus once checked
    search_note: str | None = None  # why a search hit is not checked (an unsupported family)
    quants: tuple = ()  # a GGUF-only repo's quants (engine.plan.hub.GGUFQuant): Enter lists each with its verdict


def entry_for_hit(hit) -> CatalogEntry:
    """A search hit as a catalog row: the curated entry when there is one, else what the Hub says."""
    from moechat.engine.plan.catalog import find

    curated = find(hit.repo_id)
    if curated is not None:
        return curated
    return CatalogEntry(hit.repo_id, hit.model_type or "?", (hit.params or 0) / 1e9, 0.0, "?",
                        gated=bool(hit.gated), note="from Hub search")



def cell_texts(r: _Row, narrow: bool, offline: str | None, hardware) -> dict[str, str]:
    """Every column's text for a row: its verdict word, download, note and speed, the catalog's estimate offline
    (`offline`: why the Hub is not asked; `hardware`: the machine the estimate is for); `narrow`: the short forms."""
    e, s = r.entry, r.status
    verdict = s.verdict if s is not None else None
    estimate = (catalog_estimate(e, hardware) if offline and s is not None and verdict is None
                and e.supported and r.search_note is None else None)
    if verdict is not None:
        word = verdict.verdict
    elif r.quants:
        word = "GGUF"
    elif r.search_note is not None or (s is not None and not e.supported):
        word = "unsupported"
    elif s is None:
        word = "checking…"
    elif estimate is not None:
        word = estimate[0]
    elif s.gated and s.error:
        word = "gated"
    else:
        word = "unknown"
    if s is not None and s.downloaded:
        download = "downloaded"
    elif verdict is not None:
        download = _size(verdict.download_bytes - verdict.cached_bytes)
    elif r.quants:
        sizes = [q.size for q in r.quants]
        download = _size(min(sizes)) if len(sizes) == 1 else f"{_size(min(sizes))}-{_size(max(sizes))}"
    elif s is not None and s.download_bytes:
        download = _size(s.download_bytes)
    elif estimate is not None and estimate[2]:
        download = "~" + _size(estimate[2])
    else:
        download = ""
    if not e.supported:
        note = _short(e.why_unsupported or r.search_note or "")
    elif estimate is not None:
        note = estimate[1]
    elif r.quants and verdict is None:
        note = f"{len(r.quants)} GGUF quant{'s' if len(r.quants) != 1 else ''}: Enter lists each with its verdict"
    elif s is not None and s.error and verdict is None:
        note = _short(s.error, e.repo_id)
    else:
        note = e.note
    speed = _tok_s(verdict)
    if not speed and estimate is not None:
        speed = OFFLINE_SPEED
    if narrow:
        speed = speed.removesuffix(" tok/s")
    cells = {"model": short_name(e.repo_id) if narrow else e.repo_id, "verdict": word, "speed": speed,
             "format": _format(verdict), "download": download, "family": e.family, "params": _params(e),
             "note": note}
    return cells


class ModelTable(DataTable):
    """The catalog's table; a resize asks the screen which columns fit whole now."""

    def on_resize(self) -> None:
        fit = getattr(self.screen, "_fit_columns", None)
        if fit is not None:
            self.call_after_refresh(fit)

