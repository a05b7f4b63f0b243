"""Whether a prefill inside a bare ``cp_context`` got zigzag shards: a check of its positions.

Note [Checking a user's shard]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Inside ``cp_context`` the user shards the inputs. The ring takes each rank's local tokens as its
zigzag shard of a sequence ``cp`` times as long; nothing in the tensors says whether they are. Passing
the global ``input_ids`` as if it were the shard, or forgetting the global ``position_ids``, gave
logits off by 40-70 % relative and no error. The positions tell: for a zigzag shard, ``position_ids``
minus the global index of each local token (``local_columns``) is one constant per row over the
real tokens of every rank (0, or a left-padding offset), and it is not for the mistakes above (the
model's default positions ``0..seq_local - 1`` on every rank, for one).

So the first attention call of each forward in a context whose inputs the adapter did not cut
(``CPContext.sharded``), unpacked prefill only, sends each row's smallest and largest offset to
every rank (one small all-gather), and every rank raises the same ValueError when a row's offsets
differ. Models whose attention gets no ``position_ids`` cannot be checked (the exchange still runs,
so every rank takes part in the same collectives).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ring.integrations.hf.context import CPContext
from megatron_ring.integrations.hf.inputs import local_columns

Offsets = list[tuple[int, int] | None]
"""Per row: (smallest, largest) ``position - global index`` over this rank's real tokens, None if it has none."""


def _offsets(ctx: CPContext, position_ids: object, key_mask: torch.Tensor | None, batch: int,
             seq_local: int) -> Offsets | None:
    """This rank's offsets, or None when ``position_ids`` is not a ``[batch or 1, seq_local]`` tensor."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[1] != seq_local \
            or position_ids.shape[0] not in (1, batch):
        return None
    columns = local_columns(ctx, seq_local * ctx.size, position_ids.device)
    offset = position_ids.expand(batch, -1).long() - columns[None]
    real = torch.ones_like(offset, dtype=torch.bool) if key_mask is None else key_mask.bool().to(offset.device)
    rows: Offsets = []
    for row, keep in zip(offset, real):
        picked = row[keep]
        rows.append((int(picked.min()), int(picked.max())) if picked.numel() else None)
    return rows


def check_shard_positions(ctx: CPContext, position_ids: object, key_mask: torch.Tensor | None, batch: int,
                          seq_local: int) -> None:
    """Raise ValueError on every rank of ``ctx`` unless the local tokens are zigzag shards of one
    sequence (Note [Checking a user's shard]); ``key_mask`` ``[batch, seq_local]`` marks real tokens."""
    mine = _offsets(ctx, position_ids, key_mask, batch, seq_local)
    table: list[Offsets | None] = [mine]
    if ctx.size > 1:
        table = [None] * ctx.size
        dist.all_gather_object(table, mine, group=ctx.group)
    known = [(rank, rows) for rank, rows in enumerate(table) if rows is not None]
    if not known or len({len(rows) for _, rows in known}) > 1:  # nothing to check, or the handshake names the batch
        return
    for row in range(len(known[0][1])):
        spans = {rank: rows[row] for rank, rows in known if rows[row] is not None}
        if len({value for span in spans.values() for value in span}) > 1:
            shown = ", ".join(f"rank {rank}: {lo}..{hi}" for rank, (lo, hi) in spans.items())
            raise ValueError(
                f"position_ids inside cp_context are not those of zigzag shards of one sequence: in row {row}, "
                f"position_ids minus the global index of each local token ranges over {shown} across the CP group "
                f"(it must be one constant per row). Give each rank its zigzag shard of input_ids "
                f"(megatron_ring.shard_sequence(x, rank, {ctx.size}, dim=1)) and the matching global position_ids, "
                "or pass the global input_ids to megatron_ring.hf.ring_forward, which shards them"
            )
