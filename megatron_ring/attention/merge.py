"""fp32 log-sum-exp merge of partial attention results.

Note [Log-sum-exp merge]
~~~~~~~~~~~~~~~~~~~~~~~~
Attention of a query over keys split into blocks A and B is recoverable from the per-block
results. With ``lse_X = log sum_{j in X} exp(s_j)`` and ``o_X = softmax_X(s) @ V_X``::

    lse = logaddexp(lse_A, lse_B)
    o   = o_A * exp(lse_A - lse) + o_B * exp(lse_B - lse)

The weights are in (0, 1], so the merge never overflows. We keep ``o`` and ``lse`` in fp32 whatever
the input dtype: a bf16 accumulator would lose ~3 significant digits per ring step. A block in
which a query sees no key has ``lse = -inf``; ``-inf - -inf`` is NaN, so the weights are computed
with the -inf rows forced to weight 0 instead.
"""
from __future__ import annotations

import torch


def merge_weights(lse: torch.Tensor, lse_total: torch.Tensor) -> torch.Tensor:
    """``exp(lse - lse_total)``, 0 where ``lse_total`` is -inf (no key seen anywhere)."""
    safe_total = torch.where(torch.isneginf(lse_total), torch.zeros_like(lse_total), lse_total)
    return torch.exp(lse - safe_total)


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge one block's result into the running accumulators, in place.

    out, block_out: ``[batch, heads, q, head_dim]`` (``out`` fp32, fp64 for fp64 inputs); lse,
    block_lse: ``[batch, heads, q]`` (``lse`` in ``out``'s dtype). ``out``/``lse`` may be views
    (slices along q).
    """
    block_lse = block_lse.to(lse.dtype)
    new_lse = torch.logaddexp(lse, block_lse)
    keep = merge_weights(lse, new_lse).unsqueeze(-1)
    take = merge_weights(block_lse, new_lse).unsqueeze(-1)
    out.mul_(keep).addcmul_(block_out, take)  # fused: no block-sized temporary, any block_out dtype
    lse.copy_(new_lse)


def merge_stacked(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge P partial results stacked on dim 0.

    outs ``[P, batch, heads, q, head_dim]``, lses ``[P, batch, heads, q]`` -> (out, lse) in fp32
    (fp64 for fp64 inputs), computed in a fixed order so every rank that merges the same inputs
    gets bitwise the same result.
    """
    ct = torch.promote_types(lses.dtype, torch.float32)
    lses = lses.to(ct)
    total = torch.logsumexp(lses, dim=0)
    weights = merge_weights(lses, total.unsqueeze(0)).unsqueeze(-1)
    return (outs.to(ct) * weights).sum(dim=0), total
