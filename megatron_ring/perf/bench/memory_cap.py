"""The memory cap of ``megatron-ring bench train-memory``: a trial fits when no rank's peak exceeds it.

Note [What the cap counts]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The cap bounds the bytes one training step adds to each rank's process at its peak
(:func:`~megatron_ring.perf.bench.harness.measure_peak`: on CPU the kernel's resident high-water mark
``VmHWM``, reset just before the trial, minus the resident size then; every tensor buffer above 64 KiB
is its own ``mmap``, Note [Peak memory on CPU]). The window opens before the model exists and closes
after the optimizer step, so it counts, at every cp alike: the weights, their gradients, the AdamW
states, the activations autograd saves, the logits ``[s_local, b, vocab]`` and the loss's temporaries,
the ring's K/V buffers and dK/dV outboxes, gloo's send/receive copies, and the allocator's rounding.
It does not count what the process holds before the trial: the interpreter, torch, megatron-core,
the process groups and one-time initialisations (every trial runs in fresh processes after a warm-up
step at one unit, so code pages and lazily built state of a first step are part of that baseline:
Note [A fresh pool per trial] in perf/bench/train_memory.py). The input batch (int64 ids, labels and
positions, 24 bytes per local token) is made before the window.

The cap is checked against the exact peak after the step rather than enforced while it runs: a
trial whose peak exceeds it runs to the end and is then rejected (:class:`MemoryCapExceeded`), as a
process limit would have stopped it. A hard limit on CPU (``RLIMIT_AS``/``RLIMIT_DATA``, a cgroup)
would also count address space or page cache that is not live data, and would kill a gloo rank in
the middle of a collective; the high-water mark counts resident bytes only, at every cp alike.
"""
from __future__ import annotations

from typing import Sequence

MIB = 1 << 20


class MemoryCapExceeded(RuntimeError):
    """A rank's peak of one trial exceeded the cap: which rank, the cap, its peak, the trial."""

    def __init__(self, *, rank: int, cap_bytes: int, peak_bytes: int, seq_len: int, cp: int) -> None:
        self.rank, self.cap_bytes, self.peak_bytes, self.seq_len, self.cp = rank, cap_bytes, peak_bytes, seq_len, cp
        super().__init__(f"rank {rank} of cp = {cp} at seq_len = {seq_len}: peak {peak_bytes} bytes "
                         f"({peak_bytes / MIB:.1f} MiB) exceeds the cap of {cap_bytes} bytes ({cap_bytes / MIB:.1f} MiB)")


def check_cap_bytes(cap_bytes: int) -> int:
    """``cap_bytes`` if it is a positive integer, else ValueError naming the field and what is allowed."""
    if isinstance(cap_bytes, bool) or not isinstance(cap_bytes, int) or cap_bytes <= 0:
        raise ValueError(f"cap_bytes = {cap_bytes!r}: the memory cap per process must be a positive number "
                         "of bytes")
    return cap_bytes


def check_cap(peaks: Sequence[int], cap_bytes: int, *, seq_len: int, cp: int) -> None:
    """Raise :class:`MemoryCapExceeded` for the rank with the highest peak when it is above ``cap_bytes``.

    ``peaks``: every rank's peak bytes of one trial, in rank order.
    """
    check_cap_bytes(cap_bytes)
    rank = max(range(len(peaks)), key=lambda r: peaks[r])
    if peaks[rank] > cap_bytes:
        raise MemoryCapExceeded(rank=rank, cap_bytes=cap_bytes, peak_bytes=int(peaks[rank]), seq_len=seq_len, cp=cp)
