"""The all-gather baseline: every rank gathers every K/V shard (``comm="all_gather"``).

Kept for comparison with the ring (the seeds' criticism: O(L) memory per rank, all data moved at
once) and for Megatron's ``cp_comm_type="all_gather"``. It feeds the same per-step schedule as the
ring, so both paths compute identical blocks in the same order. The one overlap it has, as in
Transformer Engine's all-gather CP: the rank's own block is computed while the gather is in
flight (forward and backward).
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_ring.attention.instrument import active_stats, now
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
    """K/V blocks from one all-gather; gradients summed over ranks with one reduction."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self._sent_steps = self._sent_bytes = 0
        self._grads: torch.Tensor | None = None

    def take_traffic(self) -> tuple[int, int]:
        """``(steps, bytes)`` since the last call, as the equivalent ring volume: P-1 K/V steps per
        pass, and P gradient steps in backward."""
        traffic = (self._sent_steps, self._sent_bytes)
        self._sent_steps = self._sent_bytes = 0
        return traffic

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(src, k_src, v_src)`` in ring order, each ``[batch, heads_kv, seq_local, head_dim]``:
        this rank's own block while the gather is in flight, then the gathered ones."""
        kv = torch.stack((k, v))
        gathered, work = start_gather_stacked(kv, self.group, self.size)
        self._sent_steps += self.size - 1
        self._sent_bytes += kv.numel() * kv.element_size() * (self.size - 1)
        yield self.rank, k, v
        if work is not None:
            stats = active_stats()
            start = now(k.device) if stats else 0.0
            work.wait()
            if stats:
                stats.wait_s += now(k.device) - start
        for step in range(1, self.size):
            src = (self.rank - step) % self.size
            yield src, gathered[src, 0], gathered[src, 1]

    def start_grads(self, kv_shape: torch.Size, dtype: torch.dtype, device: torch.device) -> None:
        self._grads = torch.zeros((self.size, *kv_shape), dtype=dtype, device=device)

    def add_grads(self, src: int, grads: Sequence[tuple[StepPlan, torch.Tensor, torch.Tensor]]) -> None:
        """Add this step's dK/dV pieces ``(plan, dk, dv)`` for block ``src``."""
        assert self._grads is not None
        for plan, dk, dv in grads:
            self._grads[src, 0][:, :, plan.k] += dk
            self._grads[src, 1][:, :, plan.k] += dv

    def finish_grads(self) -> torch.Tensor:
        """This rank's ``[2, batch, heads_kv, seq_local, head_dim]`` K/V gradient, summed over ranks."""
        assert self._grads is not None
        grads, self._grads = self._grads, None
        if self.size == 1:
            return grads[0]
        self._sent_steps += self.size
        self._sent_bytes += grads[0].numel() * grads.element_size() * self.size
        if dist.get_backend(self.group) == "nccl":
            mine = torch.empty_like(grads[0])
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            scatter(mine, grads.view(-1, *grads.shape[2:]), group=self.group)
            return mine
        dist.all_reduce(grads, group=self.group)  # gloo has no reduce_scatter
        return grads[self.rank]
