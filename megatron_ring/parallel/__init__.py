"""Parallel layouts (pure Python) and the process groups built from them."""
from megatron_ring.parallel.groups import ParallelGroups, init_parallel
from megatron_ring.parallel.layout import AXES, ParallelLayout

__all__ = ["AXES", "ParallelGroups", "ParallelLayout", "init_parallel"]
