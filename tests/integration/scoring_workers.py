"""Workers of the scoring tests (run on every rank of a gloo pool) and their single-process reference."""
from __future__ import annotations

import os
from typing import Any

import torch

from megatron_ring import ParallelLayout, init_parallel


def runner_scores(runner: str, model: dict[str, Any], sizes: dict[str, int], ids: torch.Tensor,
                  mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``ScoringRunner.score`` of the ``runner`` ("hf" or "megatron") of ``model`` under the layout ``sizes``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if runner == "hf":
        from megatron_ring.inference.runners.hf import build_runner
    else:
        from megatron_ring.inference.runners.gpt import build_runner
    groups = init_parallel(ParallelLayout(**sizes))
    built = build_runner(model, groups, dtype=torch.float32, device=torch.device("cpu"), seed=0, batch=ids.shape[0],
                         prompt_len=ids.shape[1] + 2 * groups.layout.cp, new_tokens=1)
    built.init_deepspeed({"dtype": "fp32", "replace_with_kernel_inject": False,
                          "tensor_parallel": {"tp_size": sizes.get("tp", 1)}})
    return built.score(ids, mask)


def alone(path: str, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-process transformers (eager, fp32) scores of one unpadded row ``[seq]``: log-probabilities
    ``[seq - 1]`` and greedy tokens ``[seq]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(row[None]).logits[0].float()
    logprob = torch.log_softmax(logits[:-1], -1).gather(-1, row[1:, None])[:, 0]
    return logprob, logits.argmax(-1)
