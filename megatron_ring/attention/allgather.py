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

Note [Pairwise gather on gloo]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On gloo, ``all_gather_into_tensor`` of 16 MiB per rank took 2.3x the time of the same exchange
done as P-1 pairwise ``isend``/``irecv`` at P = 4 (148 vs 63 ms on this 2-core machine, the same
bytes) and 3.5x at P = 2 (``python -m megatron_ring.perf.bench_gather``), and the CPU it took came
out of the kernels it was meant to hide behind. So on gloo groups K and V are sent pairwise, as
two tensors (no stacking copy, and no copy of the rank's own block), and each source's block is
computed on as soon as its own receives complete rather than after the whole gather. Other
backends keep one collective (NCCL's all-gather is its fastest path). The gradients' ``reduce``
stays: P reductions took 1.3x the pairwise gather of the same size at P = 4, and sending the
pieces pairwise to their owners instead timed the same within the noise (the attention call at
L = 16k, P = 4, forward and backward). Small gathers (handshake rows, masks, decode partials) still use the collective,
though pairwise was 1.2-1.5x faster there too (4 KiB-256 KiB).
"""
from __future__ import annotations

from typing import Iterator, NamedTuple, Sequence

import torch
import torch.distributed as dist

from megatron_ring.attention.instrument import wait_all
from megatron_ring.attention.schedule import StepPlan


_GATHER_TAG = 4


class Gather(NamedTuple):
    """A gather in flight: ``blocks[src]`` holds rank ``src``'s tensors once ``arrivals[src]`` are
    done (this rank's entry is its own tensors); ``sends`` must be done before those change."""

    blocks: list[tuple[torch.Tensor, ...]]
    arrivals: list[list[dist.Work]]
    sends: list[dist.Work]

    def wait(self) -> list[tuple[torch.Tensor, ...]]:
        """Wait for everything (untimed); returns ``blocks``."""
        for work in [w for works in self.arrivals for w in works] + self.sends:
            work.wait()
        return self.blocks


def start_gather_blocks(parts: tuple[torch.Tensor, ...], group: dist.ProcessGroup | None, rank: int,
                        size: int) -> Gather:
    """Start gathering every rank's ``parts`` (same shapes on every rank): pairwise transfers on gloo
    groups (Note [Pairwise gather on gloo]), one all-gather elsewhere. ``rank`` is this rank's index
    in ``group``."""
    parts = tuple(t.contiguous() for t in parts)
    if size == 1:
        return Gather([parts], [[]], [])
    if not _sends_pairwise(group):
        stacked, work = _start_all_gather(torch.stack(parts), group, size)
        return Gather([tuple(block.unbind(0)) for block in stacked.unbind(0)], [[work]] * size, [])
    blocks = [parts if src == rank else tuple(torch.empty_like(t) for t in parts) for src in range(size)]
    peers = [src for src in range(size) if src != rank]
    ops = [dist.P2POp(dist.irecv, t, _global(group, src), group, _GATHER_TAG) for src in peers for t in blocks[src]]
    ops += [dist.P2POp(dist.isend, t, _global(group, dst), group, _GATHER_TAG) for dst in peers for t in parts]
    works = dist.batch_isend_irecv(ops)
    if len(works) != len(ops):  # a coalesced batch: one work for every transfer
        return Gather(blocks, [[] if src == rank else works for src in range(size)], [])
    n = len(parts)
    arrivals = [works[peers.index(src) * n:(peers.index(src) + 1) * n] if src != rank else [] for src in range(size)]
    return Gather(blocks, arrivals, works[len(peers) * n:])


def _sends_pairwise(group: dist.ProcessGroup | None) -> bool:
    """Whether :func:`start_gather_blocks` sends pairwise over ``group`` (Note [Pairwise gather on gloo])."""
    return dist.get_backend(group) == "gloo"


def _start_all_gather(x: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> tuple[torch.Tensor, dist.Work]:
    """Start one all-gather of ``x`` into ``[size, *x.shape]``, in rank order."""
    flat = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer name first
    return flat.view(size, *x.shape), gather(flat, x.contiguous(), group=group, async_op=True)


def _global(group: dist.ProcessGroup | None, peer: int) -> int:
    return dist.get_global_rank(group, peer) if group is not None else peer


def all_gather_stacked(x: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """Every rank's ``x`` stacked in rank order: ``[size, *x.shape]`` (one all-gather)."""
    if size == 1:
        return x.unsqueeze(0)
    stacked, work = _start_all_gather(x, group, size)
    work.wait()
    return stacked


class GatheredKV:
    """K/V blocks from one all-gather; the gradient of block j reduced to rank j as soon as it is
    complete here (Note [All-gather overlap])."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self._sent_steps = self._sent_bytes = 0
        self._grads: dict[int, torch.Tensor] | None = None
        self._grad_block: dict[str, object] = {}
        self._reduces: list[dist.Work] = []

    def take_traffic(self) -> tuple[int, int]:
        """``(steps, bytes)`` since the last call, as the equivalent ring volume: P-1 K/V steps per
        pass, and P gradient steps in backward."""
        traffic = (self._sent_steps, self._sent_bytes)
        self._sent_steps = self._sent_bytes = 0
        return traffic

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(src, k_src, v_src)``, each ``[batch, heads_kv, seq_local, head_dim]``: this rank's own
        block while the gather is in flight, then the others in rank order, each once it has arrived."""
        gather = start_gather_blocks((k, v), self.group, self.rank, self.size)
        self._sent_steps += self.size - 1
        self._sent_bytes += 2 * k.numel() * k.element_size() * (self.size - 1)
        yield self.rank, k, v
        for src in range(self.size):
            if src != self.rank:
                wait_all(gather.arrivals[src], k.device)
                yield src, *gather.blocks[src]
        wait_all(gather.sends, k.device)

    def start_grads(self, kv_shape: torch.Size, dtype: torch.dtype, device: torch.device) -> None:
        self._grad_block = dict(size=kv_shape, dtype=dtype, device=device)
        self._grads, self._reduces = {}, []

    def add_grads(self, src: int, grads: Sequence[tuple[StepPlan, torch.Tensor, torch.Tensor]]) -> None:
        """Add this step's dK/dV pieces ``(plan, dk, dv)`` for block ``src``, which is then complete
        here; start the reductions that are due. Each block's gradient is its own buffer, allocated
        when its block completes (Note [All-gather overlap])."""
        assert self._grads is not None
        block = torch.zeros(**self._grad_block)
        for plan, dk, dv in grads:
            block[0][:, :, plan.k] += dk
            block[1][:, :, plan.k] += dv
        self._grads[src] = block
        while self.size > 1 and len(self._reduces) in self._grads:
            owner = len(self._reduces)
            self._reduces.append(dist.reduce(self._grads[owner], _global(self.group, owner), group=self.group,
                                             async_op=True))

    def finish_grads(self) -> torch.Tensor:
        """This rank's ``[2, batch, heads_kv, seq_local, head_dim]`` K/V gradient, summed over ranks."""
        assert self._grads is not None
        grads, self._grads = self._grads, None
        mine = grads[self.rank]
        if self.size == 1:
            return mine
        wait_all(self._reduces, mine.device)
        self._sent_steps += self.size
        self._sent_bytes += mine.numel() * mine.element_size() * self.size
        return mine
