"""`moechat fit MODEL`: will this model run here, with what settings, and how fast, in numbers.

MODEL is a local model directory (complete weights: exact sizes from the safetensors headers; only
config.json, perhaps with the index: estimates from the config), or a Hub repo id: its downloaded snapshot,
else config.json and the safetensors headers read from the Hub (a ranged read per shard, no weights; with
HF_HUB_OFFLINE, the config.json in the local cache). `--vram-gb`, `--ram-gb`, `--disk-gb`, `--link-gbs`,
`--ram-bw-gbs`, `--cores`, the presets `--gpu`, `--ram` and `--link` (engine/plan/hardware.py, each figure with its source)
and `--context` ask "what if" without that hardware; every rate the plan uses is printed with where it comes from
("measured on this machine", a preset's spec sheet, given, assumed), and a what-if machine never gets this machine's
RAM read rate. The decode it predicts is the `--on-miss` mode `run` will use (auto unless asked). The disk check is on
the Hugging Face cache, where `moechat pull` downloads (or a repack cache for a downloaded model), or `--disk-gb`. The first line ends in exactly one of "runs", "runs with ..."
(the flags, or the free RAM, it needs) and "cannot run: <why>" (a shortfall with the cheapest fix, or what the
loader cannot read); the exit status follows it: 0, 0, 3 (0 with --force when only the plan refuses), and 1 on an
error such as a missing config. It plans on the machine's total RAM and says what is free now.

Start-up imports neither torch nor the engine; a config-only directory is planned without torch at all.
"cannot run" also comes from the loader's own checks (engine/load/loader.py `check_model`, headers and shapes only)
over a folder's weights or a Hub repo's fetched headers: what `run` refuses, fit refuses in the same words.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

from .argtypes import context_length, say_clamp  # no torch
from .argtypes import non_negative_float as _non_negative_float

EXIT_REFUSED = 3
EXPERT_FORMATS = ("native", "int8", "int4")  # moechat run --expert-format (engine/plan/format_plan.py FORMATS)


def add_fit_parser(subparsers) -> argparse.ArgumentParser:
    fit = subparsers.add_parser(
        "fit", help="plan what fits where and predict decode speed, before or after download",
        description="Plan a model on this machine (or a what-if machine): dense weights, KV cache, expert slots, "
                    "RAM and disk tiers, predicted decode tok/s and its bound, each with its reason. The first line "
                    "says runs, runs with ... or cannot run: why (exit 3). Memory sizes are GiB, bandwidths GB/s.")
    fit.add_argument("model", metavar="MODEL", help="model directory (config.json alone is enough) or a Hub repo id "
                     "(org/name: read from the Hub's metadata, without downloading the weights)")
    fit.add_argument("--json", action="store_true", help="print the plan, model spec and hardware as one JSON object")
    fit.add_argument("--context", type=context_length, metavar="N", help="tokens of KV cache to plan for (default: "
                     "4096, lowered if needed; with --prefer context, the model's maximum; a value past the model's "
                     "is lowered to it, and said)")
    fit.add_argument("--vram-gb", type=_non_negative_float, metavar="GIB", help="what if the GPU had this much free "
                     "memory (0: no GPU)")
    fit.add_argument("--ram-gb", type=_non_negative_float, metavar="GIB", help="what if this much RAM were available")
    fit.add_argument("--disk-gb", type=_non_negative_float, metavar="GIB", help="what if this much disk were free")
    fit.add_argument("--link-gbs", "--link-gbps", dest="link_gbps", type=_positive_float, metavar="GBS",
                     help="what if the host->GPU link moved this many usable GB/s (PCIe 4.0 x16 ~ 25)")
    hw = fit.add_argument_group("what-if machine", "model a machine you do not have: presets carry their vendor's "
                                "figures (named in the output); a flag given beside a preset wins")
    hw.add_argument("--gpu", type=_preset("gpu"), metavar="PRESET", help="a GPU by name, with its memory, memory "
                    "bandwidth and PCIe link from its spec sheet: rtx-3060, rtx-4060, rtx-4070, rtx-4090, rtx-5090, "
                    "h100-pcie, ... (a wrong name lists them all); --vram-gb sets its free memory")
    hw.add_argument("--ram", type=_preset("ram"), metavar="PRESET", help="the RAM's peak bandwidth by kind: "
                    "ddr4-single, ddr4-dual, ddr5-dual, ddr5-quad (JEDEC figures)")
    hw.add_argument("--link", type=_preset("link"), metavar="PRESET", help="the host->GPU link by PCIe generation "
                    "and width: pcie3-x16, pcie4-x8, pcie4-x16, pcie5-x16")
    hw.add_argument("--ram-bw-gbs", type=_positive_float, metavar="GBS", help="the RAM's peak bandwidth in GB/s "
                    "(dual-channel DDR5-5600: 89.6); decode on the CPU reads at 70%% of it, at most ~20 GB/s a thread")
    hw.add_argument("--cores", type=_positive_int, metavar="N", help="CPU cores (moechat computes on all but one)")
    fit.add_argument("--disk-read-gbps", type=_non_negative_float, metavar="GBPS", help="disk read bandwidth for "
                     "streamed experts (default: 2, an NVMe SSD)")
    fit.add_argument("--prefer", choices=["speed", "context"], default="speed", help="spare device memory goes to "
                     "expert slots (speed) or to a longer context (default: %(default)s)")
    fit.add_argument("--margin", type=_non_negative_float, default=0.05, metavar="FRACTION", help="fraction of each "
                     "memory total to leave free (default: %(default)s)")
    fit.add_argument("--device", help="plan for cpu, cuda or cuda:N (default: the GPU with the most "
                     "free memory, else the CPU)")
    fit.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="plan in this compute dtype, as "
                     "moechat run --dtype would (default: the checkpoint's own formats)")
    fit.add_argument("--hit-curve", metavar="PATH", help="miss-ratio curve JSON ({\"points\": [[fraction, "
                     "hit_rate], ...]} or bench/replay.py --json output) instead of the conservative default")
    fit.add_argument("--on-miss", choices=["load", "host", "auto"], default="auto", help="predict decode with misses "
                     "served this way, as moechat run --on-miss would (default: %(default)s, run's default)")
    fit.add_argument("--expert-format", choices=list(EXPERT_FORMATS), help="show the plan in this expert format "
                     "(native: as the checkpoint ships them; int8, int4: converted once by moechat); default: the "
                     "recommended one. Every format is planned and compared either way")
    fit.add_argument("--dense-format", choices=["native", "int8", "int4"], default="native", help="plan with "
                     "attention's projections and the LM head in int8, or attention in int4 and the LM head in int8 "
                     "(moechat run --dense-format; CPU only): fewer bytes a token reads. Every one is shown either way")
    fit.add_argument("--force", action="store_true", help="show the plan that loading anyway would use, and exit 0 "
                     "even when it does not fit")
    return fit


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value:g}")
    return value


def _positive_int(text: str) -> int:
    from .argtypes import positive_int

    value = positive_int(text)
    if value > 4096:
        raise argparse.ArgumentTypeError(f"expected at most 4096 cores, got {value}")
    return value


def _preset(kind: str):
    """An argparse type for --gpu/--ram/--link: the preset itself (engine/plan/hardware.py's tables, imported only when
    the flag is given), or one usage line listing every name."""
    def parse(text: str):
        from moechat.engine.plan.hardware import GPU_PRESETS, LINK_PRESETS, RAM_PRESETS

        table = {"gpu": GPU_PRESETS, "ram": RAM_PRESETS, "link": LINK_PRESETS}[kind]
        preset = table.get(text.strip().lower())
        if preset is None:
            raise argparse.ArgumentTypeError(f"no {kind} preset {text!r}: use one of {', '.join(table)}")
        return preset

    parse.__name__ = f"{kind} preset"
    return parse


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

    from .guard import one_line

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
    from moechat.engine.io.checkpoint import tensors_from_entries
    from moechat.engine.errors import MoechatError
    from moechat.engine.load.loader import check_model

    from .guard import one_line

    try:
        tensors = tensors_from_entries(repo_id, headers, shards)
        check_model(repo_id, dtype=dtype, raw_config=config, tensors=tensors).disk.close()
    except MoechatError as e:
        return one_line(e)
    return None


def checked_fit_spec(model: str, dtype: str | None = None):
    """(the ModelSpec fit plans, or None when it cannot be read; why `run` refuses the model, or None): app/cli/pull.py's
    `fit_spec` beside the loader's checks over the same files (a folder, a downloaded snapshot) or the same
    headers (a Hub repo: the loader's checks over the headers fetched here)."""
    from moechat.engine.plan.hub import INDEX_FILE, Hub, is_offline, looks_like_repo_id
    from moechat.engine.io.validate import check_index

    from .pull import fit_spec

    def spec_or_none(make, refused):
        try:
            return make(), refused
        except Exception:  # noqa: BLE001 - the loader's reason is the one to say (e.g. an index it refuses)
            if refused is None:
                raise
            return None, refused

    path = Path(model).expanduser()
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

        from .guard import one_line

        try:
            shards = check_index(hub._fetch_json(model, INDEX_FILE, listing), f"{model}/{INDEX_FILE}")["weight_map"]
        except CheckpointError as e:
            return None, one_line(e)
    headers = hub.headers(model, listing)
    if shards is None and len(listing.weight_files) == 1:
        shards = dict.fromkeys(headers, listing.weight_files[0].path)
    refused = hub_refusal(model, hub._fetch_json(model, "config.json", listing), headers, dtype, shards)
    return spec_or_none(lambda: hub.remote_spec(model, listing=listing), refused)  # (its own ranged reads again)


def headline(plan, spec, hw, why_not: str | None, expert_format: str, plan_now=None,
             need_ram: int | None = None) -> tuple[str, int]:
    """The first line's verdict and the exit status that goes with it: exactly one of "runs", "runs with ..." (the
    flags or conditions it needs) and "cannot run: <why>" (exit 3; 0 with --force, which loads anyway).

    `plan` is made on the machine's total RAM; `plan_now` on what is free at this instant. A cache uses what RAM
    it is given, so the model runs now unless even the smallest plan needs more than is free: then the headline
    says how much RAM must be free (`need_ram`, from `least_free_ram`)."""
    from moechat.engine.plan import gib

    if why_not is not None:
        return f"cannot run: {why_not}", EXIT_REFUSED
    if not plan.ok:
        text = f"cannot run: {plan.refusal.message}"
        if plan.overridden:
            return text + " (--force: below is the plan loading anyway would use)", 0
        return text, EXIT_REFUSED
    needs = []
    if expert_format != "native":
        needs.append(f"--expert-format {expert_format}")
    free = hw.ram.free_now_bytes
    if free is not None and plan_now is not None and not plan_now.ok:
        needs.append(f"{gib(need_ram or hw.ram.total_bytes)} of RAM free (this machine has "
                     f"{gib(hw.ram.total_bytes)}, {gib(free)} is free now: close programs first)")
    return ("runs with " + " and ".join(needs) if needs else "runs"), 0


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


def _calibration(hw, measure: bool):
    """Measured numbers for the decode prediction (engine/plan/calibration.py): the RAM read rate (measured here once and
    kept in the cache dir) and the CPU's seconds per layer from earlier `moechat run` decodes."""
    from moechat.engine.plan import calibration
    from moechat.engine.plan.hardware import GiB

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


def run_fit(args: argparse.Namespace) -> int:
    from moechat.engine.errors import ConfigError
    from moechat.engine.plan.format_plan import plan_formats
    from moechat.engine.plan.hardware import probe
    from moechat.engine.plan.hub import default_cache_dir
    from moechat.engine.plan import FLOAT_SIZES, Preferences

    spec, refused = checked_fit_spec(args.model, args.dtype)
    if spec is None:  # the loader refuses it, and there is nothing to plan
        return _refused_only(args, refused)
    if args.dtype:
        spec = spec.in_dtype(FLOAT_SIZES[args.dtype], args.dtype)
    undensed, spec = spec, spec.in_dense_format(args.dense_format)
    if args.dense_format != "native" and args.device and not args.device.startswith("cpu"):
        raise ConfigError(f"--dense-format {args.dense_format} runs on the CPU only for now: plan it with --device cpu")
    if args.context is not None and args.context > spec.max_context:

        say_clamp(args, "--context", args.context, spec.max_context, f"the model has {spec.max_context:,} positions "
                  "(max_position_embeddings)")
    where, what = disk_target(spec, default_cache_dir())
    # Planned on the machine's total RAM (what is free changes by the minute), the free figure kept for a note
    hw = probe(where).on_total_ram()
    if hw.disk is not None:
        hw = replace(hw, disk=replace(hw.disk, path=str(where), what=what))
    hw = hw.with_overrides(vram_gb=args.vram_gb, ram_gb=args.ram_gb, disk_gb=args.disk_gb, link_gbps=args.link_gbps,
                           gpu_preset=args.gpu, link_preset=args.link)
    if args.margin >= 1:
        raise ConfigError(f"--margin {args.margin:g}: a fraction below 1, e.g. 0.05")
    # a what-if machine's RAM read rate is never this machine's probe (the RAM, or the whole box, is another one);
    # --vram-gb 0 is this machine's CPU without its GPU
    what_if_cpu = args.ram_gb is not None or args.gpu is not None or bool(args.vram_gb)
    cal = _calibration(hw, measure=not what_if_cpu)
    host = _host_rate(args, cal, what_if_cpu)
    measured_cpu = host.source.startswith("measured on this machine")
    prefs = Preferences(context=args.context, prefer=args.prefer, device=args.device, margin=args.margin,
                        hit_curve=_load_curve(args.hit_curve, spec.num_experts), disk_read_gbps=args.disk_read_gbps,
                        override=args.force, repacked=repacked_formats(spec.path), host_read_gbps=host.gbps,
                        host_read_source=host.source, cpu_layer_s=cal.cpu_layer_s if measured_cpu else None,
                        on_miss=args.on_miss, embeddings="auto")
    advice = plan_formats(spec, hw, prefs)
    chosen = advice.option(args.expert_format) if args.expert_format else advice.best
    if chosen.plan is None:
        raise ConfigError(f"--expert-format {chosen.name}: {chosen.note}")
    plan = chosen.plan
    why_not = refused or why_not_runnable(spec)  # the loader's own words first: what `run` would print
    plan_now = _plan_on_free_ram(chosen, hw, prefs) if plan.ok else None
    need = least_free_ram(chosen.spec, hw, prefs) if plan_now is not None and not plan_now.ok else None
    verdict, status = headline(plan, spec, hw, why_not, chosen.name, plan_now, need)
    rates = machine_rates(plan, hw, prefs)
    flags = _run_flags(plan, spec, chosen.name, args.on_miss)
    dense_alts = _dense_plans(undensed.in_format(chosen.name), spec.dense_format, plan, hw, prefs)
    if args.json:
        print(json.dumps({"model": args.model, "headline": verdict, "verdict": verdict.partition(":")[0].partition(
                          " with")[0] + (" with" if verdict.startswith("runs with") else ""),
                          "fits": plan.ok, "runnable": why_not is None, "why_not_runnable": why_not,
                          "expert_format": chosen.name, "on_miss": args.on_miss,
                          "calibration": cal.describe() or None, "calibration_used": measured_cpu,
                          "rates": {k: {"gbps": r.gbps, "source": r.source} for k, r in rates.items()},
                          "plan": plan.to_json(), "spec": spec.to_json(), "formats": advice.to_json(),
                          "hardware": hw.to_json(),
                          "scale_out": None if plan.ok else _scale_out(spec).to_json(),
                          "run_flags": flags if plan.ok or plan.overridden else None,
                          "dense_format": spec.dense_format,
                          "dense_int8": None if spec.dense_format != "native" or dense_alts["int8"].decode is None
                          else {"dense_read_bytes": dense_alts["int8"].spec_dense_read_bytes,
                                "decode": dense_alts["int8"].decode},
                          "dense_formats": {name: a.to_json() for name, a in dense_alts.items()},
                          "clamps": getattr(args, "clamps", None) or []},
                         indent=1))
    else:
        print(format_plan(plan, spec, hw, why_not, advice, chosen.name, verdict=verdict,
                          calibration=cal if measured_cpu else None, plan_now=plan_now, rates=rates,
                          on_miss=args.on_miss, dense_alts=dense_alts))
    return status


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


def _host_rate(args, cal, what_if_cpu: bool):
    """The CPU's read rate the plan uses, with its source (engine/plan/hardware.py `host_read_rate`)."""
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


def _rate_lines(rates: dict) -> list[str]:
    from moechat.engine.plan import GPU_EFFICIENCY

    out = []
    for name, r in rates.items():
        text = f"{name} {r.gbps:.3g} GB/s"
        if name == "GPU memory":
            text += f" peak (decode reads at {GPU_EFFICIENCY:.0%} of it: {r.gbps * GPU_EFFICIENCY:.3g} GB/s)"
        out.append(f"{'' if out else '  rates':<12}{text}: {r.source}")
    return out


def _refused_only(args: argparse.Namespace, why: str) -> int:
    """The verdict alone, when the loader refuses a model whose files cannot even be planned from."""
    verdict = f"cannot run: {why}"
    if args.json:
        print(json.dumps({"model": args.model, "headline": verdict, "verdict": "cannot run", "fits": None,
                          "runnable": False, "why_not_runnable": why, "plan": None, "spec": None}, indent=1))
    else:
        print(f"moechat fit {Path(args.model).name if Path(args.model).expanduser().exists() else args.model}: "
              f"{verdict}")
    return EXIT_REFUSED


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


def _run_flags(plan, spec, expert_format: str = "native", on_miss: str = "auto") -> list[str]:
    """The `moechat run` flags that reproduce the plan."""
    flags = ["--context", str(plan.context)]
    if spec.float_dtype != (spec.config_dtype or "float32"):  # the loader's default: config.json's dtype, else fp32
        flags += ["--dtype", spec.float_dtype]
    if plan.needs_cache:
        flags += ["--expert-slots", str(plan.expert_slots)]
        if plan.ram_cache_bytes is not None:
            flags += ["--ram-cache-mb", str(plan.ram_cache_bytes >> 20)]
    if plan.device != "cpu":
        flags += ["--device", plan.device]
    if plan.embeddings == "host" and plan.needs_cache:
        flags += ["--embeddings", "host"]
    if expert_format != "native":
        flags += ["--expert-format", expert_format]
    if on_miss != "auto" and plan.needs_cache:
        flags += ["--on-miss", on_miss]
    if spec.dense_format != "native":
        flags += ["--dense-format", spec.dense_format]
    return flags


def format_plan(plan, spec, hw, why_not: str | None, advice=None, expert_format: str = "native", *,
                verdict: str | None = None, calibration=None, plan_now=None, rates: dict | None = None,
                on_miss: str = "auto", dense_alts: dict[str, DenseAlternative] | None = None) -> str:
    from moechat.engine.plan import gib, rate, rate_range

    if verdict is None:
        verdict = headline(plan, spec, hw, why_not, expert_format)[0]
    runnable = why_not is None
    out = [f"moechat fit {spec.name} ({spec.model_type}): {verdict}"]
    ts = " + ".join(f"{t.name} {list(t.shape)} {t.dtype}" for t in spec.expert_tensors)
    out.append(f"  model     {spec.num_layers} layers, {spec.num_moe_layers} MoE x {spec.num_experts} experts, "
               f"top-{spec.top_k}" + (f", {spec.shared_experts} shared" if spec.shared_experts else "")
               + f"; {spec.total_experts:,} experts = {gib(spec.all_experts_bytes)}")
    out.append(f"            {spec.expert_format_line()}; stored as {spec.expert_format}")
    out.append(f"            one expert: {ts}")
    dense = {"native": "", "int8": " (int8 attention and LM head)",
             "int4": " (int4 attention, int8 LM head)"}.get(spec.dense_format, f" ({spec.dense_format})")
    out.append(f"            dense {gib(spec.dense_bytes)}{dense}, {gib(spec.dense_read_bytes)} read a token; "
               f"KV {gib(spec.kv_bytes_per_token())}/token "
               f"({spec.kv_kind}); checkpoint {gib(spec.checkpoint_bytes)}; sizes from {spec.source}"
               + (" (ESTIMATES)" if spec.estimated else " (exact)"))
    if dense_alts:
        out.append("            read a token by --dense-format: " + " · ".join(
            f"{name} {gib(a.spec_dense_read_bytes)}" for name, a in dense_alts.items())
            + ("" if plan.device == "cpu" else " (int8 and int4 run on the CPU only)"))
    out.append(f"            moechat run: {'supported' if runnable else 'cannot load it (planning only)'}")
    def mark(source: str) -> str:
        return " (what-if)" if source == "what-if" else ""

    gpus = "; ".join(f"{g.label} {g.name} {gib(g.free_bytes)} free{mark(g.source)}" for g in hw.gpus if g.usable)
    disk = "disk unknown" if hw.disk is None else f"disk {gib(hw.disk.free_bytes)} free on {hw.disk.describe()}"
    ram = f"RAM {gib(hw.ram.available_bytes)} available{mark(hw.ram.source)}"
    if hw.ram.free_now_bytes is not None:
        ram = f"RAM {gib(hw.ram.available_bytes)} in all (the plan's), {gib(hw.ram.free_now_bytes)} free now"
    out.append(f"  hardware  {gpus or 'no usable GPU'}; {ram}; {disk}{mark(hw.disk.source if hw.disk else '')}")
    out += _rate_lines(rates or {})
    rows = [(d.item, "" if d.bytes is None else gib(d.bytes), d.where, d.reason) for d in plan.decisions]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    w2 = max(len(r[2]) for r in rows)
    out.append("")
    out.append(f"  {'item':<{w0}}  {'size':>{w1}}  {'where':<{w2}}  why")
    for item, size, where, why in rows:
        out.append(f"  {item:<{w0}}  {size:>{w1}}  {where:<{w2}}  {why}")
    out.append("")
    if plan.decode is not None:
        d = plan.decode
        mode = "" if d.on_miss is None else f" with --on-miss {d.on_miss}"
        out.append(f"  decode    {rate_range(d.low, d.high)} tok/s predicted{mode}   (bound {rate(d.bound)} tok/s, set "
                   f"by {d.bound_by}; formula in docs/plan.md)")
        now = plan_now.decode if plan_now is not None and plan_now.ok else None
        if now is not None and (now.low, now.high) != (d.low, d.high):
            out.append(f"            with the {gib(hw.ram.free_now_bytes)} of RAM free now: "
                       f"{rate_range(now.low, now.high)} tok/s ({plan_now.expert_slots:,} slots)")
        for name, alt in (dense_alts or {}).items():
            if name != spec.dense_format and alt.decode is not None:
                a = alt.decode
                out.append(f"            with --dense-format {name}: {rate_range(a['low'], a['high'])} tok/s (the "
                           f"dense weights read {gib(alt.spec_dense_read_bytes)} a token instead of "
                           f"{gib(spec.dense_read_bytes)})")
        if calibration is not None and plan.device == "cpu":
            out.append("            " + (f"measured here: {calibration.describe()}" if calibration.describe() else
                                         "assumed figures: no RAM read rate measured yet"))
        if plan.placements:
            best = plan.best_placement
            ways = (f"{p.mode} {rate_range(p.low, p.high)} (bound {rate(p.bound)}, {p.bound_by})"
                    for p in plan.placements)
            out.append("  misses    " + " · ".join(ways)
                       + f" tok/s; best: --on-miss {best.mode}" + (" (the default)" if best.mode == "auto" else "")
                       + ("" if best.mode == on_miss else f"; predicted above with --on-miss {on_miss}, as asked"))
    if plan.refusal is not None:
        out.append(f"  REFUSED   {plan.refusal.message}")
        if not plan.overridden:
            out += _scale_out_lines(spec)
    if advice is not None and not runnable:
        out.append("  advice    none: moechat cannot load this checkpoint (the first line says why); the plan above is "
                   "what it would take")
    elif advice is not None:
        out += _format_lines(advice, expert_format)
    if (plan.ok or plan.overridden) and runnable:
        when = [w for w, cond in (("after the download", not spec.weights_present), ("on that hardware", hw.what_if))
                if cond]
        flags = " ".join(_run_flags(plan, spec, expert_format, on_miss))
        out.append(f"  run with  moechat run {spec.path or spec.name} {flags} --prompt ..."
                   + (f"   ({', '.join(when)})" if when else ""))
    if plan.notes:
        out.append("  notes")
        out += [f"    - {n}" for n in plan.notes]
    return "\n".join(out)


def _scale_out(spec):
    from moechat.engine.plan.scaleout import scale_out

    return scale_out(spec, spec.path or spec.name)


def _scale_out_lines(spec) -> list[str]:
    """Beside a refusal: the GPUs that would serve it with vLLM or SGLang (expert parallel), and their launch lines."""
    from moechat.engine.plan import gib

    s = _scale_out(spec)
    if s.recommended is None:
        return ["  scale out more than 4 nodes of the largest GPUs: beyond what moechat can plan"]
    out = [f"  scale out {gib(s.weights_bytes)} of weights + {gib(s.kv_bytes)} of KV for "
           f"{s.context:,} tokens, served with expert parallelism on any of:"]
    out += [f"            {'*' if o == s.recommended else ' '} {o.describe()}" for o in s.options]
    out.append(f"    vLLM    {s.vllm_command()}")
    out.append(f"    SGLang  {s.sglang_command()}")
    out.append("            then: moechat chat --remote http://HOST:PORT (vLLM's default port 8000, SGLang's 30000)")
    return out


def _format_lines(advice, shown: str) -> list[str]:
    """Every expert format side by side, then the advice and why."""
    out = []
    for i, o in enumerate(advice.options):
        mark = "*" if o.name == advice.recommended else " "
        out.append(f"  {'formats' if i == 0 else '':<8}{mark} {o.name:<6}  {o.describe()}")
    best = advice.option(advice.recommended) if advice.recommended else None
    if best is None:
        out.append(f"  advice    {advice.reason}")
    else:
        out.append(f"  advice    {best.headline()}")
        out.append(f"            ({advice.reason})")
        if shown != best.name:
            out.append(f"            the plan above is {shown}'s, as asked")
    return out


def plan_for_run(model_dir, *, device: str, dtype: str | None, context: int | None,
                 expert_format: str | None = None, embeddings: str = "device"):
    """The plan `moechat run` takes its cache defaults from, for the device and dtype it will use.

    Planned as `run` allocates: the context it will allocate (never lowered), every KV layer at full
    length (the KV cache has no sliding-window ring yet), sizes in the dtype the loader picks (--dtype, else
    config.json's, else float32: a config that names none, like gpt-oss's, loads its bf16 tensors as float32),
    and experts in `expert_format` (int8/int4: the repacked form every tier holds).
    """
    from moechat.engine.errors import MoechatError
    from moechat.engine.plan.hardware import probe
    from moechat.engine.load.loader import DTYPES, read_model_config, resolve_dtype
    from moechat.engine.plan import DEFAULT_CONTEXT, FLOAT_SIZES, Preferences, make_plan, read_model_spec

    try:
        spec = read_model_spec(model_dir)
        torch_dtype = resolve_dtype(dtype, read_model_config(model_dir)[1])
    except MoechatError:
        return None  # not plannable (a dense model, a broken config...): the loader says why, in its words
    name = next(n for n, d in DTYPES.items() if d == torch_dtype)
    try:
        spec = spec.in_dtype(FLOAT_SIZES[name], name).in_format(expert_format)
    except MoechatError:
        return None  # a format this model cannot take: the loader says why
    ctx = min(context or DEFAULT_CONTEXT, spec.max_context)
    dev = "cpu" if device.startswith("cpu") else device
    if dev != "cpu" and not (dev == "cuda" or dev.startswith("cuda:")):
        return None  # a device the planner does not know: keep today's defaults
    # On the CPU no GPU is planned for: skip NVML and torch.cuda (~0.05 s of `run`'s start-up)
    hw = probe(model_dir, nvml=None, cuda=None) if dev == "cpu" else probe(model_dir)
    if dev != "cpu" and hw.gpu(int(dev.partition(":")[2] or 0)) is None:
        return None  # a GPU the probe cannot see: keep today's defaults
    return make_plan(spec, hw, Preferences(context=ctx, device=dev, windowed_kv=False, override=True,
                                           repacked=repacked_formats(model_dir), embeddings=embeddings))


def cache_defaults(model_dir, *, device: str, dtype: str | None, context: int | None, expert_slots: int | None,
                   ram_cache_mb: int | None, warn=None,
                   expert_format: str | None = None, embeddings: str = "device") -> tuple[int | None, int | None]:
    """(slots, RAM-cache bytes) for `moechat run` and the app: what the user left unset comes from the memory
    plan when the experts do not all fit the compute device (RAM on a CPU); else it stays unset (resident).
    The plan is made in `expert_format`: int4 experts are a third of bf16's, so the same memory holds 3x the slots."""
    ram_cache_bytes = None if ram_cache_mb is None else ram_cache_mb << 20
    if expert_slots is not None and ram_cache_mb is not None:
        return expert_slots, ram_cache_bytes
    plan = plan_for_run(model_dir, device=device, dtype=dtype, context=context, expert_format=expert_format,
                        embeddings=embeddings)
    if plan is not None and plan.needs_cache:
        if plan.refusal is not None and warn is not None:
            warn(f"{plan.refusal.message}; loading anyway")
        expert_slots = expert_slots or plan.expert_slots
        if ram_cache_mb is None:
            ram_cache_bytes = plan.ram_cache_bytes
    return expert_slots, ram_cache_bytes


