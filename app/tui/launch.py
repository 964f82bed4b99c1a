"""Entry points of the terminal app, for app/cli/main.py to wire in:

    sub = parser.add_subparsers(...)
    add_chat_parser(sub)                 # `moechat chat MODEL [--dtype ...]`
    ...
    if args.command == "chat": return run_chat(args)
    if args.command is None:   return run_default()     # bare `moechat`

Bare `moechat` opens the bundled demo model (assets/demo-moe) when it is there, else the model used
last, else a welcome screen that says how to pass a model. Nothing here imports torch: the app's
first frame is up before the model starts loading. `python -m moechat.app.tui.launch chat MODEL` runs the
same thing without cli.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moechat.engine.text.reasoning import REASONING_EFFORTS  # pure Python, no torch

from ..cli.argtypes import non_negative_int as _non_negative_int
from ..cli.argtypes import positive_int as _positive_int
from ..cli.argtypes import prefetch_depth as _prefetch_depth
from ..cli.engine_args import MODEL_HELP, THREADS_HELP, add_sampling_args, sampling_overrides, threads
from ..cli.pull import DEMO_MODEL  # noqa: F401 - re-exported: the app and the tests read it here

# No Textual here either (app/tui/bridge.py imports it): `moechat run` builds this parser, and Textual's import is
# 0.3 s of its start-up. The bridge and the app are imported when `chat` or bare `moechat` runs.
EXIT_ERROR = 1


def add_chat_parser(subparsers) -> argparse.ArgumentParser:
    """Add `moechat chat MODEL` to a subparsers object; its options mirror `moechat run`'s."""
    chat = subparsers.add_parser(
        "chat", help="chat with a model in the terminal app, with the live expert-cache panel",
        description="Open the chat app on a local Hugging Face MoE model directory (or a Hub repo id downloaded "
                    "with moechat pull). The experts are kept in a slot cache so the panel can show it; "
                    "retune it live from the panel.")
    chat.add_argument("model", metavar="MODEL", nargs="?", help=MODEL_HELP)
    chat.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                      help="compute dtype (default: the checkpoint's)")
    chat.add_argument("--context", type=_positive_int, metavar="N", help="context length to allocate the KV "
                      "cache for (default 4096, at most the model's)")
    chat.add_argument("--device", default=None, help="compute device: cpu, cuda or cuda:N (default: "
                      "cuda if available, else cpu)")
    chat.add_argument("--threads", type=threads, metavar="N", help=THREADS_HELP)
    chat.add_argument("--reasoning-effort", choices=REASONING_EFFORTS, help="how hard a reasoning model thinks "
                      "in this session, passed to the chat template (gpt-oss; default: the one set in the app, "
                      "else the template's own, medium for gpt-oss)")
    chat.add_argument("--thinking", choices=("on", "off"), help="a reasoning model's thinking on or off in this "
                      "session, passed to the chat template as enable_thinking (Qwen3/3.5, GLM, Nemotron 3, "
                      "Gemma 4, DeepSeek-V3.1; default: the one set in the app, else the template's own)")
    cache = chat.add_argument_group("expert cache", "N slots on the compute device over a RAM tier and the disk "
                                    "(default: a slot for every expert, every expert in RAM)")
    cache.add_argument("--expert-slots", type=_positive_int, metavar="N", help="slots for experts on the device")
    from moechat.engine.cache.policy import DEFAULT_POLICY, POLICIES  # pure Python and numpy: no torch

    cache.add_argument("--policy", choices=list(POLICIES), default=DEFAULT_POLICY,
                       help="eviction policy of the slots (default: %(default)s)")
    cache.add_argument("--ram-cache-mb", type=_non_negative_int, metavar="MB", help="bound the RAM tier to MB; "
                       "experts beyond it stream from disk (default: every expert in RAM)")
    cache.add_argument("--resident", action="store_true", help="no cache: every expert on the device (the "
                       "heatmap stays empty until slots are set in the panel)")
    cache.add_argument("--expert-format", choices=["native", "int8", "int4"], default=None,
                       help="how every tier holds the experts, for this session: native (as the checkpoint ships "
                       "them), int8 or int4 (converted once into a repacked file under $XDG_CACHE_HOME/moechat/"
                       "repacked); default: the one chosen for this model in the app's panel, else native. `moechat "
                       "fit MODEL` says which one to use")
    chat.add_argument("--dense-format", choices=["native", "int8", "int4"], default="native",
                        help="how the dense weights (attention projections, LM head) are held: native (the "
                        "model's dtype), int8 (per output channel, quantized at load; CPU only: half the bytes a "
                        "token reads there, perplexity within 0.05%% of native on the demo model, "
                        "bench/expert_formats.py --dense) or int4 (attention in groups of 32, the LM head in int8; "
                        "CPU only). Default: native")
    from moechat.engine.cache.prefetch import MAX_PREFETCH_DEPTH, PREFETCH_MODES  # pure Python: no torch

    cache.add_argument("--prefetch", choices=list(PREFETCH_MODES), default=None,
                       help="load the experts later layers will want while this layer computes: next-layer "
                       "(their routers on this layer's hidden state), previous-token (temporal reuse), both, or off. "
                       "Default: next-layer on a GPU; off on a CPU, where bench/prefetch.py measured it slower. It "
                       "acts only when some experts have no slot (--expert-slots below the expert count)")
    cache.add_argument("--prefetch-depth", type=_prefetch_depth, default=1, metavar="N",
                       help=f"predict N MoE layers ahead (1-{MAX_PREFETCH_DEPTH}, default 1)")
    cache.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=True,
                       help="fill the slots at start from this model's saved routing profile (default: on)")
    from moechat.engine.cache.hybrid import ON_MISS  # pure Python

    cache.add_argument("--on-miss", choices=list(ON_MISS), default="auto",
                       help="where an expert that is not in a slot runs: load (copy it into a slot), host (compute "
                       "it on the CPU from the RAM tier), or auto (a cost model decides per miss; on a CPU-only "
                       "machine that is host). The heatmap shows where each expert ran. Default: auto")
    cache.add_argument("--host-layers", type=_non_negative_int, default=0, metavar="N",
                       help="keep every expert of the first N MoE layers on the host, never slotted (like "
                       "llama.cpp's --n-cpu-moe)")
    add_sampling_args(chat, "chat")  # the app's sampling settings start from them, for this session
    chat.set_defaults(handler=run_chat)
    return chat


