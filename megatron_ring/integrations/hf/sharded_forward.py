"""A training forward of a ``"ring"`` transformers model on inputs that are already zigzag shards."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from megatron_ring.integrations.hf.context import cp_context


def sharded_logits(model: Callable[..., object], input_ids: torch.Tensor, position_ids: torch.Tensor,
                   group: dist.ProcessGroup | None, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[batch, seq_local, vocab]`` of this rank's zigzag shard (``input_ids`` and *global*
    ``position_ids``, both ``[batch, seq_local]``) of unpadded sequences sharded over ``group``.

    ``cu_seqlens`` (int32 ``[n_docs + 1]``): one packed row (batch 1) of documents, each a multiple of
    ``2 * cp`` long and sharded zigzag on its own (Note [Packed sequences] in packed.py); attention
    stays within each document.

    ``model`` is the transformers model or a wrapper that forwards keyword arguments to it (a
    DeepSpeed engine); the backward of the ring runs outside the block, on the group saved by the forward.
    """
    with cp_context(group, cu_seqlens=cu_seqlens) as ctx:
        ctx.sharded = True
        return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
