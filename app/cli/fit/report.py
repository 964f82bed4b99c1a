"""The text `moechat fit` prints: the first line's verdict and exit status (`headline`), then the model, the
hardware and every rate with its source, the plan's table (item, size, where, why), the predicted decode and its
bound, the placements of misses, a refusal with the scale-out beside it, the expert formats side by side, the `run`
flags that reproduce the plan, and the notes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .gather import DenseAlternative

EXIT_REFUSED = 3


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


def _rate_lines(rates: dict) -> list[str]:
    from moechat.engine.plan import GPU_EFFICIENCY

    out = []
    for name, r in rates.items():
        text = f"{name} {r.gbps:.3g} GB/s"
        if name == "GPU memory":
            text += f" peak (decode reads at {GPU_EFFICIENCY:.0%} of it: {r.gbps * GPU_EFFICIENCY:.3g} GB/s)"
        out.append(f"{'' if out else '  rates':<12}{text}: {r.source}")
    return out


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
