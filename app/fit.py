"""`moechat fit MODEL`: will this model run here, with what settings, and how fast, in numbers.

MODEL is a local model directory (complete weights: exact sizes from the safetensors headers; only
config.json, perhaps with the index: estimates from the config), or a Hub repo id: its downloaded snapshot,
else config.json and the safetensors headers read from the Hub (a ranged read per shard, no weights; with
HF_HUB_OFFLINE, the config.json in the local cache). `--vram-gb`, `--ram-gb`, `--disk-gb`, `--link-gbps` and
`--context` ask "what if" without that hardware. Exit status: 0 when it fits, 3 when the plan refuses
(the message names the shortfall and the cheapest fix), 1 on an error such as a missing config.

Start-up imports neither torch nor the engine; a config-only directory is planned without torch at all.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .argtypes import non_negative_float as _non_negative_float
from .argtypes import positive_int as _positive_int

EXIT_REFUSED = 3
EXPERT_FORMATS = ("native", "int8", "int4")  # moechat run --expert-format (engine/format_plan.py FORMATS)


def add_fit_parser(subparsers) -> argparse.ArgumentParser:
    fit = subparsers.add_parser(
        "fit", help="plan what fits where and predict decode speed, before or after download",
        description="Plan a model on this machine (or a what-if machine): dense weights, KV cache, expert slots, "
                    "RAM and disk tiers, predicted decode tok/s and its bound, each with its reason. Exits 3 when it "
                    "does not fit. Memory sizes are GiB, bandwidths GB/s.")
    fit.add_argument("model", metavar="MODEL", help="model directory (config.json alone is enough) or a Hub repo id "
                     "(org/name: read from the Hub's metadata, without downloading the weights)")
    fit.add_argument("--json", action="store_true", help="print the plan, model spec and hardware as one JSON object")
    fit.add_argument("--context", type=_positive_int, metavar="N", help="tokens of KV cache to plan for (default: "
                     "4096, lowered if needed; with --prefer context, the model's maximum)")
    fit.add_argument("--vram-gb", type=_non_negative_float, metavar="GIB", help="what if the GPU had this much free "
                     "memory (0: no GPU)")
    fit.add_argument("--ram-gb", type=_non_negative_float, metavar="GIB", help="what if this much RAM were available")
    fit.add_argument("--disk-gb", type=_non_negative_float, metavar="GIB", help="what if this much disk were free")
    fit.add_argument("--link-gbps", type=_non_negative_float, metavar="GBPS", help="host->GPU link bandwidth, usable "
                     "GB/s (PCIe 4.0 x16 ~ 25)")
    fit.add_argument("--disk-read-gbps", type=_non_negative_float, metavar="GBPS", help="disk read bandwidth for "
                     "streamed experts (default: 2, an NVMe SSD)")
    fit.add_argument("--prefer", choices=["speed", "context"], default="speed", help="spare device memory goes to "
                     "expert slots (speed) or to a longer context (default: %(default)s)")
    fit.add_argument("--margin", type=_non_negative_float, default=0.05, metavar="FRACTION", help="fraction of each "
                     "memory total to leave free (default: %(default)s)")
    fit.add_argument("--device", help="plan for cpu, cuda or cuda:N (default: the GPU with the most free memory, "
                     "else the CPU)")
    fit.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="plan in this compute dtype, as "
                     "moechat run --dtype would (default: the checkpoint's own formats)")
    fit.add_argument("--hit-curve", metavar="PATH", help="miss-ratio curve JSON ({\"points\": [[fraction, "
                     "hit_rate], ...]} or bench/replay.py --json output) instead of the conservative default")
    fit.add_argument("--expert-format", choices=list(EXPERT_FORMATS), help="show the plan in this expert format "
                     "(native: as the checkpoint ships them; int8, int4: converted once by moechat); default: the "
                     "recommended one. Every format is planned and compared either way")
    fit.add_argument("--force", action="store_true", help="show the plan that loading anyway would use, and exit 0 "
                     "even when it does not fit")
    return fit


def _runnable(model_type: str) -> bool:
    """moechat runs a model_type registered in engine/models' ARCHITECTURES (read without importing torch)."""
    from moechat.engine.catalog import SUPPORTED_TYPES

    return model_type in SUPPORTED_TYPES


