"""argparse value types shared by the `moechat` subcommands: a bad value is one clear usage line."""

from __future__ import annotations

import argparse


def _number(text: str, parse, kind: str, minimum: float, inclusive: bool):
    try:
        value = parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
    if value < minimum or (value == minimum and not inclusive):
        raise argparse.ArgumentTypeError(f"expected a number {'>=' if inclusive else '>'} {minimum:g}, got {value:g}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, "a whole number", 0, inclusive=False)


def non_negative_int(text: str) -> int:
    return _number(text, int, "a whole number", 0, inclusive=True)


def non_negative_float(text: str) -> float:
    return _number(text, float, "a number", 0, inclusive=True)
