"""The gloo worker pool for tests (ours and users'): :class:`GlooPool` runs a function on N CPU ranks.

It lives in :mod:`megatron_ring.runtime.pool`, where the benchmarks use it too; this is its
import path for test code. :func:`runs_per_size` runs one worker once per pool size;
:class:`CaseGrid` runs a grid of one worker's cases in one pool call per size.
"""
from __future__ import annotations

import traceback
from typing import Any, Callable, Hashable, Iterable, Mapping

from megatron_ring.runtime.pool import GlooPool, WorkerError, free_port, run_gloo

__all__ = ["CaseGrid", "GlooPool", "WorkerError", "free_port", "run_cases", "run_gloo", "runs_per_size"]

Call = tuple[tuple[Any, ...], dict[str, Any]]
"""One case: a worker's positional and keyword arguments."""


def runs_per_size(pools: Callable[[int], GlooPool], fn: Callable[[], Any], timeout_s: float) -> Callable[[int], list]:
    """``get(P)`` -> every rank's result of ``fn`` on the P-rank pool of ``pools``, run on the first call
    for that P only (tests that check several cases of one worker launch share it)."""
    cache: dict[int, list] = {}

    def get(size: int) -> list:
        if size not in cache:
            cache[size] = pools(size).run(fn, timeout_s=timeout_s)
        return cache[size]
    return get


def run_cases(fn: Callable[..., Any], calls: list[Call]) -> list[tuple[bool, Any]]:
    """On every rank: ``fn(*args, **kwargs)`` for each call in order; ``(True, result)`` or ``(False, traceback)``
    per call, so that one case's failure is reported as that case's."""
    out: list[tuple[bool, Any]] = []
    for args, kwargs in calls:
        try:
            out.append((True, fn(*args, **kwargs)))
        except Exception:  # noqa: BLE001 - the case's test reports it
            out.append((False, traceback.format_exc()))
    return out


def _key(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Hashable:
    return args, tuple(sorted(kwargs.items()))


class CaseGrid:
    """A parametrized grid's calls of one worker, run together: one pool call per ring size, on the
    first case of that size a test asks for; each test then reads (and asserts) its own case.

    ``calls_by_size``: ring size -> every ``(args, kwargs)`` the grid's tests will ask for at that size.
    ``grid(size, *args, **kwargs)`` returns every rank's result of that call, like ``GlooPool.run``,
    and raises :class:`WorkerError` naming the call when it failed on some rank.
    """

    def __init__(self, pools: Callable[[int], GlooPool], fn: Callable[..., Any],
                 calls_by_size: Mapping[int, Iterable[Call]], timeout_s: float = 600.0) -> None:
        self._pools, self._fn, self._timeout_s = pools, fn, timeout_s
        self._calls: dict[int, list[Call]] = {}
        for size, calls in calls_by_size.items():
            unique = {_key(args, kwargs): (tuple(args), dict(kwargs)) for args, kwargs in calls}
            self._calls[size] = list(unique.values())
        self._index = {size: {_key(*call): i for i, call in enumerate(calls)} for size, calls in self._calls.items()}
        self._results: dict[int, list[list[tuple[bool, Any]]]] = {}

    def __call__(self, size: int, *args: Any, **kwargs: Any) -> list[Any]:
        index = self._index.get(size, {}).get(_key(args, kwargs))
        if index is None:
            raise KeyError(f"{self._fn.__name__}{args} {kwargs} at size {size} is not in the grid")
        if size not in self._results:
            self._results[size] = self._pools(size).run(run_cases, self._fn, self._calls[size],
                                                        timeout_s=self._timeout_s)
        per_rank = [results[index] for results in self._results[size]]
        failed = {rank: value for rank, (ok, value) in enumerate(per_rank) if not ok}
        if failed:
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
            raise WorkerError(f"{self._fn.__name__}{args} {kwargs} failed on ranks {sorted(failed)}:\n{text}")
        return [value for _, value in per_rank]
