"""Command-line values shared by every entry point: argparse types that say what is allowed, and the
one-line error at the boundary.

An argparse ``type`` raising :class:`argparse.ArgumentTypeError` gives ``PROG: error: argument --L:
expected an integer >= 1, got 0`` and exit status 2; :func:`usage_error` prints a rejected
combination of flags (a ``ValueError``, :class:`~megatron_ring.config.strict.ConfigError` included)
the same way. The standard library only: entry points that need torch alone import it.
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Callable


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer ``>= minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def usage_error(prog: str, err: Exception | str) -> int:
    """Print ``PROG: error: ERR`` to stderr, as argparse does; return the exit status 2."""
    print(f"{prog}: error: {err}", file=sys.stderr)
    return 2
