"""What `moechat fit` plans from: the model (its spec from a folder, a downloaded snapshot or the Hub's headers, and
why `run` would refuse it, in the loader's own words), the machine (the disk the check is on, the RAM read rate and
the GPU's figures with where each comes from, the calibration measured here) and the plans beside the chosen one
(on the RAM free now, the least RAM that plans, every --dense-format). Imports torch or the engine only inside the
functions, and a config-only folder never needs torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

EXPERT_FORMATS = ("native", "int8", "int4")  # moechat run --expert-format (engine/plan/format_plan.py FORMATS)


def why_not_runnable(spec) -> str | None:
    """Why `moechat run` would refuse this checkpoint (the loader's architectures and quantization methods, read
    without importing torch); None when it loads it."""
    from moechat.engine.plan.catalog import why_not_runnable as why

    return why(spec.model_type, spec.quant_method, spec.remote_code)


def loader_refusal(model_dir, dtype: str | None = None) -> str | None:
    """Why `moechat run` refuses this folder, in its loader's words: `engine/load/loader.py`'s `check_model`, the checks
    `run` makes before it reads a weight (headers and shapes only), so fit's verdict is run's. None when it loads
    it, or when the folder holds no weights yet (config.json alone, or a download still going: planned from the
    config, without torch)."""
    from moechat.engine.errors import MoechatError

    from ..guard import one_line

    model_dir = Path(model_dir).expanduser()
    try:
        if not _has_weights(model_dir):
            return None
        from moechat.engine.load.loader import check_model  # torch: there are headers to check

        check_model(model_dir, dtype=dtype).disk.close()
    except MoechatError as e:
        return one_line(e)
    return None


def _has_weights(model_dir: Path) -> bool:
    """Whether `run` would read weights here now: every shard the index names is there (a FIFO or a folder counts:
    the loader refuses it), or *.safetensors files, or only pickle weights (refused). The index is checked by the
    loader's rules first (a weight_map that is not an object, or a shard outside the folder, is its typed error)."""
    import os

    from moechat.engine.errors import CheckpointError
    from moechat.engine.io.files import read_json_file
    from moechat.engine.io.validate import INDEX_NAME, PICKLE_NAMES, check_index

    if not model_dir.is_dir():
        return False
    index = model_dir / INDEX_NAME
    if os.path.lexists(index):
        data = read_json_file(index, "safetensors index", error=lambda m: CheckpointError(m, path=str(index)))
        shards = set(check_index(data, str(index))["weight_map"].values())
        return all(os.path.lexists(model_dir / s) for s in shards)
    return (next(model_dir.glob("*.safetensors"), None) is not None
            or any(os.path.lexists(model_dir / n) for n in PICKLE_NAMES))


def hub_refusal(repo_id: str, config: dict, headers: dict, dtype: str | None = None,
                shards: dict[str, str] | None = None) -> str | None:
    """`loader_refusal` for a Hub repo: the loader's checks over its config.json and the safetensors headers
    fetched from the Hub (no weight bytes); `shards` (tensor -> file) names each tensor's file in the messages."""
    from moechat.engine.errors import MoechatError
    from moechat.engine.io.checkpoint import tensors_from_entries
    from moechat.engine.load.loader import check_model

    from ..guard import one_line

    try:
        tensors = tensors_from_entries(repo_id, headers, shards)
        check_model(repo_id, dtype=dtype, raw_config=config, tensors=tensors).disk.close()
    except MoechatError as e:
        return one_line(e)
    return None


def gguf_quant_spec(repo: str, quant: str):
    """`moechat fit org/name:QUANT`: (the quant's ModelSpec from its cached files or its GGUF header(s) on the Hub,
    None) or, when the loader would refuse the file (an architecture or a ggml type moechat lacks, a hostile
    header), (None, why in its words). A quant the repo does not have is an error listing those it has."""
    from moechat.engine.errors import CheckpointError, ConfigError, UnsupportedModelError
    from moechat.engine.plan.hub import Hub

    from ..guard import one_line

    try:
        return Hub().gguf_quant_spec(repo, quant)[0], None
    except (CheckpointError, UnsupportedModelError, ConfigError) as e:
        return None, one_line(e)


