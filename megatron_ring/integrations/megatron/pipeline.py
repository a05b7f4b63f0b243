"""Pipeline-parallel forward/backward of one stage by hand, with blocking send/recv.

Megatron's schedules allocate on CUDA; these two functions run a stage on any device.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_ring.integrations.megatron.model import unwrap


def stage_forward(model: torch.nn.Module, tokens: Optional[torch.Tensor], position_ids: torch.Tensor,
                  labels: Optional[torch.Tensor] = None) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """Run this rank's pipeline stage; returns (received input or None, stage output).

    ``tokens``/``position_ids``/``labels`` are this CP rank's ``[b, s_local]``. Activations
    ``[s_local, b, h]`` travel to the next stage with a blocking send (pp = 1: a plain forward).
    """
    inp = None
    config = unwrap(model).config
    if not ps.is_pipeline_first_stage():
        b, s = position_ids.shape
        inp = torch.empty(s, b, config.hidden_size, dtype=config.pipeline_dtype)
        dist.recv(inp, src=ps.get_pipeline_model_parallel_prev_rank())
        inp.requires_grad_(torch.is_grad_enabled())
        model.set_input_tensor(inp)
    out = model(tokens if ps.is_pipeline_first_stage() else None, position_ids, None, labels=labels)
    if not ps.is_pipeline_last_stage():
        dist.send(out.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    return inp, out


def stage_backward(inp: Optional[torch.Tensor], out: torch.Tensor, loss_scale: float) -> None:
    """Backward of :func:`stage_forward` with labels: the last stage starts from ``sum(loss) * loss_scale``."""
    if ps.is_pipeline_last_stage():
        (out.float().sum() * loss_scale).backward()
    else:
        grad = torch.empty_like(out)
        dist.recv(grad, src=ps.get_pipeline_model_parallel_next_rank())
        out.backward(grad)
    if inp is not None:
        dist.send(inp.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
