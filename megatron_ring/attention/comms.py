"""The comms (their names: costs/comm_names.py, re-exported here) and the groups of hierarchical context parallelism
they run over (:class:`CPGroups`). ``comm="auto"`` chooses among them per call (costs/comm_choice.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist

from megatron_ring.costs.comm_names import (
    A2A_COMMS, COMM_CHOICES, COMMS, FLAT_COMMS, RING_COMMS, TIE_ORDER, Comm,
)

__all__ = ["A2A_COMMS", "COMM_CHOICES", "COMMS", "FLAT_COMMS", "RING_COMMS", "TIE_ORDER", "Comm", "CPGroups"]


class CPGroups(NamedTuple):
    """The groups of hierarchical context parallelism (Megatron's ``hierarchical_context_parallel_sizes``).

    Pass as ``ring_attention(..., group=CPGroups(a2a, ring, cp))`` or as a plain tuple
    ``(a2a, ring)``. With ``cp = a2a_size x ring_size``, CP rank c must be rank ``c % a2a_size`` of
    its ``a2a`` group (adjacent CP ranks) and rank ``c // a2a_size`` of its ``ring`` group;
    :meth:`megatron_ring.parallel.groups.ParallelGroups.cp_groups` builds them so. ``cp`` (the whole
    CP group, optional) lets the same object serve ``comm="p2p"``, ``"all_gather"`` and ``"a2a"``,
    and ``"auto"`` choose among all four.
    """

    a2a: dist.ProcessGroup | None
    ring: dist.ProcessGroup | None
    cp: dist.ProcessGroup | None = None
