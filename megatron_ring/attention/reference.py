"""float64 single-process attention references: what every attention path is checked against (tests, benchmarks, the demo)."""
from __future__ import annotations

import math
from typing import Sequence

import torch


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                        softmax_scale: float | None = None, key_padding_mask: torch.Tensor | None = None,
                        window_size: tuple[int, int] = (-1, -1),
                        cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Plain attention in float64 over global tensors ``[batch, seq, heads, head_dim]`` (GQA aware).
    ``key_padding_mask``: bool ``[batch, seq_k]``, True = a real key; a query that sees no key gets a zero output.
    ``window_size``: flash-attn's ``(left, right)`` on positions (-1 = unbounded). ``cu_seqlens``: q/k/v packed
    ``[tokens, heads, head_dim]`` (mask ``[tokens]``), each document computed on its own, positions counted from its
    start. Differentiable, so references for gradients come from ``torch.autograd``. Returns float64."""
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        docs = [attention_reference(
            q[None, a:b], k[None, a:b], v[None, a:b], causal=causal, softmax_scale=softmax_scale,
            key_padding_mask=None if key_padding_mask is None else key_padding_mask[None, a:b],
            window_size=window_size)[0] for a, b in zip(bounds, bounds[1:])]
        return torch.cat(docs)
    scores = _scores(q, k, softmax_scale)
    if causal:
        sq, sk = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
    if key_padding_mask is not None:
        scores = scores.masked_fill(~key_padding_mask[:, None, None, :].to(scores.device), float("-inf"))
    left, right = window_size
    d = torch.arange(scores.shape[-2])[:, None] - torch.arange(scores.shape[-1])[None, :]
    if left >= 0:
        scores = scores.masked_fill(d > left, float("-inf"))
    if right >= 0:
        scores = scores.masked_fill(d < -right, float("-inf"))
    blind = torch.isneginf(scores).all(dim=-1, keepdim=True)  # rows that see no key: zero output
    probs = torch.softmax(scores.masked_fill(blind, 0.0), dim=-1).masked_fill(blind, 0.0)
    return torch.matmul(probs, _heads_first(v, q.shape[2])).transpose(1, 2)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (Frobenius norms)."""
    expected = expected.to(torch.float64)
    denom = expected.norm().item()
    return (actual.to(torch.float64) - expected).norm().item() / (denom if denom else 1.0)


def dilated_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dilation: Sequence[tuple[int, int]], *,
                      causal: bool = False, softmax_scale: float | None = None) -> torch.Tensor:
    """LongNet's dilated attention in float64, from its definition, over global ``[batch, seq, heads, head_dim]``
    tensors (GQA aware); differentiable. ``dilation``: pairs ``(w, r)``. For each pair the sequence is cut into segments
    of ``w`` tokens (the last shorter); query head ``h`` has phase ``p = h * r // heads_q``; the query at offset ``i``
    and the key at offset ``j`` of one segment meet iff ``i = j = p (mod r)`` (and ``j <= i`` with ``causal``). Each
    pair gives ``(out_k, denominator_k)`` per query and head; the result is ``sum_k out_k * denominator_k / sum_k
    denominator_k`` (zero for a query no pair covers)."""
    seq, heads = q.shape[1], q.shape[2]
    pos = torch.arange(seq)
    outs, lses = [], []
    for w, r in dilation:
        seg, off = pos // w, pos % w
        phase = torch.arange(heads) * r // heads
        on = (off[None, :] % r) == phase[:, None]  # [heads, seq]
        meet = on[:, :, None] & on[:, None, :] & (seg[:, None] == seg[None, :])
        if causal:
            meet = meet & (pos[:, None] >= pos[None, :])
        scores = _scores(q, k, softmax_scale).masked_fill(~meet, float("-inf"))
        lse = _logsumexp(scores, -1)  # [b, h, q]: log of the softmax denominator
        probs = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0.0)[..., None])
        outs.append(torch.matmul(probs, _heads_first(v, heads)))
        lses.append(lse)
    lse = _logsumexp(torch.stack(lses), 0)
    weights = [torch.exp(x - lse.masked_fill(torch.isneginf(lse), 0.0)) for x in lses]
    return sum(o * wt[..., None] for o, wt in zip(outs, weights)).transpose(1, 2)


def _logsumexp(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``logsumexp`` along ``dim``, -inf where every entry is -inf, with finite gradients there."""
    blind = torch.isneginf(x).all(dim, keepdim=True)
    return torch.logsumexp(x.masked_fill(blind, 0.0), dim).masked_fill(blind.squeeze(dim), float("-inf"))


def _heads_first(x: torch.Tensor, heads: int) -> torch.Tensor:
    """float64 ``[b, heads, s, d]`` from ``[b, s, heads_x, d]``, K/V heads repeated for GQA."""
    x64 = x.to(torch.float64).transpose(1, 2)
    return x64.repeat_interleave(heads // x64.shape[1], dim=1)


def _scores(q: torch.Tensor, k: torch.Tensor, softmax_scale: float | None) -> torch.Tensor:
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return torch.matmul(_heads_first(q, q.shape[2]), _heads_first(k, q.shape[2]).transpose(-1, -2)) * scale
