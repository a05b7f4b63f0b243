"""Packed inputs for transformers models: rows of documents whose ``position_ids`` restart.

Note [Packed sequences]
~~~~~~~~~~~~~~~~~~~~~~~
transformers' packing collators (``DataCollatorWithFlattening``) concatenate documents into one
row and mark the boundaries only by ``position_ids`` that restart (``0 1 2 0 1 0 1 2 3``); the
single-process model then masks attention per document. Under the ring the adapter turns that into
the core's varlen layout: every document (of every row) becomes one entry of ``cu_seqlens``, padded
at its end to a multiple of ``2 * cp`` (pad token, positions continuing), and is sharded zigzag on
its own, so every rank holds chunks r and 2P-1-r of every document::

    position_ids  0  1  2  3  4  0  1  2           documents a (5 tokens), b (3 tokens); cp = 2
    packed row    a0 a1 a2 a3 a4 -- -- -- b0 b1 b2 --    cu_seqlens = [0, 8, 12]  (-- = padding)
    rank 0        a0 a1 -- -- b0 --                      chunks 0 and 3 of each document
    rank 1        a2 a3 a4 -- b1 b2                      chunks 1 and 2

A document's padding comes after its real tokens, so under the causal mask no real token sees it.
The logits are gathered, un-sharded per document and put back in the caller's ``[batch, seq]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ring.attention.sharding import shard_sequence


def is_packed(position_ids: torch.Tensor, attention_mask: torch.Tensor) -> bool:
    """True if, in some row, a real token's position is not its real predecessor's plus one."""
    both_real = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    return bool(((position_ids[:, 1:] != position_ids[:, :-1] + 1) & both_real).any())


@dataclass(frozen=True)
class PackedRow:
    """One packed row ``[1, total]`` of every document, and where the caller's tokens went.

    ``input_ids``/``position_ids``: ``[1, total]``; ``cu_seqlens``: int32 ``[n_docs + 1]`` (global,
    each document padded to a multiple of ``2 * cp``); ``index``: int64 ``[batch, seq]``, the
    packed column of each of the caller's tokens.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    index: torch.Tensor

    def shard(self, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(input_ids, position_ids)``, each ``[1, total / cp]``."""
        return tuple(shard_sequence(t, rank, size, dim=1, cu_seqlens=self.cu_seqlens)  # type: ignore[return-value]
                     for t in (self.input_ids, self.position_ids))


def pack_rows(input_ids: torch.Tensor, position_ids: torch.Tensor, multiple: int, pad_id: int) -> PackedRow:
    """Split ``[batch, seq]`` rows into documents where positions restart; pack them (Note [Packed sequences])."""
    ids, pos, index, lengths = [], [], torch.empty_like(input_ids), []
    offset = 0
    for row in range(input_ids.shape[0]):
        starts = [0] + [i for i in range(1, input_ids.shape[1])
                        if int(position_ids[row, i]) != int(position_ids[row, i - 1]) + 1]
        for start, end in zip(starts, starts[1:] + [input_ids.shape[1]]):
            n = end - start
            padded = -(-n // multiple) * multiple
            last = int(position_ids[row, end - 1])
            ids += [input_ids[row, start:end], input_ids.new_full((padded - n,), pad_id)]
            pos += [position_ids[row, start:end], torch.arange(last + 1, last + 1 + padded - n).to(position_ids)]
            index[row, start:end] = torch.arange(offset, offset + n)
            offset += padded
            lengths.append(padded)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=input_ids.device)
    return PackedRow(torch.cat(ids)[None], torch.cat(pos)[None], cu, index)
