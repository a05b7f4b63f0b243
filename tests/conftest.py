"""Shared fixtures: gloo process pools reused across tests (one per world size)."""
from __future__ import annotations

import os
from typing import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from megatron_ring.testing.gloo import GlooPool  # noqa: E402


class Pools:
    """Lazily started :class:`GlooPool` per world size; a broken pool is replaced on next use."""

    def __init__(self) -> None:
        self._pools: dict[int, GlooPool] = {}

    def __call__(self, world_size: int) -> GlooPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive():
            pool = self._pools[world_size] = GlooPool(world_size, timeout_s=120)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def gloo_pool() -> Iterator[Pools]:
    """``gloo_pool(P)`` -> a running :class:`GlooPool` of P ranks, shared by the session."""
    pools = Pools()
    yield pools
    pools.close()
