"""How the K/V of a dilated call travel: the compact rows of each piece (dilated_schedule.py).

* :class:`DilatedTransfers` (``comm="p2p"``): as Note [Direct transfers] in direct.py, block by
  block straight from its owner, only the compact rows some plan reads, every piece's rows of a
  step packed into one message; steps without rows are skipped; dK/dV rows go straight home.
* :class:`DilatedGather` (``comm="all_gather"``, the baseline): the whole K/V gathered
  (gather.py), each block's pieces cut out where they are used.

Both yield ``(src, blocks)`` (forward) or ``(src, blocks, grads)`` (backward) where ``blocks[i]``
is ``(kv, first)``: piece i's K/V ``[2, batch, heads_kv_piece, rows, head_dim]`` holding compact
rows ``first, first + 1, ...`` of block ``src``, and ``grads[i]`` an fp32 zero tensor of the same
shape that the caller adds dK/dV into. At the end of backward the caller's ``dkv`` ``[2, batch,
heads_kv, seq_local, head_dim]`` (zeros on entry) holds this rank's dK/dV from every rank.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_ring.attention.dilated_schedule import Piece, row_index
from megatron_ring.attention.gather import GatheredBlocks
from megatron_ring.attention.transport import post, wait_all

PieceBlocks = dict[int, tuple[torch.Tensor, int]]
PieceGrads = dict[int, torch.Tensor]
Layout = list[tuple[int, slice, tuple[int, ...], int]]
"""``(piece, compact rows, shape [2, b, h, rows, d], offset)`` of each part of a packed message."""

_KV_TAG, _GRAD_TAG = 5, 6


def compact_kv(k: torch.Tensor, v: torch.Tensor, piece: Piece, rank: int) -> torch.Tensor:
    """``[2, batch, heads_kv_piece, rows, head_dim]``: rank ``rank``'s compact K/V of ``piece``, from
    its block k, v ``[batch, heads_kv, seq_local, head_dim]``."""
    index = row_index(piece.runs[rank], k.device)
    out = k.new_empty((2, k.shape[0], piece.kv.stop - piece.kv.start, index.numel(), k.shape[-1]))
    torch.index_select(k[:, piece.kv], 2, index, out=out[0])
    torch.index_select(v[:, piece.kv], 2, index, out=out[1])
    return out


def scatter_grads(dkv: torch.Tensor, pieces: Sequence[Piece], grads: PieceGrads, rank: int) -> None:
    """Add compact gradients ``grads`` of rank ``rank``'s block into ``dkv`` ``[2, b, h_kv, seq, d]``."""
    for i, grad in grads.items():
        dkv[:, :, pieces[i].kv].index_add_(3, row_index(pieces[i].runs[rank], dkv.device), grad)


def _layout(pieces: Sequence[Piece], rows: Sequence[slice | None], like: torch.Tensor) -> tuple[Layout, int]:
    """The parts of one message carrying ``rows[i]`` of each piece, and its element count (``like``:
    a piece's compact K/V ``[2, batch, heads, rows, head_dim]``)."""
    parts: Layout = []
    total = 0
    b, d = like.shape[1], like.shape[-1]
    for i, (piece, r) in enumerate(zip(pieces, rows)):
        if r is not None:
            shape = (2, b, piece.kv.stop - piece.kv.start, r.stop - r.start, d)
            parts.append((i, r, shape, total))
            total += 2 * b * shape[2] * shape[3] * d
    return parts, total


def _views(flat: torch.Tensor, layout: Layout) -> PieceBlocks:
    return {i: (flat[at:at + torch.Size(shape).numel()].view(shape), r.start) for i, r, shape, at in layout}


