"""``deepspeed.init_inference`` for a model that is already tensor-parallel (Megatron's layers)."""
from __future__ import annotations

from typing import Any

import torch


def init_inference(module: torch.nn.Module, ds: dict[str, Any]) -> Any:
    """Hand ``module`` to ``deepspeed.init_inference`` with DeepSpeed's part of the config.

    ``tensor_parallel`` is replaced by ``{"tp_size": 1}``: Megatron's layers already do the tensor
    parallelism (see Note above). Returns the InferenceEngine; ``module`` is converted in place.
    """
    import deepspeed

    config = dict(ds)
    config["tensor_parallel"] = {"tp_size": 1}
    return deepspeed.init_inference(module, config=config)
