"""`make_plan(spec, hardware, preferences) -> MemoryPlan`: what goes where, why, and how fast decode will be.

Dense weights, KV cache and a workspace reserve go on the compute device (a GPU, or RAM on a CPU-only box); the rest
of its budget becomes C expert slots; every expert then lives in pinned RAM if all fit, else in a RAM cache over the
disk tier (the shards). Packed experts are planned as packed: GPT-OSS-20B's MXFP4 expert is 13.2 MB (bf16: 49.8 MB),
so an 8 GiB GPU holds 285 slots where bf16 would hold 76. Pure: same inputs, same plan.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

from ..errors import ConfigError
from .hardware import (
    ASSUMED_DISK_GBPS,
    ASSUMED_GPU_MEMORY_GBPS,
    ASSUMED_LINK_GBPS,
    ASSUMED_RAM_GBPS,
    GB,
    GiB,
    GpuInfo,
    Hardware,
)
from .memory_plan import (
    CONTEXT_STEP,
    CUDA_CONTEXT_BYTES,
    MIN_CONTEXT,
    ON_MISS_MODES,
    PREFILL_CHUNK,
    PROCESS_RAM_CPU,
    PROCESS_RAM_GPU,
    REPACK_DIR_HINT,
    Decision,
    MemoryPlan,
    Preferences,
    Refusal,
)
from .rates import GPU_EFFICIENCY, MissPlacement, _decode, _placements, rate, rate_range
from .spec import CONVERTIBLE_FORMATS, DEFAULT_CONTEXT, ModelSpec, gib


def _workspace(spec: ModelSpec, context: int, chunk: int, on_gpu: bool) -> tuple[int, str]:
    """Activation/workspace reserve for a prefill chunk of `chunk` tokens, and its one-line breakdown."""
    T = min(chunk, context)
    H, I, K = spec.hidden_size, spec.expert_intermediate, spec.top_k
    # fp32 upper bound: ~8 [T, H] tensors (hidden, residual, norm, q/k/v, attention out) + the K experts' [T, 2I]
    # gate/up intermediates, twice for the SwiGLU product; on a CPU at least what the layer call holds at once
    # (engine/layers/experts.py: each pair's fp32 contrib row [TK, H], and native_prefill_int.c's gate/up [TK, 2I],
    # down [TK, H] fp32 and the pairs' quantized inputs [TK, max(H, I)] bytes)
    experts = 4 * T * 4 * K * I
    if not on_gpu:
        experts = max(experts, 4 * T * K * (2 * I + 2 * H) + T * K * max(H, I))
    act = 4 * T * 8 * H + experts
    # CPU prefill: SDPA's flash kernel tiles the scores (a [32, 1024, 8192] fp32 score tensor would be 1 GiB; the
    # call grows the process by 44 MiB), but the keys and values it reads are expanded to every query head, one
    # layer at a time, for the whole context (engine/models/base.py, mla.py)
    expanded = 0 if on_gpu else spec.prefill_kv_expanded_elems * context * max(2, spec.float_bytes)
    base = CUDA_CONTEXT_BYTES if on_gpu else 0
    parts = [f"CUDA context {gib(base)}"] if base else []
    parts.append(f"{T}-token prefill activations {gib(act)}")
    if expanded:
        parts.append(f"K/V expanded per head {gib(expanded)}")
    return base + act + expanded, " + ".join(parts)


def prefill_chunk_for(spec: ModelSpec, on_gpu: bool, asked: int | None) -> int:
    """The prefill chunk the engine will run with (engine/runtime/generate.py default_prefill_chunk): as asked, else
    512 on a GPU and, on a CPU, the most whose fp32 activations stay in this machine's last-level cache."""
    if asked:
        return asked
    if on_gpu:
        return PREFILL_CHUNK
    from ..quant.prefill import machine_chunk_size

    return machine_chunk_size(spec.hidden_size, spec.expert_intermediate)


