"""A transformers causal LM for the training loop: built from the ``transformers`` entry, and its token losses.

The loop's data (:mod:`megatron_ring.training.data`) already hands each rank its zigzag shard of
every row with *global* position ids and next-token labels, so the model runs on the shard as is
(:func:`~megatron_ring.integrations.hf.sharded_forward.sharded_logits`) and each position's loss is
the cross entropy against its own label: no shift, no gathering. The loss of a rank and the
gradient reduction are the loop's, as for the Megatron GPT (Note [The loss of a context-parallel
rank] in :mod:`megatron_ring.training.loop`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedModel

from megatron_ring.config.checkpoint import CheckpointSource
from megatron_ring.integrations.hf.attention import register
from megatron_ring.integrations.hf.checkpoint import local_dir_once, resolve_checkpoint
from megatron_ring.integrations.hf.sharded_forward import sharded_logits
from megatron_ring.parallel.groups import ParallelGroups
from megatron_ring.training.data import Batch
from megatron_ring.training.schema import TrainSpec, deepspeed_dtype


def build_causal_lm(spec: TrainSpec) -> PreTrainedModel:
    """The fp32 model of ``spec.train.transformers`` in training mode: random weights from
    ``megatron_ring.seed``, or the pretrained checkpoint's with the section's config overrides
    (``spec.transformers``); a GGUF file is de-quantised once, by rank 0, into its cache. Under
    DeepSpeed's ``bf16`` section the parameters are bf16 (Note [bf16 under ZeRO-3]); DeepSpeed's
    optimizer keeps fp32 master copies of them."""
    register()
    section = spec.train.transformers
    kwargs: dict[str, Any] = {"attn_implementation": section.attention, "dtype": torch.float32}
    source = section.source(spec.base_dir)
    if source is not None:
        model = AutoModelForCausalLM.from_pretrained(pretrained_dir(source), config=spec.transformers,
                                                     local_files_only=True, **kwargs)
    else:
        torch.manual_seed(spec.train.seed)
        model = AutoModelForCausalLM.from_config(spec.transformers, **kwargs)
    if deepspeed_dtype(spec.deepspeed) == "bf16":
        cast_parameters(model, torch.bfloat16)
    return model.train()


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the parameters (not the buffers: RoPE's ``inv_freq`` stays fp32) to ``dtype`` in place.

    Note [bf16 under ZeRO-3]: DeepSpeed casts a module to its ``bf16`` dtype itself at ZeRO 0-2, but
    leaves alone one partitioned by ``zero.Init(module=...)`` (ZeRO-3,
    :func:`~megatron_ring.integrations.deepspeed.zero3.partition_over_dp_cp`), which then trains in
    fp32 under a bf16 config. Casting first makes every stage compute in bf16 with fp32 master
    weights that start from the same bf16 values.
    """
    for param in model.parameters():
        if param.is_floating_point():
            param.data = param.data.to(dtype)


def pretrained_dir(source: CheckpointSource) -> Path:
    """The local checkpoint directory of ``source`` (a GGUF file converted by rank 0 while the others wait)."""
    path = resolve_checkpoint(source.checkpoint)
    return local_dir_once(path, source.gguf_file, Path(source.cache_dir) if source.cache_dir else None)


def causal_lm_token_loss(engine: Any, batch: Batch, groups: ParallelGroups) -> torch.Tensor:
    """Per-token cross entropy ``[micro, seq_local]`` (fp32) of this rank's shard of ``batch``; a packed
    batch (``cu_seqlens``, Note [Packed training rows] in :mod:`megatron_ring.training.data`) attends
    within each document only."""
    logits = sharded_logits(engine, batch.tokens, batch.position_ids, groups.cp, batch.cu_seqlens)
    return F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten(), reduction="none").view_as(batch.labels)
