"""The flags that say how to load a model, shared by `moechat run` and `moechat serve`, and the load itself.

    add_load_args(parser)                     # --dtype --context --device and the "expert cache" group
    add_sampling_args(parser, "run")          # --temperature --top-k ... --max-tokens, in run, chat and serve
    engine = load_engine_from_args(args)      # resolve MODEL, check values, plan the cache, Engine.load

One definition, so the two commands cannot drift: a flag added here exists in both, with the same
meaning, default and checks. Nothing here imports torch at import time (the parsers are built at
start-up); `load_engine_from_args` imports it.
"""

from __future__ import annotations

import argparse

from . import argtypes as _types
from .argtypes import non_negative_int as _non_negative_int
from .argtypes import prefetch_depth as _prefetch_depth

_at_most = _types.at_most
_caps = _types.caps


_MAX_CONTEXT, _MAX_EXPERTS, _MAX_LAYERS = _caps()
context_length = _types.context_length  # shared with `moechat fit --context` and `run --max-tokens`
expert_slots = _at_most(_MAX_LAYERS * _MAX_EXPERTS, "slots", "more experts than any model moechat loads has")
host_layers = _at_most(_MAX_LAYERS, "layers", "more layers than any model moechat loads has",
                       minimum=_non_negative_int)
ram_cache_mb = _at_most(1 << 30, "MiB", "1 PiB", minimum=_non_negative_int)


def _max_threads() -> int:
    from moechat.engine.plan.hardware import MAX_THREADS  # no torch

    return MAX_THREADS


def _threads_help() -> str:
    from moechat.engine.plan.hardware.cores import default_threads_help  # no torch

    return ("CPU threads that compute (the native kernels' pool, and torch's ops on one thread up to 2, on N from 3; "
            f"set once at load; the greedy tokens are the same at any N). Default: {default_threads_help()}; "
            "OMP_NUM_THREADS when set")


threads = _at_most(_max_threads(), "threads", "more than any machine moechat runs on has cores")
# run, serve and chat (app/tui/launch.py): one help, so the three say the same default. fit plans for --cores (all
# but one compute, the same rule) and pull downloads: neither runs the compute pools.
THREADS_HELP = _threads_help()


# The positional of run, chat and serve (fit's also takes a Hub repo id it has not downloaded): one name, one help.
MODEL_HELP = ("a model directory (config.json and *.safetensors), a .gguf file (a split set's first part) or a folder "
              "holding one, or a Hub repo id downloaded with moechat pull (org/repo:QUANT for a GGUF quant; "
              "default: the bundled demo model)")
SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")  # SamplingParams' names
_SAMPLING_SCOPE = {
    "run": ("", "the model's generation_config.json"),
    "chat": ("for this session's chat, until one is chosen in the sampling dialog (F3); ",
             "the one set in the app, else the model's"),
    "serve": ("for the requests that do not send it; ", "the model's generation_config.json"),
}


def add_sampling_args(parser: argparse.ArgumentParser, scope: str) -> None:
    """The "sampling" group of `run`, `chat` and `serve` (scope: which one, for the help): one definition, checked
    at parse time by the engine's own rules (app/cli/argtypes.py), so a bad value is a usage line before any load."""
    lead, default = _SAMPLING_SCOPE[scope]
    group = parser.add_argument_group("sampling", "how each next token is chosen; a value left out is the "
                                      "model's (generation_config.json, read as transformers' generate() reads it)")
    group.add_argument("--max-tokens", type=context_length, metavar="N", help=f"{lead}tokens to generate at most "
                       "(default: the model's max_new_tokens, else 512; at most what the context leaves, said if "
                       "lower)" if scope != "chat" else f"{lead}tokens to generate at most (default: {default}, "
                       "else its max_new_tokens, else 512)")
    group.add_argument("--temperature", type=_types.temperature, metavar="T", help=f"{lead}0 = greedy, else at "
                       f"least 0.001 (default: {default})")
    group.add_argument("--top-k", type=_types.top_k, metavar="K", help=f"{lead}sample among the K likeliest tokens "
                       f"only (0 = all; default: {default})")
    group.add_argument("--top-p", type=_types.top_p, metavar="P", help=f"{lead}sample among the likeliest tokens "
                       f"whose probabilities add up to P, in (0, 1] (default: {default})")
    group.add_argument("--min-p", type=_types.min_p, metavar="P", help=f"{lead}drop tokens less likely than P x the "
                       f"likeliest one, in [0, 1] (default: {default}, else 0)")
    group.add_argument("--repetition-penalty", type=_types.repetition_penalty, metavar="R", help=f"{lead}divide "
                       f"the scores of tokens already in the text by R > 0; 1 = off (default: {default}, else 1)")
    group.add_argument("--seed", type=_types.seed, metavar="S", help=f"{lead}sampling seed, 0 to 2**64-1 (same "
                       "seed, same reply; default: a fresh one each time)")


