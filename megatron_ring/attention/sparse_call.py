"""The window and packed-document arguments of ``ring_attention``: checks, schedule, handshake fields.

``window_size`` (window.py) and ``cu_seqlens`` (Note [Packed documents (varlen)] in sharding.py)
turn the plain ring schedule into :class:`~megatron_ring.attention.schedule.RankSchedule` plans
(Note [Windows and documents: which blocks meet] in schedule.py). A window that hides nothing
(at least as long as the longest document) without ``cu_seqlens`` keeps the plain schedule.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from megatron_ring.attention.handshake import Field
from megatron_ring.attention.schedule import RankSchedule, rank_schedule
from megatron_ring.attention.sharding import doc_lengths, rank_segments
from megatron_ring.attention.window import NO_WINDOW, band_limits, check_window, is_windowed


@dataclass(frozen=True)
class SparseCall:
    """A checked call's window and documents: what the handshake compares and the schedule."""

    window: tuple[int, int]
    windowed: bool
    """Whether the window hides a pair that ``causal`` does not (then blocks need a band mask)."""
    docs_code: int
    """0 without ``cu_seqlens``, else ``n_docs << 32 | crc32(boundaries)``."""
    schedule: RankSchedule | None


def _docs_code(cu_seqlens: torch.Tensor | None) -> int:
    if cu_seqlens is None:
        return 0
    bounds = cu_seqlens.tolist()
    return (len(bounds) - 1) << 32 | zlib.crc32(",".join(map(str, bounds)).encode())


def prepare_sparse(rank: int, size: int, seq_local: int, *, causal: bool, sharding: str, window_size: object,
                   cu_seqlens: torch.Tensor | None) -> SparseCall:
    """Check ``window_size`` and ``cu_seqlens`` (ValueError/TypeError naming them) and build this
    rank's schedule; ``sharding`` is already checked."""
    window = check_window(window_size)
    total = seq_local * size
    lengths = (total,) if cu_seqlens is None else doc_lengths(cu_seqlens, total, size, sharding)
    windowed = is_windowed(window, causal, max(lengths))
    if not windowed and cu_seqlens is None:
        return SparseCall(window, False, 0, None)
    lo, hi = band_limits(window if windowed else NO_WINDOW, causal)
    segments = [rank_segments(r, size, lengths, sharding) for r in range(size)]
    return SparseCall(window, windowed, _docs_code(cu_seqlens), rank_schedule(rank, size, segments, lo, hi))


def _show_docs(code: int) -> str:
    return "None" if code == 0 else f"{code >> 32} documents (boundaries crc32 {code & 0xFFFFFFFF:#010x})"


def sparse_fields(call: SparseCall) -> list[Field]:
    """Handshake fields: the window as given and the documents' boundaries (as a digest)."""
    return [Field("window_size[0]", call.window[0]), Field("window_size[1]", call.window[1]),
            Field("cu_seqlens", call.docs_code, _show_docs)]


def packed_as_batch(q: object, k: object, v: object, key_padding_mask: object,
                    cu_seqlens: object) -> tuple[object, object, object, object]:
    """With ``cu_seqlens``: packed ``[tokens_local, heads, head_dim]`` q/k/v (and a ``[tokens_local]``
    mask) as a batch of one, ``[1, tokens_local, heads, head_dim]``; without, the inputs unchanged."""
    if cu_seqlens is None:
        return q, k, v, key_padding_mask
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() != 3:
            raise ValueError(f"with cu_seqlens, {name} must be packed 3-D [tokens_local, heads, head_dim], "
                             f"got shape {tuple(t.shape)}")
    if isinstance(key_padding_mask, torch.Tensor) and key_padding_mask.dim() != 1:
        raise ValueError(f"with cu_seqlens, key_padding_mask must be 1-D [tokens_local], "
                         f"got shape {tuple(key_padding_mask.shape)}")
    return tuple(t.unsqueeze(0) if isinstance(t, torch.Tensor) else t  # type: ignore[return-value]
                 for t in (q, k, v, key_padding_mask))
