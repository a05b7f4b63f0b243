"""A transformers causal LM for the training loop: built from the ``transformers`` entry, and its token losses.

The loop's data (:mod:`megatron_ring.training.data`) already hands each rank its zigzag shard of
every row with *global* position ids and next-token labels, so the model runs on the shard as is
(:func:`~megatron_ring.integrations.hf.sharded_forward.sharded_logits`) and each position's loss is
the cross entropy against its own label: no shift, no gathering. The loss of a rank and the
gradient reduction are the loop's, as for the Megatron GPT (Note [The loss of a context-parallel
rank] in :mod:`megatron_ring.training.loop`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedModel

from megatron_ring.integrations.hf.attention import register
from megatron_ring.integrations.hf.sharded_forward import sharded_logits
from megatron_ring.parallel.groups import ParallelGroups
from megatron_ring.training.data import Batch
from megatron_ring.training.schema import TrainSpec


def build_causal_lm(spec: TrainSpec) -> PreTrainedModel:
    """The fp32 model of ``spec.train.transformers`` in training mode: random weights from
    ``megatron_ring.seed``, or the local checkpoint's."""
    register()
    section = spec.train.transformers
    kwargs: dict[str, Any] = {"attn_implementation": section.attention, "dtype": torch.float32}
    if section.path is not None:
        model = AutoModelForCausalLM.from_pretrained(spec.path(section.path, existing=True), config=spec.transformers,
                                                     local_files_only=True, **kwargs)
    else:
        torch.manual_seed(spec.train.seed)
        model = AutoModelForCausalLM.from_config(spec.transformers, **kwargs)
    return model.train()


def causal_lm_token_loss(engine: Any, batch: Batch, groups: ParallelGroups) -> torch.Tensor:
    """Per-token cross entropy ``[micro, seq_local]`` (fp32) of this rank's shard of ``batch``; a packed
    batch (``cu_seqlens``, Note [Packed training rows] in :mod:`megatron_ring.training.data`) attends
    within each document only."""
    logits = sharded_logits(engine, batch.tokens, batch.position_ids, groups.cp, batch.cu_seqlens)
    return F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten(), reduction="none").view_as(batch.labels)
