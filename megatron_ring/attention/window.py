"""Sliding windows: ``window_size=(left, right)`` and the band of (query, key) distances it allows. Pure.

flash-attn's convention on positions: the query at position i sees the key at position j iff
``i - left <= j <= i + right``, -1 meaning unbounded on that side; ``causal`` adds ``j <= i``. Both are one condition on
the distance ``d = i - j``: ``lo <= d <= hi`` (:func:`band_limits`). Inside a block whose queries and keys are runs of
consecutive positions, ``d`` is ``offset + row - col``, so the allowed pairs form a diagonal band (:class:`Band`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

UNBOUNDED = 1 << 62
"""Stands for an infinite distance (fits int64, never reached by a real position)."""
NO_WINDOW: tuple[int, int] = (-1, -1)


def band_limits(window: tuple[int, int], causal: bool) -> tuple[int, int]:
    """``(lo, hi)``: the query sees the key iff ``lo <= q_pos - k_pos <= hi`` (UNBOUNDED for none)."""
    left, right = window
    lo = -UNBOUNDED if right < 0 else -right
    hi = UNBOUNDED if left < 0 else left
    return (max(lo, 0) if causal else lo), hi


def is_windowed(window: tuple[int, int], causal: bool, longest: int) -> bool:
    """Whether the window hides any pair of a sequence (or document) of ``longest`` tokens beyond
    what ``causal`` already hides; a window at least as long as the sequence changes nothing."""
    lo, hi = band_limits(window, causal)
    return hi < longest - 1 or lo > (0 if causal else -(longest - 1))


@dataclass(frozen=True)
class Band:
    """Pairs of a block that are visible: query row ``i`` sees key column ``j`` iff
    ``lo <= offset + i - j <= hi`` (``offset`` = position of row 0 minus position of column 0)."""

    offset: int
    lo: int
    hi: int

    def visible(self, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
        """bool ``[q_len, k_len]``, True where the query sees the key."""
        reach = q_len + k_len + abs(self.offset)  # diagonals beyond the block change nothing
        lowest, highest = max(-reach, self.offset - self.hi), min(reach, self.offset - self.lo)
        return torch.ones(q_len, k_len, dtype=torch.bool, device=device).triu_(lowest).tril_(highest)


def positions_visible(q_positions: torch.Tensor, k_positions: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
    """bool ``[q_len, k_len]`` from int64 positions ``[q_len]`` and ``[k_len]`` (decode: any order)."""
    lo, hi = band_limits(window, causal=False)
    d = q_positions[:, None].to(torch.int64) - k_positions[None, :].to(torch.int64)
    return (d >= lo) & (d <= hi)


def check_positions(name: str, positions: object, length: int, what: str, needed: str = "") -> torch.Tensor:
    """int ``[length]`` positions (``what`` names the dimension) as int64; ValueError naming ``name`` (``needed``: when
    they are needed, for the message)."""
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64) \
            or tuple(positions.shape) != (length,):
        got = f"{positions.dtype} {tuple(positions.shape)}" if isinstance(positions, torch.Tensor) else \
            type(positions).__name__
        raise ValueError(f"{name} must be an int32/int64 tensor [{what}] = [{length}]{needed}, got {got}")
    return positions.to(torch.int64)
