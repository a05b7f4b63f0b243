"""Workers of the sharded loading tests (run on every rank of a gloo pool)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def sharded_and_whole(directory: str, sizes: dict[str, int]) -> dict[str, Any]:
    """This rank's GPTModel of the checkpoint at ``directory`` under the layout ``sizes``, loaded twice: from its
    safetensors files (each rank reading its slices) and from transformers' whole model in memory. Returns the
    file reads ``[(name, dim, start, stop)]``, whether both models are equal, the rank's TP/PP coordinates
    and its parameters' element count."""
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from megatron_ring.config.gpt import GPTConfig
    from megatron_ring.integrations.megatron.hf_checkpoint import checkpoint_weights
    from megatron_ring.integrations.megatron.hf_weights import HFWeights
    from megatron_ring.integrations.megatron.model import build_gpt_model, load_full_state_dict
    from megatron_ring.integrations.megatron.state import init_megatron
    from megatron_ring.integrations.megatron.tensor_source import SafetensorsTensors
    from megatron_ring.parallel.layout import ParallelLayout

    weights = checkpoint_weights(Path(directory))
    assert isinstance(weights.source, SafetensorsTensors), type(weights.source)
    cfg = GPTConfig.parse({"model": weights.fields, "dtype": "fp32", "attention": "sdpa", "parallel": sizes})
    init_megatron(ParallelLayout(**sizes))
    sharded = build_gpt_model(cfg).eval()
    load_full_state_dict(sharded, weights)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
    whole = build_gpt_model(cfg).eval()
    converted = HFWeights(hf.config.to_dict(), hf.state_dict())
    load_full_state_dict(whole, {key: converted[key] for key in converted})  # a dict: cut by shard_of, as before
    pairs = list(zip(sharded.named_parameters(), whole.named_parameters()))
    equal = all(na == nb and torch.equal(a, b) for (na, a), (nb, b) in pairs)
    return {"reads": list(weights.source.reads), "equal": equal, "shapes": dict(weights.source.shapes),
            "tp_rank": ps.get_tensor_model_parallel_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "elements": sum(p.numel() for p in sharded.parameters())}
