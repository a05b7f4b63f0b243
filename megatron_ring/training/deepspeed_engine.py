"""``engine: deepspeed``: the GPT of ``spec.model`` (or a transformers model) inside DeepSpeed's engine,
gradients reduced over dp x cp (Note [Gradients of weights replicated over context-parallel ranks] in
:mod:`megatron_ring.integrations.deepspeed.mpu`), ZeRO 0 to 3.

:class:`DeepSpeedTrainer` is its :class:`~megatron_ring.training.engine.Engine`: the loop's
micro-batches go through the model one by one, each loss scaled so that the reduced gradient is that
of the global mean token loss (Note [The loss of a context-parallel rank] in
:mod:`megatron_ring.training.global_loss`).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from megatron_ring.integrations.deepspeed.mpu import DeepSpeedMPU
from megatron_ring.integrations.deepspeed.process_group import init_deepspeed_comm
from megatron_ring.integrations.deepspeed.zero3 import gradient_divisor_excess, partition_over_dp_cp
from megatron_ring.parallel.groups import ParallelGroups
from megatron_ring.training.data import Batch, masked_loss
from megatron_ring.training.global_loss import global_mean, global_sums, global_token_count, gradient_scale

if TYPE_CHECKING:
    from megatron_ring.training.schema import TrainSpec

TokenLoss = Callable[[Any, Batch, ParallelGroups], torch.Tensor]
"""``(model, batch on the device, groups) -> [micro, seq_local]`` per-token losses of the model."""


def gpt_token_loss(model: Any, batch: Batch, groups: ParallelGroups) -> torch.Tensor:
    """Per-token losses ``[micro, seq_local]`` of the Megatron GPT on this rank's shard of ``batch`` (a packed
    row of documents as THD: Note [Packed training rows] in :mod:`megatron_ring.training.data`)."""
    from megatron_ring.integrations.megatron.packed import packed_seq_params

    return model(batch.tokens, batch.position_ids, None, labels=batch.labels,
                 packed_seq_params=packed_seq_params(batch.cu_seqlens))


def token_loss_of(spec: "TrainSpec") -> TokenLoss:
    """The per-token loss of ``spec``'s model: the transformers model's, else the Megatron GPT's."""
    if spec.transformers is not None:
        from megatron_ring.training.hf_model import causal_lm_token_loss

        return causal_lm_token_loss
    return gpt_token_loss


def build_deepspeed_model(spec: "TrainSpec", groups: ParallelGroups) -> Any:
    """The GPT model of ``spec.model`` (or the transformers model) inside a DeepSpeed engine reducing over dp x cp."""
    import deepspeed

    mpu = DeepSpeedMPU(groups)
    init_deepspeed_comm()
    if spec.transformers is not None:
        from megatron_ring.training.hf_model import build_causal_lm

        model = build_causal_lm(spec)
    else:
        from megatron_ring.integrations.megatron.model import build_gpt_model

        model = build_gpt_model(spec.model)
    partition_over_dp_cp(model, mpu, copy.deepcopy(spec.deepspeed))
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params,
                                           config=copy.deepcopy(spec.deepspeed), mpu=mpu)
    return engine


class DeepSpeedTrainer:
    """One rank's DeepSpeed training (:class:`~megatron_ring.training.engine.Engine`). ``model`` is the
    DeepSpeed engine (or any module with ``backward``/``step``: built from ``spec`` when None)."""

    name = "deepspeed"
    reshards = False  # ZeRO's files are named by the dp x cp and tp ranks

    def __init__(self, spec: Optional["TrainSpec"], groups: ParallelGroups, device: torch.device, *,
                 model: Any = None, token_loss: Optional[TokenLoss] = None) -> None:
        self.groups, self.device = groups, device
        self.model = model if model is not None else build_deepspeed_model(spec, groups)
        self.token_loss = token_loss if token_loss is not None else token_loss_of(spec)

    @property
    def module(self) -> torch.nn.Module:
        """The model DeepSpeed's engine wraps (parameters partitioned under ZeRO-3)."""
        return self.model.module

    def step(self, batches: Sequence[Batch]) -> float:
        """Each micro-batch's forward and backward, ``engine.step()`` after each (DeepSpeed steps the optimizer
        at the last of ``grad_accum``); the global mean token loss."""
        count = global_token_count(batches, self.groups, self.device)
        divisor = self.groups.layout.dp * len(batches) * gradient_divisor_excess(self.model, self.groups.layout.cp)
        scale = gradient_scale(divisor, count)
        total = torch.zeros((), device=self.device)
        for batch in batches:
            b = batch.to(self.device)
            local = masked_loss(self.token_loss(self.model, b, self.groups), b.loss_mask)
            self.model.backward(local * scale)
            self.model.step()
            total += local.detach()
        return global_mean(global_sums(total, self.groups), count)

    def eval_sums(self, batches: Sequence[Batch]) -> torch.Tensor:
        """This rank's ``[loss sum, token count]`` (float64), forward only in eval mode."""
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        self.model.eval()
        with torch.no_grad():
            for batch in batches:
                b = batch.to(self.device)
                total += torch.stack([masked_loss(self.token_loss(self.model, b, self.groups), b.loss_mask),
                                      b.loss_mask.sum()]).double()
        self.model.train()
        return total

    def lr(self) -> float:
        return float(self.model.get_lr()[0])

    def save(self, ckpt_dir: Path, tag: str, client_state: dict[str, Any]) -> None:
        """DeepSpeed's ``save_checkpoint`` (its own ``latest`` file left to the marker)."""
        self.model.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)

    def load(self, ckpt_dir: Path, tag: str) -> Optional[dict[str, Any]]:
        _, client = self.model.load_checkpoint(str(ckpt_dir), tag=tag)
        return client

    def destroy(self) -> None:
        """DeepSpeed's ``destroy`` (its optimizer's buffers and hooks), then the engine is dropped."""
        destroy = getattr(self.model, "destroy", None)
        if destroy is not None:
            destroy()
        self.model = None
