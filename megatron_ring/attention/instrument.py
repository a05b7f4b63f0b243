"""Optional timing and byte counts filled by the ring while a :func:`ring_stats` block is active.

``wait_s`` is the time the ring spends blocked on communication after its compute for a step is
done: the *exposed* communication. On CUDA the ring synchronises the device while stats are
active (to time kernels from the host), which removes some overlap; use it to measure, not to run.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist


@dataclass
class RingStats:
    """Totals over every ring call (forward and backward) made inside one :func:`ring_stats` block, on this rank.

    ``steps`` counts communication rounds: P-1 per forward, 2P-1 per backward (P-1 K/V rotations
    and P gradient transfers). ``bytes_sent`` counts what this rank sends; for ``comm="all_gather"``
    it is the equivalent ring volume. With a window or packed documents (direct transfers,
    direct.py) both count only the steps in which this rank sends, and what it sends.
    """

    calls: int = 0
    steps: int = 0
    bytes_sent: int = 0
    wait_s: float = 0.0
    compute_s: float = 0.0
    total_s: float = 0.0

    @property
    def exposed_fraction(self) -> float:
        """Share of the ring's time spent waiting on communication (0 when nothing was timed)."""
        return self.wait_s / self.total_s if self.total_s else 0.0


_ACTIVE: list[RingStats] = []


@contextmanager
def ring_stats() -> Iterator[RingStats]:
    """Collect :class:`RingStats` for the ring calls made inside the block."""
    stats = RingStats()
    _ACTIVE.append(stats)
    try:
        yield stats
    finally:
        _ACTIVE.remove(stats)


def active_stats() -> RingStats | None:
    return _ACTIVE[-1] if _ACTIVE else None


def now(device: torch.device) -> float:
    """Host clock, after draining the device queue when it is a GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def wait_all(works: Sequence[dist.Work], device: torch.device) -> None:
    """Wait for ``works``, adding the time to the active :class:`RingStats` ``wait_s``."""
    if not works:
        return
    stats = active_stats()
    start = now(device) if stats else 0.0
    for work in works:
        work.wait()
    if stats:
        stats.wait_s += now(device) - start