class DilatedTransfers:
    """Point-to-point transfers of the compact rows the pieces' schedules read (module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int, pieces: Sequence[Piece]) -> None:
        self.group, self.rank, self.size, self.pieces = group, rank, size, pieces

    def _rows(self, t: int, side: str) -> list[slice | None]:
        return [getattr(p.schedule, side)[t] for p in self.pieces]

    def _walk(self, own: list[torch.Tensor]) -> Iterator[tuple[int, PieceBlocks]]:
        """``(t, blocks)`` for every step t = 0..P-1 in order (empty where nothing is read); step
        t+1's message is in flight while step t's blocks are out (Note [Direct transfers])."""
        def start(t: int) -> tuple[list[dist.Work], PieceBlocks]:
            send, n_send = _layout(self.pieces, self._rows(t, "send_rows"), own[0])
            recv, n_recv = _layout(self.pieces, self._rows(t, "recv_rows"), own[0])
            sends, recvs, blocks = [], [], {}
            if send:
                flat = own[0].new_empty(n_send)
                for i, (part, first) in _views(flat, send).items():
                    part.copy_(own[i][:, :, :, first:first + part.shape[3]])
                sends = [((self.rank + t) % self.size, flat)]
            if recv:
                flat = own[0].new_empty(n_recv)
                blocks = _views(flat, recv)
                recvs = [((self.rank - t) % self.size, flat)]
            return post(self.group, sends, recvs, _KV_TAG), blocks

        works, blocks = start(1) if self.size > 1 else ([], {})
        yield 0, {i: (kv, 0) for i, kv in enumerate(own) if self.pieces[i].schedule.recv_rows[0] is not None}
        for t in range(1, self.size):
            wait_all(works, own[0].device)
            current = blocks
            works, blocks = start(t + 1) if t + 1 < self.size else ([], {})
            yield t, current
        wait_all(works, own[0].device)

    def _own(self, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        return [compact_kv(k, v, p, self.rank) for p in self.pieces]

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[tuple[int, PieceBlocks]]:
        """``(src, blocks)`` of every block some piece reads, this rank's own first."""
        for t, blocks in self._walk(self._own(k, v)):
            if blocks:
                yield (self.rank - t) % self.size, blocks

    def blocks_and_grads(self, k: torch.Tensor, v: torch.Tensor,
                         dkv: torch.Tensor) -> Iterator[tuple[int, PieceBlocks, PieceGrads]]:
        """The blocks of :meth:`blocks` with their grads; after step t the rows of dK/dV computed on
        block ``rank - t`` go home, and those rank ``rank + t`` computed on this rank's come in."""
        own = self._own(k, v)
        mine = {i: dkv.new_zeros(kv.shape) for i, kv in enumerate(own)}
        works: list[dist.Work] = []
        landing: tuple[torch.Tensor, Layout] | None = None
        for t, blocks in self._walk(own):
            src = (self.rank - t) % self.size
            if t == 0:
                if blocks:
                    yield src, blocks, {i: mine[i] for i in blocks}
                continue
            layout, n_out = _layout(self.pieces, self._rows(t, "recv_rows"), own[0])
            out = dkv.new_zeros(n_out)
            if blocks:
                yield src, blocks, {i: grad for i, (grad, _) in _views(out, layout).items()}
            wait_all(works, dkv.device)
            _land(mine, landing)
            back, n_back = _layout(self.pieces, self._rows(t, "send_rows"), own[0])
            landing = (dkv.new_empty(n_back), back) if back else None
            sends = [(src, out)] if blocks else []
            recvs = [((self.rank + t) % self.size, landing[0])] if landing else []
            works = post(self.group, sends, recvs, _GRAD_TAG)
        wait_all(works, dkv.device)
        _land(mine, landing)
        scatter_grads(dkv, self.pieces, mine, self.rank)


def _land(mine: PieceGrads, landing: tuple[torch.Tensor, Layout] | None) -> None:
    """Add a landed message of dK/dV rows (flat buffer, layout) into this rank's compact grads."""
    if landing is not None:
        for i, (grad, first) in _views(*landing).items():
            mine[i][:, :, :, first:first + grad.shape[3]] += grad


class DilatedGather:
    """``comm="all_gather"``: every rank's whole K/V gathered (gather.py), pieces cut out per block."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int, pieces: Sequence[Piece]) -> None:
        self.gather, self.pieces = GatheredBlocks(group, rank, size), pieces

    def _cut(self, src: int, k_src: torch.Tensor, v_src: torch.Tensor) -> PieceBlocks:
        return {i: (compact_kv(k_src, v_src, p, src), 0) for i, p in enumerate(self.pieces) if p.schedule.plans[src]}

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[tuple[int, PieceBlocks]]:
        for src, _, k_src, v_src in self.gather.blocks(k, v):
            blocks = self._cut(src, k_src, v_src)
            if blocks:
                yield src, blocks

    def blocks_and_grads(self, k: torch.Tensor, v: torch.Tensor,
                         dkv: torch.Tensor) -> Iterator[tuple[int, PieceBlocks, PieceGrads]]:
        for src, k_src, v_src, outbox in self.gather.blocks_and_grads(k.contiguous(), v.contiguous(), dkv):
            blocks = self._cut(src, k_src, v_src)
            if not blocks:
                continue
            grads = {i: dkv.new_zeros(kv.shape) for i, (kv, _) in blocks.items()}
            yield src, blocks, grads
            full = torch.zeros_like(dkv)
            scatter_grads(full, self.pieces, grads, src)
            outbox.append((slice(0, dkv.shape[3]), full[0], full[1]))