def sampling_overrides(args: argparse.Namespace) -> dict:
    """The sampling flags given (SamplingParams' names -> values); those left out are not in it."""
    return {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name, None) is not None}


say_clamp = _types.say_clamp
warn = _types.warn


def _policies() -> list[str]:
    from moechat.engine.cache.policy import POLICIES  # pure Python: no torch at start-up

    return list(POLICIES)


def _default_policy() -> str:
    from moechat.engine.cache.policy import DEFAULT_POLICY

    return DEFAULT_POLICY


def _prefetch_modes() -> list[str]:
    from moechat.engine.cache.prefetch import PREFETCH_MODES  # no torch at import time either

    return list(PREFETCH_MODES)


def _on_miss_modes() -> list[str]:
    from moechat.engine.cache.hybrid import ON_MISS  # pure Python

    return list(ON_MISS)


def add_load_args(parser: argparse.ArgumentParser, *, record_trace: bool = True) -> None:
    """--dtype, --context, --device and the "expert cache" argument group (with --record-trace when asked)."""
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="compute dtype (default: the checkpoint's)")
    parser.add_argument("--context", type=context_length, metavar="N", help="context length to allocate the KV "
                        "cache for (default 4096, at most the model's: a larger value is lowered, and said)")
    parser.add_argument("--device", default=None, help="compute device: cpu, cuda or cuda:N (default: "
                        "cuda if available, else cpu)")
    parser.add_argument("--threads", type=threads, metavar="N", help=THREADS_HELP)
    cache = parser.add_argument_group("expert cache", "keep only N experts on the compute device, the rest in RAM "
                                      "or on disk (default: every expert resident)")
    cache.add_argument("--expert-slots", type=expert_slots, metavar="N", help="slots for experts on the device")
    cache.add_argument("--policy", choices=_policies(), help="eviction policy of the slots (default: %(default)s)",
                       default=_default_policy())
    cache.add_argument("--ram-cache-mb", type=ram_cache_mb, metavar="MB", help="bound the RAM tier to MB; "
                       "experts beyond it stream from disk (default: every expert in RAM)")
    if record_trace:
        cache.add_argument("--record-trace", metavar="PATH", help="save the routing trace of this run as .npz")
    cache.add_argument("--expert-format", choices=["native", "int8", "int4"], default="native",
                       help="how every tier holds the experts: native (as the checkpoint ships them: bf16, MXFP4 or "
                       "FP8), int8 (per-channel, ~half of bf16) or int4 (groups of 32, ~0.3 of bf16); converted once "
                       "into a repacked file (--repack-dir, default under $XDG_CACHE_HOME/moechat/repacked)")
    parser.add_argument("--dense-format", choices=["native", "int8", "int4"], default="native",
                        help="how the dense weights (attention projections, LM head) are held: native (the "
                        "model's dtype), int8 (per output channel, quantized at load; CPU only: half the bytes a "
                        "token reads there, perplexity within 0.05%% of native on the demo model, "
                        "bench/expert_formats.py --dense) or int4 (attention in groups of 32 with fp16 scales, 4.5 "
                        "bits a weight, the LM head in int8 as llama.cpp keeps it; CPU only; bench/dense_format.py). "
                        "Default: native")
    cache.add_argument("--on-miss", choices=_on_miss_modes(), default="auto",
                       help="where an expert that is not in a slot runs: load (copy it into a slot), host (compute "
                       "it on the CPU straight from the RAM tier, sending only activations), or auto (a cost model "
                       "from measured numbers decides per miss; on a CPU-only machine that is always host: no copy). "
                       "Default: auto")
    cache.add_argument("--host-layers", type=host_layers, default=0, metavar="N",
                       help="keep every expert of the first N MoE layers on the host, never slotted (like "
                       "llama.cpp's --n-cpu-moe)")
    cache.add_argument("--embeddings", choices=["auto", "host", "device"], default="auto",
                       help="where the input embedding table lives on a GPU: host gathers each token's row in RAM and "
                       "copies it in, leaving its VRAM to expert slots; auto (default): host when the plan sizes the "
                       "slots and it buys some")
    cache.add_argument("--repack-dir", metavar="DIR", help="stream experts from a repacked copy kept in DIR "
                       "(one read per expert; written on first use, needs as much disk as the experts)")
    cache.add_argument("--prefetch", choices=_prefetch_modes(), default=None,
                       help="load the experts later layers will want while this layer computes: next-layer "
                       "(their routers on this layer's hidden state), previous-token (temporal reuse), both, or off. "
                       "Default: next-layer on a GPU; off on a CPU, where bench/prefetch.py measured it slower. It "
                       "acts only when some experts have no slot (--expert-slots below the expert count)")
    cache.add_argument("--prefetch-depth", type=_prefetch_depth, default=1, metavar="N",
                       help="predict N MoE layers ahead (1-4, default 1)")
    cache.add_argument("--warm-start", nargs="?", const=True, default=True, type=_warm_start, metavar="imatrix:FILE",
                       help="fill the slots at start with the experts this model used most in earlier runs "
                       "(a routing profile saved at exit under $XDG_CACHE_HOME/moechat; default: on), else with "
                       "those llama.cpp's imatrix beside the model ranks first; imatrix:FILE ranks them by that "
                       "imatrix (.dat or .gguf). Put MODEL before the flag")
    cache.add_argument("--no-warm-start", dest="warm_start", action="store_false",
                       help="start with empty slots")


