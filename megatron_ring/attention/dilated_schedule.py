"""The schedule of a dilated call: one :class:`Piece` per (pair, phase), each planned like packed
documents in compact coordinates (Note [Dilated attention as one ring call] in dilated.py). Pure,
cached per shape; the row indices are cached per device.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from megatron_ring.attention.dilated import HeadGroup, Pairs, Run, compact_runs, phase_heads
from megatron_ring.attention.schedule import Schedule, rank_schedule
from megatron_ring.attention.sharding import rank_segments
from megatron_ring.attention.window import UNBOUNDED


@dataclass(frozen=True)
class Piece:
    """One (pair, phase): its query heads ``q`` and K/V heads ``kv`` (slices of all heads), their GQA
    ``groups``, every rank's compact ``runs[rank]``, and this rank's :class:`Schedule` over compact
    rows (``plans[src]`` slices index compact rows of this rank and of ``src``)."""

    pair: tuple[int, int]
    phase: int
    q: slice
    kv: slice
    groups: tuple[HeadGroup, ...]
    runs: tuple[tuple[Run, ...], ...]
    schedule: Schedule

    def rows(self, rank: int) -> int:
        """How many compact rows rank ``rank`` holds."""
        return sum(run.segment.length for run in self.runs[rank])

    def within(self, group: HeadGroup) -> tuple[slice, slice]:
        """``group``'s query and K/V heads relative to this piece's."""
        return (slice(group.q.start - self.q.start, group.q.stop - self.q.start),
                slice(group.kv.start - self.kv.start, group.kv.stop - self.kv.start))


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
            pieces.append(Piece((w, r), phase, q, kv, groups, runs, schedule))
    return tuple(pieces)


@lru_cache(maxsize=1024)
def row_index(runs: tuple[Run, ...], device: torch.device) -> torch.Tensor:
    """int64 ``[rows]``: the local row of each compact row of ``runs`` (on ``device``)."""
    parts = [torch.arange(run.first, run.first + run.step * run.segment.length, run.step) for run in runs]
    index = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    return index.to(device)
