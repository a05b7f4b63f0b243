"""Workers of the checkpoint loader tests (run on every rank of a gloo pool)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_ring.config.gpt import GPTConfig
from megatron_ring.integrations.megatron.hf_weights import HFWeights
from megatron_ring.integrations.megatron.model import build_gpt_model, load_full_state_dict
from megatron_ring.integrations.megatron.state import init_megatron
from megatron_ring.parallel.layout import ParallelLayout
from megatron_ring.testing.tiny_hf import tiny_model


def converted_logits(family: str, overrides: dict[str, Any], ids: torch.Tensor, attention: str = "sdpa") -> torch.Tensor:
    """Logits ``[b, s, vocab]`` of the tiny transformers model ``family`` converted into Megatron's GPTModel
    (tp = pp = cp = 1, fp32): ``attention`` sdpa (the core's block kernel) or local (Megatron's own)."""
    hf = tiny_model(family, **overrides)
    weights = HFWeights(hf.config.to_dict(), hf.state_dict())
    cfg = GPTConfig.parse({"model": weights.fields, "dtype": "fp32", "attention": attention})
    init_megatron(ParallelLayout(dp=dist.get_world_size()))
    model = build_gpt_model(cfg).eval()
    load_full_state_dict(model, weights)
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1), None)


def serve(model: dict[str, Any], sizes: dict[str, int], ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, bool]:
    """Greedy ids ``[batch, new_tokens]`` of the megatron runner of ``model`` under the layout ``sizes``, and
    whether the runner carries a tokenizer."""
    from megatron_ring.inference.runners.gpt import build_runner
    from megatron_ring.parallel.groups import init_parallel

    groups = init_parallel(ParallelLayout(**sizes))
    runner = build_runner(model, groups, dtype=torch.float32, device=torch.device("cpu"), seed=0, batch=ids.shape[0],
                          prompt_len=ids.shape[1], new_tokens=new_tokens)
    tokens = [runner.prefill(ids)]
    for _ in range(new_tokens - 1):
        tokens.append(runner.decode(tokens[-1]))
    return torch.stack(tokens, dim=1), runner.tokenizer is not None
