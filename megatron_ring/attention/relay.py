"""The relay ring (``comm="p2p"``): every K/V block passes around the ring, one hop per step.

Note [Overlap and double buffering]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
At step t the ring posts the send of the current K/V and the receive of the next *before*
computing on the current block, and waits only after the compute: the transfer hides behind the
attention math when compute >= communication (L/P above the crossover). Step 0 sends a
heads-first copy of the rank's own K/V (the caller's tensors when they already are); two
buffers, allocated once per pass, alternate after that, the copy's one of them. The buffer being
received into was last read at step t-1, whose communication has completed, so there is no
hazard. Only the ``heads_kv`` heads travel, heads-first (Note [Heads-first blocks] in ring.py)
in the caller's dtype (bf16 for bf16 models) in forward; the backward's dK/dV accumulator
travels in fp32, twice the bytes of bf16 K/V.

Backward runs a second ring: K/V rotate as in forward, and a gradient accumulator (fp32) travels
one step behind them, collecting every rank's dK/dV contribution for that block; the last transfer
carries it home to the block's owner, straight into the caller's ``dkv``. A step's pieces are
added to the accumulator only after the previous step's gradient transfer has landed, which is
after this step's compute: that transfer hides behind the compute too.

Note [Forward memory]
~~~~~~~~~~~~~~~~~~~~~
A rank computes on one block while the next arrives, and its neighbour needs that block at the
very next step, so a relay holds two blocks of K/V in flight. In forward the relay therefore runs
one ring per head group (``g`` groups of the ``heads_kv`` heads, with their query heads): all
P steps of group 0, then of group 1, ... Within a group it is the double-buffered relay above on 1/g of
the heads, so it needs two buffers of 1/g of a block, reused from group to group, and every transfer
still hides behind a kernel on the same group. (Interleaving the groups step by step would need
``g + 1`` such buffers, as the neighbour takes a piece only ``g`` kernels after it was
sent; a split along the sequence would leave zigzag's second chunk with no work on half the steps,
its transfer exposed.) Step 0 of a group copies that group's own K/V heads-first (Note [Heads-first
blocks] in ring.py) into one of the buffers, and ring_forward copies that group's q. So a forward
call at P ranks and g = 2 holds, with ``X`` = its local q: the output accumulator (X, in the compute dtype;
the output itself when fp32), the lse, one group's q (X / 2), two half blocks of K and V (2X when
``heads_kv = heads_q``) and one kernel's output for one group (X / 2 at most): about 4X, where it
held 9X with whole copies of q, k and v and two whole receive blocks (docs/performance.md §3; at
P = 1, 3X). Costs: the transfers are g x (P - 1) messages of 1 / g of a block each, and
each kernel call takes 1 / g of the heads (on a GPU, fewer thread blocks per call). Backward
rotates whole blocks (one group), its dK/dV accumulators with them.

The groups are schedule pieces (``split_heads``, Note [Pieces] in ring.py), so the loop does not know them. How
many is a trade of buffer memory against per-message latency, which the cost model makes per call (Note [Pieces per
hop] in costs/comm_choice.py: 2 where the extra messages cost under 2 % of the ring's time, else 1) and which
``costs.comm_choice.PIECES`` overrides; the call carries it (``RingCall.relay_pieces``). comm="auto" and the planner
count the messages it sends (``traffic.p2p_forward_messages``). On NCCL a message costs about 25 us
(profiles/h100-sxm.json), on gloo 200 us.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from megatron_ring.attention.schedule import Piece
from megatron_ring.attention.transport import Block, BlockAndGrads, GradPieces, add_pieces, post, wait_all

_KV_TAG, _GRAD_TAG = 0, 1


def split_heads(piece: Piece, n: int) -> tuple[Piece, ...]:
    """A whole ``piece`` cut into ``n`` groups of its K/V heads (``n`` divides them), each with its
    query heads and the same schedule."""
    if n == 1:
        return (piece,)
    kv, q = (piece.kv.stop - piece.kv.start) // n, (piece.q.stop - piece.q.start) // n
    return tuple(Piece(slice(piece.q.start + j * q, piece.q.start + (j + 1) * q),
                       slice(piece.kv.start + j * kv, piece.kv.start + (j + 1) * kv),
                       ((slice(0, q), slice(0, kv)),), piece.schedule) for j in range(n))


class RelayRing:
    """K/V rotation over ``group`` (rank ``rank`` of ``size``) with batched send/recv, of a whole ``piece``
    (schedule.py), in ``pieces`` head groups in forward (a divisor of its K/V heads)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int, piece: Piece, pieces: int = 1) -> None:
        self.group, self.rank, self.size, self.piece, self.pieces = group, rank, size, piece, pieces
        self.next, self.prev = (rank + 1) % size, (rank - 1) % size

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[Block]:
        """``(src, piece, k_src, v_src)``: one ring per head group (a piece of the whole one), each
        yielding t = 0..P-1 with ``src = (rank - t) mod P`` (Note [Forward memory])."""
        free: list[tuple[torch.Tensor, torch.Tensor]] = []
        for piece in split_heads(self.piece, self.pieces):
            yield from self._rotate(k, v, piece, free)

    def _rotate(self, k: torch.Tensor, v: torch.Tensor, piece: Piece,
                free: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[Block]:
        """The K/V heads of ``piece`` of every block, the next one in flight while the caller computes
        on the current. The own block is ``k``/``v`` sliced when contiguous (no copy), else a heads-first
        copy; copies and receive buffers are taken from ``free`` and go back to it once sent and used."""
        heads = piece.kv

        def buffer() -> tuple[torch.Tensor, torch.Tensor]:
            width = heads.stop - heads.start
            return free.pop() if free else (k.new_empty((k.shape[0], width, *k.shape[2:])),
                                            v.new_empty((v.shape[0], width, *v.shape[2:])))

        cur = (k[:, heads], v[:, heads])
        pooled = not (cur[0].is_contiguous() and cur[1].is_contiguous())
        if pooled:
            kb, vb = buffer()
            cur = (kb.copy_(cur[0]), vb.copy_(cur[1]))
        for step in range(self.size):
            nxt = buffer() if step < self.size - 1 else None
            works = [] if nxt is None else post(self.group, [(self.next, t) for t in cur],
                                                [(self.prev, t) for t in nxt], _KV_TAG)
            yield (self.rank - step) % self.size, piece, cur[0], cur[1]
            wait_all(works, k.device)
            if pooled:
                free.append(cur)
            if nxt is not None:
                cur, pooled = nxt, True

    def blocks_and_grads(self, k: torch.Tensor, v: torch.Tensor, dkv: torch.Tensor) -> Iterator[BlockAndGrads]:
        """Whole blocks (all heads), each with an outbox; the accumulator of block ``src``
        passes on after its step (Note [Overlap and double buffering]). The two accumulators are
        ``dkv`` and one more buffer: an accumulator is free again once its transfer has landed."""
        # dkv is accs[size % 2], where the last transfer lands; accs[0] holds the first sum, from zeros
        if self.size == 1:
            accs = [dkv]
        else:
            accs = [dkv, torch.empty_like(dkv)] if self.size % 2 == 0 else [torch.zeros_like(dkv), dkv]
        works: list[dist.Work] = []
        for step, (src, piece, k_src, v_src) in enumerate(self._rotate(k, v, self.piece, [])):
            outbox: GradPieces = []
            yield src, piece, k_src, v_src, outbox
            wait_all(works, k.device)
            acc = accs[step % len(accs)]
            add_pieces(acc, outbox)
            del outbox
            if self.size > 1:
                home = accs[(step + 1) % 2]
                works = post(self.group, [(self.next, acc)], [(self.prev, home)], _GRAD_TAG)
        wait_all(works, k.device)