def checked_fit_spec(model: str, dtype: str | None = None):
    """(the ModelSpec fit plans, or None when it cannot be read; why `run` refuses the model, or None):
    app/cli/pull.py's `fit_spec` beside the loader's checks over the same files (a folder, a downloaded snapshot)
    or the same headers (a Hub repo: the loader's checks over the headers fetched here)."""
    from moechat.engine.io.validate import check_index
    from moechat.engine.plan.hub import INDEX_FILE, Hub, is_offline, looks_like_repo_id, split_quant

    from ..pull import fit_spec

    def spec_or_none(make, refused):
        try:
            return make(), refused
        except Exception:  # noqa: BLE001 - the loader's reason is the one to say (e.g. an index it refuses)
            if refused is None:
                raise
            return None, refused

    path = Path(model).expanduser()
    repo, quant = split_quant(model)
    if quant is not None and not path.exists() and looks_like_repo_id(repo):  # org/name:Q4_K_M, one GGUF quant
        return gguf_quant_spec(repo, quant)
    if path.exists() or not looks_like_repo_id(model):
        return spec_or_none(lambda: fit_spec(model), loader_refusal(path, dtype))
    hub = Hub()
    local = hub.local_snapshot(model)
    if local is not None or is_offline():
        return spec_or_none(lambda: fit_spec(model), None if local is None else loader_refusal(local, dtype))
    listing = hub.listing(model)
    shards = None  # tensor -> the shard file its header is in (error messages name it)
    if listing.file(INDEX_FILE) is not None:  # before the headers, which read the shard names from it
        from moechat.engine.errors import CheckpointError

        from ..guard import one_line

        try:
            shards = check_index(hub._fetch_json(model, INDEX_FILE, listing), f"{model}/{INDEX_FILE}")["weight_map"]
        except CheckpointError as e:
            return None, one_line(e)
    headers = hub.headers(model, listing)
    if shards is None and len(listing.weight_files) == 1:
        shards = dict.fromkeys(headers, listing.weight_files[0].path)
    refused = hub_refusal(model, hub._fetch_json(model, "config.json", listing), headers, dtype, shards)
    return spec_or_none(lambda: hub.remote_spec(model, listing=listing), refused)  # (its own ranged reads again)


def disk_target(spec, hf_cache: Path) -> tuple[Path, str]:
    """(the folder whose filesystem the disk check is on, which one it is in words). Weights still to download go
    where `moechat pull` puts them, the Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub), unless a local folder
    already holds part of them; a downloaded model needs disk only for a repacked file (--expert-format), which
    goes to the repack cache."""
    if not spec.weights_present:
        if spec.path is not None and spec.present_bytes and not _in(Path(spec.path), hf_cache):
            return Path(spec.path), "the model folder, which holds part of the download"
        return hf_cache, "the Hugging Face cache, HF_HUB_CACHE or HF_HOME/hub: where moechat pull downloads"
    return repack_dir(spec.path, "int8").parent, "the repack cache, where --expert-format writes ($XDG_CACHE_HOME)"


def _in(path: Path, folder: Path) -> bool:
    try:
        path.expanduser().resolve().relative_to(folder.expanduser().resolve())
    except ValueError:
        return False
    return True


def repacked_formats(model_dir) -> frozenset[str]:
    """The converted formats whose repacked file for this model is already written (a later start reuses it)."""
    if model_dir is None:
        return frozenset()
    return frozenset(f for f in EXPERT_FORMATS[1:] if (repack_dir(model_dir, f) / "experts.bin").is_file())


def repack_dir(model_dir, fmt: str) -> Path:
    """engine/cache/store.py's default_repack_dir without importing torch (a test keeps the two equal)."""
    import os

    from moechat.engine.cache.prefetch import profile_key  # numpy, no torch

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moechat" / "repacked" / f"{profile_key(model_dir)}-{fmt}"


def _calibration(hw, measure: bool):
    """Measured numbers for the decode prediction (engine/plan/calibration.py): the RAM read rate (measured here once
    and kept in the cache dir) and the CPU's seconds per layer from earlier `moechat run` decodes."""
    from moechat.engine.plan import calibration
    from moechat.engine.units import GiB

    free = hw.ram.free_now_bytes if hw.ram.free_now_bytes is not None else hw.ram.available_bytes
    if measure and (free or 0) > 2 * GiB:  # the probe reads 256 MiB
        return calibration.ensure_ram_read_gbps()
    return calibration.load()


def _load_curve(path: str | None, num_experts: int):
    if path is None:
        return None
    from moechat.engine.errors import ConfigError
    from moechat.engine.io.files import read_json_file
    from moechat.engine.plan import MissRatioCurve

    data = read_json_file(path, "miss-ratio curve")  # a FIFO refused, deep nesting typed
    try:
        return MissRatioCurve.from_json(data, num_experts)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
        raise ConfigError(f"{path}: not a miss-ratio curve ({e})") from None


