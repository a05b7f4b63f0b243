"""Which part of a key/value block each query block sees: the per-step work of the ring. Pure math.

Rank r (of P) holds queries of its local tokens; at ring step t it holds the K/V of rank
``src = (r - t) mod P``. :func:`step_plan` says which local queries attend to which part of that
K/V block, and whether a causal mask is needed inside it.

Note [Causal zigzag: equal work at every step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under zigzag sharding rank r holds chunks (r, 2P-1-r), each c tokens long. For a K/V block from
``src``:

* ``src == r``: the diagonal; the local causal mask is exact because local positions increase.
* ``src < r``: chunk ``src`` precedes both query chunks, chunk ``2P-1-src`` follows both:
  all 2c queries see the first c keys, unmasked.
* ``src > r``: chunk r precedes both key chunks (sees nothing); chunk ``2P-1-r`` follows both:
  the last c queries see all 2c keys, unmasked.

So every off-diagonal step is one unmasked ``2c x c`` or ``c x 2c`` product (half of a full block)
on every rank: no rank idles, and no work is spent on masked-out blocks. Under contiguous sharding
a causal rank r computes ``src < r`` fully and skips ``src > r``: rank P-1 works at every step
while rank 0 idles after the first, which is the imbalance zigzag removes.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_ring.attention.sharding import check_sharding


@dataclass(frozen=True)
class StepPlan:
    """Local query slice, key slice of the block, and whether the diagonal causal mask applies."""

    q: slice
    k: slice
    causal: bool


def step_plan(rank: int, src: int, size: int, seq_local: int, *, causal: bool, sharding: str) -> StepPlan | None:
    """The work of ``rank`` on the K/V block of ``src``, or None when no local query sees it."""
    check_sharding(sharding)
    everything = slice(0, seq_local)
    if not causal:
        return StepPlan(everything, everything, False)
    if src == rank:
        return StepPlan(everything, everything, True)
    if sharding == "contiguous":
        return StepPlan(everything, everything, False) if src < rank else None
    half = seq_local // 2
    if src < rank:
        return StepPlan(everything, slice(0, half), False)
    return StepPlan(slice(half, seq_local), everything, False)
