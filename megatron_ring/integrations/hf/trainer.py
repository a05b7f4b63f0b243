"""transformers' ``Trainer`` over a context-parallel group: :class:`RingTrainer`.

``RingTrainer`` is ``transformers.Trainer`` for a ``"ring"`` causal LM whose sequences are split
over CP ranks. It changes three things and leaves everything else (optimizer, scheduler,
DeepSpeed or DDP, checkpoints, callbacks, logging) to the Trainer:

* **batches** — the training data loader is sharded over the *dp* group, not over every process:
  the CP ranks of one DP group draw the same global batch (``get_train_dataloader``);
* **the forward** — each rank pads the global batch on the right to a multiple of ``2 * cp``,
  cuts its zigzag shard of ``input_ids``, global ``position_ids`` and next-token targets, and runs
  the model on it inside ``cp_context`` (``compute_loss``);
* **the loss** — the mean over every valid target of the whole optimizer step (all micro-batches,
  all DP and CP ranks), not a mean of per-rank means (``get_batch_samples`` counts them).

Note [The loss of a RingTrainer rank]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A step's loss is ``L = S / N``: ``S`` the summed cross entropy of every valid target of the step's
global batch (all micro-batches of gradient accumulation, all DP groups), ``N`` their count
(``get_batch_samples`` sums each micro-batch's targets on this rank and all-reduces over the dp
group: the CP ranks of a DP group hold the same batch, so summing over dp counts each target once).
A rank's micro-batch contributes ``s_r`` (its own shard's sum) and back-propagates
``s_r * W / N``, ``W`` the number of processes (``dp * cp``). Both engines the Trainer runs reduce
gradients over *all* processes and divide by ``W``: DDP averages over the world; DeepSpeed, given
no ``mpu``, takes the world as its data-parallel group (ZeRO 0-2 all-reduce or reduce-scatter and
divide by its size, ZeRO-3 partitions over it and its reduce-scatter divides by it). With tp = 1
the world *is* dp x cp, so the sum over ranks of ``s_r * W / N`` divided by ``W`` is exactly
``dL/dw``: CP partial gradients summed, DP replicas averaged, no factor cp. (The training loop's
``DeepSpeedMPU`` exists for tp > 1, where the world is not dp x cp and DeepSpeed must be told the
group; Note [Gradients of weights replicated over context-parallel ranks] in
integrations/deepspeed/mpu.py.) The micro-batch losses are already normalised over the whole step,
so ``loss_is_scaled_for_ga`` is True (no division by the accumulation steps) and the Trainer tells
DeepSpeed ``scale_wrt_gas=False`` itself.

The Trainer logs the mean over all processes of each rank's ``s_r * W / N`` summed over the step's
micro-batches, which is ``sum_r s_r / N = L``: the logged loss is the global one.

DeepSpeed's batch arithmetic then counts processes, not sequences: with ``"auto"`` the Trainer
fills ``train_batch_size = micro * grad_accum * dp * cp``, each sequence counted once per CP rank.
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import Trainer

from megatron_ring.attention.sharding import chunks_per_rank, shard_sequence
from megatron_ring.integrations.hf.context import SHARDING, cp_context
from megatron_ring.integrations.hf.sharded_forward import sharded_logits
from megatron_ring.parallel.groups import ParallelGroups

IGNORE = -100
"""transformers' label of a position that carries no loss."""


def right_padding_collator(pad_id: int):
    """A data collator for rows ``{"input_ids": [int, ...]}`` of any length: ``input_ids`` ``[batch, seq]``
    padded on the right with ``pad_id``, ``attention_mask`` (1 real, 0 padding) and ``labels``
    (the ids, ``-100`` on padding). Rows may bring their own ``labels`` (``-100``: no loss there)."""

    def collate(rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        seq = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), seq), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, IGNORE)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            ids[i, :n] = torch.as_tensor(row["input_ids"])
            mask[i, :n] = 1
            labels[i, :n] = torch.as_tensor(row.get("labels", row["input_ids"]))
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return collate


def next_token_targets(inputs: dict[str, Any]) -> torch.Tensor:
    """The target of every position ``[batch, seq]``: the label of the next token (``labels``, or
    ``input_ids`` without them), ``-100`` at the last position and where the next token is padding.

    Only right padding is accepted: a padding token after the real ones is never seen by a real
    token under the causal mask, so the model runs without the mask (left padding would shift
    positions and need it; pad on the right, ``tokenizer.padding_side = "right"``).
    """
    ids = inputs["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty 2-D tensor [batch, seq], got {getattr(ids, 'shape', type(ids))}")
    if inputs.get("position_ids") is not None:
        raise ValueError("position_ids in the batch (packed rows) are not supported by RingTrainer yet; "
                         "allowed: rows without position_ids (positions are 0..seq-1)")
    labels = inputs.get("labels")
    labels = ids if labels is None else labels
    if labels.shape != ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(ids.shape)}")
    targets = torch.cat([labels[:, 1:], labels.new_full((ids.shape[0], 1), IGNORE)], dim=1)
    mask = inputs.get("attention_mask")
    if mask is not None:
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask {tuple(mask.shape)} must have the shape of input_ids {tuple(ids.shape)}")
        real = mask.bool()
        if bool((real[:, 1:] & ~real[:, :-1]).any()):
            raise ValueError("attention_mask has padding before a real token (left padding); RingTrainer takes "
                             "right padding only: tokenizer.padding_side = 'right'")
        targets = targets.masked_fill(~torch.cat([real[:, 1:], real.new_zeros((ids.shape[0], 1))], dim=1), IGNORE)
    return targets


