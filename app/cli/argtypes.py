"""argparse value types shared by the `moechat` subcommands: a bad value is one clear usage line."""

from __future__ import annotations

import argparse
import math
import sys


def _number(text: str, parse, kind: str, minimum: float, inclusive: bool, maximum: float = math.inf):
    try:
        value = parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    if value < minimum or (value == minimum and not inclusive):
        raise argparse.ArgumentTypeError(f"expected a number {'>=' if inclusive else '>'} {minimum:g}, got {value:g}")
    if value > maximum:
        raise argparse.ArgumentTypeError(f"expected a number <= {maximum:g}, got {value:g}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, "a whole number", 0, inclusive=False)


def device_problem(name: str) -> str | None:
    """What is wrong with a --device name, without torch (the app checks it before its first frame; `run` asks
    torch, which also knows whether CUDA is there): None for cpu, cuda and cuda:N. The loader's words."""
    kind, colon, index = name.strip().lower().partition(":")
    if kind in ("cpu", "cuda") and (not colon or index.isdigit()):
        return None
    return f"device {name!r} is not a device: use cpu, cuda or cuda:N"


def prefetch_depth(text: str) -> int:
    """--prefetch-depth of `run`, `serve` and `chat`: one type, so a bad value is the same usage error (exit 2)."""
    from moechat.engine.cache.prefetch import MAX_PREFETCH_DEPTH  # pure Python

    return _number(text, int, "a whole number", 1, inclusive=True, maximum=MAX_PREFETCH_DEPTH)


def non_negative_int(text: str) -> int:
    return _number(text, int, "a whole number", 0, inclusive=True)


def non_negative_float(text: str) -> float:
    # capped: GiB and GB/s what-ifs past a billion are typos, and would overflow the byte arithmetic
    return _number(text, float, "a number", 0, inclusive=True, maximum=1e9)


def finite_float(text: str) -> float:
    return _number(text, float, "a number", -math.inf, inclusive=True)


def utf8_text(text: str) -> str:
    """Text that can be encoded: bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape) and
    would fail deep in the tokenizer; here they are one usage line naming where."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"U+{ord(bad):04X}"
        raise argparse.ArgumentTypeError(f"not valid UTF-8 text ({byte} at character {e.start}); pass UTF-8, or "
                                         "token ids with --prompt-ids") from None
    return text


def _sampling_type(name: str, parse, kind: str, *, no_zero: tuple[str, str] | None = None):
    """An argparse type for the sampling parameter `name`, refused by the engine's own rule (engine/runtime/sampling.py
    `problem`, pure Python: no torch at start-up) with one usage line; `no_zero` = (the range without 0, why not
    0) refuses 0 as well, and names that range for any refused value."""
    def check(text: str):
        from moechat.engine.runtime.sampling import problem

        try:
            value = parse(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        rule = problem(name, value)
        if no_zero is not None and (rule is not None or value == 0):
            rule = no_zero[0] + (f" ({no_zero[1]})" if value == 0 else "")
        if rule is not None:
            rule = rule.removesuffix(" or null")  # JSON's null is the flag left out here
            raise argparse.ArgumentTypeError(f"expected {'a number ' if rule[0] in 'i<>' else ''}{rule}, got {text}")
        return value

    check.__name__ = name  # argparse names the type in its "invalid ... value" line
    return check


temperature = _sampling_type("temperature", float, "a number")
top_k = _sampling_type("top_k", int, "a whole number")
top_p = _sampling_type("top_p", float, "a number",
                       no_zero=("in (0, 1]", "0 would keep only the likeliest token: for that, pass --temperature 0"))
min_p = _sampling_type("min_p", float, "a number")
repetition_penalty = _sampling_type("repetition_penalty", float, "a number")
seed = _sampling_type("seed", int, "a whole number")


def at_most(limit: int, unit: str, why: str, minimum=positive_int):
    """An argparse type: `minimum`'s whole number, refused above `limit` (a value no model could use: a typo, or an
    int64 overflow later) with one usage line that says why."""
    def parse(text: str) -> int:
        value = minimum(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"expected at most {limit:,} {unit} ({why}), got {value:,}")
        return value

    parse.__name__ = minimum.__name__  # argparse names the type in its "invalid ... value" line
    return parse


def caps():
    from moechat.engine.io.validate import MAX_CONTEXT, MAX_EXPERTS, MAX_LAYERS  # pure Python

    return MAX_CONTEXT, MAX_EXPERTS, MAX_LAYERS


_MAX_CONTEXT = caps()[0]
# Shared by `moechat fit --context`, `run --context` and `run --max-tokens`: tokens past any model's positions.
context_length = at_most(_MAX_CONTEXT, "tokens", "more positions than any model moechat loads has")


def warn(message: str) -> None:
    print(f"moechat: warning: {message}", file=sys.stderr)


def say_clamp(args: argparse.Namespace, flag: str, asked, got, why: str) -> None:
    """A value moechat lowered (or did not apply): one stderr line with what was asked, what it got and why, and an
    entry in `args.clamps` for the --json output. No clamp is silent."""
    warn(f"{flag} {asked}: using {got}: {why}")
    if getattr(args, "clamps", None) is None:
        args.clamps = []
    args.clamps.append({"flag": flag, "asked": asked, "got": got, "why": why})
