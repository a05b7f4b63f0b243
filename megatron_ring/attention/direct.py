"""K/V transfers for sparse schedules (sliding windows, packed documents): each block goes straight
from its owner to the ranks that use it, and only the rows they use.

Note [Direct transfers]
~~~~~~~~~~~~~~~~~~~~~~~
The plain ring relays every block through every rank: P-1 hops, whatever the work. With a window (or documents) a rank
needs few blocks, and often only some of their rows: under causal zigzag with a window of one chunk, rank r needs one
chunk from its left and one from its right neighbour, which a relay would only deliver at the *last* step, after every
transfer. So here, at step t (t = 1..P-1), rank r

* receives block ``src = (r - t) mod P`` straight from ``src``, only the rows its plans read
  (``Schedule.recv_rows[t]``), and only when its plan for ``src`` is not empty;
* sends the rows of its own K/V that rank ``(r + t) mod P`` reads (``send_rows[t]``), if any.

A step where a rank neither sends nor receives is skipped (no kernel call, no transfer): the rule is "transfer exactly
the rows some plan reads", so once no remaining block can fall in the window nothing more moves; with contiguous
sharding and a causal window of w chunks this is the ring stopping after ``ceil(w)`` steps. Both sides derive the rows
from the same pure schedule, so sends and receives pair up. Every rank walks all steps t = 1..P-1 in the same order,
posting step t+1's K/V before step t's gradients (posting nothing where it has nothing), so the p2p operations between
two ranks are posted in the same order on both, as NCCL requires (it ignores tags). The transfer of the next needed step
is in flight while the current block computes (two receive buffers: Note [Overlap and double buffering], relay.py).

Backward is the mirror image: the rows of dK/dV (fp32) computed on a received block go straight back to its owner at the
same step, which adds them to its own gradient; no accumulator travels. Received rows land in full-length
``[seq, batch, heads, dim]`` buffers (a row range is then one contiguous piece), whose unread rows are never touched.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from megatron_ring.attention.schedule import Piece
from megatron_ring.attention.transport import Block, BlockAndGrads, GradPieces, add_pieces, post, wait_all

_KV_TAG, _GRAD_TAG = 2, 3
_Whole = tuple[int, torch.Tensor, torch.Tensor]
"""``(src, k_src, v_src)``: a whole block (every head)."""


class DirectTransfers:
    """Point-to-point transfers of exactly the rows a piece's :class:`~megatron_ring.attention.schedule.Schedule`
    reads (Note above); ``k``/``v`` hold the piece's heads and rows."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int, piece: Piece) -> None:
        self.group, self.rank, self.size, self.piece, self.schedule = group, rank, size, piece, piece.schedule

    def _walk(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[tuple[int, _Whole | None]]:
        """``(t, block)`` for every step t = 0..P-1 in order (see the Note on ordering), ``block`` None where this rank
        reads nothing of block ``rank - t``; step t+1's K/V are in flight while step t's block is out. Only the used
        rows of a received block hold data."""
        k, v = k.contiguous(), v.contiguous()  # heads-first (Note [Heads-first blocks] in ring.py)
        own = (k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3))  # [seq, batch, heads, dim] views
        buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # two slots, allocated on first use
        recv_rows, send_rows = self.schedule.recv_rows, self.schedule.send_rows
        shape = (max([own[0].shape[0]] + [r.stop for r in recv_rows if r is not None]), *own[0].shape[1:])

        def start(t: int) -> list[dist.Work]:
            sends = [] if send_rows[t] is None else [((self.rank + t) % self.size, x[send_rows[t]].contiguous())
                                                     for x in own]
            recvs = []
            if recv_rows[t] is not None:
                if t % 2 not in buffers:
                    buffers[t % 2] = (own[0].new_empty(shape), own[1].new_empty(shape))  # rows: the longest block
                recvs = [((self.rank - t) % self.size, x[recv_rows[t]]) for x in buffers[t % 2]]
            return post(self.group, sends, recvs, _KV_TAG)

        works = start(1) if self.size > 1 else []
        yield 0, ((self.rank, k, v) if recv_rows[0] is not None else None)
        for t in range(1, self.size):
            wait_all(works, k.device)
            works = start(t + 1) if t + 1 < self.size else []
            block = None
            if recv_rows[t] is not None:
                kb, vb = buffers[t % 2]
                block = ((self.rank - t) % self.size, kb.permute(1, 2, 0, 3), vb.permute(1, 2, 0, 3))
            yield t, block
        wait_all(works, k.device)

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[Block]:
        """``(src, piece, k_src, v_src)`` (the piece's heads, ``[batch, heads, rows, head_dim]``) of
        the blocks this rank's plans read, its own first."""
        for _, block in self._walk(k, v):
            if block is not None:
                yield block[0], self.piece, block[1], block[2]

    def blocks_and_grads(self, k: torch.Tensor, v: torch.Tensor, dkv: torch.Tensor) -> Iterator[BlockAndGrads]:
        """The blocks of :meth:`blocks`, each with an outbox. After step t, the rows of dK/dV computed on block
        ``rank - t`` go home to it, and the rows rank ``rank + t`` computed on this rank's block come in (added to
        ``dkv`` once landed, after the next step's compute)."""
        works: list[dist.Work] = []
        landing: tuple[slice, torch.Tensor] | None = None
        for t, block in self._walk(k, v):
            outbox: GradPieces = []
            if block is not None:
                yield block[0], self.piece, block[1], block[2], outbox
            if t == 0:
                add_pieces(dkv, outbox)
                continue
            wait_all(works, k.device)
            if landing is not None:
                dkv[:, :, :, landing[0]] += landing[1]
            sends, recvs, landing = [], [], None
            rows = self.schedule.recv_rows[t]
            if outbox and rows is not None:
                out = dkv.new_zeros(_rows_shape(dkv, rows))
                add_pieces(out, outbox, rows.start)
                sends = [((self.rank - t) % self.size, out)]
            back = self.schedule.send_rows[t]
            if back is not None:
                landing = (back, dkv.new_empty(_rows_shape(dkv, back)))
                recvs = [((self.rank + t) % self.size, landing[1])]
            works = post(self.group, sends, recvs, _GRAD_TAG)
        wait_all(works, k.device)
        if landing is not None:
            dkv[:, :, :, landing[0]] += landing[1]


def _rows_shape(dkv: torch.Tensor, rows: slice) -> list[int]:
    """``dkv``'s shape ``[2, batch, heads_kv, seq, head_dim]`` with ``rows.stop - rows.start`` rows."""
    shape = list(dkv.shape)
    shape[3] = rows.stop - rows.start
    return shape
