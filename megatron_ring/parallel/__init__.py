"""Parallel layouts and their process groups.

Files:

* ``layout.py`` :class:`ParallelLayout`: tp, cp, dp, pp sizes, rank <-> coordinates, groups per axis (pure Python);
* ``groups.py`` :func:`init_parallel`: the torch.distributed groups of a layout, with timeouts.
"""
from megatron_ring.parallel.groups import ParallelGroups, init_parallel
from megatron_ring.parallel.layout import AXES, ParallelLayout

__all__ = ["AXES", "ParallelGroups", "ParallelLayout", "init_parallel"]
