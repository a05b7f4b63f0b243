"""DeepSpeed AutoTP on a Hugging Face model, for tensor x context parallelism (TP x CP).

AutoTP (``deepspeed.init_inference(..., tensor_parallel={"tp_size": N})``) splits the model's
linear layers over a TP group: each rank keeps ``heads / tp`` query and K/V heads and the
attention function sees only those. Ring attention runs unchanged on the local heads over the CP
group (ranks with the same TP rank), so TP x CP needs only the right groups::

    groups = init_parallel(ParallelLayout(tp=2, cp=2))
    model = init_autotp(model, groups.tp, ds_config)          # ds_config: DeepSpeed inference JSON
    tokens = ring_generate(model, input_ids, group=groups.cp, max_new_tokens=32)

Note [AutoTP on our own TP group]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``init_inference`` ignores ``tensor_parallel.tp_group`` and builds its TP group from ranks
``0..tp-1`` unless it is given an ``mpu``; with CP that group is wrong for every other TP group.
:class:`TPGroup` is that ``mpu``. DeepSpeed's comm backend (which AutoTP's all-reduces go through)
JIT-compiles a shared-memory all-reduce op on the CPU accelerator (~80 s per fresh machine);
:func:`init_deepspeed_comm` creates the backend over the running torch.distributed without it, so
those all-reduces use torch.distributed (gloo on CPU).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from megatron_ring.integrations.deepspeed.process_group import init_deepspeed_comm


class TPGroup:
    """DeepSpeed's ``mpu`` protocol for an existing tensor-parallel process group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.group

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self.group)

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self.group)


def init_autotp(model: torch.nn.Module, tp_group: dist.ProcessGroup,
                ds_config: dict[str, Any] | None = None) -> torch.nn.Module:
    """Shard ``model``'s linear layers over ``tp_group`` with DeepSpeed AutoTP; return the sharded model.

    ``ds_config`` is DeepSpeed's inference config (``dtype``, ...; default: the model's dtype, no
    kernel injection). Its ``tensor_parallel.tp_size``, if given, must equal ``tp_group``'s size.
    """
    import deepspeed

    tp_size = dist.get_world_size(tp_group)
    config = copy.deepcopy(ds_config) if ds_config is not None else {"dtype": model.dtype}
    config.setdefault("replace_with_kernel_inject", False)
    if config["replace_with_kernel_inject"]:
        raise ValueError("replace_with_kernel_inject=True replaces the attention kernels; ring attention needs False")
    tp = dict(config.get("tensor_parallel") or {})
    if tp.get("tp_size", tp_size) != tp_size:
        raise ValueError(f"tensor_parallel.tp_size={tp['tp_size']} but the TP group has {tp_size} ranks")
    tp["tp_size"] = tp_size
    if tp_size > 1:
        tp["mpu"] = TPGroup(tp_group)
        tp["tp_group"] = tp_group
        init_deepspeed_comm()
    config["tensor_parallel"] = tp
    return deepspeed.init_inference(model, config=config).module
