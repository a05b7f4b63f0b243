"""The step loss of every training engine: sums over the global batch (dp x cp, and pp), the token
count, the refusal of a batch without tokens, and the scale that makes a reduced gradient that of the
global mean.

Note [The loss of a context-parallel rank]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The step loss is the mean over every valid token of the global batch: ``L = sum_tokens / N``.
A rank sees only its CP share of its DP share of the batch (and, with pipelining, only the last
stage sees losses at all), so every engine reports ``L`` the same way: this rank's ``[loss sum,
token count]`` summed over dp x cp, then over pp (:func:`global_sums`), divided (:func:`global_mean`).

Each engine's gradient reduction sums the weight gradients over dp x cp and divides the sum by a
``divisor``; the gradient is that of ``L`` when every micro-batch backpropagates
``local_sum * divisor / N`` before that division (:func:`gradient_scale`). What the divisor is:

* DeepSpeed (see Note [Gradients of weights replicated over context-parallel ranks] in
  :mod:`megatron_ring.integrations.deepspeed.mpu`) divides by dp, and each micro-batch's loss by the
  gradient accumulation steps, so ``divisor = dp * grad_accum``; ZeRO-3's reduce-scatter divides by
  dp x cp, so cp times more (Note [ZeRO-3 over dp x cp] in
  :mod:`megatron_ring.integrations.deepspeed.zero3`). ``N`` is all-reduced over dp x cp once per step
  before the first forward (:func:`global_token_count`).
* Megatron-core (``calculate_per_token_loss``) divides by ``N`` itself: its schedule returns each
  micro-batch's loss sum and token count, and ``finalize_model_grads`` divides the reduced gradients
  by the count summed over dp x cp, so the scale is 1 and no count is needed before the step.

The gradient is then exactly that of ``L`` whatever the layout, which is what makes cp = 2 (or
tp = 2 x cp = 2) train to the same weights as cp = 1 on the same global batch.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from megatron_ring.parallel.groups import ParallelGroups
from megatron_ring.training.data import Batch

NO_TOKENS = "the global batch of this step has no valid token (loss_mask is all zero)"
"""Why a step cannot give a loss: its global batch has no token to learn."""


def global_sums(values: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """``values`` (this rank's sums, e.g. ``[loss sum, token count]``) summed in place over dp x cp, then
    over the pipeline when pp > 1 (stages other than the last add zeros); the same on every rank."""
    dist.all_reduce(values, group=groups.dp_cp)
    if groups.layout.pp > 1:
        dist.all_reduce(values, group=groups.groups["pp"])
    return values


def require_tokens(count: torch.Tensor) -> None:
    """ValueError (:data:`NO_TOKENS`) when the global token ``count`` is zero."""
    if count.item() == 0:
        raise ValueError(NO_TOKENS)


def global_token_count(batches: Sequence[Batch], groups: ParallelGroups, device: torch.device) -> torch.Tensor:
    """``N``: the valid tokens of the step's global batch (this rank's micro-batches summed over dp x cp);
    ValueError when there is none."""
    count = global_sums(torch.stack([b.loss_mask.sum() for b in batches]).sum().to(device), groups)
    require_tokens(count)
    return count


def global_mean(total: torch.Tensor, count: torch.Tensor) -> float:
    """``L = total / count``, both already global (:func:`global_sums`); ValueError when ``count`` is zero."""
    require_tokens(count)
    return float(total / count)


def gradient_scale(divisor: float, count: torch.Tensor) -> torch.Tensor:
    """What each micro-batch's loss sum is multiplied by before its backward, for an engine whose gradient
    reduction divides the dp x cp sum by ``divisor``: ``divisor / N`` (Note [The loss of a context-parallel rank])."""
    return divisor / count
