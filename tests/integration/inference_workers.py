"""Functions run on every rank of a gloo pool for the inference tests (importable by spawned workers)."""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_ring.inference.loop import run_requests
from megatron_ring.runtime.reporting import progress
from megatron_ring.inference.schema import runner_module
from megatron_ring.parallel.groups import init_parallel
from megatron_ring.parallel.layout import ParallelLayout


def greedy_tokens(runner: str, model: dict[str, Any], layout: dict[str, int], work: dict[str, int]) -> list[list[int]]:
    """Greedy tokens ``[batch][new_tokens]`` of one fp32 request served by ``runner`` on ``layout``."""
    lay = ParallelLayout(**layout)
    groups = init_parallel(lay, timeout=timedelta(seconds=120))
    module = runner_module(runner)
    module.check_model(model, lay, batch=work["batch"], prompt_len=work["prompt_len"], new_tokens=work["new_tokens"],
                       dtype="fp32")
    model_runner = module.build_runner(model, groups, dtype=torch.float32, device=torch.device("cpu"),
                                       seed=work["seed"], batch=work["batch"], prompt_len=work["prompt_len"],
                                       new_tokens=work["new_tokens"])
    result = run_requests(model_runner, batch=work["batch"], prompt_len=work["prompt_len"],
                          new_tokens=work["new_tokens"], warmup=0, repeats=1, seed=work["seed"],
                          barrier=dist.barrier, bar=progress(0, enabled=False, desc=""))
    return result.generated
