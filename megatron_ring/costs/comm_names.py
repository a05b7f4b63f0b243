"""The names of the comms, how the ranks of a context-parallel (CP) group exchange data: the one place that names them.

* ``"p2p"``: the ring (relay transfers; direct transfers under windows and packed documents);
* ``"all_gather"``: every rank gathers every K/V shard (the baseline);
* ``"a2a"``: DeepSpeed-Ulysses, all-to-all from sequence to heads over the whole CP group;
* ``"a2a+p2p"``: all-to-all inside a node, the ring across nodes (Megatron's hierarchical CP), over
  ``attention.comms.CPGroups``;
* ``"auto"``: one of those, chosen per call by the cost model (comm_choice.py).

The cost model (costs/) and the core read them here; ``megatron_ring.attention.comms`` re-exports them beside the
groups they run over, and every other module that names a comm (the planner, the benchmarks, the integrations and
the configs) imports them from there.
"""
from __future__ import annotations

from typing import Literal

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
"""Comms that run over one (flat) CP group; ``a2a+p2p`` runs over ``attention.comms.CPGroups``."""
