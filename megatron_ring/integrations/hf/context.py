"""The active CP context: how the ``"ring"`` attention function learns its group during a model call."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch.distributed as dist

from megatron_ring.attention.checks import group_rank_size

if TYPE_CHECKING:
    from megatron_ring.integrations.hf.cache import RingCache

ATTN_IMPLEMENTATION = "ring"
SHARDING = "zigzag"  # causal LMs: zigzag balances the ring (Note [Zigzag sharding] in attention/sharding.py)


@dataclass
class CPContext:
    """The CP group of the running model call and what the attention function must do.

    ``phase`` is ``"prefill"`` (local tokens of a zigzag-sharded sequence: ring attention) or
    ``"decode"`` (new tokens identical on all ranks against ``cache``: decode attention).
    ``total_len`` is the longest global sequence this call can reach (sliding-window check).
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int
    phase: str = "prefill"
    cache: "RingCache | None" = None
    total_len: int = 0


_ACTIVE: list[CPContext] = []
"""The open contexts, innermost last: a plain list, which torch.compile traces (a ContextVar breaks its
graph). One per process, so threads running models under different CP contexts at once would share it."""


@contextlib.contextmanager
def cp_context(group: dist.ProcessGroup | None = None, *, total_len: int = 0) -> Iterator[CPContext]:
    """Make ``group`` the CP group of ring-attention model calls inside the ``with`` block.

    :func:`ring_forward` and :func:`ring_generate` open it for you. Use it directly to run a
    ``"ring"`` model forward (prefill) on inputs you sharded yourself: zigzag shards of
    ``input_ids``, the padding mask (or None on every rank) and *global* ``position_ids``;
    ``total_len`` is the global length for the sliding-window check (default: local x cp). It does not
    see the model: :func:`enable_ring_attention` checks that a model can run under the ring.
    """
    rank, size = group_rank_size(group)
    ctx = CPContext(group, rank, size, total_len=total_len)
    _ACTIVE.append(ctx)
    try:
        yield ctx
    finally:
        _ACTIVE.pop()  # contexts nest, so ours is the last


def active() -> CPContext:
    if not _ACTIVE:
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} needs a context-parallel context: call the model through "
            "megatron_ring.hf.ring_forward / ring_generate, or inside `with megatron_ring.hf.cp_context(group):`"
        )
    return _ACTIVE[-1]