def _host_rate(args, cal, what_if_cpu: bool):
    """The CPU's read rate the plan uses, with its source (engine/plan/hardware/presets.py `host_read_rate`)."""
    from moechat.engine.plan.hardware import Rate, host_read_rate, usable_cores

    peak = None
    if args.ram_bw_gbs is not None:
        peak = Rate(args.ram_bw_gbs, "given (--ram-bw-gbs)")
    elif args.ram is not None:
        peak = Rate(args.ram.peak_gbps, f"from --ram {args.ram.name} preset ({args.ram.source})")
    cores, cores_source = args.cores, "given (--cores)"
    if cores is None and peak is not None:
        cores, cores_source = (None, "") if what_if_cpu else (usable_cores(), "measured on this machine")
    return host_read_rate(peak=peak, cores=cores, cores_source=cores_source, measured_gbps=cal.ram_read_gbps,
                          what_if=what_if_cpu)


def _this_machine(source: str) -> str | None:
    """A GPU figure's source as said: the probe's (NVML) is "measured on this machine"; None when unknown."""
    if source in ("unknown", ""):
        return None
    if source.startswith(("from --", "given", "assumed")):
        return source
    return f"measured on this machine ({source})"


def machine_rates(plan, hw, prefs) -> dict:
    """Every bandwidth the plan computes with, each with where it comes from: name -> Rate."""
    from moechat.engine.plan.hardware import (
        ASSUMED_DISK_GBPS,
        ASSUMED_GPU_MEMORY_GBPS,
        ASSUMED_LINK_GBPS,
        ASSUMED_RAM_GBPS,
        Rate,
    )

    rates = {}
    gpu = None if plan.device == "cpu" else hw.gpu(int(plan.device.partition(":")[2] or 0))
    if gpu is not None:
        src = _this_machine(gpu.memory_source) if gpu.memory_gbps is not None else None
        rates["GPU memory"] = (Rate(gpu.memory_gbps, src) if src else
                               Rate(ASSUMED_GPU_MEMORY_GBPS, "assumed: not reported; --gpu PRESET sets it"))
        src = _this_machine(gpu.link_source) if gpu.link_gbps is not None else None
        rates["link"] = (Rate(gpu.link_gbps, src) if src else
                         Rate(ASSUMED_LINK_GBPS, "assumed PCIe 4.0 x16: not reported; --link PRESET sets it"))
    rates["RAM read"] = Rate(prefs.host_read_gbps or ASSUMED_RAM_GBPS, prefs.host_read_source or "assumed")
    rates["disk read"] = (Rate(prefs.disk_read_gbps, "given (--disk-read-gbps)") if prefs.disk_read_gbps else
                          Rate(ASSUMED_DISK_GBPS, "assumed: an NVMe SSD; --disk-read-gbps sets it"))
    return rates


def least_free_ram(spec, hw, prefs) -> int:
    """The least free RAM with which `spec` plans on `hw` (bisection over make_plan, which is pure arithmetic: ~20
    plans, milliseconds), from what is free now up to the total."""
    from dataclasses import replace

    from moechat.engine.plan import make_plan

    def ok(avail: int) -> bool:
        return make_plan(spec, replace(hw, ram=replace(hw.ram, available_bytes=avail)), prefs).ok

    lo, hi = hw.ram.free_now_bytes, hw.ram.total_bytes
    while hi - lo > max(16 << 20, hi // 200):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def _plan_on_free_ram(option, hw, prefs):
    """The same format planned on the RAM free at this instant (None: no instant figure, or a what-if)."""
    from dataclasses import replace

    from moechat.engine.plan import make_plan

    free = hw.ram.free_now_bytes
    if free is None or option.spec is None:
        return None
    return make_plan(option.spec, replace(hw, ram=replace(hw.ram, available_bytes=free)), prefs)


@dataclass(frozen=True)
class DenseAlternative:
    """The chosen plan with one `--dense-format`: what fit shows beside the chosen dense weights."""

    spec_dense_bytes: int
    spec_dense_read_bytes: int
    decode: dict | None  # {"low", "high", "bound"} tok/s; None off a CPU plan (the quantized ones are CPU only)

    def to_json(self) -> dict:
        return {"dense_bytes": self.spec_dense_bytes, "dense_read_bytes": self.spec_dense_read_bytes,
                "decode": self.decode}


def _dense_plans(undensed, chosen: str, plan, hw, prefs) -> dict[str, DenseAlternative]:
    """Every --dense-format of the chosen experts (`undensed`: their spec with native dense weights): its dense
    bytes, and on a CPU plan its decode rate with the same experts and cache (the chosen one's is the plan's)."""
    from moechat.engine.plan import make_plan

    out = {}
    for name in ("native", "int8", "int4"):
        spec = undensed.in_dense_format(name)
        d = None
        if plan.device == "cpu" and plan.decode is not None:
            d = plan.decode if name == chosen else make_plan(spec, hw, prefs).decode
        out[name] = DenseAlternative(spec.dense_bytes, spec.dense_read_bytes, None if d is None else {
            "low": d.low, "high": d.high, "bound": d.bound})
    return out
