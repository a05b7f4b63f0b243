"""The all-gather baseline: every rank gathers every K/V shard (``comm="all_gather"``).

Kept for comparison with the ring (the seeds' criticism: O(L) memory per rank, all data moved at
once) and for Megatron's ``cp_comm_type="all_gather"``. It feeds the same per-step schedule as the
ring, so both paths compute identical blocks (in another order).

Note [All-gather overlap]
~~~~~~~~~~~~~~~~~~~~~~~~~
As in Transformer Engine's all-gather CP, the rank's own block is computed while the gather of the others is in flight,
in forward and again in backward (which gathers K/V again rather than keep P blocks per layer). Then the blocks come in
rank order on every rank, so that in backward the gradient of block j can be reduced to its owner j (one ``reduce``
each, in the same order everywhere, as collectives must be) as soon as block j is done here, behind the next blocks'
compute: every rank has finished blocks 0..j (its own one first) when it issues reduction j. On this machine four
reductions also took 0.8x the time of one all-reduce of the same buffer.

Note [Pairwise gather on gloo]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On gloo, ``all_gather_into_tensor`` of 16 MiB per rank took 2.3x the time of the same exchange done as P-1 pairwise
``isend``/``irecv`` at P = 4 (148 vs 63 ms on this 2-core machine, the same bytes) and 3.5x at P = 2 (``python -m
megatron_ring.perf.bench.gather``), and the CPU it took came out of the kernels it was meant to hide behind. So on gloo
groups K and V are sent pairwise, as two tensors (no stacking copy, and no copy of the rank's own block), and each
source's block is computed on as soon as its own receives complete rather than after the whole gather. Other backends
keep one collective (NCCL's all-gather is its fastest path). The gradients' ``reduce`` stays: P reductions took 1.3x the
pairwise gather of the same size at P = 4, and sending the pieces pairwise to their owners instead timed the same within
the noise (the attention call at L = 16k, P = 4, forward and backward). Small gathers (handshake rows, masks, decode
partials) still use the collective, though pairwise was 1.2-1.5x faster there too (4 KiB-256 KiB).
"""
from __future__ import annotations

from typing import Iterator, NamedTuple

import torch
import torch.distributed as dist

from megatron_ring.attention.schedule import Piece
from megatron_ring.attention.transport import (
    Block, BlockAndGrads, GradPieces, add_pieces, count_sent, global_rank, start_all_gather, wait_all,
)

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
    """Start gathering every rank's ``parts`` (same shapes on every rank): pairwise transfers on gloo groups
    (Note [Pairwise gather on gloo]), one all-gather elsewhere. ``rank`` is this rank's index in ``group``."""
    parts = tuple(t.contiguous() for t in parts)
    if size == 1:
        return Gather([parts], [[]], [])
    if not _sends_pairwise(group):
        stacked, work = start_all_gather(torch.stack(parts), group, size)
        return Gather([tuple(block.unbind(0)) for block in stacked.unbind(0)], [[work]] * size, [])
    blocks = [parts if src == rank else tuple(torch.empty_like(t) for t in parts) for src in range(size)]
    peers = [src for src in range(size) if src != rank]
    ops = [dist.P2POp(dist.irecv, t, global_rank(group, src), group, _GATHER_TAG) for src in peers for t in blocks[src]]
    ops += [dist.P2POp(dist.isend, t, global_rank(group, dst), group, _GATHER_TAG) for dst in peers for t in parts]
    works = dist.batch_isend_irecv(ops)
    if len(works) != len(ops):  # a coalesced batch: one work for every transfer
        return Gather(blocks, [[] if src == rank else works for src in range(size)], [])
    n = len(parts)
    arrivals = [works[peers.index(src) * n:(peers.index(src) + 1) * n] if src != rank else [] for src in range(size)]
    return Gather(blocks, arrivals, works[len(peers) * n:])


def _sends_pairwise(group: dist.ProcessGroup | None) -> bool:
    """Whether :func:`start_gather_blocks` sends pairwise over ``group`` (Note [Pairwise gather on gloo])."""
    return dist.get_backend(group) == "gloo"


class GatheredBlocks:
    """K/V blocks from one gather; the gradient of block j reduced to rank j as soon as it is
    complete here (Note [All-gather overlap])."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int, piece: Piece | None) -> None:
        self.group, self.rank, self.size, self.piece = group, rank, size, piece

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[Block]:
        """``(src, piece, k_src, v_src)`` (a whole piece; None when a caller cuts pieces out), each
        ``[batch, heads_kv, seq_local, head_dim]`` heads-first: this rank's own block while the gather is in flight,
        then the others in rank order, each once it has arrived. Counted as the ring's volume: P-1 steps of K/V."""
        k, v = k.contiguous(), v.contiguous()  # heads-first (Note [Heads-first blocks] in ring.py)
        gather = start_gather_blocks((k, v), self.group, self.rank, self.size)
        count_sent(self.size - 1, 2 * k.numel() * k.element_size() * (self.size - 1))
        yield self.rank, self.piece, k, v
        for src in range(self.size):
            if src != self.rank:
                wait_all(gather.arrivals[src], k.device)
                yield src, self.piece, *gather.blocks[src]
        wait_all(gather.sends, k.device)

    def blocks_and_grads(self, k: torch.Tensor, v: torch.Tensor, dkv: torch.Tensor) -> Iterator[BlockAndGrads]:
        """The blocks of :meth:`blocks`, each with an outbox. Each block's gradient is its own buffer (``dkv`` for this
        rank's), allocated when the block completes, and reduced to its owner in rank order as soon as blocks 0..j are
        done (Note [All-gather overlap])."""
        done: dict[int, torch.Tensor] = {}
        reduces: list[dist.Work] = []
        for src, piece, k_src, v_src in self.blocks(k, v):
            outbox: GradPieces = []
            yield src, piece, k_src, v_src, outbox
            done[src] = dkv if src == self.rank else torch.zeros_like(dkv)
            add_pieces(done[src], outbox)
            del outbox
            while self.size > 1 and len(reduces) in done:
                owner = len(reduces)
                reduces.append(dist.reduce(done[owner], global_rank(self.group, owner), group=self.group,
                                           async_op=True))
        if self.size > 1:
            wait_all(reduces, dkv.device)
            count_sent(self.size, dkv.numel() * dkv.element_size() * self.size)
