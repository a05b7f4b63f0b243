"""Dilated attention (LongNet, arXiv 2307.02486): the definition, its checks and where a rank's tokens fall in it. Pure.

``dilation = ((w_1, r_1), (w_2, r_2), ...)``: for each pair (segment length w, dilation r) the global sequence is cut
into segments of w tokens (the last one shorter when w does not divide the length; one segment when w >= L). Query head
h has the *phase* ``p = h * r // heads_q`` (the heads in r contiguous groups, so every offset 0..r-1 is some group's
phase when ``r <= heads_q``). Within a segment, the query and the key whose offsets in it are both ``= p (mod r)`` meet
(with ``causal``, the key no later than the query); nothing else meets. Each pair gives an output and a softmax
denominator per (query, head), and LongNet weights the pairs' outputs by their denominators: exactly the log-sum-exp
merge of block.py (a token seen by two pairs counts twice).

Note [Dilated attention as one ring call]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
For a pair and a phase, number the selected tokens of segment s in order: the m-th is at position ``s*w + p + m*r``. In
these *compact* coordinates the pattern is plain attention (causal or not) inside each segment, i.e. packed documents,
and a rank's selected tokens are runs of consecutive compact positions of one segment (:func:`compact_runs`, as
:class:`~megatron_ring.attention.sharding.Segment`). So the schedule of packed documents (``segment_plans`` in
schedule.py) plans each (pair, phase) *piece* on its own: blocks that cannot meet are skipped, and only the compact rows
some plan reads travel (dilated_transport.py). The pieces differ in their heads (the phase's head group), so a piece
reads a slice of heads and a gathered set of rows. One ring call runs every piece of every block and merges all of them
into one (out, lse): the merge of LongNet. Backward then takes each block's gradient from the merged out and lse
(Note [Log-sum-exp merge] in block.py), so each piece's share is exact.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence

from megatron_ring.attention.sharding import Segment

Pairs = tuple[tuple[int, int], ...]
"""``((segment_length, dilation), ...)``, checked."""


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_dilation(dilation: object, heads_q: int, conflicts: dict[str, bool]) -> Pairs | None:
    """``dilation`` as checked pairs (None stays None): one pair ``(w, r)`` or a non-empty sequence of them, ints
    ``w >= 1``, ``1 <= r <= heads_q``. ``conflicts``: the other options that exclude it (name -> given); ValueError
    naming the field, its value and what is allowed."""
    if dilation is None:
        return None
    pairs = (dilation,) if isinstance(dilation, (tuple, list)) and len(dilation) == 2 and all(
        _is_int(x) for x in dilation) else dilation
    rule = "a pair (segment_length, dilation) or a non-empty sequence of them, ints >= 1"
    if not isinstance(pairs, (tuple, list)) or not pairs or not all(
            isinstance(p, (tuple, list)) and len(p) == 2 and all(_is_int(x) and x >= 1 for x in p) for p in pairs):
        raise ValueError(f"dilation must be {rule}, got {dilation!r}")
    checked = tuple((int(w), int(r)) for w, r in pairs)
    for w, r in checked:
        if r > heads_q:
            raise ValueError(f"dilation pair {(w, r)}: the dilation {r} exceeds heads_q ({heads_q}); each of the "
                             f"{r} offsets needs a head group, so allowed: 1 <= dilation <= heads_q")
    given = [name for name, on in conflicts.items() if on]
    if given:
        raise ValueError(f"dilation does not combine with {', '.join(given)}; dilated attention takes causal or "
                         "full attention on plain sequences with comm 'p2p', 'all_gather' or 'auto'")
    return checked


def dilation_code(pairs: Pairs | None) -> int:
    """0 for None, else ``n_pairs << 32 | crc32(pairs)`` (the handshake's field)."""
    if pairs is None:
        return 0
    return len(pairs) << 32 | zlib.crc32(repr(pairs).encode())


def show_dilation(code: int) -> str:
    return "None" if code == 0 else f"{code >> 32} pairs (crc32 {code & 0xFFFFFFFF:#010x})"


@dataclass(frozen=True)
class HeadGroup:
    """Query heads ``q`` (which use K/V heads ``kv``) of one phase, as slices of the whole heads;
    ``len(q)`` a multiple of ``len(kv)`` with query head h on K/V head ``h // (heads_q // heads_kv)``."""

    q: slice
    kv: slice


def phase_heads(heads_q: int, heads_kv: int, r: int, phase: int) -> tuple[slice, slice, tuple[HeadGroup, ...]]:
    """The query heads of ``phase`` (``h * r // heads_q == phase``), the K/V heads they use, and
    the phase's heads split into GQA-valid groups (one group when aligned with the K/V heads)."""
    h0 = -(-phase * heads_q // r)
    h1 = -(-(phase + 1) * heads_q // r)
    g = heads_q // heads_kv
    kv = slice(h0 // g, (h1 - 1) // g + 1)
    if h0 % g == 0 and h1 % g == 0:
        return slice(h0, h1), kv, (HeadGroup(slice(h0, h1), kv),)
    cuts = sorted({h0, h1, *range(-(-h0 // g) * g, h1, g)})
    groups = tuple(HeadGroup(slice(a, b), slice(a // g, a // g + 1)) for a, b in zip(cuts, cuts[1:]))
    return slice(h0, h1), kv, groups


@dataclass(frozen=True)
class Run:
    """Local rows ``first, first + step, ...`` (``length`` of them): compact positions ``pos ..`` of
    segment ``doc`` (as ``segment`` says, whose ``local`` is the compact row)."""

    first: int
    step: int
    segment: Segment


def compact_runs(runs: Sequence[Segment], w: int, r: int, phase: int) -> tuple[Run, ...]:
    """A rank's tokens of (pair ``(w, r)``, ``phase``) in compact coordinates (Note above), in
    position order; ``runs``: the rank's runs of global positions (one document), any order."""
    out: list[Run] = []
    row = 0
    for g in sorted(runs, key=lambda s: s.pos):
        for seg in range(g.pos // w, (g.pos + g.length - 1) // w + 1):
            start = seg * w + phase
            lo, hi = max(g.pos, seg * w) - start, min(g.pos + g.length, (seg + 1) * w) - start
            m0, m1 = max(0, -(-lo // r)), max(0, -(-hi // r))
            if m1 > m0:
                out.append(Run(g.local + start + m0 * r - g.pos, r, Segment(row, m1 - m0, seg, m0)))
                row += m1 - m0
    return tuple(out)
