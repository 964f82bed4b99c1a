"""Every command-line path ends in one line on stderr, never a traceback (unless asked for one).

`guarded(fn)` runs a command: a typed `MoechatError` prints its message, an out-of-memory error says
what to lower, Ctrl+C prints "stopped" (exit 130), a closed stdout (`moechat run ... | head`) exits
quietly, and anything else, a bug or a library's untyped exception, prints "unexpected <Type>:
<message>" with exit status 1. `--debug` anywhere on the command line, or MOECHAT_DEBUG=1, adds the
full traceback after that line. No torch here: the CLI imports this at start-up.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130
DEBUG_FLAG = "--debug"
DEBUG_ENV = "MOECHAT_DEBUG"


def debug_from_env() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def take_debug_flag(argv: list[str]) -> tuple[bool, list[str]]:
    """(whether --debug or MOECHAT_DEBUG asks for tracebacks, argv without --debug). The flag is taken from any
    position so every subcommand has it without each parser declaring it; after `--` it is left alone."""
    end = argv.index("--") if "--" in argv else len(argv)
    found = DEBUG_FLAG in argv[:end]
    kept = [a for i, a in enumerate(argv) if not (i < end and a == DEBUG_FLAG)]
    return found or debug_from_env(), kept


def one_line(text: object) -> str:
    """A message as one line: an exception text with newlines (a library's multi-line error) joined up."""
    return " ".join(str(text).split()) or "(no message)"


def _oom_errors() -> tuple[type[BaseException], ...]:
    torch = sys.modules.get("torch")  # only if already imported: start-up must not import it
    return (torch.OutOfMemoryError, MemoryError) if torch is not None else (MemoryError,)


def report(error: BaseException, *, debug: bool, stream=None) -> int:
    """Print one line for `error` (and its traceback when debugging); the exit status to use."""
    from moechat.engine.errors import MoechatError

    stream = stream or sys.stderr
    if isinstance(error, KeyboardInterrupt):
        print("moechat: stopped", file=stream)
        return EXIT_INTERRUPTED
    if debug:
        traceback.print_exception(error, file=stream)
    hint = "" if debug else f" (run again with {DEBUG_FLAG} or {DEBUG_ENV}=1 for the traceback)"
    if isinstance(error, MoechatError):
        unexpected = type(error).__name__ == "UnexpectedError"  # an untyped error the engine wrapped
        print(f"moechat: error: {one_line(error)}{hint if unexpected else ''}", file=stream)
    elif isinstance(error, _oom_errors()):
        print(f"moechat: error: out of memory: {one_line(str(error).splitlines()[0] if str(error) else '')}; lower "
              "--context, use fewer --expert-slots or a smaller --dtype", file=stream)
    else:
        print(f"moechat: error: unexpected {type(error).__name__}: {one_line(error)}{hint}", file=stream)
    return EXIT_ERROR


def guarded(fn: Callable[[], int], *, debug: bool = False) -> int:
    """Run a command; whatever it raises becomes one line and an exit status (see the module docstring)."""
    try:
        return fn()
    except SystemExit:
        raise
    except BrokenPipeError:
        # The reader of stdout went away: nothing more can be said there; point stdout at devnull so the
        # interpreter's own flush at exit does not print a second error.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_ERROR
    except BaseException as e:  # noqa: BLE001 - the point of this function
        return report(e, debug=debug)
