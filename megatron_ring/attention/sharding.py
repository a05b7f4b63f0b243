"""How a global sequence is laid over the ranks of a context-parallel group.

Note [Zigzag sharding]
~~~~~~~~~~~~~~~~~~~~~~
With a causal mask, token i attends to tokens 0..i, so the late tokens do most of the work. Cut the sequence into P
contiguous chunks and the last rank does ~2P-1 times the work of the first. Zigzag cuts it into 2P equal chunks and
gives rank r chunks r and 2P-1-r: every rank then holds one "early" and one "late" chunk and, at every ring step,
computes the same amount (see Note [Causal zigzag: equal work at every step] in schedule.py). This is exactly
Megatron-core's ``get_batch_on_this_cp_rank`` split, so Megatron data pipelines need no change::

    L = 8 tokens, P = 2:   chunks 0 1 2 3        rank 0 -> [0, 3]   rank 1 -> [1, 2]

``contiguous`` (rank r holds chunk r of P) is kept for non-causal models and for comparison.

Note [Packed documents (varlen)]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``cu_seqlens`` (global packed boundaries, the same on every rank) each document is sharded on its own and a rank
holds its chunks of every document, concatenated in document order: the Megatron / Transformer Engine THD convention.
Every rank then holds the same share of every document, so causal work stays balanced whatever the document lengths::

    docs A (8 tokens) | B (4 tokens), P = 2, zigzag: chunks A0..A3 (2 tokens), B0..B3 (1 token)
    rank 0 -> [A0 A3 B0 B3]    rank 1 -> [A1 A2 B1 B2]

A rank's tokens are thus a list of :class:`Segment` runs (consecutive positions of one document),
which is all the schedule needs to know (schedule.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

SHARDINGS: tuple[str, ...] = ("zigzag", "contiguous")


def check_sharding(sharding: object) -> str:
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {list(SHARDINGS)}, got {sharding!r}")
    return sharding  # type: ignore[return-value]


def chunks_per_rank(sharding: str) -> int:
    """How many equal chunks of the sequence each rank holds (2 for zigzag, 1 for contiguous)."""
    return 2 if check_sharding(sharding) == "zigzag" else 1


def check_divisible(seq_len: int, cp_size: int, sharding: str, what: str = "sequence length") -> int:
    """Return the chunk length; raise ValueError unless ``seq_len`` splits evenly for ``sharding``."""
    parts = chunks_per_rank(sharding) * cp_size
    if seq_len % parts:
        rule = "2*cp" if sharding == "zigzag" else "cp"
        raise ValueError(
            f"{what} {seq_len} is not divisible by {rule} = {parts} ({sharding} sharding over cp={cp_size}); "
            f"pad it to a multiple of {parts}"
        )
    return seq_len // parts


def _check_rank(cp_rank: int, cp_size: int) -> None:
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, {cp_size}), got {cp_rank!r}")


def chunk_ids(cp_rank: int, cp_size: int, sharding: str = "zigzag") -> list[int]:
    """Indices of the global chunks rank ``cp_rank`` holds, in local order."""
    _check_rank(cp_rank, cp_size)
    if check_sharding(sharding) == "zigzag":
        return [cp_rank, 2 * cp_size - 1 - cp_rank]
    return [cp_rank]


def local_positions(seq_len: int, cp_rank: int, cp_size: int, sharding: str = "zigzag",
                    device: torch.device | str | None = None, *,
                    cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Global positions (int64 ``[seq_len // cp_size]``) of the tokens rank ``cp_rank`` holds. With ``cu_seqlens``
    (``seq_len`` = its last entry): each token's position inside its own document (what rotary embeddings need), in the
    rank's packed order."""
    segments = rank_segments(cp_rank, cp_size, _lengths(seq_len, cp_size, sharding, cu_seqlens), sharding)
    return torch.cat([torch.arange(g.pos, g.pos + g.length, device=device) for g in segments]
                     or [torch.zeros(0, dtype=torch.int64, device=device)])


@dataclass(frozen=True)
class Segment:
    """A run of a rank's local tokens: rows ``[local, local + length)`` hold positions
    ``[pos, pos + length)`` of document ``doc`` (positions counted from the document's start)."""

    local: int
    length: int
    doc: int
    pos: int


