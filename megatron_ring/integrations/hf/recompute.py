"""``generate(use_cache=False)`` over a CP group: every step a ring prefill of the whole sequence.

Note [Generation without a cache]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Without a cache ``generate`` calls the model each step on the whole global sequence so far
(prompt and generated tokens). :func:`ring_prefill_every_call` hooks the model's ``forward`` (a
pre-hook and a hook, removed on exit; no model code changes) so that each call runs as
``ring_forward`` does: the inputs are left-padded to a multiple of ``2 * cp`` (mask 0, position 0),
each rank computes its zigzag shard with ring attention, and the last position's logits, which sit
on :data:`~megatron_ring.integrations.hf.inputs.LAST_TOKEN_RANK`, are broadcast to every rank. So
``generate`` sees ``[batch, 1, vocab]`` logits, bitwise the same on every rank, and its own
sampling, beams, stopping and logits processors run unchanged on the unpadded sequence.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from transformers import PreTrainedModel

from megatron_ring.integrations.hf.context import CPContext
from megatron_ring.integrations.hf.inputs import check_ids, last_token, local_inputs


@contextlib.contextmanager
def ring_prefill_every_call(model: PreTrainedModel, ctx: CPContext) -> Iterator[None]:
    """Inside the block, every ``model(input_ids=..., ...)`` call is a ring prefill of its global inputs."""

    def shard(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if args or kwargs.get("input_ids") is None:
            raise ValueError("under ring attention the model must be called with input_ids=... as a keyword "
                             "(inputs_embeds and positional inputs are not supported)")
        ids, mask = check_ids(kwargs["input_ids"], kwargs.get("attention_mask"))
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        local, _ = local_inputs(model, ctx, ids, mask, positions)
        return args, {**kwargs, **local}

    def gather_last(module: torch.nn.Module, args: tuple, output: Any) -> Any:
        output.logits = last_token(ctx, output.logits)
        return output

    handles = [model.register_forward_pre_hook(shard, with_kwargs=True), model.register_forward_hook(gather_last)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