class RingTrainer(Trainer):
    """``transformers.Trainer`` for a ``"ring"`` causal LM over the CP and DP groups of ``groups``
    (Note [The loss of a RingTrainer rank]). Every other argument is the Trainer's.

    ``groups`` must cover every process with tp = pp = 1 (``init_parallel(ParallelLayout(cp=..., dp=...))``).
    The batch of a row may have any length and right padding (``attention_mask``); ``labels`` are
    optional (``input_ids`` then), ``-100`` marks a position without loss. Training only: evaluate
    with ``ring_nll`` or ``ring_forward``.
    """

    def __init__(self, *args: Any, groups: ParallelGroups, **kwargs: Any) -> None:
        layout = groups.layout
        if layout.tp != 1 or layout.pp != 1:
            raise ValueError(f"layout tp = {layout.tp}, pp = {layout.pp}: RingTrainer trains a transformers model "
                             "context- and data-parallel only; allowed: tp = 1, pp = 1")
        world = dist.get_world_size() if dist.is_initialized() else 1
        if layout.cp * layout.dp != world:
            raise ValueError(f"layout cp = {layout.cp} x dp = {layout.dp} does not cover the {world} processes; "
                             f"allowed: cp * dp = {world}")
        super().__init__(*args, **kwargs)
        if self.label_smoother is not None or self.compute_loss_func is not None:
            raise ValueError("RingTrainer computes the cross entropy itself; label_smoothing_factor = "
                             f"{self.args.label_smoothing_factor} and compute_loss_func = {self.compute_loss_func!r} "
                             "are not supported; allowed: label_smoothing_factor 0, no compute_loss_func")
        if self.args.world_size != world:
            raise ValueError(f"the Trainer sees {self.args.world_size} processes but torch.distributed has {world}; "
                             "start torch.distributed before building TrainingArguments, and on CPU pass use_cpu=True (DDP) or "
                             "the accelerator_config of megatron_ring.training.hf_trainer (DeepSpeed)")
        self.groups = groups
        self.loss_is_scaled_for_ga = True  # Note [The loss of a RingTrainer rank]

    # --- batches: one per DP group -----------------------------------------------------------------

    def get_train_dataloader(self) -> Any:
        """The Trainer's loader, sharded over the dp group: every CP rank of a DP group gets the same batches."""
        loader = super().get_train_dataloader()
        shard = getattr(loader, "batch_sampler", None)
        if self.accelerator.num_processes == 1:
            return loader  # one process: accelerate did not shard it
        if not hasattr(shard, "num_processes") or not hasattr(shard, "process_index"):
            raise ValueError(f"RingTrainer needs a map-style train_dataset (one with __len__), sharded by accelerate's "
                             f"BatchSamplerShard; got a loader with batch_sampler {type(shard).__name__}")
        shard.num_processes = self.groups.layout.dp
        shard.process_index = self.groups.coords["dp"]
        return loader

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: torch.device) -> tuple[list, torch.Tensor]:
        """The step's micro-batches and ``N``, the number of valid targets of the step's global batch."""
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        count = torch.zeros((), dtype=torch.long, device=device)
        for batch in batches:
            count += next_token_targets(batch).ne(IGNORE).sum().to(device)
        if self.groups.layout.dp > 1:
            dist.all_reduce(count, group=self.groups.dp)
        if batches and count.item() == 0:
            raise ValueError("the global batch of this step has no valid target (every label is -100 or padding)")
        return batches, count

    # --- forward and loss ----------------------------------------------------------------------------

    def training_step(self, model: Any, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """The Trainer's step (forward and backward) inside the CP context, so that layers recomputed in
        the backward (``gradient_checkpointing``) run their ring attention over the same group."""
        with cp_context(self.groups.cp) as ctx:
            ctx.sharded = True  # compute_loss cuts the shards itself
            return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """This rank's share ``s_r * W / N`` of the step loss (Note [The loss of a RingTrainer rank])."""
        if not model.training:
            raise ValueError("RingTrainer trains only; evaluate a ring model with megatron_ring.hf.ring_forward "
                             "(or ring_nll for the loss)")
        if num_items_in_batch is None:
            raise ValueError("RingTrainer.compute_loss needs num_items_in_batch (the step's valid target count, "
                             "from get_batch_samples)")
        ids = inputs["input_ids"]
        targets = next_token_targets(inputs)
        cp, rank = self.groups.cp_size, self.groups.cp_rank
        pad = -ids.shape[1] % (chunks_per_rank(SHARDING) * cp)
        if pad:  # right padding: after every real token, so no real token sees it (causal)
            ids = F.pad(ids, (0, pad), value=0)
            targets = F.pad(targets, (0, pad), value=IGNORE)
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        local_ids, local_pos, local_targets = (shard_sequence(t, rank, cp, dim=1, sharding=SHARDING)
                                               for t in (ids, positions, targets))
        logits = sharded_logits(model, local_ids, local_pos, self.groups.cp)  # [batch, seq_local, vocab]
        total = F.cross_entropy(logits.float().flatten(0, 1), local_targets.flatten(), ignore_index=IGNORE,
                                reduction="sum")
        loss = total * (self.accelerator.num_processes / num_items_in_batch)
        return (loss, {"logits": logits}) if return_outputs else loss
