"""The memory plan `moechat run` (and the app) take their cache defaults from: `plan_for_run` plans as `run`
allocates, `cache_defaults` fills in the slots and the RAM cache the user left unset. No torch until a plan is made.
"""

from __future__ import annotations

from .gather import repacked_formats


def plan_for_run(model_dir, *, device: str, dtype: str | None, context: int | None,
                 expert_format: str | None = None, embeddings: str = "device"):
    """The plan `moechat run` takes its cache defaults from, for the device and dtype it will use.

    Planned as `run` allocates: the context it will allocate (never lowered), full KV layers at that length and
    sliding-window layers a ring of their window, sizes in the dtype the loader picks (--dtype, else
    config.json's, else float32: a config that names none, like gpt-oss's, loads its bf16 tensors as float32),
    and experts in `expert_format` (int8/int4: the repacked form every tier holds).
    """
    from moechat.engine.errors import MoechatError
    from moechat.engine.load.loader import DTYPES, read_model_config, resolve_dtype
    from moechat.engine.plan import DEFAULT_CONTEXT, FLOAT_SIZES, Preferences, make_plan, read_model_spec
    from moechat.engine.plan.hardware import probe

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
    return make_plan(spec, hw, Preferences(context=ctx, device=dev, override=True,
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
