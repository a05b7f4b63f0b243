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
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from megatron_ring.attention.transport import Block, BlockAndGrads, GradPieces, add_pieces, post, wait_all

_KV_TAG, _GRAD_TAG = 0, 1


class RelayRing:
    """K/V rotation over ``group`` (rank ``rank`` of ``size``) with batched send/recv."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.next, self.prev = (rank + 1) % size, (rank - 1) % size

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[Block]:
        """``(src, k_src, v_src)`` for t = 0..P-1, ``src = (rank - t) mod P``; the first send reads
        ``k``/``v`` (no copy when contiguous), at most two receive buffers are allocated."""
        cur = (k.contiguous(), v.contiguous())
        spare: list[tuple[torch.Tensor, torch.Tensor]] = []
        for step in range(self.size):
            works: list[dist.Work] = []
            if step < self.size - 1:
                if len(spare) < min(2, self.size - 1):
                    spare.append((torch.empty_like(cur[0]), torch.empty_like(cur[1])))
                nxt = spare[step % len(spare)]
                works = post(self.group, [(self.next, t) for t in cur], [(self.prev, t) for t in nxt], _KV_TAG)
            yield (self.rank - step) % self.size, cur[0], cur[1]
            wait_all(works, k.device)
            if works:
                cur = nxt

    def blocks_and_grads(self, k: torch.Tensor, v: torch.Tensor, dkv: torch.Tensor) -> Iterator[BlockAndGrads]:
        """The blocks of :meth:`blocks`, each with an outbox; the accumulator of block ``src`` passes
        on after its step (Note [Overlap and double buffering])."""
        accs = (dkv,) if self.size == 1 else (torch.zeros_like(dkv), torch.empty_like(dkv))
        works: list[dist.Work] = []
        for step, (src, k_src, v_src) in enumerate(self.blocks(k, v)):
            outbox: GradPieces = []
            yield src, k_src, v_src, outbox
            wait_all(works, k.device)
            acc = accs[step % len(accs)]
            add_pieces(acc, outbox)
            del outbox
            if self.size > 1:
                home = dkv if step == self.size - 1 else accs[(step + 1) % 2]
                works = post(self.group, [(self.next, acc)], [(self.prev, home)], _GRAD_TAG)
        wait_all(works, k.device)
