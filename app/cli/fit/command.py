"""The `moechat fit` subcommand: its flags (`add_fit_parser`) and `run_fit`, which reads the model, probes the machine
(or a what-if one), plans every expert format, and prints the report (report.py) or, with --json, one JSON object;
its exit status is the headline's (0 runs, 3 cannot run, 0 with --force) and 1 on an error (a typed MoechatError).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from ..argtypes import context_length, say_clamp  # no torch
from ..argtypes import non_negative_float as _non_negative_float
from .gather import (
    EXPERT_FORMATS,
    _calibration,
    _dense_plans,
    _host_rate,
    _load_curve,
    _plan_on_free_ram,
    checked_fit_spec,
    disk_target,
    least_free_ram,
    machine_rates,
    repacked_formats,
    why_not_runnable,
)
from .report import EXIT_REFUSED, _run_flags, _scale_out, format_plan, headline


def add_fit_parser(subparsers) -> argparse.ArgumentParser:
    fit = subparsers.add_parser(
        "fit", help="plan what fits where and predict decode speed, before or after download",
        description="Plan a model on this machine (or a what-if machine): dense weights, KV cache, expert slots, "
                    "RAM and disk tiers, predicted decode tok/s and its bound, each with its reason. The first line "
                    "says runs, runs with ... or cannot run: why (exit 3). Memory sizes are GiB, bandwidths GB/s.")
    fit.add_argument("model", metavar="MODEL", help="model directory (config.json alone is enough), a .gguf file, or "
                     "a Hub repo id (org/name: read from the Hub's metadata, without downloading the weights; "
                     "org/name:Q4_K_M: one GGUF quant, from its header alone)")
    fit.add_argument("--quant", metavar="QUANT", help="the GGUF quant of a Hub repo to plan (as MODEL:QUANT)")
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
    from ..argtypes import positive_int

    value = positive_int(text)
    if value > 4096:
        raise argparse.ArgumentTypeError(f"expected at most 4096 cores, got {value}")
    return value


def _preset(kind: str):
    """An argparse type for --gpu/--ram/--link: the preset itself (engine/plan/hardware/presets.py's tables, imported
    only when the flag is given), or one usage line listing every name."""
    def parse(text: str):
        from moechat.engine.plan.hardware import GPU_PRESETS, LINK_PRESETS, RAM_PRESETS

        table = {"gpu": GPU_PRESETS, "ram": RAM_PRESETS, "link": LINK_PRESETS}[kind]
        preset = table.get(text.strip().lower())
        if preset is None:
            raise argparse.ArgumentTypeError(f"no {kind} preset {text!r}: use one of {', '.join(table)}")
        return preset

    parse.__name__ = f"{kind} preset"
    return parse


def run_fit(args: argparse.Namespace) -> int:
    from moechat.engine.errors import ConfigError
    from moechat.engine.plan import FLOAT_SIZES, Preferences
    from moechat.engine.plan.format_plan import plan_formats
    from moechat.engine.plan.hardware import probe
    from moechat.engine.plan.hub import default_cache_dir

    if args.quant:
        from moechat.engine.plan.hub import split_quant

        repo, named = split_quant(args.model)
        if named is not None and named.upper() != args.quant.upper():
            raise ConfigError(f"{args.model} names quant {named} and --quant says {args.quant}: give one of them")
        args.model = f"{repo}:{args.quant}"
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
