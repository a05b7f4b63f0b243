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


def autotp_sharded_and_whole(directory: str, tp: int) -> dict[str, Any]:
    """The hf runner's model at tp ``tp`` built empty, cut by AutoTP and read a slice at a time, against transformers'
    whole model cut by AutoTP: whether every parameter and buffer is equal, the reads and this rank's elements."""
    from megatron_ring.config.checkpoint import CheckpointSource
    from megatron_ring.inference.runners.checkpoint import load_checkpoint
    from megatron_ring.inference.runners.hf import HFRunner
    from megatron_ring.integrations.deepspeed.autotp import init_autotp
    from megatron_ring.parallel.groups import init_parallel
    from megatron_ring.parallel.layout import ParallelLayout

    groups = init_parallel(ParallelLayout(tp=tp))
    ds = {"dtype": "fp32", "replace_with_kernel_inject": False}
    source = CheckpointSource.parse({"checkpoint": directory})
    runner = HFRunner(source, groups, dtype=torch.float32, device=torch.device("cpu"))
    assert runner._slices is not None, "the sliced route was not taken"
    files = runner._slices[0]
    runner.init_deepspeed(ds)
    whole, _ = load_checkpoint(source, dtype=torch.float32, attn_implementation="ring", where="test")
    whole = init_autotp(whole, groups.tp, ds)
    ours = dict(runner.module.named_parameters()) | dict(runner.module.named_buffers())
    theirs = dict(whole.named_parameters()) | dict(whole.named_buffers())
    equal = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    return {"equal": equal, "reads": list(files.reads), "shapes": dict(files.shapes),
            "elements": sum(p.numel() for p in runner.module.parameters())}