def options_from_args(args: argparse.Namespace):
    from .bridge import LoadOptions

    return LoadOptions(dtype=args.dtype, device=args.device, context=args.context, expert_slots=args.expert_slots,
                       policy=args.policy, ram_cache_mb=args.ram_cache_mb, resident=args.resident,
                       prefetch=args.prefetch, prefetch_depth=args.prefetch_depth, warm_start=args.warm_start,
                       expert_format=args.expert_format, on_miss=args.on_miss, host_layers=args.host_layers,
                       dense_format=args.dense_format, threads=args.threads)


def _run(app) -> int:
    app.run()
    return app.return_code or 0


def run_chat(args: argparse.Namespace) -> int:
    from ..cli.argtypes import device_problem
    from .bridge import NO_MODEL_HINT, is_local_model, looks_like_repo_id

    if args.device is not None and device_problem(args.device):
        print(f"moechat: error: {device_problem(args.device)}", file=sys.stderr)  # before the app opens
        return EXIT_ERROR
    model = args.model
    if model is not None and not is_local_model(model) and not looks_like_repo_id(model):
        print(f"moechat: error: {model}: no such model directory; {NO_MODEL_HINT}", file=sys.stderr)
        return EXIT_ERROR
    if model is not None and is_local_model(model):
        model = str(Path(model).expanduser().resolve())
    else:
        from ..cli.pull import resolve_model_arg

        # None: the bundled demo; a repo id: the complete cached snapshot, or an error naming `moechat pull`
        model = resolve_model_arg(model)
    from .app import make_app

    return _run(make_app(model, options=options_from_args(args), reasoning_effort=args.reasoning_effort,
                         sampling=sampling_overrides(args), max_tokens=args.max_tokens,
                         thinking=thinking_arg(args)))


def thinking_arg(args) -> bool | None:
    """--thinking on|off as the template's switch value (None: not given)."""
    value = getattr(args, "thinking", None)
    return None if value is None else value == "on"


def default_model(demo: Path | None = None, settings=None) -> str | None:
    """The bundled demo model if it is there, else the most recently used model that still exists."""
    demo = DEMO_MODEL if demo is None else demo
    if (demo / "config.json").is_file():
        return str(demo)
    if settings is None:
        from .settings import Settings

        settings = Settings.load()
    from .bridge import is_local_model, looks_like_repo_id

    for model in settings.recent_models:
        if is_local_model(model) or looks_like_repo_id(model):
            return model
    return None


def run_default() -> int:
    from .app import make_app
    from .settings import Settings

    settings = Settings.load()
    return _run(make_app(default_model(settings=settings), settings=settings))


def main(argv: list[str] | None = None) -> int:
    from ..cli.guard import guarded, take_debug_flag

    debug, argv = take_debug_flag(list(sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(prog="moechat")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_chat_parser(sub)
    args = parser.parse_args(argv)
    return guarded(lambda: run_default() if args.command is None else args.handler(args), debug=debug)


if __name__ == "__main__":
    sys.exit(main())
