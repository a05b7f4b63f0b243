"""Batches and outputs across the CP group: Megatron's zigzag batch split and its inverse for logits."""
from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ring.attention.sharding import shard_sequence, unshard_sequence


def get_batch_on_this_cp_rank(batch: Mapping[str, Optional[torch.Tensor]], *, cp_rank: Optional[int] = None,
                              cp_size: Optional[int] = None) -> dict[str, Optional[torch.Tensor]]:
    """This CP rank's zigzag part of a global batch, exactly like Megatron's ``get_batch_on_this_cp_rank``.

    ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (``[b, s]``) are cut along dim 1,
    ``attention_mask`` (``[b, 1, s, s]``) along dim 2 (queries only). ``cp_rank``/``cp_size``
    default to Megatron's parallel_state. Returns a new dict; None values stay None.
    """
    if cp_rank is None or cp_size is None:
        cp_rank = parallel_state.get_context_parallel_rank() if cp_rank is None else cp_rank
        cp_size = parallel_state.get_context_parallel_world_size() if cp_size is None else cp_size
    if cp_size == 1:
        return dict(batch)
    return {
        key: None if val is None else shard_sequence(val, cp_rank, cp_size, dim=2 if key == "attention_mask" else 1)
        for key, val in batch.items()
    }


def gather_sequence(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None, *, dim: int = 1,
                    cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of the zigzag split across ``group`` (default: Megatron's CP group); not differentiable.

    With ``cu_seqlens`` (global padded THD boundaries) the inverse of the per-document split of
    :func:`~megatron_ring.integrations.megatron.packed.get_thd_batch_on_this_cp_rank`.
    """
    group = parallel_state.get_context_parallel_group() if group is None else group
    if group.size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group.size())]
    dist.all_gather(parts, x.contiguous(), group=group)
    return unshard_sequence(parts, dim=dim, sharding="zigzag", cu_seqlens=cu_seqlens)


def gather_logits(logits: torch.Tensor, *, tp_group: Optional[dist.ProcessGroup] = None,
                  cp_group: Optional[dist.ProcessGroup] = None,
                  cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Full logits ``[b, s, vocab]`` from this rank's ``[b, s / cp, vocab / tp]`` (GPTModel's output layout).

    Vocabulary shards are concatenated over the TP group, then zigzag sequence parts over the CP
    group (defaults: Megatron's groups); ``cu_seqlens``: a packed THD row split per document.
    For checking and greedy decoding; not differentiable.
    """
    tp_group = parallel_state.get_tensor_model_parallel_group() if tp_group is None else tp_group
    if tp_group.size() > 1:
        parts = [torch.empty_like(logits) for _ in range(tp_group.size())]
        dist.all_gather(parts, logits.contiguous(), group=tp_group)
        logits = torch.cat(parts, dim=-1)
    return gather_sequence(logits, cp_group, dim=1, cu_seqlens=cu_seqlens)
