"""Workers for the ZeRO-3 training tests: a training config run on a gloo pool rank, its weights gathered.

Under ZeRO-3 a rank holds only its partition of every parameter; the weights compared are gathered
first (``deepspeed.zero.GatheredParameters``), then TP shards concatenated like the other tests'.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_ring.training.loop import init_model_parallel, train
from megatron_ring.training.schema import parse_train_spec
from tests.integration.train_workers import full_weights, scoped_groups


def run_gathered(raw: dict[str, Any], base_dir: str) -> dict[str, Any]:
    """Train ``raw`` on this rank; ``{"losses", "start_step", "weights"}`` with the full weights on rank 0
    (else None); ``torch.nn.functional.linear`` is restored afterwards for the pool's next worker."""
    os.environ.update(RANK=str(dist.get_rank()), LOCAL_RANK=str(dist.get_rank()),
                      WORLD_SIZE=str(dist.get_world_size()))
    linear = torch.nn.functional.linear  # zero.Init replaces it for good (memory_efficient_linear)
    try:
        return _run_gathered(raw, base_dir)
    finally:
        torch.nn.functional.linear = linear


def _run_gathered(raw: dict[str, Any], base_dir: str) -> dict[str, Any]:
    with scoped_groups():  # the run's objects are gone (a frame of their own) when the groups are freed
        return _train_and_gather(raw, base_dir)


def _train_and_gather(raw: dict[str, Any], base_dir: str) -> dict[str, Any]:
    import deepspeed

    spec = parse_train_spec(raw, world_size=dist.get_world_size(), base_dir=Path(base_dir))
    device = torch.device("cpu")
    groups = init_model_parallel(spec, device)
    run = train(spec, groups, device)
    module = run.engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        weights = full_weights(module, groups.tp)
    run.engine.destroy()
    return {"losses": [r["loss"] for r in run.records], "start_step": run.start_step,
            "weights": weights if dist.get_rank() == 0 else None,
            "evals": {r["step"]: r["eval_loss"] for r in run.evals}}
