"""The all-gather baseline: every rank gathers every K/V shard (``comm="all_gather"``).

Kept for comparison with the ring (the seeds' criticism: O(L) memory per rank, all data moved at
once) and for Megatron's ``cp_comm_type="all_gather"``. It feeds the same per-step schedule as the
ring, so both paths compute identical blocks (in another order).

Note [All-gather overlap]
~~~~~~~~~~~~~~~~~~~~~~~~~
As in Transformer Engine's all-gather CP, the rank's own block is computed while the gather of
the others is in flight, in forward and again in backward (which gathers K/V again rather than
keep P blocks per layer). Then the blocks come in rank order on every rank, so that in backward
the gradient of block j can be reduced to its owner j (one ``reduce`` each, in the same order
everywhere, as collectives must be) as soon as block j is done here, behind the next blocks'
compute: every rank has finished blocks 0..j (its own one first) when it issues reduction j. On
this machine four reductions also took 0.8x the time of one all-reduce of the same buffer.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_ring.attention.instrument import wait_all
from megatron_ring.attention.schedule import StepPlan


def start_gather_stacked(x: torch.Tensor, group: dist.ProcessGroup | None,
                         size: int) -> tuple[torch.Tensor, dist.Work | None]:
    """Start gathering every rank's ``x`` in rank order into ``[size, *x.shape]``; returns the
    buffer and the work to wait on before reading it (None when there is nothing to wait for)."""
    if size == 1:
        return x.unsqueeze(0), None
    flat = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer name first
    return flat.view(size, *x.shape), gather(flat, x.contiguous(), group=group, async_op=True)


def all_gather_stacked(x: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """Every rank's ``x`` stacked in rank order: ``[size, *x.shape]`` (one all-gather)."""
    gathered, work = start_gather_stacked(x, group, size)
    if work is not None:
        work.wait()
    return gathered


class GatheredKV:
    """K/V blocks from one all-gather; the gradient of block j reduced to rank j as soon as it is
    complete here (Note [All-gather overlap])."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self._sent_steps = self._sent_bytes = 0
        self._grads: torch.Tensor | None = None
        self._complete: set[int] = set()
        self._reduces: list[dist.Work] = []

    def take_traffic(self) -> tuple[int, int]:
        """``(steps, bytes)`` since the last call, as the equivalent ring volume: P-1 K/V steps per
        pass, and P gradient steps in backward."""
        traffic = (self._sent_steps, self._sent_bytes)
        self._sent_steps = self._sent_bytes = 0
        return traffic

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(src, k_src, v_src)``, each ``[batch, heads_kv, seq_local, head_dim]``: this rank's own
        block while the gather is in flight, then the others in rank order."""
        kv = torch.stack((k, v))
        gathered, work = start_gather_stacked(kv, self.group, self.size)
        self._sent_steps += self.size - 1
        self._sent_bytes += kv.numel() * kv.element_size() * (self.size - 1)
        yield self.rank, k, v
        wait_all([work] if work is not None else [], k.device)
        for src in range(self.size):
            if src != self.rank:
                yield src, gathered[src, 0], gathered[src, 1]

    def start_grads(self, kv_shape: torch.Size, dtype: torch.dtype, device: torch.device) -> None:
        self._grads = torch.zeros((self.size, *kv_shape), dtype=dtype, device=device)
        self._complete, self._reduces = set(), []

    def add_grads(self, src: int, grads: Sequence[tuple[StepPlan, torch.Tensor, torch.Tensor]]) -> None:
        """Add this step's dK/dV pieces ``(plan, dk, dv)`` for block ``src``, which is then complete
        here; start the reductions that are due."""
        assert self._grads is not None
        for plan, dk, dv in grads:
            self._grads[src, 0][:, :, plan.k] += dk
            self._grads[src, 1][:, :, plan.k] += dv
        self._complete.add(src)
        while self.size > 1 and len(self._reduces) in self._complete:
            owner = len(self._reduces)
            dst = dist.get_global_rank(self.group, owner) if self.group is not None else owner
            self._reduces.append(dist.reduce(self._grads[owner], dst, group=self.group, async_op=True))

    def finish_grads(self) -> torch.Tensor:
        """This rank's ``[2, batch, heads_kv, seq_local, head_dim]`` K/V gradient, summed over ranks."""
        assert self._grads is not None
        grads, self._grads = self._grads, None
        if self.size == 1:
            return grads[0]
        wait_all(self._reduces, grads.device)
        self._sent_steps += self.size
        self._sent_bytes += grads[0].numel() * grads.element_size() * self.size
        return grads[self.rank]
