"""torch.distributed process groups for a :class:`ParallelLayout`: tp, cp, dp, pp and the ring.

Every rank must call :func:`init_parallel` with the same layout, after
``torch.distributed.init_process_group``. Each group is created with a timeout, so a rank that
disagrees with its peers (shapes, sizes) fails with an error instead of waiting forever.
Megatron-core users who already called ``parallel_state.initialize_model_parallel`` get the same
object from :func:`megatron_ring.integrations.megatron.state.parallel_from_megatron` instead.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from megatron_ring.attention.comms import CPGroups
from megatron_ring.parallel.layout import AXES, HIERARCHICAL_LEVELS, ParallelLayout

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""Collective timeout of every group we create unless the caller gives another."""

GROUP_AXES: tuple[str, ...] = AXES + ("dp-cp", "tp-cp")
"""Groups built by :func:`init_parallel`: the four axes and the two joint ones Megatron also keeps
(``dp-cp`` reduces gradients of weights replicated over data- and context-parallel ranks)."""


@dataclass
class ParallelGroups:
    """This rank's process groups and its place on the context-parallel ring."""

    layout: ParallelLayout
    rank: int
    groups: dict[str, dist.ProcessGroup] = field(repr=False)
    ranks: dict[str, list[int]]
    timeout: Optional[timedelta] = None
    """Collective timeout the groups were created with (None: not created by :func:`init_parallel`)."""

    @property
    def tp(self) -> dist.ProcessGroup:
        return self.groups["tp"]

    @property
    def pp(self) -> dist.ProcessGroup:
        return self.groups["pp"]

    @property
    def cp(self) -> dist.ProcessGroup:
        return self.groups["cp"]

    @property
    def dp(self) -> dist.ProcessGroup:
        return self.groups["dp"]

    @property
    def dp_cp(self) -> dist.ProcessGroup:
        return self.groups["dp-cp"]

    @property
    def cp_groups(self) -> CPGroups:
        """``CPGroups(a2a, ring, cp)`` for ``ring_attention`` (any comm, ``a2a+p2p`` included);
        ValueError unless the layout sets ``cp_a2a``."""
        if "cp-a2a" not in self.groups:
            raise ValueError("this layout has no hierarchical CP groups: build it with ParallelLayout(cp=.., cp_a2a=..)")
        return CPGroups(self.groups["cp-a2a"], self.groups["cp-ring"], self.cp)

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)

    @property
    def cp_rank(self) -> int:
        return self.ranks["cp"].index(self.rank)

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    @property
    def ring_next(self) -> int:
        """Global rank this rank sends K/V to."""
        ring = self.ranks["cp"]
        return ring[(self.cp_rank + 1) % len(ring)]

    @property
    def ring_prev(self) -> int:
        """Global rank this rank receives K/V from."""
        ring = self.ranks["cp"]
        return ring[(self.cp_rank - 1) % len(ring)]


_CREATED: dict[tuple[ParallelLayout, timedelta], tuple[object, ParallelGroups]] = {}
"""Groups already created in this process, keyed by layout and timeout, with the world they belong to."""


def init_parallel(layout: ParallelLayout, *, timeout: timedelta = DEFAULT_TIMEOUT) -> ParallelGroups:
    """Create the process groups of ``layout`` and return this rank's.

    Works on any backend (nccl, gloo, the fake backend). All ranks create all groups in the same
    order, as torch.distributed requires. Idempotent: a second call with the same layout and timeout
    in the same world returns the groups of the first (unless one of them was destroyed since), as
    re-creating them would leak a gloo group's threads and sockets on every call.
    """
    if not isinstance(layout, ParallelLayout):
        raise TypeError(f"layout must be a ParallelLayout, got {type(layout).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("init_parallel needs torch.distributed.init_process_group to have been called")
    layout.check_world_size(dist.get_world_size())
    world, key = dist.group.WORLD, (layout, timeout)
    if key in _CREATED and _CREATED[key][0] is world:
        cached = _CREATED[key][1]
        if all(g in dist.distributed_c10d._world.pg_map for g in cached.groups.values()):
            return cached
    rank = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    ranks: dict[str, list[int]] = {}
    levels = HIERARCHICAL_LEVELS if layout.cp_a2a is not None else ()
    for axis in GROUP_AXES + levels:
        for members in layout.groups(axis) if axis in GROUP_AXES else layout.hierarchical_groups(axis):
            group = dist.new_group(members, timeout=timeout)
            if rank in members:
                mine[axis], ranks[axis] = group, members
    groups = ParallelGroups(layout=layout, rank=rank, groups=mine, ranks=ranks, timeout=timeout)
    _CREATED[key] = (world, groups)
    return groups


def destroy_groups(which: Optional[Callable[[dist.ProcessGroup], bool]] = None) -> None:
    """Destroy every live process group but the world (those ``which`` selects, if given), then join their
    threads: the one teardown of groups (Megatron's re-initialisation, a test's scope, a pool worker's reset).

    A gloo group's threads end when its last reference goes (Note [Leaving torch.distributed]), so the
    caller must not hold the groups itself; the collection runs after the frame that listed them ended.
    """
    _destroy_listed(which)
    gc.collect()


def _destroy_listed(which: Optional[Callable[[dist.ProcessGroup], bool]]) -> None:
    if dist.is_initialized():
        world = dist.GroupMember.WORLD
        for group in [g for g in dist.distributed_c10d._world.pg_map
                      if g is not world and (which is None or which(g))]:
            dist.destroy_process_group(group)


def leave_distributed() -> None:
    """End this process's part in torch.distributed: wait for every rank, forget the groups
    :func:`init_parallel` cached, destroy every process group and join their threads now.

    Note [Leaving torch.distributed]: a gloo group's threads end when its last reference goes. A
    group still referenced at interpreter exit (our cache of a layout's groups) is destroyed during
    finalisation, after the peers may have closed their sockets, and one run in ten of
    ``torchrun --nnodes 2 -m megatron_ring.demo`` ended with ``terminate called without an active
    exception`` (SIGABRT) on one rank, or with the launcher waiting for it. The barrier lets no
    rank close its sockets while another still talks; the collection joins the threads while the
    interpreter is whole.
    """
    if not dist.is_initialized():
        return
    dist.barrier()
    _CREATED.clear()
    dist.destroy_process_group()
    gc.collect()
