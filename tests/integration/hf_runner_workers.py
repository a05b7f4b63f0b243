"""Workers of the hf runner tests (run on every rank of a gloo pool) and their single-process references."""
from __future__ import annotations

import os
from typing import Any

import torch

from megatron_ring import ParallelLayout, init_parallel
from megatron_ring.inference.runners.hf import build_runner

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")
"""A chat template for the tiny byte tokenizer (it ships none)."""


def serve(model: dict[str, Any], layout: dict[str, int], ids: torch.Tensor, mask: torch.Tensor | None,
          new_tokens: int) -> tuple[torch.Tensor, int]:
    """Greedy ids ``[batch, new_tokens]`` of the hf runner under ``layout``, and this rank's ``q_proj`` rows."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    groups = init_parallel(ParallelLayout(**layout))
    runner = build_runner(model, groups, dtype=torch.float32, device=torch.device("cpu"), seed=0,
                          batch=ids.shape[0], prompt_len=ids.shape[1], new_tokens=new_tokens)
    runner.init_deepspeed({"dtype": "fp32", "replace_with_kernel_inject": False,
                           "tensor_parallel": {"tp_size": layout.get("tp", 1)}})
    tokens = [runner.prefill(ids, mask)]
    for _ in range(new_tokens - 1):
        tokens.append(runner.decode(tokens[-1]))
    return torch.stack(tokens, dim=1), runner.module.model.layers[0].self_attn.q_proj.weight.shape[0]


def reference(path: str, ids: torch.Tensor, mask: torch.Tensor | None, new_tokens: int) -> torch.Tensor:
    """Single-process greedy ``generate`` (eager attention, fp32, no early stop) -> ``[batch, new_tokens]``."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                              pad_token_id=model.config.pad_token_id)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, generation_config=config)
    return out[:, ids.shape[1]:]
