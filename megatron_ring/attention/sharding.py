"""How a global sequence is laid over the ranks of a context-parallel group.

Note [Zigzag sharding]
~~~~~~~~~~~~~~~~~~~~~~
With a causal mask, token i attends to tokens 0..i, so the late tokens do most of the work. Cut
the sequence into P contiguous chunks and the last rank does ~2P-1 times the work of the first.
Zigzag cuts it into 2P equal chunks and gives rank r chunks r and 2P-1-r: every rank then holds
one "early" and one "late" chunk and, at every ring step, computes the same amount (see
:func:`megatron_ring.attention.schedule.step_plan`). This is exactly Megatron-core's
``get_batch_on_this_cp_rank`` split, so Megatron data pipelines need no change::

    L = 8 tokens, P = 2:   chunks 0 1 2 3        rank 0 -> [0, 3]   rank 1 -> [1, 2]

``contiguous`` (rank r holds chunk r of P) is kept for non-causal models and for comparison.
"""
from __future__ import annotations

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
                    device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (int64 ``[seq_len // cp_size]``) of the tokens rank ``cp_rank`` holds."""
    chunk = check_divisible(seq_len, cp_size, sharding)
    return torch.cat([
        torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunk_ids(cp_rank, cp_size, sharding)
    ])


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, *, dim: int = 1,
                   sharding: str = "zigzag") -> torch.Tensor:
    """The part of ``x`` (global along ``dim``) that rank ``cp_rank`` of ``cp_size`` holds."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _check_rank(cp_rank, cp_size)
    dim = dim % x.dim()
    chunk = check_divisible(x.shape[dim], cp_size, sharding)
    return torch.cat([x.narrow(dim, c * chunk, chunk) for c in chunk_ids(cp_rank, cp_size, sharding)], dim=dim)


def unshard_sequence(parts: Sequence[torch.Tensor], *, dim: int = 1, sharding: str = "zigzag") -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the global tensor from every rank's part, in rank order."""
    if not parts:
        raise ValueError("parts must hold one tensor per rank, got an empty sequence")
    cp_size = len(parts)
    dim = dim % parts[0].dim()
    per_rank = chunks_per_rank(sharding)
    lengths = {p.shape[dim] for p in parts}
    if len(lengths) != 1 or next(iter(lengths)) % per_rank:
        raise ValueError(f"every part must have the same length along dim {dim}, divisible by {per_rank}; got {sorted(lengths)}")
    chunk = next(iter(lengths)) // per_rank
    ordered: list[torch.Tensor | None] = [None] * (per_rank * cp_size)
    for rank, part in enumerate(parts):
        for i, c in enumerate(chunk_ids(rank, cp_size, sharding)):
            ordered[c] = part.narrow(dim, i * chunk, chunk)
    return torch.cat(ordered, dim=dim)  # type: ignore[arg-type]
