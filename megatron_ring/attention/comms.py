"""The comms and the CP groups they run over: the one place that names them.

``comm`` picks how the ranks of a context-parallel (CP) group exchange data:

* ``"p2p"``: the ring (relay transfers; direct transfers under windows and packed documents);
* ``"all_gather"``: every rank gathers every K/V shard (the baseline);
* ``"a2a"``: DeepSpeed-Ulysses, all-to-all from sequence to heads over the whole CP group;
* ``"a2a+p2p"``: all-to-all inside a node, the ring across nodes (Megatron's hierarchical CP),
  over :class:`CPGroups`;
* ``"auto"``: one of those, chosen per call by the cost model (costs/comm_choice.py).

Every module that names a comm (the core, the planner, the benchmarks, the integrations and the
configs) imports it from here.
"""
from __future__ import annotations

from typing import Literal, NamedTuple

import torch.distributed as dist

Comm = Literal["p2p", "all_gather", "a2a", "a2a+p2p"]
"""A concrete comm (what ``"auto"`` resolves to)."""
COMMS: tuple[Comm, ...] = ("p2p", "all_gather", "a2a", "a2a+p2p")
"""Every concrete comm, in the order tables and configs list them."""
COMM_CHOICES: tuple[str, ...] = (*COMMS, "auto")
"""Every value of ``comm``."""
TIE_ORDER: tuple[Comm, ...] = ("p2p", "a2a+p2p", "a2a", "all_gather")
"""The order ``"auto"`` breaks ties of predicted time in."""
RING_COMMS: tuple[Comm, ...] = ("p2p", "all_gather")
"""Comms that run the ring's loops (ring.py) over the flat group: a transport brings every K/V block."""
A2A_COMMS: tuple[Comm, ...] = ("a2a", "a2a+p2p")
"""Comms that trade sequence for heads with an all-to-all (alltoall.py)."""
FLAT_COMMS: tuple[Comm, ...] = ("p2p", "all_gather", "a2a")
"""Comms that run over one (flat) CP group; ``a2a+p2p`` runs over :class:`CPGroups`."""


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


PIECES: int | None = None
"""The relay's head groups per forward hop (Note [Forward memory] in relay.py): ``None``, the cost model
chooses them per call (Note [Pieces per hop] in costs/comm_choice.py); an int >= 1 overrides it for every call
(``gcd(PIECES, heads_kv)`` groups: 1, whole blocks and the fewest messages; more, smaller buffers and one more
message per group and hop). Read at every call."""