def _pick_device(hw: Hardware, prefs: Preferences) -> tuple[GpuInfo | None, str]:
    dev = prefs.device
    if dev == "cpu":
        return None, "CPU (asked for)"
    if dev is None:
        g = hw.best_gpu()
        if g is None:
            return None, "no usable GPU" + (" (see notes)" if hw.gpu_notes else "")
        if g.source == "what-if":
            return g, "what-if"
        n = len([x for x in hw.gpus if x.usable])
        return g, "the GPU with the most free memory" + (f" of {n}" if n > 1 else "")
    m = re.fullmatch(r"cuda(?::(\d+))?", dev)
    if not m:
        raise ConfigError(f"device {dev!r}: use cpu, cuda or cuda:N")
    idx = int(m.group(1) or 0)
    g = hw.gpu(idx)
    if g is None or not g.usable:
        found = ", ".join(f"{x.label} {x.name}" for x in hw.gpus) or "none"
        raise ConfigError(f"device {dev}: no such usable GPU (found: {found}); "
                          "pass --vram-gb to plan for one anyway")
    return g, f"{dev} (asked for)"


def make_plan(spec: ModelSpec, hw: Hardware, prefs: Preferences = Preferences()) -> MemoryPlan:  # noqa: B008 (frozen)
    """Where everything goes, why, and how fast decode will be. Pure: same inputs, same plan."""
    if prefs.prefer not in ("speed", "context"):
        raise ConfigError(f"prefer {prefs.prefer!r}: use speed or context")
    if prefs.on_miss not in ON_MISS_MODES:
        raise ConfigError(f"--on-miss {prefs.on_miss!r}: use one of {', '.join(ON_MISS_MODES)}")
    if prefs.embeddings not in ("auto", "host", "device"):
        raise ConfigError(f"--embeddings {prefs.embeddings!r}: use auto, host or device")
    gpu, device_why = _pick_device(hw, prefs)
    if gpu is not None:
        spec = spec.for_gpu()  # what a GPU holds where it differs (a GGUF's packed head and table are dequantized)
    if prefs.embeddings != "device" and (gpu is None or not spec.embedding_bytes):
        prefs = replace(prefs, embeddings="device")  # a CPU's device is its RAM; a tied table is the LM head too
    if prefs.embeddings == "auto":
        return _choose_embeddings(spec, hw, prefs)
    host_embed = spec.embedding_bytes if prefs.embeddings == "host" else 0
    kind = "gpu" if gpu else "cpu"
    notes = list(spec.notes) + list(hw.all_notes)
    decisions: list[Decision] = []
    eb, N, K, Lm = spec.expert_bytes, spec.total_experts, spec.top_k, spec.num_moe_layers
    elem = spec.float_bytes

    ram_total = hw.ram.total_bytes or 0
    ram_avail = hw.ram.available_bytes
    if ram_avail is None:
        notes.append("RAM size unknown: planning with none; pass --ram-gb")
        ram_avail = 0
    ram_budget = int(ram_avail - prefs.margin * ram_total)
    process = (PROCESS_RAM_GPU if gpu else PROCESS_RAM_CPU) + host_embed  # a host embedding table lives in RAM
    if gpu:
        dev_label, dev_name = gpu.label, gpu.name
        total = gpu.total_bytes or gpu.free_bytes
        budget = int(gpu.free_bytes - prefs.margin * total)
        link = gpu.link_gbps
        if link is None:
            link = ASSUMED_LINK_GBPS
            notes.append(f"PCIe link not reported: {link:g} GB/s assumed (PCIe 4.0 x16); pass --link-gbs or --link "
                         "PRESET")
        devbw = gpu.memory_gbps
        if devbw is None:
            devbw = ASSUMED_GPU_MEMORY_GBPS
            # the table's figure is the peak x GPU_EFFICIENCY: say both, so the note and the table agree
            notes.append(f"GPU memory bandwidth not reported: {devbw:g} GB/s peak assumed, so decode reads at "
                         f"{devbw * GPU_EFFICIENCY:g} GB/s ({GPU_EFFICIENCY:.0%} of it, the figure the table uses); "
                         "pass --gpu PRESET")
        why = " (what-if)" if device_why == "what-if" else f": {device_why}"
        decisions.append(Decision("device", total, dev_label,
                                  f"{gpu.name}, {gib(gpu.free_bytes)} free of {gib(total)}{why}; budget "
                                  f"{gib(budget)} after a {prefs.margin:.0%} margin"))
    else:
        dev_label, dev_name = "cpu", "CPU"
        budget = ram_budget - process
        link = None
        devbw = prefs.host_read_gbps or ASSUMED_RAM_GBPS
        decisions.append(Decision("device", ram_avail, "cpu",
                                  f"CPU: {device_why}; the compute device is RAM, {gib(ram_avail)} available: budget "
                                  f"{gib(budget)} after a {prefs.margin:.0%} margin and {gib(process)} for the "
                                  "process"))
    diskbw = prefs.disk_read_gbps or ASSUMED_DISK_GBPS

    dense = spec.dense_bytes - host_embed  # on the device
    chunk = prefill_chunk_for(spec, bool(gpu), prefs.prefill_chunk)

    def fixed(ctx: int) -> int:
        return (dense + spec.kv_bytes(ctx, windowed=prefs.windowed_kv) + spec.recurrent_state_bytes
                + _workspace(spec, ctx, chunk, bool(gpu))[0])

    max_ctx = spec.max_context
    auto_ctx = prefs.context is None
    # "speed" starts from the default context and gives the rest to slots; "context" starts from the
    # model's maximum. Either way at least one layer's top-k must fit, and a context that was not asked
    # for is lowered until it does.
    want = min(prefs.context or (max_ctx if prefs.prefer == "context" else DEFAULT_CONTEXT), max_ctx)
    c_min = min(N, K)

    first = min(MIN_CONTEXT, want)
    candidates = sorted({first, want, *range(math.ceil(first / CONTEXT_STEP) * CONTEXT_STEP, want, CONTEXT_STEP)})

    def largest_context(slots: int) -> int | None:
        """The longest candidate context that still leaves `slots` expert slots (fixed() grows with context)."""
        def fits(i: int) -> bool:
            return fixed(candidates[i]) + slots * eb <= budget

        if not fits(0):
            return None
        lo, hi = 0, len(candidates) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return candidates[lo]

    refusal_parts: list[Refusal] = []
    context, slots = want, 0
    room = budget - fixed(want)
    ctx_reason = ""
    if room >= c_min * eb:
        slots = min(N, room // eb) if eb else N
        if prefs.context:
            ctx_reason = "as asked" + (f" (capped at the model maximum {max_ctx:,})" if prefs.context > max_ctx else "")
        elif prefs.prefer == "context":
            ctx_reason = f"the model maximum ({max_ctx:,}), preferring context"
        else:
            ctx_reason = f"the default {DEFAULT_CONTEXT:,}" + (", capped at the model maximum" if want < DEFAULT_CONTEXT
                                                               else "")
    else:
        found = largest_context(c_min) if auto_ctx else None
        if found is not None:
            # Exactly top-k slots: the leftover below one context step stays free, so more memory never
            # means fewer slots.
            context, slots = found, c_min
            ctx_reason = f"lowered from {want:,} so that top-k = {c_min} expert slots fit"
        else:
            need = fixed(min(want, MIN_CONTEXT) if auto_ctx else want) + c_min * eb
            refusal_parts.append(_device_refusal(spec, hw, prefs, gpu, budget, need, want, auto_ctx,
                                                 largest_context(c_min), c_min))
            context = min(want, MIN_CONTEXT) if auto_ctx else want
            slots = c_min
    kv = spec.kv_bytes(context, windowed=prefs.windowed_kv)
    ws, ws_detail = _workspace(spec, context, chunk, bool(gpu))
    dev_used = dense + kv + spec.recurrent_state_bytes + ws + slots * eb

    parts = sorted(((w, b) for w, b in spec.dense_parts if b and not (host_embed and w == "embeddings")),
                   key=lambda p: -p[1])  # a host table is in RAM: its line is "embeddings"
    big = [(w, b) for w, b in parts if b >= 0.01 * GiB][:5]
    rest = dense - sum(b for _, b in big)
    shown = " + ".join(f"{w} {b / GiB:.2f}" for w, b in big) + (f" + other {rest / GiB:.2f}" if rest >= 0.005 * GiB
                                                                   else "")
    shown = f"{shown} GiB" if shown else f"{gib(dense)} in all, each part under 0.01 GiB"
    decisions.append(Decision("dense weights", dense, dev_label,
                              f"{shown} ({spec.float_dtype}); every token reads "
                              f"{gib(spec.dense_read_bytes)} of it"))
    kvpt = spec.kv_bytes_per_token()
    kv_full, kv_ring = spec.kv_bytes(context, windowed=False), spec.kv_bytes(context, windowed=True)
    if kv_ring >= kv_full:
        alloc = ""
    elif prefs.windowed_kv:
        alloc = f"; window layers allocated {spec.window} tokens each ({gib(kv_full - kv_ring)} less than full length)"
    else:
        alloc = (f"; every layer allocated full length, as engine/layers/kv_cache.py does (a {spec.window}-token "
                 f"ring on the window layers would need {gib(kv_ring)}, {gib(kv_full - kv_ring)} less)")
    decisions.append(Decision(f"KV cache, {context:,} tokens", kv, dev_label,
                              f"{gib(kvpt)}/token ({spec.kv_kind}: {spec.kv_detail}, {elem} B); context "
                              f"{ctx_reason or 'as far as it fits'}{alloc}"))
    if spec.recurrent_state_bytes:
        decisions.append(Decision("recurrent state", spec.recurrent_state_bytes, dev_label, spec.recurrent_detail))
    decisions.append(Decision("workspace", ws, dev_label, ws_detail))
    frac = slots / N if N else 1.0
    if slots >= N:
        why = (f"all {N:,} experts ({gib(spec.all_experts_bytes)}) fit the {gib(budget)} budget with "
               f"{gib(budget - dev_used)} to spare: no cache, no copies")
    elif refusal_parts:
        why = f"the minimum, top-k = {K}, and it does not fit"
    else:
        share = f"{frac:.1%} of {N:,} experts ({Lm} layers x {spec.num_experts})"
        if ctx_reason.startswith("lowered"):
            why = (f"{slots:,} x {gib(eb)} = {gib(slots * eb)}: held there so the context is as long as it can be; "
                   f"{share}")
        else:
            why = f"{slots:,} x {gib(eb)} = {gib(slots * eb)}: the rest of the {gib(budget)} budget; {share}"
    fmt = spec.expert_format_line(None if refusal_parts else budget - (dense + kv + ws))
    decisions.append(Decision(f"expert slots C = {slots:,}", slots * eb, dev_label, f"{fmt}; {why}"))

    # Host tier.
    all_bytes = spec.all_experts_bytes
    ram_cache: int | None = None
    host = "none"
    ram_experts = 0
    if slots >= N:
        ram_used = process + (dev_used if not gpu else 0)
        decisions.append(Decision("host tier", None, "-", f"not needed: all {N:,} experts ({gib(all_bytes)}) are on "
                                  f"{dev_label}"))
    elif gpu:
        room_ram = ram_budget - process
        if all_bytes <= room_ram:
            host, ram_cache, ram_experts = "all experts in RAM", None, N
            ram_used = process + all_bytes
            decisions.append(Decision("host tier: all experts in RAM", all_bytes, "RAM",
                                      f"{N:,} experts = {gib(all_bytes)} fit the {gib(room_ram)} RAM budget "
                                      f"({gib(ram_avail)} available - {prefs.margin:.0%} - {gib(process)} process); "
                                      "pinned, so misses are DMA copies"))
        else:
            ram_experts = max(0, int(room_ram // eb)) if eb else 0
            ram_cache = ram_experts * eb
            host = "RAM cache" if ram_experts else "disk only"
            ram_used = process + ram_cache
            decisions.append(Decision(f"host tier: RAM cache of {ram_experts:,} experts", ram_cache, "RAM",
                                      f"all experts ({gib(all_bytes)}) exceed the {gib(max(0, room_ram))} RAM "
                                      f"budget; it holds {ram_experts / N:.1%} of them, the rest stream from disk"))
    else:
        host, ram_cache = "none", 0
        ram_used = process + dev_used
        decisions.append(Decision("host tier", None, "-", f"none: on a CPU the {slots:,} slots are the RAM tier; "
                                  f"the other {N - slots:,} experts stream from disk"))
    if gpu and ram_budget < process:
        refusal_parts.append(Refusal("RAM", process, max(0, ram_budget), (
            f"close programs to free {gib(process - ram_budget)} of RAM",),
            detail=f"the process itself needs {gib(process)}, {gib(max(0, ram_budget))} is left after the margin"))
    converted = spec.converted_from is not None
    to_write = converted and spec.format_key not in prefs.repacked
    if converted:
        how = (f"are converted from {spec.converted_from} once, at the first start, into a {gib(all_bytes)} file"
               if to_write else f"converted from {spec.converted_from} are already in a {gib(all_bytes)} file")
        decisions.append(Decision("repacked experts", all_bytes, "disk",
                                  f"--expert-format {spec.format_key}: the {N:,} experts {how} ({REPACK_DIR_HINT}, "
                                  "or --repack-dir), reused on later starts"))
    if slots < N:
        src = ("the repacked file holds" if converted else
               "the shards on disk hold" if spec.weights_present else "the shards (once downloaded) hold")
        decisions.append(Decision("disk tier", all_bytes, "disk",
                                  f"{src} every expert ({gib(all_bytes)}); read at {diskbw:g} GB/s "
                                  f"({'given' if prefs.disk_read_gbps else 'assumed NVMe'})"))

    # Disk: a model that is not (fully) downloaded needs room for the rest of it, and converted experts for the
    # repacked file (counted on the same disk; an existing file is reused, so a second start needs nothing).
    disk_free = hw.disk.free_bytes if hw.disk else None
    download = 0 if spec.weights_present else max(0, spec.checkpoint_bytes - spec.present_bytes)
    disk_need = download + (all_bytes if to_write else 0)
    where = hw.disk.describe() if hw.disk else "disk"
    if download:
        decisions.append(Decision("download", download, "disk",
                                  f"{gib(download)} of weights to download"
                                  f"{'' if disk_free is None else f'; {gib(disk_free)} free on {where}'}"))
    if disk_need and disk_free is not None and disk_free < disk_need:
        fixes = [f"free {gib(disk_need - disk_free)} on {where}"]
        if to_write:
            fixes.append(f"--repack-dir on a disk with {gib(all_bytes)} free")
            if download <= disk_free:
                fixes.append("the native format (no repacked file)")
        if download > disk_free and spec.format_key == "dense" and spec.expert_bits >= 16:
            fixes.append(f"an FP8 checkpoint of this model, where one is published (about "
                         f"{gib(spec.fp8_checkpoint_bytes())}; moechat loads block-FP8 as shipped)")
        fixes.append(f"--disk-gb {math.ceil(disk_need / GiB)} to plan for a disk with that much free")
        if download and to_write:
            needs = f"the download ({gib(download)}) and the repacked experts ({gib(all_bytes)}) need"
        else:
            needs = "the download needs" if download else "the repacked experts need"
        refusal_parts.append(Refusal("disk", disk_need, disk_free, tuple(fixes),
                                     detail=f"{needs} {gib(disk_need)}, {gib(disk_free)} free on {where}"))
    if not download and disk_free is not None and hw.disk:
        notes.append(f"weights already on disk ({gib(spec.checkpoint_bytes)}): no disk needed for them; "
                     f"{gib(disk_free)} free on {where}")

    refusal = None
    if refusal_parts:
        first = refusal_parts[0]
        refusal = replace(first, also=tuple(r.message for r in refusal_parts[1:]))
    overridden = refusal is not None and prefs.override
    decode = None
    if refusal is None or overridden:
        decode = _decode(spec, kind, context, slots, ram_experts if gpu else 0, link, devbw, diskbw,
                         prefs.hit_curve, None if gpu else prefs.cpu_layer_s)
        hit = (f"{decode.hit_rate_low:.1%}" if decode.hit_rate_low == decode.hit_rate_high
               else f"{decode.hit_rate_low:.1%}-{decode.hit_rate_high:.1%}")
        decisions.append(Decision("expected hit rate", None, "-", f"{hit} at C = {slots:,} ({frac:.1%} of experts): "
                                  f"{decode.hit_source}"))
    placements: tuple[MissPlacement, ...] = ()
    hostbw = prefs.host_read_gbps or ASSUMED_RAM_GBPS
    host_src = prefs.host_read_source or ("given" if prefs.host_read_gbps else "assumed")
    if decode is not None and gpu and slots < N and ram_experts:
        placements = _placements(spec, decode, hostbw)
    load_decode = decode
    if placements:  # the headline, the formats and --json all predict the mode `run` will use
        chosen = next(p for p in placements if p.mode == prefs.on_miss)
        decode = replace(decode, low=chosen.low, high=chosen.high, bound=chosen.bound, bound_by=chosen.bound_by,
                         on_miss=chosen.mode)
    if decode is not None:
        moved = []
        if load_decode.link_bytes_low:
            moved.append(f"{load_decode.link_bytes_high / GB:.2f}-{load_decode.link_bytes_low / GB:.2f} GB over the "
                         f"{link:.3g} GB/s link" + ("" if decode.on_miss in (None, "load") else " if every miss loads"))
        if decode.disk_bytes_low:
            moved.append(f"{decode.disk_bytes_high / GB:.2f}-{decode.disk_bytes_low / GB:.2f} GB from disk")
        mode = "" if decode.on_miss is None else f" with --on-miss {decode.on_miss}"
        decisions.append(Decision("decode", None, "-",
                                  f"{rate_range(decode.low, decode.high)} tok/s predicted{mode}; bound "
                                  f"{rate(decode.bound)} tok/s ({decode.bound_by}); per token "
                                  f"{decode.device_bytes / GB:.2f} GB of {dev_label} reads at "
                                  f"{decode.device_gbps:.0f} GB/s"
                                  + (f" ({spec.format_key} experts compute at {decode.compute_efficiency:.0%} of "
                                     "that rate today)" if decode.compute_efficiency < 1 else "")
                                  + ("; " + ", ".join(moved) if moved else "")))
    if placements:
        load, host_p = placements[0], placements[1]
        decisions.append(Decision("where misses run", None, "-",
                                  f"load {rate_range(load.low, load.high)} tok/s (bound {rate(load.bound)}, "
                                  f"{load.bound_by})"
                                  f" | host {rate_range(host_p.low, host_p.high)} (bound {rate(host_p.bound)}, "
                                  f"{host_p.bound_by}; {host_p.host_experts:.0f} experts/token on the CPU at "
                                  f"{hostbw:.3g} GB/s, {host_src}) | auto: per miss the cheaper, "
                                  f"at least the better ({rate_range(placements[2].low, placements[2].high)})"))
    if overridden:
        decisions.append(Decision("override", None, "-", f"loading anyway as asked: {refusal.message}"))
    return MemoryPlan(
        model=spec.name, device=dev_label, device_name=dev_name, context=context, expert_slots=slots,
        total_experts=N, expert_bytes=eb, host_tier=host, ram_cache_bytes=ram_cache, dense_bytes=dense, kv_bytes=kv,
        workspace_bytes=ws, device_budget_bytes=budget, device_used_bytes=dev_used, ram_budget_bytes=ram_budget,
        ram_used_bytes=ram_used, disk_free_bytes=disk_free, disk_needed_bytes=disk_need, decisions=tuple(decisions),
        decode=decode, refusal=refusal, overridden=overridden, estimated=spec.estimated, notes=tuple(notes),
        placements=placements, embeddings=prefs.embeddings)


def _choose_embeddings(spec: ModelSpec, hw: Hardware, prefs: Preferences) -> MemoryPlan:
    """A GPU with an untied embedding table: plan it on the device and on the host, keep the host plan when it has
    more slots (and is not refused where the device plan is not), and say the trade in slots and tok/s."""
    dev = make_plan(spec, hw, replace(prefs, embeddings="device"))
    host = make_plan(spec, hw, replace(prefs, embeddings="host"))
    use_host = host.expert_slots > dev.expert_slots and (host.ok or not dev.ok)
    pick = host if use_host else dev

    def speed(p: MemoryPlan) -> str:
        return f"{rate_range(p.decode.low, p.decode.high)} tok/s" if p.decode is not None else "no estimate"

    gained = host.expert_slots - dev.expert_slots
    if use_host:
        row = spec.hidden_size * spec.float_bytes
        why = (f"{gib(spec.embedding_bytes)} table in RAM, each token's row ({row:,} B) "
               f"gathered there and copied in: +{gained} slots ({dev.expert_slots} -> {host.expert_slots}), "
               f"{speed(dev)} -> {speed(host)}; --embeddings device keeps it on the GPU")
    elif gained <= 0:
        why = f"on the device: every expert already fits, or moving the {gib(spec.embedding_bytes)} table buys no slot"
    else:
        why = (f"on the device: in RAM it would buy {gained} slots but {host.refusal.message if host.refusal else ''}"
               if not host.ok else f"on the device ({speed(dev)}; host would give {speed(host)})")
    line = Decision("embeddings", spec.embedding_bytes, "cpu" if use_host else pick.device, why)
    return replace(pick, decisions=(*pick.decisions, line))


def _device_refusal(spec: ModelSpec, hw: Hardware, prefs: Preferences, gpu: GpuInfo | None, budget: int,
                    need: int, want: int, auto_ctx: bool, ctx_fit: int | None, c_min: int) -> Refusal:
    """Short of device memory: the fixes, cheapest first."""
    short = need - budget
    fixes = []
    if not auto_ctx and ctx_fit is not None:
        fixes.append(f"lower --context to {ctx_fit:,}")
    if gpu is not None:
        others = (gpu.total_bytes or 0) - (gpu.free_bytes or 0)
        if others >= short:
            fixes.append(f"close programs using the GPU (they hold {gib(others)})")
        if prefs.device != "cpu":
            cpu_plan = make_plan(spec, hw, replace(prefs, device="cpu", override=False))
            if cpu_plan.ok:
                fixes.append(f"run on the CPU (--device cpu): RAM holds it, ~"
                             f"{rate_range(cpu_plan.decode.low, cpu_plan.decode.high)} tok/s")
    if spec.format_key == "dense" and spec.converted_from is None:  # converting is measured from full precision
        for name in CONVERTIBLE_FORMATS:
            try:
                small = spec.in_format(name).expert_bytes
            except ConfigError:
                continue
            if c_min * (spec.expert_bytes - small) >= short:
                fixes.append(f"--expert-format {name} ({gib(small)} an expert instead of {gib(spec.expert_bytes)})")
                break
    what = "GPU" if gpu is not None else "machine"
    fixes.append(f"a {what} with at least {gib(need + prefs.margin * ((gpu.total_bytes or 0) if gpu else 0))} "
                 f"{'free VRAM' if gpu is not None else 'of available RAM'}")
    resource = "VRAM" if gpu is not None else "RAM"
    ctx = min(want, MIN_CONTEXT) if auto_ctx else want
    detail = (f"dense {gib(spec.dense_bytes)} + KV for {ctx:,} tokens + workspace + {c_min} expert "
              f"slot{'' if c_min == 1 else 's'} need "
              f"{gib(need)}, the budget is {gib(budget)}")
    return Refusal(resource, need, max(0, budget), tuple(fixes), detail=detail)