def check_cu_seqlens(cu_seqlens: object, total_tokens: int) -> tuple[int, ...]:
    """The document lengths of packed boundaries ``cu_seqlens`` (int32 ``[n_docs + 1]``, from 0 to ``total_tokens``,
    non-decreasing); TypeError/ValueError naming ``cu_seqlens`` otherwise. Reads the values to the host (one device
    synchronisation when they live on a GPU)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be an int32 torch.Tensor [n_docs + 1] or None, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens.dtype is {cu_seqlens.dtype}; allowed: torch.int32")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [n_docs + 1] with n_docs >= 1, got shape {tuple(cu_seqlens.shape)}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {bounds[0]}")
    lengths = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    if min(lengths) < 0:
        at = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{at}] = {bounds[at]} > "
                         f"cu_seqlens[{at + 1}] = {bounds[at + 1]}")
    if bounds[-1] != total_tokens:
        raise ValueError(f"cu_seqlens[-1] = {bounds[-1]} must equal the global packed token count {total_tokens} "
                         "(tokens_local x cp)")
    return lengths


def doc_lengths(cu_seqlens: torch.Tensor, total_tokens: int, cp_size: int, sharding: str) -> tuple[int, ...]:
    """The document lengths of ``cu_seqlens``, each checked to split evenly over ``cp_size`` ranks."""
    lengths = check_cu_seqlens(cu_seqlens, total_tokens)
    parts = chunks_per_rank(sharding) * cp_size
    for doc, length in enumerate(lengths):
        if length % parts:
            rule = "2*cp" if sharding == "zigzag" else "cp"
            raise ValueError(f"cu_seqlens: document {doc} has {length} tokens, not divisible by {rule} = {parts} "
                             f"({sharding} sharding over cp={cp_size}); pad every document to a multiple of {parts}")
    return lengths


def rank_segments(cp_rank: int, cp_size: int, lengths: Sequence[int], sharding: str) -> tuple[Segment, ...]:
    """The runs of consecutive positions rank ``cp_rank`` holds, in local order, for documents of
    ``lengths`` (one document = an unpacked sequence). Empty documents have no run."""
    _check_rank(cp_rank, cp_size)
    parts = chunks_per_rank(sharding) * cp_size
    segments: list[Segment] = []
    local = 0
    for doc, length in enumerate(lengths):
        chunk = length // parts
        if chunk == 0:
            continue
        for c in chunk_ids(cp_rank, cp_size, sharding):
            segments.append(Segment(local, chunk, doc, c * chunk))
            local += chunk
    return tuple(segments)


def _lengths(total: int, cp_size: int, sharding: str, cu_seqlens: torch.Tensor | None) -> tuple[int, ...]:
    """The document lengths of ``total`` tokens: ``cu_seqlens``'s, or one document; each checked to split evenly."""
    if cu_seqlens is not None:
        return doc_lengths(cu_seqlens, total, cp_size, sharding)
    check_divisible(total, cp_size, sharding)
    return (total,)


def _global_runs(cp_rank: int, cp_size: int, lengths: tuple[int, ...], sharding: str) -> list[tuple[int, int]]:
    """``(global start, length)`` of each run of rank ``cp_rank`` (documents of ``lengths``), in its local order."""
    starts = [sum(lengths[:doc]) for doc in range(len(lengths))]
    return [(starts[g.doc] + g.pos, g.length) for g in rank_segments(cp_rank, cp_size, lengths, sharding)]


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, *, dim: int = 1, sharding: str = "zigzag",
                   cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The part of ``x`` (global along ``dim``) that rank ``cp_rank`` of ``cp_size`` holds. ``cu_seqlens``: ``x`` is
    packed along ``dim`` (e.g. ``[tokens, heads, head_dim]`` with ``dim=0``) and each document is sharded on its own
    (Note [Packed documents (varlen)])."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _check_rank(cp_rank, cp_size)
    dim = dim % x.dim()
    lengths = _lengths(x.shape[dim], cp_size, check_sharding(sharding), cu_seqlens)
    runs = _global_runs(cp_rank, cp_size, lengths, sharding)
    return torch.cat([x.narrow(dim, start, n) for start, n in runs] or [x.narrow(dim, 0, 0)], dim=dim)


def unshard_sequence(parts: Sequence[torch.Tensor], *, dim: int = 1, sharding: str = "zigzag",
                     cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the global tensor from every rank's part, in rank order."""
    if not parts:
        raise ValueError("parts must hold one tensor per rank, got an empty sequence")
    cp_size = len(parts)
    dim = dim % parts[0].dim()
    per_rank = chunks_per_rank(sharding)
    lengths = {p.shape[dim] for p in parts}
    if len(lengths) != 1 or next(iter(lengths)) % per_rank:
        raise ValueError(f"every part must have the same length along dim {dim}, divisible by {per_rank}; got {sorted(lengths)}")
    docs = _lengths(next(iter(lengths)) * cp_size, cp_size, sharding, cu_seqlens)
    pieces: list[tuple[int, torch.Tensor]] = []
    for rank, part in enumerate(parts):
        local = 0
        for start, n in _global_runs(rank, cp_size, docs, sharding):
            pieces.append((start, part.narrow(dim, local, n)))
            local += n
    return torch.cat([p for _, p in sorted(pieces, key=lambda item: item[0])] or [parts[0]], dim=dim)
