"""The `moechat` command line.

`moechat run MODEL_DIR --prompt TEXT` streams a reply to stdout; `--json` prints one JSON object at the
end instead. These flags are a contract other tools (benchmarks, scripts, the CI) rely on: keep them
stable. A reasoning model's thinking (gpt-oss's analysis channel, Qwen3's <think> block) is split off
the answer: stdout and "text" hold only the answer, `--show-thinking` streams the thinking to stderr
(dimmed on a terminal), and "thinking" holds it in the JSON. Start-up imports neither torch nor the
engine; they are imported when a command needs them, so `moechat --help` answers at once. Every error
a user can cause is one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from moechat.engine.text.reasoning import REASONING_EFFORTS  # pure Python, no torch

from .argtypes import utf8_text as _utf8_text
from .engine_args import MODEL_HELP, add_load_args, add_sampling_args, sampling_overrides, say_clamp

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
_DIM, _RESET = "\x1b[2m", "\x1b[0m"


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2,3, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="moechat", description="Run Mixture-of-Experts models bigger than your GPU, and see what the expert cache "
        "does. `moechat` alone opens the chat app on the bundled demo model (else the model used last).",
        epilog="Start with: moechat run --prompt \"What does math.sqrt do?\" --temperature 0   (the demo model); "
        "moechat fit MODEL says whether a model runs here before you download it.")
    parser.add_argument("--version", action=_Version, help="print moechat's version and exit")
    parser.add_argument("--debug", action="store_true", help="print the full traceback of an unexpected error "
                        "(accepted after any subcommand too; or set MOECHAT_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="generate a reply from a model (default: the bundled demo model)",
                         description="Generate from MODEL: a local Hugging Face MoE model directory (safetensors) or "
                         "a Hub repo id downloaded with moechat pull; without MODEL, the bundled demo model.")
    run.add_argument("model_dir", metavar="MODEL", nargs="?", help=MODEL_HELP)
    src = run.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", type=_utf8_text, help="the user message (the chat template is applied unless --raw)")
    src.add_argument("--prompt-ids", type=_token_ids, metavar="IDS", help="token ids, e.g. 1,2,3 (no template)")
    run.add_argument("--raw", action="store_true", help="send --prompt as plain text, without the chat template")
    run.add_argument("--system", type=_utf8_text, help="system prompt (chat template only)")
    run.add_argument("--reasoning-effort", choices=REASONING_EFFORTS, help="how hard a reasoning model thinks, "
                     "passed to the chat template as reasoning_effort (gpt-oss; default: the template's own, "
                     "medium for gpt-oss)")
    run.add_argument("--thinking", choices=("on", "off"), help="turn a reasoning model's thinking on or off, "
                     "passed to the chat template as enable_thinking (Qwen3/3.5, GLM, Nemotron 3, Gemma 4, "
                     "DeepSeek-V3.1; default: the template's own)")
    run.add_argument("--show-thinking", action="store_true", help="stream the model's reasoning to stderr "
                     "(dimmed on a terminal); by default only the answer is printed")
    add_sampling_args(run, "run")  # --max-tokens --temperature --top-k ...: the same flags as chat and serve
    run.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    add_load_args(run)  # --dtype --context --device and the expert cache: the same flags as `moechat serve`
    from moechat.app.cli.fit import add_fit_parser  # no torch, no engine
    from moechat.app.cli.pull import add_pull_parser
    from moechat.app.serve.server import add_serve_parser
    from moechat.app.tui.launch import add_chat_parser
    from moechat.app.tui.remote import add_remote_args

    add_fit_parser(sub)
    add_remote_args(add_chat_parser(sub))  # chat --remote URL: the app on any OpenAI-compatible server
    add_pull_parser(sub)
    add_serve_parser(sub)
    parser.run_parser = run  # main's checks between flags end in its usage line
    return parser


def _check_run_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags that contradict each other, refused at parse time (exit 2) rather than one of them ignored."""
    if args.system is not None and (args.raw or args.prompt_ids is not None):
        without = "--raw" if args.raw else "--prompt-ids"
        parser.run_parser.error(f"--system is a chat-template message and {without} sends no chat template: drop "
                                f"--system, or put the system text in the prompt yourself")


