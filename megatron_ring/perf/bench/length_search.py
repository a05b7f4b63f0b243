"""The longest sequence that fits: a galloping search (steps doubling away from a start), then bisection,
over multiples of a unit (pure).

Assumes that whether a length fits is monotone (what fits at ``n`` fits at every shorter length),
which holds for memory that grows with the sequence. A start near the limit (a prediction) costs a
few calls; a start far from it about ``2 * log2(distance / unit)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class LengthSearch:
    """The result: ``longest`` (0 when not even one unit fits), the trials in order as
    ``(length, fits)``, and ``at_ceiling`` when ``ceiling`` itself fits (the true limit may be longer)."""

    longest: int = 0
    trials: list[tuple[int, bool]] = field(default_factory=list)
    at_ceiling: bool = False


def longest_fitting(fits: Callable[[int], bool], *, unit: int, start: int, ceiling: int) -> LengthSearch:
    """The longest multiple of ``unit`` up to ``ceiling`` for which ``fits(length)`` is true.

    From ``start`` (a multiple of ``unit``) the length moves up while it fits (down while it does not)
    by steps of 1, 2, 4, ... units, then the gap between the longest fitting and the shortest failing
    length is bisected down to one unit.
    """
    for name, value in (("unit", unit), ("start", start), ("ceiling", ceiling)):
        if value < 1 or value % unit:
            raise ValueError(f"{name} = {value}: must be a positive multiple of unit = {unit}")
    if start > ceiling:
        raise ValueError(f"start = {start} is above ceiling = {ceiling}")
    search = LengthSearch()

    def trial(units: int) -> bool:
        ok = fits(units * unit)
        search.trials.append((units * unit, ok))
        return ok

    first, top = start // unit, ceiling // unit
    lo, hi = 0, top + 1  # lo fits (0: none known), hi fails (top + 1: none known)
    if trial(first):
        lo, step = first, 1
        while lo < top:
            n = min(first + step, top)
            if not trial(n):
                hi = n
                break
            lo, step = n, 2 * step
    else:
        hi, step = first, 1
        while hi > 1:
            n = max(first - step, 1)
            if trial(n):
                lo = n
                break
            hi, step = n, 2 * step
    while hi - lo > 1 and lo < top:
        mid = (lo + hi) // 2
        if trial(mid):
            lo = mid
        else:
            hi = mid
    search.longest, search.at_ceiling = lo * unit, lo == top
    return search
