"""float64 single-process references for the attention tests and the numerics benchmark."""
from __future__ import annotations

import math

import torch


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                        softmax_scale: float | None = None) -> torch.Tensor:
    """Plain attention in float64 over global tensors ``[batch, seq, heads, head_dim]`` (GQA aware).

    Differentiable, so references for gradients come from ``torch.autograd``. Returns float64.
    """
    q64, k64, v64 = (t.to(torch.float64).transpose(1, 2) for t in (q, k, v))
    groups = q64.shape[1] // k64.shape[1]
    k64 = k64.repeat_interleave(groups, dim=1)
    v64 = v64.repeat_interleave(groups, dim=1)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q64, k64.transpose(-1, -2)) * scale
    if causal:
        sq, sk = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v64).transpose(1, 2)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (Frobenius norms)."""
    expected = expected.to(torch.float64)
    denom = expected.norm().item()
    return (actual.to(torch.float64) - expected).norm().item() / (denom if denom else 1.0)
