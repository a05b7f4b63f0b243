"""The schedule of a dilated call: one :class:`~megatron_ring.attention.schedule.Piece` per (pair, phase), its rows
compact (``runs``), each planned like packed documents in compact coordinates (Note [Dilated attention as one ring call]
in dilated.py). Pure, cached per shape; the row indices are cached per device.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from megatron_ring.attention.dilated import Pairs, Run, compact_runs, phase_heads
from megatron_ring.attention.schedule import Piece, rank_schedule
from megatron_ring.attention.sharding import rank_segments
from megatron_ring.attention.window import UNBOUNDED


@lru_cache(maxsize=64)
def dilated_schedule_for(rank: int, size: int, seq_local: int, heads_q: int, heads_kv: int, pairs: Pairs, *,
                         causal: bool, sharding: str) -> tuple[Piece, ...]:
    """Every piece of a checked dilated call (the global length splits evenly: checked by the call)."""
    layout = sharding if size > 1 else "contiguous"
    plain = [rank_segments(r, size, (seq_local * size,), layout) for r in range(size)]
    lo = 0 if causal else -UNBOUNDED
    pieces = []
    for w, r in pairs:
        for phase in range(r):
            q, kv, groups = phase_heads(heads_q, heads_kv, r, phase)
            runs = tuple(compact_runs(plain[x], w, r, phase) for x in range(size))
            schedule = rank_schedule(rank, size, [[run.segment for run in rs] for rs in runs], lo, UNBOUNDED,
                                     sparse=True)
            within = tuple((slice(g.q.start - q.start, g.q.stop - q.start),
                            slice(g.kv.start - kv.start, g.kv.stop - kv.start)) for g in groups)
            pieces.append(Piece(q, kv, within, schedule, runs))
    return tuple(pieces)


@lru_cache(maxsize=1024)
def row_index(runs: tuple[Run, ...], device: torch.device) -> torch.Tensor:
    """int64 ``[rows]``: the local row of each compact row of ``runs`` (on ``device``)."""
    parts = [torch.arange(run.first, run.first + run.step * run.segment.length, run.step) for run in runs]
    index = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    return index.to(device)
