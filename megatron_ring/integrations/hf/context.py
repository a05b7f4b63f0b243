"""The active CP context: how the ``"ring"`` attention function learns its group during a model call."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist

from megatron_ring.attention.call import group_rank_size

if TYPE_CHECKING:
    from megatron_ring.integrations.hf.cache import RingCache

ATTN_IMPLEMENTATION = "ring"
SHARDING = "zigzag"  # causal LMs: zigzag balances the ring (Note [Zigzag sharding] in attention/sharding.py)


@dataclass
class CPContext:
    """The CP group of the running model call and what the attention function must do.

    ``phase`` is ``"prefill"`` (local tokens of a zigzag-sharded sequence: ring attention),
    ``"decode"`` (new tokens identical on all ranks against ``cache``: decode attention) or ``"turn"``
    (this rank's share of a new turn against ``cache``: turn attention, Note [Pass-KV or pass-Q]) or
    ``"decode_rows"`` (one new token per row, each row against its own cache in ``rows``).
    ``cu_seqlens`` (int32 ``[n_docs + 1]``, global boundaries) marks a packed prefill: one row of
    documents, each sharded zigzag on its own (Note [Packed sequences] in packed.py).
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int
    phase: str = "prefill"
    cache: "RingCache | None" = None
    cu_seqlens: torch.Tensor | None = None
    turn_positions: torch.Tensor | None = None
    """Phase ``"turn"``: the global positions (int64 ``[n_local]``) of this rank's new tokens."""
    turn_mode: str = "auto"
    rows: "list[RingCache] | None" = None
    """Phase ``"decode_rows"``: each batch row's conversation cache (``ring_decode_rows``)."""
    """Phase ``"turn"``: ``turn_attention``'s mode (``"auto"``, ``"pass_kv"``, ``"pass_q"``)."""
    sharded: bool = False
    """This rank's prefill inputs were cut by the adapter (``local_inputs``), so they are a zigzag
    shard; otherwise a prefill's positions are checked first (Note [Checking a user's shard] in shard_check.py)."""
    generating: bool = False
    """``ring_generate`` runs ``model.generate`` in this context; anywhere else ``generate`` is refused."""
    attention_calls: int = 0
    """Attention calls of this context that returned (Note [A model error on one rank] in peer_errors.py)."""
    in_attention: bool = False
    """An attention call (with its handshake) is running: an error now is the core's to report."""
    compiled: bool = False
    """A torch.compile-traced attention call ran here: nothing was counted (Note [Counting under torch.compile])."""


_ACTIVE: list[CPContext] = []
"""The open contexts, innermost last: a plain list, which torch.compile traces (a ContextVar breaks its
graph). One per process, so threads running models under different CP contexts at once would share it."""


@contextlib.contextmanager
def cp_context(group: dist.ProcessGroup | None = None, *,
               cu_seqlens: torch.Tensor | None = None) -> Iterator[CPContext]:
    """Make ``group`` the CP group of ring-attention model calls inside the ``with`` block.

    :func:`ring_forward` and :func:`ring_generate` open it for you. Use it directly to run a
    ``"ring"`` model forward (prefill) on inputs you sharded yourself: zigzag shards of
    ``input_ids``, the padding mask (or None on every rank) and *global* ``position_ids``. For a
    packed row of documents pass their global boundaries ``cu_seqlens`` (int32 ``[n_docs + 1]``,
    each document a multiple of ``2 * cp`` long) and shard with
    ``shard_sequence(x, rank, cp, dim=1, cu_seqlens=cu_seqlens)``, batch 1, no padding mask. It does
    not see the model: :func:`enable_ring_attention` checks that a model can run under the ring.
    """
    rank, size = group_rank_size(group)
    ctx = CPContext(group, rank, size, cu_seqlens=cu_seqlens)
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


def generating() -> bool:
    """Whether the innermost context is one in which ``ring_generate`` runs ``model.generate``."""
    return bool(_ACTIVE) and _ACTIVE[-1].generating
