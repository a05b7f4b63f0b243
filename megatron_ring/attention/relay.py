"""The relay ring (``comm="p2p"``): every K/V block passes around the ring, one hop per step.

Note [Overlap and double buffering]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
At step t the ring posts the send of the current K/V and the receive of the next *before*
computing on the current block, and waits only after the compute: the transfer hides behind the
attention math when compute >= communication (L/P above the crossover). Step 0 sends the
caller's own K/V; two receive buffers (one for P = 2), allocated once per pass, alternate after
that. The buffer being received into was last read at step t-1, whose communication has
completed, so there is no hazard. Only the ``heads_kv`` heads travel, heads-first (Note
[Heads-first blocks] in ring.py) in the caller's dtype (bf16 for bf16 models) in forward; the
backward's dK/dV accumulator travels in fp32, twice the bytes of bf16 K/V.

Backward runs a second ring: K/V rotate as in forward, and a gradient accumulator (fp32) travels
one step behind them, collecting every rank's dK/dV contribution for that block; the last transfer
carries it home to the block's owner, straight into the caller's ``dkv``. A step's pieces are
added to the accumulator only after the previous step's gradient transfer has landed, which is
after this step's compute: that transfer hides behind the compute too.

Note [Forward memory]
~~~~~~~~~~~~~~~~~~~~~
A ring rank holds one block of K/V while computing on it and receives the next meanwhile, so K/V
in flight cost two blocks (``2 x 2 x s x heads_kv x head_dim`` elements with ``s = L/P``). In
forward the relay moves a block as ``PIECES`` head groups, each its own message: piece j of step t
is sent on and computed while piece j of step t+1 arrives, and its buffer takes a later piece as
soon as both are done. At most ``pieces + 1`` piece buffers are alive (1.5 blocks for 2 pieces),
every transfer still hides behind a kernel on a piece, and every piece has the same work (a
split along the sequence would leave zigzag's second chunk with no work on half the steps, its
transfer exposed). The rank's own block is copied into those buffers piece by piece, heads-first
(Note [Heads-first blocks] in ring.py), when it is first sent: the call keeps no copy of k and v.
So a forward call at P ranks holds, besides its output: the heads-first copy of q, the output
accumulator and lse (compute dtype), ``pieces + 1`` K/V pieces, and one kernel's output for one
piece's query heads (``1/pieces`` of q at most); none of it grows with L beyond ``L/P``. Backward
rotates whole blocks (one piece), its dK/dV accumulators with them.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_ring.attention.transport import Block, BlockAndGrads, GradPieces, add_pieces, post, wait_all

_KV_TAG, _GRAD_TAG = 0, 1
PIECES = 2
"""Head groups a forward block travels and is computed in (Note [Forward memory]); fewer when
``heads_kv`` does not split so many ways (one for MQA)."""


class RelayRing:
    """K/V rotation over ``group`` (rank ``rank`` of ``size``) with batched send/recv."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.next, self.prev = (rank + 1) % size, (rank - 1) % size

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[Block]:
        """``(src, heads, k_src, v_src)``: one ring per head group, each yielding t = 0..P-1 with
        ``src = (rank - t) mod P`` (Note [Forward memory])."""
        pieces = math.gcd(PIECES, k.shape[1])
        width = k.shape[1] // pieces
        free: list[tuple[torch.Tensor, torch.Tensor]] = []
        for j in range(pieces):
            yield from self._rotate(k, v, slice(j * width, (j + 1) * width), free)

    def _rotate(self, k: torch.Tensor, v: torch.Tensor, heads: slice,
                free: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[Block]:
        """Heads ``heads`` of every block, the next one in flight while the caller computes on the
        current. The own block is ``k``/``v`` sliced when contiguous (no copy), else a heads-first
        copy; copies and receive buffers are taken from ``free`` and go back to it once sent and used."""
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
            works: list[dist.Work] = []
            if step < self.size - 1:
                nxt = buffer()
                works = post(self.group, [(self.next, t) for t in cur], [(self.prev, t) for t in nxt], _KV_TAG)
            yield (self.rank - step) % self.size, heads, cur[0], cur[1]
            wait_all(works, k.device)
            if pooled:
                free.append(cur)
            if works:
                cur, pooled = nxt, True

    def blocks_and_grads(self, k: torch.Tensor, v: torch.Tensor, dkv: torch.Tensor) -> Iterator[BlockAndGrads]:
        """Whole blocks (all heads), each with an outbox; the accumulator of block ``src``
        passes on after its step (Note [Overlap and double buffering]). The two accumulators are
        ``dkv`` and one more buffer: an accumulator is free again once its transfer has landed."""
        # dkv is accs[size % 2], where the last transfer lands; accs[0] holds the first sum, from zeros
        other = torch.empty_like(dkv) if self.size % 2 == 0 else torch.zeros_like(dkv)
        accs = [dkv] if self.size == 1 else [dkv, other] if self.size % 2 == 0 else [other, dkv]
        works: list[dist.Work] = []
        for step, (src, _, k_src, v_src) in enumerate(self._rotate(k, v, slice(0, k.shape[1]), [])):
            outbox: GradPieces = []
            yield src, k_src, v_src, outbox
            wait_all(works, k.device)
            acc = accs[step % len(accs)]
            add_pieces(acc, outbox)
            del outbox
            if self.size > 1:
                home = accs[(step + 1) % 2]
                works = post(self.group, [(self.next, acc)], [(self.prev, home)], _GRAD_TAG)
        wait_all(works, k.device)
