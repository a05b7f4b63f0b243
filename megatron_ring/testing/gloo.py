"""The gloo worker pool for tests (ours and users'): :class:`GlooPool` runs a function on N CPU ranks.

It lives in :mod:`megatron_ring.runtime.pool`, where the benchmarks use it too; this is its
import path for test code.
"""
from megatron_ring.runtime.pool import GlooPool, WorkerError, free_port, run_gloo

__all__ = ["GlooPool", "WorkerError", "free_port", "run_gloo"]
