"""One parser for every numeric option: a number (or the text of one) checked against the
range where it means something, NaN refused everywhere, infinity where it is meaningless.

A NaN bound makes every comparison false: `--tol nan` can never fail, `--rtol nan` fails
everything, `--grad-norm nan:1e9` drops its lower bound. So each option states its range
once, here, and a value outside it is a one-line usage error naming the option, the value
and an example (exit 2). No torch: the CLI and the options use it.
"""

from __future__ import annotations

import math
import operator
from typing import Any, SupportsFloat, SupportsIndex

from hookcli.errors import UsageError

SEED_MAX = 2**64 - 1  # torch.manual_seed takes 0 … 2**64-1 (and negatives, which we refuse)
INT32_MAX = 2**31 - 1  # counts: --topk, --per-image, and integers in --model-arg
BATCH_MAX = 2**16  # images per batch
WORKERS_MAX = 1024  # DataLoader processes


def _show(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else f"{text[:20]}…({len(text)} characters)"


def _span(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        if low == 0:
            return "above 0" if low_open else "0 or more"
        return f"{'above' if low_open else 'at least'} {low:g}"
    if high is not None:
        return f"{'below' if high_open else 'at most'} {high:g}"
    return ""


def number(
    value: Any,
    option: str,
    *,
    example: str,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    infinite: bool = False,
) -> float:
    """A float option (given as a number or as text) within its range: never NaN, and
    ±inf only when `infinite` (a one-sided bound, say). Raises a UsageError naming the
    option, its range and the value otherwise."""
    where = _span(low, high, low_open, high_open)
    a_number = f"a number {where}" if where else "a number"
    hint = f"e.g. {example}"
    if isinstance(value, bool) or not isinstance(value, str | SupportsFloat):
        raise UsageError(f"{option} must be {a_number}, got {_show(value)}.", hint)
    try:
        x = float(value)
    except (ValueError, TypeError, OverflowError):
        raise UsageError(f"{option} must be {a_number}, got {_show(value)}.", hint) from None
    if math.isnan(x):
        raise UsageError(
            f"{option} cannot be NaN (every comparison with NaN is false); give {a_number}.",
            hint,
        )
    if math.isinf(x) and not infinite:
        finite = f"finite ({where})" if where else "finite"
        raise UsageError(f"{option} must be {finite}, got {_show(value)}.", hint)
    if (low is not None and (x < low or (low_open and x == low))) or (
        high is not None and (x > high or (high_open and x == high))
    ):
        raise UsageError(f"{option} must be {where}, got {_show(value)}.", hint)
    return x


def integer(value: Any, option: str, *, low: int, high: int, example: str) -> int:
    """An int option within [low, high]; the message names the range."""
    hint = f"e.g. {example}"
    if isinstance(value, bool) or not isinstance(value, str | SupportsIndex):
        raise UsageError(f"{option} must be an integer, got {_show(value)}.", hint)
    try:
        n = int(value) if isinstance(value, str) else operator.index(value)
    except (ValueError, TypeError):
        raise UsageError(f"{option} must be an integer, got {_show(value)}.", hint) from None
    digits = str(n)
    shown = digits if len(digits) <= 40 else f"a {len(digits)}-digit number"
    if n < low:
        raise UsageError(f"{option} must be {low} or more (up to {high}), got {shown}.", hint)
    if n > high:
        raise UsageError(f"{option} must be at most {high} ({low} or more), got {shown}.", hint)
    return n


def tolerance(value: Any, option: str, example: str) -> float:
    """A tolerance: a finite number, 0 or more (a negative or NaN one can never pass or never
    fail; an infinite one can never fail)."""
    return number(value, option, low=0, example=example)
