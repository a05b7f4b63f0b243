"""The gloo worker pool for tests (ours and users'): :class:`GlooPool` runs a function on N CPU ranks.

It lives in :mod:`megatron_ring.runtime.pool`, where the benchmarks use it too; this is its
import path for test code. :func:`runs_per_size` runs one worker once per pool size.
"""
from typing import Any, Callable

from megatron_ring.runtime.pool import GlooPool, WorkerError, free_port, run_gloo

__all__ = ["GlooPool", "WorkerError", "free_port", "run_gloo", "runs_per_size"]


def runs_per_size(pools: Callable[[int], GlooPool], fn: Callable[[], Any], timeout_s: float) -> Callable[[int], list]:
    """``get(P)`` -> every rank's result of ``fn`` on the P-rank pool of ``pools``, run on the first call
    for that P only (tests that check several cases of one worker launch share it)."""
    cache: dict[int, list] = {}

    def get(size: int) -> list:
        if size not in cache:
            cache[size] = pools(size).run(fn, timeout_s=timeout_s)
        return cache[size]
    return get