def _warm_start(text: str) -> str:
    """--warm-start's value, checked at parse time: imatrix:FILE."""
    from moechat.engine.cache.imatrix import parse_warm_start
    from moechat.engine.errors import ConfigError

    try:
        return parse_warm_start(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--warm-start ")) from None


def cache_config_from_args(args: argparse.Namespace, device: str):
    """The CacheConfig the flags ask for (None: every expert resident); unset sizes come from the memory plan."""
    from moechat.app.cli.fit import cache_defaults
    from moechat.engine.cache.provider import CacheConfig
    from moechat.engine.errors import ConfigError, MoechatError

    record = bool(getattr(args, "record_trace", None))
    embeddings = _embeddings_for_run(args, device)
    slots, ram_cache_bytes = cache_defaults(args.model_dir, device=device, dtype=args.dtype, context=args.context,
                                            expert_slots=args.expert_slots, ram_cache_mb=args.ram_cache_mb, warn=warn,
                                            expert_format=args.expert_format, embeddings=embeddings)
    if not (slots or ram_cache_bytes is not None or record or args.repack_dir):
        if args.prefetch not in (None, "off"):
            warn(f"--prefetch {args.prefetch} does nothing here: every expert is resident on the {device} (no "
                 "--expert-slots or --ram-cache-mb, and they all fit), so there is nothing to load ahead; pass "
                 "--expert-slots N to keep only N experts there and prefetch the rest")
        return None
    from moechat.engine.cache.prefetch import check_prefetch, default_prefetch

    prefetch = args.prefetch or default_prefetch(device)
    try:
        check_prefetch(prefetch, args.prefetch_depth)
    except ValueError as e:
        raise MoechatError(str(e)) from None
    if prefetch != "off" and str(device).split(":")[0] == "cpu" and args.on_miss != "load" and ram_cache_bytes is None:
        from moechat.engine.cache.prefetch import nothing_to_prefetch

        # misses computed in place and the plan keeps every expert in RAM: the provider would refuse it at load
        raise ConfigError(nothing_to_prefetch(prefetch))
    return CacheConfig(expert_slots=slots, policy=args.policy, ram_cache_bytes=ram_cache_bytes,
                       record_trace=record, repack_dir=args.repack_dir, prefetch=prefetch,
                       prefetch_depth=args.prefetch_depth, warm_start=args.warm_start, on_miss=args.on_miss,
                       host_layers=args.host_layers, embeddings=embeddings)


def _embeddings_for_run(args: argparse.Namespace, device: str) -> str:
    """--embeddings: host or device; auto asks the plan on a GPU whose slots it sizes (the table goes to RAM when
    that buys slots); a CPU's device is its RAM."""
    choice = getattr(args, "embeddings", None) or "auto"
    if not str(device).startswith("cuda"):
        return "device"
    if choice != "auto":
        return choice
    if args.expert_slots is not None:
        return "device"  # slots sized by hand: the table stays where they were sized for
    from moechat.app.cli.fit import plan_for_run

    plan = plan_for_run(args.model_dir, device=device, dtype=args.dtype, context=args.context,
                        expert_format=args.expert_format, embeddings="auto")
    return plan.embeddings if plan is not None and plan.needs_cache else "device"


def load_engine_from_args(args: argparse.Namespace, check=None):
    """Resolve args.model_dir (a Hub repo id: its downloaded snapshot), run `check(args, device)` (values refused
    before the model loads), then load the engine the flags describe."""
    from moechat.app.cli.pull import resolve_model_arg

    args.model_dir = resolve_model_arg(args.model_dir)  # no network

    from moechat.engine.plan.hardware import quiet_openmp, set_threads

    quiet_openmp()  # before torch loads its OpenMP runtime: no spinning workers taking the native pool's core
    import torch

    from moechat.engine.runtime.generate import Engine

    set_threads(torch, getattr(args, "threads", None))  # default_threads(), as the app's
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if check is not None:
        check(args, device)
    say_config_clamps(args)  # from config.json, before the plan and the weights
    cache = cache_config_from_args(args, device)
    engine = Engine.load(args.model_dir, dtype=args.dtype, device=device, context=args.context, cache=cache,
                         expert_format=args.expert_format, dense_format=args.dense_format)
    for notice in engine.notices:  # e.g. a tokenizer far smaller than the model's embedding
        warn(notice)
    if cache is not None and cache.expert_slots is None and args.ram_cache_mb is not None:
        _explain_ram_cache_alone(engine, args.ram_cache_mb)
    say_load_clamps(args, engine)
    return engine


def say_config_clamps(args: argparse.Namespace) -> None:
    """The load flags past what the model's config.json allows, said before a weight is read (`say_clamp`) and
    lowered to it: --context past its positions, --expert-slots past its routed experts, --host-layers past its MoE
    layers. A config.json that cannot be read is left to the load, which says why in its own words."""
    from moechat.engine.errors import MoechatError
    from moechat.engine.load.loader import read_model_config

    try:
        cls, margs, _ = read_model_config(args.model_dir)
        positions, experts = int(margs.max_position_embeddings), int(margs.num_experts)
        moe_layers = len(cls.moe_layers(margs))
    except (MoechatError, AttributeError, TypeError, ValueError):
        return
    if args.context is not None and args.context > positions:
        say_clamp(args, "--context", args.context, positions, f"the model has {positions:,} positions "
                  "(max_position_embeddings)")
        args.context = positions
    if args.expert_slots is not None and args.expert_slots > moe_layers * experts:
        say_clamp(args, "--expert-slots", args.expert_slots, moe_layers * experts, f"the model has "
                  f"{moe_layers * experts:,} routed experts, and a slot holds one")
        args.expert_slots = moe_layers * experts
    if (getattr(args, "host_layers", 0) or 0) > moe_layers:
        say_clamp(args, "--host-layers", args.host_layers, moe_layers, f"the model has {moe_layers:,} MoE layers")
        args.host_layers = moe_layers


def say_load_clamps(args: argparse.Namespace, engine) -> None:
    """After the load, what config.json could not tell (`say_config_clamps` lowered the rest before it). Each load
    flag the engine could not take as given, said (`say_clamp`): a context past the model's positions,
    more slots than the model has experts, more host layers than MoE layers, host layers with every expert resident
    or with no RAM tier to compute from."""
    if args.context is not None and engine.context < args.context:
        say_clamp(args, "--context", args.context, engine.context, f"the model has {engine.context:,} positions "
                  "(max_position_embeddings)")
    loaded, provider = engine.loaded, engine.provider
    moe_layers = len(loaded.cls.moe_layers(loaded.args)) if loaded.cls is not None else None
    snap = engine.cache_snapshot()
    if snap is not None and args.expert_slots is not None and snap.num_slots < args.expert_slots:
        say_clamp(args, "--expert-slots", args.expert_slots, snap.num_slots, f"the model has {snap.num_slots:,} "
                  "routed experts, and a slot holds one")
    asked = getattr(args, "host_layers", 0) or 0
    if asked:
        got = len(getattr(provider, "host_layers", ()) or ())
        if snap is None:
            why = (f"every expert is resident on the {loaded.device.type} (no --expert-slots or --ram-cache-mb), so "
                   "none needs the host")
        elif got == 0:
            why = "the experts stream from disk, and there is no RAM tier to compute them from"
        else:
            why = f"the model has {moe_layers:,} MoE layers"
        if got < asked:
            say_clamp(args, "--host-layers", asked, got, why)


def _explain_ram_cache_alone(engine, ram_cache_mb: int) -> None:
    """--ram-cache-mb without --expert-slots: the provider chose the slots; say how many, why, and what the RAM tier
    then holds, so a tiny budget is not a silent surprise."""
    snap, provider = engine.cache_snapshot(), engine.provider
    if snap is None:
        return
    eb = getattr(provider.store, "expert_bytes", 0)
    held = f"{_count(snap.ram_cache_bytes // eb, 'expert')} ({eb / 2**10:,.0f} KiB each)" if eb else "what fits"
    warn(f"--ram-cache-mb {ram_cache_mb} without --expert-slots: {_count(snap.num_slots, 'slot')} chosen (on a CPU "
         f"with a bounded RAM tier: two decode steps' worth of experts), and the {ram_cache_mb} MiB RAM tier holds "
         f"{held}; every other expert is read from disk when used. Pass --expert-slots N to choose")


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")