def _load_curve(path: str | None, num_experts: int):
    if path is None:
        return None
    from moechat.engine.errors import ConfigError
    from moechat.engine.files import read_json_file
    from moechat.engine.plan import MissRatioCurve

    data = read_json_file(path, "miss-ratio curve")  # a FIFO refused, deep nesting typed
    try:
        return MissRatioCurve.from_json(data, num_experts)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
        raise ConfigError(f"{path}: not a miss-ratio curve ({e})") from None


def run_fit(args: argparse.Namespace) -> int:
    from moechat.engine.errors import ConfigError
    from moechat.engine.format_plan import plan_formats
    from moechat.engine.hardware import probe
    from moechat.engine.hub import default_cache_dir
    from moechat.engine.plan import FLOAT_SIZES, Preferences

    from .pull import fit_spec

    spec = fit_spec(args.model)
    if args.dtype:
        spec = spec.in_dtype(FLOAT_SIZES[args.dtype], args.dtype)
    where = spec.path or (args.model if Path(args.model).expanduser().exists() else default_cache_dir())
    hw = probe(where).with_overrides(vram_gb=args.vram_gb, ram_gb=args.ram_gb,
                                                       disk_gb=args.disk_gb, link_gbps=args.link_gbps)
    if args.margin >= 1:
        raise ConfigError(f"--margin {args.margin:g}: a fraction below 1, e.g. 0.05")
    prefs = Preferences(context=args.context, prefer=args.prefer, device=args.device, margin=args.margin,
                        hit_curve=_load_curve(args.hit_curve, spec.num_experts), disk_read_gbps=args.disk_read_gbps,
                        override=args.force, repacked=repacked_formats(spec.path))
    advice = plan_formats(spec, hw, prefs)
    chosen = advice.option(args.expert_format) if args.expert_format else advice.best
    if chosen.plan is None:
        raise ConfigError(f"--expert-format {chosen.name}: {chosen.note}")
    plan = chosen.plan
    runnable = _runnable(spec.model_type)
    if args.json:
        print(json.dumps({"model": args.model, "fits": plan.ok, "runnable": runnable, "expert_format": chosen.name,
                          "plan": plan.to_json(), "spec": spec.to_json(), "formats": advice.to_json(),
                          "hardware": hw.to_json(),
                          "scale_out": None if plan.ok else _scale_out(spec).to_json(),
                          "run_flags": _run_flags(plan, spec, chosen.name) if plan.ok or plan.overridden else None},
                         indent=1))
    else:
        print(format_plan(plan, spec, hw, runnable, advice, chosen.name))
    if plan.ok or plan.overridden:
        return 0
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


def _run_flags(plan, spec, expert_format: str = "native") -> list[str]:
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
    if expert_format != "native":
        flags += ["--expert-format", expert_format]
    return flags


