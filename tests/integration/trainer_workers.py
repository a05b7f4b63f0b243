"""Gloo-pool workers for tests/integration/test_hf_trainer.py: transformers' Trainer (or RingTrainer) on a tiny Llama."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_ring.testing.tiny_hf import save_tiny_model


def write_tiny_llama(path: str) -> str:
    """The tiny random Llama (GQA, RoPE, byte tokenizer) in ``path``, written once."""
    if not (Path(path) / "config.json").is_file():
        save_tiny_model("llama", path)
    return path


def train(ours: dict[str, Any], training: dict[str, Any]) -> dict[str, Any]:
    """Train with the example's :func:`build_trainer` on this rank; ``{"losses", "weights"}`` (weights
    gathered under ZeRO-3, on rank 0 only). The launcher's variables, accelerate's process state and
    transformers' DeepSpeed config are put back afterwards for the pool's next worker."""
    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                            "MASTER_PORT", "ACCELERATE_USE_DEEPSPEED")}
    threads = torch.get_num_threads()  # accelerate's CPU set-up may change it
    world = str(dist.get_world_size())  # what a launcher sets (accelerate reads it)
    os.environ.update(RANK=str(dist.get_rank()), LOCAL_RANK=str(dist.get_rank()), WORLD_SIZE=world,
                      LOCAL_WORLD_SIZE=world, MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"))
    linear = torch.nn.functional.linear  # ZeRO-3's zero.Init replaces it for good
    try:
        return _train(ours, training)
    finally:
        torch.nn.functional.linear = linear
        torch.set_num_threads(threads)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _train(ours: dict[str, Any], training: dict[str, Any]) -> dict[str, Any]:
    import deepspeed
    from accelerate.state import AcceleratorState
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from megatron_ring.training.hf_trainer import (RingTrainerArguments, accelerator_config, build_trainer,
                                                   init_trainer_groups, step_losses)

    args_ours = RingTrainerArguments(**ours)
    deepspeed_on = training.get("deepspeed") is not None
    groups = init_trainer_groups(args_ours.cp, deepspeed=deepspeed_on)
    try:
        args = TrainingArguments(**training, accelerator_config=accelerator_config(deepspeed_on))
        trainer = build_trainer(args_ours, args, groups)
        trainer.train()
        params = list(trainer.model.parameters())
        with deepspeed.zero.GatheredParameters(params) if trainer.is_deepspeed_enabled else _nothing():
            weights = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters()}
        if trainer.is_deepspeed_enabled:
            trainer.model_wrapped.destroy()
        return {"losses": step_losses(trainer), "weights": weights if dist.get_rank() == 0 else None}
    finally:
        unset_hf_deepspeed_config()
        AcceleratorState._reset_state(reset_partial_state=True)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
