"""Workers for the pretrained Megatron-engine tests (tests/integration/test_train_megatron_pretrained.py),
run on every rank of a gloo pool: train a config, then the trained model's logits on fixed tokens and,
on rank 0, the export of its checkpoint loaded back by ``AutoModelForCausalLM.from_pretrained``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from tests.integration.train_workers import children_allowed, scoped_groups, trained


def engine_logits(engine: Any, groups: Any, tokens: torch.Tensor) -> Optional[torch.Tensor]:
    """Logits ``[b, s, vocab]`` (fp32) of the trained Megatron model on ``tokens`` ``[b, s]`` (positions
    0..s-1), through Megatron's forward-only schedule at the training layout: on the last pipeline
    stage's ranks (TP shards and CP zigzag parts gathered), None elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ring.attention.sharding import shard_sequence, unshard_sequence
    from megatron_ring.integrations.megatron.on_cpu import cuda_calls_on_cpu

    cp, cp_rank = groups.layout.cp, groups.cp_rank
    b, s = tokens.shape
    local = shard_sequence(tokens, cp_rank, cp, dim=1).contiguous()
    positions = shard_sequence(torch.arange(s).expand(b, -1), cp_rank, cp, dim=1).contiguous()
    captured: list[torch.Tensor] = []

    def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        next(data_iterator)
        output = model(local, positions, None)

        def keep(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
            captured.append(out.detach().float())
            return out.sum() * 0, torch.ones((), dtype=torch.int), {}
        return output, keep

    chunks = engine.model
    with cuda_calls_on_cpu(), torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter([None]) for _ in chunks] if len(chunks) > 1 else iter([None]),
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=1, seq_length=s,
            micro_batch_size=b, forward_only=True)
    if not captured:
        return None
    logits = captured[0]  # [b, s / cp, vocab / tp]
    if groups.layout.tp > 1:
        parts = [torch.empty_like(logits) for _ in range(groups.layout.tp)]
        dist.all_gather(parts, logits.contiguous(), group=groups.tp)
        logits = torch.cat(parts, dim=-1)
    if cp > 1:
        parts = [torch.empty_like(logits) for _ in range(cp)]
        dist.all_gather(parts, logits.contiguous(), group=groups.groups["cp"])
        logits = unshard_sequence(parts, dim=1)
    return logits


def train_and_export(raw: dict[str, Any], base_dir: str, tokens: torch.Tensor, out_dir: str) -> dict[str, Any]:
    """Train ``raw`` (which saves a checkpoint at its last step), then ``{"losses", "logits"}`` on every
    rank (logits: the trained model's on ``tokens`` where this rank holds them, else None); rank 0 then
    exports the checkpoint into ``out_dir`` (``megatron-ring export``'s function) and adds ``"exported"``: ``from_pretrained``'s fp32 logits."""
    with scoped_groups(), children_allowed():
        spec, groups, run = trained(raw, base_dir)
        logits = engine_logits(run.engine, groups, tokens)
        run.engine.destroy()
        result: dict[str, Any] = {"losses": [r["loss"] for r in run.records], "logits": logits}
        dist.barrier()
        if dist.get_rank() == 0:
            from transformers import AutoModelForCausalLM

            from megatron_ring.training.export import export_checkpoint

            ckpt = spec.path(spec.train.checkpoint.dir)
            out = export_checkpoint(ckpt, Path(out_dir))  # megatron-ring export: the engine told by the marker
            model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
            with torch.no_grad():
                result["exported"] = model.eval()(tokens).logits.float()
            result["files"] = sorted(p.name for p in out.iterdir())
        return result
