"""Which part of a key/value block each query block sees: the per-step work of the ring. Pure math.

Rank r (of P) holds queries of its local tokens; at ring step t it holds the K/V of rank
``src = (r - t) mod P``. Every call gets one :class:`Schedule` (:func:`schedule_for`, cached per
shape): ``plans[src]`` says which local queries attend to which part of that K/V block, and
whether a causal mask or a band is needed inside it; an empty tuple skips the block.

Note [Causal zigzag: equal work at every step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under zigzag sharding rank r holds chunks (r, 2P-1-r), each c tokens long. For a K/V block from ``src``:

* ``src == r``: the diagonal; the local causal mask is exact because local positions increase.
* ``src < r``: chunk ``src`` precedes both query chunks, chunk ``2P-1-src`` follows both:
  all 2c queries see the first c keys, unmasked.
* ``src > r``: chunk r precedes both key chunks (sees nothing); chunk ``2P-1-r`` follows both:
  the last c queries see all 2c keys, unmasked.

So every off-diagonal step is one unmasked ``2c x c`` or ``c x 2c`` product (half of a full block)
on every rank: no rank idles, and no work is spent on masked-out blocks. Under contiguous sharding
a causal rank r computes ``src < r`` fully and skips ``src > r``: rank P-1 works at every step
while rank 0 idles after the first, which is the imbalance zigzag removes.

Note [Windows and documents: which blocks meet]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With a sliding window or packed documents (``cu_seqlens``) a rank's tokens are runs of consecutive positions of one
document (:class:`~megatron_ring.attention.sharding.Segment`: 2 per document under zigzag). The query may see the key
iff both lie in one document and ``lo <= d <= hi`` with ``d = q_pos - k_pos`` (window.py). For a run of queries against
a run of keys of the same document, ``d = offset + row - col``, so :func:`segment_plans` can decide each pair of runs
exactly from integers: *empty* (no kernel call), *full* (no mask), *causal* (the diagonal) or a *band*; and it trims the
pair to the rows and columns that see anything. A band costs a full product plus its mask, so a banded pair longer than
``BAND_TILE`` is cut into tiles, each again empty, full or banded: only the tiles along the band's edges keep a mask,
the rest run unmasked (for a triangle, about half the product plus one tile per edge). Full pieces that share their keys
(or their queries) and touch are merged, so a packed batch costs one kernel call per document and step, as each document
alone would. Per rank and step (src = the block's owner)::

    window (W = chunk), causal, zigzag, P = 2:   chunks 0 1 2 3;  rank 0 = [0 3], rank 1 = [1 2]
    rank 0, src 1:  q0 x k1, k2: empty (future)     q3 x k2: band (d in 1..2c-1, W cuts)    q3 x k1: empty (too far)

A step whose plan is empty is skipped: no kernel call and, for ``comm="p2p"``, no transfer
either (Note [Direct transfers] in direct.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Sequence

from megatron_ring.attention.sharding import Segment, check_divisible, rank_segments
from megatron_ring.attention.window import NO_WINDOW, UNBOUNDED, Band, band_limits, is_windowed

if TYPE_CHECKING:
    from megatron_ring.attention.dilated import Run

BAND_TILE = 512
"""Tile length of banded pairs (Note [Windows and documents: which blocks meet])."""


@dataclass(frozen=True)
class StepPlan:
    """Local query slice, key slice of the block, whether the diagonal causal mask applies, and
    the band of visible pairs inside the block when neither full nor causal."""

    q: slice
    k: slice
    causal: bool
    band: Band | None = None


def _pair_plan(qs: Segment, ks: Segment, lo: int, hi: int) -> StepPlan | None:
    """The work of query run ``qs`` on key run ``ks`` (one document) under ``lo <= d <= hi``, trimmed."""
    off = qs.pos - ks.pos  # d = off + i - j
    i0, i1 = max(0, lo - off), min(qs.length - 1, hi - off + ks.length - 1)
    j0, j1 = max(0, off - hi), min(ks.length - 1, off + qs.length - 1 - lo)
    if i0 > i1 or j0 > j1:
        return None
    off, nq, nk = off + i0 - j0, i1 - i0 + 1, j1 - j0 + 1
    q, k = slice(qs.local + i0, qs.local + i1 + 1), slice(ks.local + j0, ks.local + j1 + 1)
    if off - (nk - 1) >= lo and off + nq - 1 <= hi:
        return StepPlan(q, k, False)
    if lo == 0 and off == 0 and nq == nk and hi >= nq - 1:
        return StepPlan(q, k, True)
    return StepPlan(q, k, False, Band(off, lo, hi))


def _tiles(segment: Segment) -> list[Segment]:
    """``segment`` cut into runs of at most ``BAND_TILE`` tokens."""
    return [Segment(segment.local + i, min(BAND_TILE, segment.length - i), segment.doc, segment.pos + i)
            for i in range(0, segment.length, BAND_TILE)]


def _merge_full(plans: list[StepPlan], along: str) -> list[StepPlan]:
    """Merge unmasked plans that share their other slice and touch along ``along`` ("q" or "k")."""
    other = "k" if along == "q" else "q"
    merged: list[StepPlan] = []
    for plan in sorted(plans, key=lambda p: (getattr(p, other).start, getattr(p, along).start)):
        last = merged[-1] if merged else None
        if (last is not None and not (last.causal or plan.causal) and last.band is None and plan.band is None
                and getattr(last, other) == getattr(plan, other) and getattr(last, along).stop == getattr(plan, along).start):
            grown = slice(getattr(last, along).start, getattr(plan, along).stop)
            merged[-1] = replace(last, **{along: grown})
        else:
            merged.append(plan)
    return merged


def segment_plans(q_segments: Sequence[Segment], k_segments: Sequence[Segment], lo: int, hi: int, *,
                  same_rank: bool) -> tuple[StepPlan, ...]:
    """The work of a rank's queries (runs ``q_segments``) on a K/V block (runs ``k_segments``) when the query sees the
    key iff same document and ``lo <= q_pos - k_pos <= hi``; empty = skip. ``same_rank``: the block is the rank's own;
    then, for a causal unwindowed document, its local rows are one causal block (local positions increase, as in
    Note [Causal zigzag: equal work at every step]). See Note [Windows and documents: which blocks meet]."""
    plans: list[StepPlan] = []
    for doc in sorted({g.doc for g in q_segments}):
        qs = [g for g in q_segments if g.doc == doc]
        ks = [g for g in k_segments if g.doc == doc]
        if same_rank and lo == 0 and hi >= UNBOUNDED and qs:
            rows = slice(qs[0].local, qs[-1].local + qs[-1].length)
            plans.append(StepPlan(rows, rows, True))
            continue
        pairs: list[StepPlan] = []
        for a, b in ((a, b) for a in qs for b in ks):
            plan = _pair_plan(a, b, lo, hi)
            if plan is not None and plan.band is not None and max(a.length, b.length) > BAND_TILE:
                tiles = (_pair_plan(x, y, lo, hi) for x in _tiles(a) for y in _tiles(b))
                pairs += [t for t in tiles if t is not None]
            elif plan is not None:
                pairs.append(plan)
        plans += _merge_full(_merge_full(pairs, "q"), "k")
    return tuple(plans)


def rows_used(plans: Sequence[StepPlan]) -> slice | None:
    """The key rows of the block that ``plans`` read, as one range (None when there is no plan)."""
    if not plans:
        return None
    return slice(min(p.k.start for p in plans), max(p.k.stop for p in plans))


@dataclass(frozen=True)
class Schedule:
    """One rank's whole schedule: ``plans[src]`` (empty = skip that block), ``recv_rows[t]`` the rows of block
    ``(rank - t) mod P`` it reads (None: not needed) and ``send_rows[t]`` the rows of its own block that rank
    ``(rank + t) mod P`` reads. ``windowed``: the window hides a pair that ``causal`` does not (blocks may then need a
    band mask and a kernel that takes one); ``sparse``: a window or documents shape it (``p2p`` then moves blocks
    directly)."""

    plans: tuple[tuple[StepPlan, ...], ...]
    recv_rows: tuple[slice | None, ...]
    send_rows: tuple[slice | None, ...]
    windowed: bool = False
    sparse: bool = False


@dataclass(frozen=True, eq=False)
class Piece:
    """The unit of a ring call's work (Note [Pieces]): query heads ``q`` and K/V heads ``kv`` (slices of all heads),
    their GQA ``groups`` (``(query heads, K/V heads)`` relative to the piece's), the rows, and the :class:`Schedule`
    over them. ``runs`` None: every local row, in place (a view of the caller's tensors); else ``runs[rank]`` the local
    rows of each rank's compact rows (dilated.py's ``Run``), which the schedule's slices index. Compared by identity."""

    q: slice
    kv: slice
    groups: tuple[tuple[slice, slice], ...]
    schedule: Schedule
    runs: tuple[tuple[Run, ...], ...] | None = None


def rank_schedule(rank: int, size: int, segments: Sequence[Sequence[Segment]], lo: int, hi: int, *,
                  windowed: bool = False, sparse: bool = False) -> Schedule:
    """The schedule of ``rank`` given every rank's runs ``segments[r]`` and the band ``lo..hi``. Every rank derives the
    same pairs from the same inputs, so what one rank sends at step t is exactly what its peer expects
    (Note [Direct transfers] in direct.py)."""
    def plans(r: int, src: int) -> tuple[StepPlan, ...]:
        return segment_plans(segments[r], segments[src], lo, hi, same_rank=r == src)

    mine = tuple(plans(rank, src) for src in range(size))
    recv = tuple(rows_used(mine[(rank - t) % size]) for t in range(size))
    send = tuple(rows_used(plans((rank + t) % size, rank)) for t in range(size))
    return Schedule(mine, recv, send, windowed, sparse)


@lru_cache(maxsize=256)
def schedule_for(rank: int, size: int, seq_local: int, docs: tuple[int, ...] | None, *, causal: bool,
                 sharding: str, window: tuple[int, int]) -> Schedule:
    """The schedule of a call (checked arguments): ``docs`` the packed documents' lengths (None: one sequence of
    ``seq_local * size`` tokens, which must then split evenly; ValueError otherwise). A window that hides nothing beyond
    ``causal`` is no window. Cached: every layer of a model shares its shape's schedule."""
    total = seq_local * size
    if docs is None and size > 1:
        check_divisible(total, size, sharding, what=f"global sequence length (seq_local {seq_local} x cp {size})")
    lengths = docs or (total,)
    windowed = is_windowed(window, causal, max(lengths))
    lo, hi = band_limits(window if windowed else NO_WINDOW, causal)
    layout = sharding if size > 1 else "contiguous"  # one rank holds its whole sequence in order either way
    segments = [rank_segments(r, size, lengths, layout) for r in range(size)]
    return rank_schedule(rank, size, segments, lo, hi, windowed=windowed, sparse=windowed or docs is not None)
