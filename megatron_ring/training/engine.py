"""What the training loop asks of a training engine (:class:`Engine`), and the one place that picks it.

Note [One engine protocol]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The loop (:mod:`megatron_ring.training.loop`) never asks which engine it drives: it steps, evaluates,
saves, loads and destroys through :class:`Engine`, and :func:`build_engine` chooses the class from
``megatron_ring.engine`` once. Two engines implement it:

* ``deepspeed``: :class:`~megatron_ring.training.deepspeed_engine.DeepSpeedTrainer`, the GPT (or a
  transformers model) inside DeepSpeed's engine; the loop's micro-batches one by one, each loss scaled;
* ``megatron``: :class:`~megatron_ring.training.megatron_engine.MegatronTrainer`, Megatron-core's DDP,
  optimizer, scheduler and pipeline schedules.

What they share exists once: the global loss, the token count and the gradient scale
(:mod:`megatron_ring.training.global_loss`), the checkpoint markers, digests and resume checks
(:mod:`megatron_ring.training.checkpoint`), and the end of process groups
(:func:`~megatron_ring.parallel.groups.destroy_groups`).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

import torch

from megatron_ring.parallel.groups import ParallelGroups
from megatron_ring.training.data import Batch

if TYPE_CHECKING:
    from megatron_ring.training.schema import TrainSpec


class Engine(Protocol):
    """One rank's training engine. Batches are this rank's micro-batches ``[micro, seq_len / cp]``
    (:class:`~megatron_ring.training.data.Batch`, on the CPU)."""

    name: str
    """``megatron_ring.engine``'s value for it, recorded in every checkpoint's marker."""
    reshards: bool
    """Whether it loads a checkpoint saved at another layout (else resume insists on the same layout)."""

    def step(self, batches: Sequence[Batch]) -> float:
        """Forward, backward and optimizer step over ``batches``; the global mean token loss, on every rank."""
        ...

    def eval_sums(self, batches: Sequence[Batch]) -> torch.Tensor:
        """Forward only (eval mode, then back to training): this rank's ``[loss sum, token count]`` of
        ``batches`` (float64; zeros on a pipeline stage without the loss), for
        :func:`~megatron_ring.training.global_loss.global_sums`."""
        ...

    def lr(self) -> float:
        """The learning rate of the first parameter group (for the step log)."""
        ...

    def save(self, ckpt_dir: Path, tag: str, client_state: dict[str, Any]) -> None:
        """Every rank's files of this state into ``ckpt_dir/tag``, ``client_state`` with them; ends with a
        barrier (the marker is :func:`~megatron_ring.training.checkpoint.save_checkpoint`'s business)."""
        ...

    def load(self, ckpt_dir: Path, tag: str) -> Optional[dict[str, Any]]:
        """Load ``ckpt_dir/tag`` into this engine; the client state saved with it (None: no states found)."""
        ...

    def destroy(self) -> None:
        """Let go of the model, optimizer and their buffers, so that the process groups they hold can end."""
        ...


def build_engine(spec: "TrainSpec", groups: ParallelGroups, device: torch.device) -> Engine:
    """The engine ``spec.train.engine`` names, built for this rank (the only place that reads the name)."""
    return _BUILDERS[spec.train.engine]()(spec, groups, device)


def _deepspeed() -> Callable[..., Engine]:
    from megatron_ring.training.deepspeed_engine import DeepSpeedTrainer

    return DeepSpeedTrainer


def _megatron() -> Callable[..., Engine]:
    from megatron_ring.training.megatron_engine import MegatronTrainer

    return MegatronTrainer


_BUILDERS: dict[str, Callable[[], Callable[..., Engine]]] = {"deepspeed": _deepspeed, "megatron": _megatron}
"""Each engine's class, imported when chosen (the other framework is not loaded)."""