def format_plan(plan, spec, hw, runnable: bool, advice=None, expert_format: str = "native") -> str:
    from moechat.engine.plan import gib

    verdict = "fits" if plan.ok else ("does NOT fit (loading anyway: --force)" if plan.overridden else "does NOT fit")
    if expert_format != "native":
        verdict += f" with --expert-format {expert_format}"
        if advice is not None and advice.recommended == expert_format:
            verdict += " (recommended)"
    out = [f"moechat fit {spec.name} ({spec.model_type}): {verdict}"]
    ts = " + ".join(f"{t.name} {list(t.shape)} {t.dtype}" for t in spec.expert_tensors)
    out.append(f"  model     {spec.num_layers} layers, {spec.num_moe_layers} MoE x {spec.num_experts} experts, "
               f"top-{spec.top_k}" + (f", {spec.shared_experts} shared" if spec.shared_experts else "")
               + f"; {spec.total_experts:,} experts = {gib(spec.all_experts_bytes)}")
    out.append(f"            {spec.expert_format_line()}; stored as {spec.expert_format}")
    out.append(f"            one expert: {ts}")
    out.append(f"            dense {gib(spec.dense_bytes)}; KV {gib(spec.kv_bytes_per_token())}/token "
               f"({spec.kv_kind}); checkpoint {gib(spec.checkpoint_bytes)}; sizes from {spec.source}"
               + (" (ESTIMATES)" if spec.estimated else " (exact)"))
    out.append(f"            moechat run: {'supported' if runnable else 'not supported yet (planning only)'}")
    def mark(source: str) -> str:
        return " (what-if)" if source == "what-if" else ""

    gpus = "; ".join(f"{g.label} {g.name} {gib(g.free_bytes)} free{mark(g.source)}" for g in hw.gpus if g.usable)
    disk = "disk unknown" if hw.disk is None else f"disk {gib(hw.disk.free_bytes)} free on {hw.disk.path}"
    ram = f"RAM {gib(hw.ram.available_bytes)} available{mark(hw.ram.source)}"
    out.append(f"  hardware  {gpus or 'no usable GPU'}; {ram}; {disk}{mark(hw.disk.source if hw.disk else '')}")
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
        out.append(f"  decode    {d.low:.1f}-{d.high:.1f} tok/s predicted   (bound {d.bound:.1f} tok/s, set by "
                   f"{d.bound_by}; formula in docs/plan.md)")
        if plan.placements:
            best = plan.best_placement
            ways = (f"{p.mode} {p.low:.1f}-{p.high:.1f} (bound {p.bound:.1f}, {p.bound_by})" for p in plan.placements)
            out.append("  misses    " + " · ".join(ways)
                       + f" tok/s; best: --on-miss {best.mode}" + (" (the default)" if best.mode == "auto" else ""))
    if plan.refusal is not None:
        out.append(f"  REFUSED   {plan.refusal.message}")
        if not plan.overridden:
            out += _scale_out_lines(spec)
    if advice is not None:
        out += _format_lines(advice, expert_format)
    if (plan.ok or plan.overridden) and runnable:
        when = [w for w, cond in (("after the download", not spec.weights_present), ("on that hardware", hw.what_if))
                if cond]
        flags = " ".join(_run_flags(plan, spec, expert_format))
        out.append(f"  run with  moechat run {spec.path or spec.name} {flags} --prompt ..."
                   + (f"   ({', '.join(when)})" if when else ""))
    if plan.notes:
        out.append("  notes")
        out += [f"    - {n}" for n in plan.notes]
    return "\n".join(out)


def _scale_out(spec):
    from moechat.engine.scaleout import scale_out

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
                 expert_format: str | None = None):
    """The plan `moechat run` takes its cache defaults from, for the device and dtype it will use.

    Planned as `run` allocates: the context it will allocate (never lowered), every KV layer at full
    length (the KV cache has no sliding-window ring yet), sizes in the dtype the loader picks (--dtype, else
    config.json's, else float32: a config that names none, like gpt-oss's, loads its bf16 tensors as float32),
    and experts in `expert_format` (int8/int4: the repacked form every tier holds).
    """
    from moechat.engine.errors import MoechatError
    from moechat.engine.hardware import probe
    from moechat.engine.loader import DTYPES, read_model_config, resolve_dtype
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
    hw = probe(model_dir)
    if dev != "cpu" and hw.gpu(int(dev.partition(":")[2] or 0)) is None:
        return None  # a GPU the probe cannot see: keep today's defaults
    return make_plan(spec, hw, Preferences(context=ctx, device=dev, windowed_kv=False, override=True,
                                           repacked=repacked_formats(model_dir)))


def cache_defaults(model_dir, *, device: str, dtype: str | None, context: int | None, expert_slots: int | None,
                   ram_cache_mb: int | None, warn=None,
                   expert_format: str | None = None) -> tuple[int | None, int | None]:
    """(slots, RAM-cache bytes) for `moechat run` and the app: what the user left unset comes from the memory
    plan when the experts do not all fit the compute device (RAM on a CPU); else it stays unset (resident).
    The plan is made in `expert_format`: int4 experts are a third of bf16's, so the same memory holds 3x the slots."""
    ram_cache_bytes = None if ram_cache_mb is None else ram_cache_mb << 20
    if expert_slots is not None and ram_cache_mb is not None:
        return expert_slots, ram_cache_bytes
    plan = plan_for_run(model_dir, device=device, dtype=dtype, context=context, expert_format=expert_format)
    if plan is not None and plan.needs_cache:
        if plan.refusal is not None and warn is not None:
            warn(f"{plan.refusal.message}; loading anyway")
        expert_slots = expert_slots or plan.expert_slots
        if ram_cache_mb is None:
            ram_cache_bytes = plan.ram_cache_bytes
    return expert_slots, ram_cache_bytes


def warn(message: str) -> None:
    print(f"moechat: warning: {message}", file=sys.stderr)
