"""GQA head bookkeeping of the block kernels (block.py, sdpa_backend.py): grouping and folding
query heads onto their K/V head (Note [GQA without repeats] in block.py). Pure torch.

Layout ``[batch, heads, seq, ...]``; query head ``h`` uses K/V head ``h // (heads_q / heads_kv)``.
"""
from __future__ import annotations

import torch


def grouped(q: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """``[b, hq, s, d]`` -> ``[b, hkv, hq/hkv, s, d]`` (a view): query heads grouped by their K/V head."""
    b, hq, s, d = q.shape
    return q.reshape(b, heads_kv, hq // heads_kv, s, d)


def fold_queries(t: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """``[b, hq, s, ...]`` -> ``[b, hkv, (hq/hkv) * s, ...]``: the query heads of a K/V head as one axis."""
    b, hq, s = t.shape[:3]
    return t.reshape(b, heads_kv, (hq // heads_kv) * s, *t.shape[3:])


def unfold_queries(t: torch.Tensor, heads_q: int) -> torch.Tensor:
    """Inverse of :func:`fold_queries`: ``[b, hkv, g * s, ...]`` -> ``[b, heads_q, s, ...]``."""
    b, hkv, gs = t.shape[:3]
    return t.reshape(b, heads_q, gs // (heads_q // hkv), *t.shape[3:])
