"""The comms and the CP groups they run over: the one place that names them.

``comm`` picks how the ranks of a context-parallel (CP) group exchange data:

* ``"p2p"``: the ring (relay transfers; direct transfers under windows and packed documents);
* ``"all_gather"``: every rank gathers every K/V shard (the baseline);
* ``"a2a"``: DeepSpeed-Ulysses, all-to-all from sequence to heads over the whole CP group;
* ``"a2a+p2p"``: all-to-all inside a node, the ring across nodes (Megatron's hierarchical CP),
  over :class:`CPGroups`;
* ``"auto"``: one of those, chosen per call by the cost model (auto_comm.py).

Every module that names a comm (the core, the planner, the benchmarks, the integrations and the
configs) imports it from here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
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


def group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) of this process in ``group``; (0, 1) when torch.distributed is not initialised.

    ValueError, before any collective, when this process is not a member of ``group``.
    """
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the given group "
                         "(torch.distributed.get_rank(group) is -1); call it only on the group's members")
    return rank, dist.get_world_size(group)



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


PIECES = 2
"""The relay's head groups per forward block (Note [Forward memory] in relay.py): one message each per
hop, half the K/V buffers per group. Assign another int >= 1 to trade memory for messages (1: whole
blocks, the fewest messages; more: smaller buffers, one message per group); :func:`relay_pieces`
reads it at every call."""


def relay_pieces(heads_kv: int) -> int:
    """The head groups the relay's forward moves a block in: ``gcd(PIECES, heads_kv)`` (one for MQA, or
    when ``heads_kv`` does not split ``PIECES`` ways)."""
    return math.gcd(PIECES, heads_kv)


@dataclass(frozen=True)
class CPPlace:
    """Where this process sits for one call: the flat CP group and/or the two hierarchical ones."""

    rank: int
    size: int
    flat: dist.ProcessGroup | None
    has_flat: bool
    hier: tuple[tuple[dist.ProcessGroup | None, int, int], tuple[dist.ProcessGroup | None, int, int]] | None
    """``((a2a group, rank, size), (ring group, rank, size))`` when hierarchical groups were given."""

    def comms(self) -> tuple[str, ...]:
        """The comms these groups can run (``auto`` chooses among them)."""
        return (FLAT_COMMS if self.has_flat else ()) + (("a2a+p2p",) if self.hier is not None else ())

    def levels(self, comm: str) -> tuple[tuple[dist.ProcessGroup | None, int, int], tuple[dist.ProcessGroup | None, int, int]]:
        """``(a2a level, ring level)`` of an a2a comm: ``"a2a"`` is the flat group and a ring of one."""
        if comm == "a2a":
            return (self.flat, self.rank, self.size), (None, 0, 1)
        assert self.hier is not None
        return self.hier

    def a2a_size(self, comm: str) -> int:
        return self.levels(comm)[0][2]


def cp_place(group: object, comm: str) -> CPPlace:
    """Resolve ``ring_attention``'s ``group`` for ``comm``; ValueError naming ``group`` when it cannot serve it."""
    if isinstance(group, tuple):
        if len(group) not in (2, 3):
            raise ValueError(f"group as a tuple must be (a2a_group, ring_group) or CPGroups, got {len(group)} items")
        (ga, ra, a), (gr, rr, r) = ((g, *group_rank_size(g)) for g in group[:2])
        flat = group[2] if len(group) == 3 else None
        if flat is not None:
            rank, size = group_rank_size(flat)
            if (rank, size) != (rr * a + ra, a * r):
                raise ValueError(f"CPGroups: cp rank {rank} of {size} is not ring rank {rr} x a2a size {a} + a2a rank "
                                 f"{ra} (of cp {a} x {r}); a2a groups must be adjacent CP ranks")
        place = CPPlace(rr * a + ra, a * r, flat, flat is not None, ((ga, ra, a), (gr, rr, r)))
    else:
        rank, size = group_rank_size(group)  # type: ignore[arg-type]
        place = CPPlace(rank, size, group, True, None)  # type: ignore[arg-type]
    if comm != "auto" and comm not in place.comms():
        if comm == "a2a+p2p":
            raise ValueError("comm='a2a+p2p' needs group=(a2a_group, ring_group) or a CPGroups (e.g. "
                             "init_parallel(...).cp_groups), got a single process group")
        if comm in FLAT_COMMS:
            raise ValueError(f"comm={comm!r} needs the whole CP group: pass group=<cp group> or "
                             "CPGroups(a2a, ring, cp) with cp set")
    return place
