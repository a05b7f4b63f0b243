"""How the K/V of a dilated call travel: its pieces' compact rows (dilated_schedule.py), moved by the plain transports;
a schedule over them, not another transport (Note [Pieces] in ring.py). Both yield what every transport yields:
``(src, piece, k_src, v_src)`` with the piece's K/V heads and compact rows of block ``src``,
``[batch, heads_kv_piece, rows, head_dim]``.

* ``comm="p2p"``: piece after piece, each piece's compact K/V through its own ``DirectTransfers``
  (Note [Direct transfers]: only the compact rows some plan reads, steps without rows skipped); dK/dV rows go straight
  home and are added into the caller's ``dkv`` by row index.
* ``comm="all_gather"`` (the baseline): the whole K/V gathered once (``GatheredBlocks``), each block's pieces cut out
  where they are used, their gradients scattered back into the block's before it is reduced home.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_ring.attention.dilated_schedule import row_index
from megatron_ring.attention.direct import DirectTransfers
from megatron_ring.attention.gather import GatheredBlocks
from megatron_ring.attention.schedule import Piece
from megatron_ring.attention.transport import Block, BlockAndGrads, GradPieces, add_pieces


def compact_kv(k: torch.Tensor, v: torch.Tensor, piece: Piece, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s compact K and V of ``piece``, each ``[batch, heads_kv_piece, rows, head_dim]``,
    from its block k, v ``[batch, heads_kv, seq_local, head_dim]``."""
    index = row_index(piece.runs[rank], k.device)  # type: ignore[index]
    return k[:, piece.kv].index_select(2, index), v[:, piece.kv].index_select(2, index)


def scatter_grads(dkv: torch.Tensor, piece: Piece, grad: torch.Tensor, rank: int) -> None:
    """Add ``piece``'s compact gradient ``grad`` ``[2, b, heads_kv_piece, rows, d]`` of rank ``rank``'s
    block into ``dkv`` ``[2, b, heads_kv, seq_local, d]``."""
    dkv[:, :, piece.kv].index_add_(3, row_index(piece.runs[rank], dkv.device), grad)  # type: ignore[index]


class DilatedPieces:
    """The pieces of a dilated call through the plain transports (module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int, pieces: Sequence[Piece],
                 comm: str) -> None:
        self.group, self.rank, self.size, self.pieces, self.comm = group, rank, size, pieces, comm

    def _gather(self) -> GatheredBlocks:
        return GatheredBlocks(self.group, self.rank, self.size, None)

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[Block]:
        """Every piece's blocks: piece after piece (``p2p``), or block after block (``all_gather``)."""
        if self.comm == "all_gather":
            for src, _, k_src, v_src in self._gather().blocks(k, v):
                for piece in self.pieces:
                    if piece.schedule.plans[src]:
                        yield src, piece, *compact_kv(k_src, v_src, piece, src)
            return
        for piece in self.pieces:
            transfers = DirectTransfers(self.group, self.rank, self.size, piece)
            yield from transfers.blocks(*compact_kv(k, v, piece, self.rank))

    def blocks_and_grads(self, k: torch.Tensor, v: torch.Tensor, dkv: torch.Tensor) -> Iterator[BlockAndGrads]:
        """The blocks of :meth:`blocks` with their outboxes; at the end ``dkv`` holds this rank's dK/dV."""
        if self.comm == "all_gather":
            for src, _, k_src, v_src, outbox in self._gather().blocks_and_grads(k.contiguous(), v.contiguous(), dkv):
                full = None
                for piece in self.pieces:
                    if piece.schedule.plans[src]:
                        kc, vc = compact_kv(k_src, v_src, piece, src)
                        mine: GradPieces = []
                        yield src, piece, kc, vc, mine
                        grad = dkv.new_zeros((2, *kc.shape))
                        add_pieces(grad, mine)
                        full = torch.zeros_like(dkv) if full is None else full
                        scatter_grads(full, piece, grad, src)
                if full is not None:
                    outbox.append((slice(None), slice(0, dkv.shape[3]), full[0], full[1]))
            return
        for piece in self.pieces:
            kc, vc = compact_kv(k, v, piece, self.rank)
            grad = dkv.new_zeros((2, *kc.shape))
            yield from DirectTransfers(self.group, self.rank, self.size, piece).blocks_and_grads(kc, vc, grad)
            scatter_grads(dkv, piece, grad, self.rank)