def _check_run_args(args: argparse.Namespace, device: str) -> None:
    from moechat.engine.io.files import check_writable
    from moechat.engine.load.loader import resolve_device

    resolve_device(device)  # a typo, or cuda where there is none (the sampling flags were checked at parse time)
    if args.record_trace:
        check_writable(args.record_trace, "routing trace")  # not after the reply: the trace would be lost


def _run(args: argparse.Namespace) -> int:
    import threading

    from moechat.app.cli.engine_args import load_engine_from_args

    # a Hub repo id resolved to its snapshot; a bad value fails in one line before the model loads
    engine = load_engine_from_args(args, check=_check_run_args)
    sampling = engine.sampling(**sampling_overrides(args))
    reasoning = None
    chat = args.prompt_ids is None and not args.raw
    if args.reasoning_effort is not None and not (chat and engine.template_reads("reasoning_effort")):
        where = "this model's chat template does not read it" if chat else "it applies to the chat template only"
        print(f"moechat: warning: --reasoning-effort ignored: {where}", file=sys.stderr)
    switch = engine.thinking_kwargs(None if args.thinking is None else args.thinking == "on")
    if args.thinking is not None and not (chat and switch):
        where = ("this model's chat template has no thinking switch" if chat
                 else "it applies to the chat template only")
        print(f"moechat: warning: --thinking ignored: {where}", file=sys.stderr)
    if args.prompt_ids is not None:
        prompt_ids = args.prompt_ids
    elif args.raw:
        prompt_ids = engine.encode(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        # Only a given effort is passed: unset, the template keeps its own default (gpt-oss: "medium").
        effort = {} if args.reasoning_effort is None else {"reasoning_effort": args.reasoning_effort}
        prompt_ids = engine.encode_chat(messages + [{"role": "user", "content": args.prompt}], **effort, **switch)
        reasoning = engine.reasoning_parser(prompt_ids)
    room = engine.context - len(prompt_ids)
    if args.max_tokens is not None and 0 < room < args.max_tokens:
        say_clamp(args, "--max-tokens", args.max_tokens, room, f"the {len(prompt_ids):,}-token prompt leaves "
                  f"{room:,} of the {engine.context:,}-token context")
    cancel = threading.Event()
    token_ids: list[int] = []
    text: list[str] = []
    thinking: list[str] = []
    last = None
    shown = _ThinkingPrinter(sys.stderr) if args.show_thinking and not args.json else None
    stream = engine.generate(prompt_ids, sampling=sampling, max_tokens=args.max_tokens, cancel=cancel,
                             reasoning=reasoning)
    try:
        for chunk in stream:
            token_ids.extend(chunk.token_ids)
            text.append(chunk.text)
            thinking.append(chunk.thinking)
            last = chunk
            if shown is not None and chunk.thinking:
                shown.write(chunk.thinking)
            if not args.json and chunk.text:
                if shown is not None:
                    shown.close()
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        cancel.set()
        stream.close()
        engine.close()
        if shown is not None:
            shown.close()
        if not args.json:
            sys.stdout.write("\n")
        print("moechat: stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    if shown is not None:
        shown.close()
    engine.close()  # in-flight loads stopped, routing profile saved for --warm-start
    snapshot = engine.cache_snapshot()
    if snapshot is None and last is not None and engine.loaded.device.type == "cpu":
        from moechat.engine.plan.calibration import record_run

        # what `moechat fit` predicts this machine's decode from (engine/plan/calibration.py); never a failure
        record_run(args.model_dir, last.decode_tokens_per_s, len(token_ids))
    status = 0
    if args.record_trace:
        try:
            engine.provider.recorder.to_trace().save(args.record_trace)  # all or nothing (atomic_write)
        except OSError as e:  # checked writable at start; the disk filled or the folder went away since
            print(f"moechat: error: {args.record_trace}: cannot write the routing trace: {e.strerror or e}",
                  file=sys.stderr)
            status = EXIT_ERROR
    if args.json:
        cache_json = snapshot.to_json() if snapshot is not None else {
            "slots": None, "mode": "resident", "hits": 0, "misses": 0, "bytes_from_ram": 0, "bytes_from_disk": 0,
            "expert_loads_prefill": 0, "expert_loads_decode": 0}
        print(json.dumps({
            "model": str(args.model_dir),
            "dtype": str(engine.loaded.dtype).removeprefix("torch."),
            "device": str(engine.loaded.device),
            "prompt_tokens": len(prompt_ids),
            "token_ids": token_ids,
            "text": "".join(text),
            "thinking": "".join(thinking),
            "generated_tokens": len(token_ids),
            "finish_reason": last.finish_reason if last else None,
            "prefill_tokens_per_s": last.prefill_tokens_per_s if last else 0.0,
            "decode_tokens_per_s": last.decode_tokens_per_s if last else 0.0,
            "cache": cache_json,
            "clamps": getattr(args, "clamps", None) or [],  # each flag value moechat lowered: asked, got, why
            **({"cpu_paths": cpu_paths()} if engine.loaded.device.type == "cpu" else {}),
        }))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()  # the reply before the stats line on stderr
        if last is not None:
            print(f"[{len(prompt_ids)} prompt tokens, {last.prefill_tokens_per_s:.1f} tok/s prefill; "
                  f"{len(token_ids)} generated, {last.decode_tokens_per_s:.1f} tok/s decode; "
                  f"{last.finish_reason}]", file=sys.stderr)
            hidden = len("".join(thinking)) if shown is None else 0
            if hidden:
                print(f"[thinking: {hidden} characters not shown; --show-thinking prints them]", file=sys.stderr)
            if snapshot is not None:
                slots = f"{snapshot.num_slots} slot" + ("" if snapshot.num_slots == 1 else "s")
                print(f"[cache: {slots}, {snapshot.policy}, hit rate {snapshot.hit_rate:.1%}, "
                      f"{snapshot.bytes_from_ram / 2**20:.1f} MiB from RAM, {snapshot.bytes_from_disk / 2**20:.1f} MiB "
                      "from disk]", file=sys.stderr)
                if snapshot.prefetch != "off":
                    print(f"[prefetch {snapshot.prefetch} depth {snapshot.prefetch_depth}: "
                          f"{sum(snapshot.prefetch_used)} of {sum(snapshot.prefetch_issued)} used, "
                          f"{snapshot.demand_misses} demand misses, stalled {snapshot.stall_seconds * 1e3:.0f} ms, "
                          f"prediction precision {snapshot.prefetch_precision:.0%} recall "
                          f"{snapshot.prefetch_recall:.0%}; {snapshot.warm_loaded} "
                          f"expert{'' if snapshot.warm_loaded == 1 else 's'} warm-started]",
                          file=sys.stderr)
    return status


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error in one line (the command, what is wrong, where the flags are listed) and exit
    status 2, instead of the whole usage block above it; the subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        args, extra = self.parse_known_args(args, namespace)
        if extra:  # named by the subcommand they were given to: its --help lists what it takes
            command = getattr(args, "command", None)
            prog = f"{self.prog} {command}" if command else self.prog
            self.exit(EXIT_USAGE, f"{prog}: error: unrecognized arguments: {' '.join(extra)} (see {prog} --help)\n")
        return args


class _Version(argparse.Action):
    """--version: read from the installed package's metadata when asked, not at every start-up. The version line
    comes first and alone (scripts compare it); then one line per CPU compute path active here, and why (the native
    kernels and torch's guarded packed kernels: importing torch is fine, --version is asked for)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version

        try:
            text = version("moechat")
        except PackageNotFoundError:  # run from a source tree that was never installed
            text = "unknown (not installed)"
        print(f"moechat {text}", flush=True)  # stdout, as argparse's own version action
        for line in cpu_paths_lines():
            print(line)
        parser.exit()


def cpu_paths() -> dict:
    """The CPU compute paths active on this machine: {"native": why, "torch": [one line per guarded path]}."""
    from moechat.engine.quant import native, torch_paths

    return {"native": native.status(), "torch": torch_paths.status()}


def cpu_paths_lines() -> list[str]:
    """`cpu_paths()` as lines for a person; a path that cannot say (a broken install) says so in its line."""
    try:
        paths = cpu_paths()
    except Exception as e:  # noqa: BLE001 - --version must answer whatever the engine's state
        return [f"cpu paths: unknown ({type(e).__name__}: {e})"]
    return [f"cpu: native kernels: {paths['native']}"] + [f"cpu: {line}" for line in paths["torch"]]


class _ThinkingPrinter:
    """Streams thinking to a stream (stderr), dimmed on a terminal, ended by a newline when the answer starts."""

    def __init__(self, stream):
        self.stream = stream
        self.dim = stream.isatty()
        self.open = False

    def write(self, text: str) -> None:
        if not self.open:
            self.open = True
            if self.dim:
                self.stream.write(_DIM)
        self.stream.write(text)
        self.stream.flush()

    def close(self) -> None:
        if self.open:
            self.open = False
            self.stream.write((_RESET if self.dim else "") + "\n")
            self.stream.flush()


def main(argv: list[str] | None = None) -> int:
    """Every path ends in one line and an exit status (app/cli/guard.py); --debug (anywhere) or MOECHAT_DEBUG=1 adds
    the traceback of an unexpected error."""
    from .guard import guarded, take_debug_flag

    program = argv is None  # the `moechat` command itself, not a caller (tests) passing its own argv
    debug, argv = take_debug_flag(list(sys.argv[1:] if argv is None else argv))
    args = None
    try:
        parser = build_parser()
        args = parser.parse_args(argv)  # --version and --help print too
        if args.command == "run":
            _check_run_flags(parser, args)
        code = guarded(lambda: _flushed(_dispatch, args), debug=debug)
    except BrokenPipeError:  # raised outside the guard: printing --version into a closed pipe
        code = _closed_stdout()
    if program and args is not None and args.command in (None, "run", "chat"):
        _leave_now(code)
    return code


def _flushed(command, args: argparse.Namespace) -> int:
    """Run a command with a closed stdout (`moechat fit X | head -1`) as a quiet exit 0, as git and ls end: the
    reader has what it wanted. stdout is flushed here, inside, so the pipe breaks where it can be caught, not in
    the interpreter's flush at exit (which would print "Exception ignored" and exit 120)."""
    try:
        code = command(args)
        sys.stdout.flush()
    except BrokenPipeError:
        return _closed_stdout()
    return code


def _closed_stdout() -> int:
    """Nothing more can be said on stdout: point it at devnull so no later flush fails again; exit 0."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # not a real file (a test's capture): nothing to redirect
        pass
    return 0


def _leave_now(code: int) -> None:
    """End the process without Python's teardown once torch is loaded: finalizing its modules took 0.6-1.0 s after
    `run` printed its last line (and after the app had restored the terminal), for nothing: by then every file
    moechat writes is closed and renamed into place, the engine is closed and its threads joined, the chat store
    committed. stdout and stderr are flushed first."""
    if "torch" not in sys.modules:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said there
            pass
    os._exit(code)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command is None:
        from moechat.app.tui.launch import run_default

        return run_default()  # the chat app on the bundled demo model
    if args.command == "fit":
        from moechat.app.cli.fit import run_fit

        return run_fit(args)
    if args.command in ("chat", "serve"):
        return args.handler(args)
    if args.command == "pull":
        from moechat.app.cli.pull import run_pull

        return run_pull(args)
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
