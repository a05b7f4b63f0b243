"""Workers of tests/integration/test_train_packed_data.py: the loss and gradients of one training step's
batches, built by the loop's :class:`~megatron_ring.training.data.TrainData` and run through the loop's
transformers loss (:func:`~megatron_ring.training.hf_model.causal_lm_token_loss`) on a tiny ``"ring"``
model, over the pool's world as the CP group (dp = 1)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatron_ring.testing.tiny_hf import VOCAB_SIZE, tiny_model
from megatron_ring.training.data import Document, DocumentRows, PackedSequences, TrainData, masked_loss
from megatron_ring.training.hf_model import causal_lm_token_loss


def step_loss_and_grads(model: torch.nn.Module, data: TrainData, *, scramble_unlearned_labels: bool = False
                        ) -> dict[str, Any]:
    """Global mean token loss of step 0 and the gradients of it (summed over the CP ranks), as the loop's
    Note [The loss of a context-parallel rank] (training/global_loss.py) computes them. ``scramble_unlearned_labels``: labels of
    every token with loss mask 0 are replaced by random ids first."""
    batches = data.step_batches(0)
    if scramble_unlearned_labels:
        gen = torch.Generator().manual_seed(11 + dist.get_rank())
        for b in batches:
            noise = torch.randint(0, model.config.vocab_size, b.labels.shape, generator=gen)
            b.labels = torch.where(b.loss_mask.bool(), b.labels, noise)
    count = torch.stack([b.loss_mask.sum() for b in batches]).sum()
    dist.all_reduce(count)
    groups = SimpleNamespace(cp=dist.group.WORLD)
    model.zero_grad()
    total = torch.zeros(())
    for b in batches:
        local = masked_loss(causal_lm_token_loss(model, b, groups), b.loss_mask)
        (local / count).backward()
        total += local.detach()
    dist.all_reduce(total)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        grads[name] = g
    return {"loss": float(total / count), "grads": grads, "tokens": [b.tokens.shape[1] for b in batches],
            "real": [float(b.loss_mask.sum()) for b in batches]}


def run_documents(docs: Sequence[Document], seq_len: int, micro: int, *, packing: bool,
                  vocab_size: int = VOCAB_SIZE, scramble_unlearned_labels: bool = False) -> dict[str, Any]:
    """Step 0 of ``docs`` as :class:`DocumentRows` (unshuffled, ``micro`` rows a micro-batch)."""
    model = tiny_model("llama", attn_implementation="ring", vocab_size=vocab_size)
    rows = DocumentRows(docs, seq_len, packing=packing, source="test")
    data = _data(rows, micro)
    out = step_loss_and_grads(model, data, scramble_unlearned_labels=scramble_unlearned_labels)
    out["rows"] = rows.rows
    return out


def run_token_rows(stream: torch.Tensor, seq_len: int, micro: int, vocab_size: int = VOCAB_SIZE) -> dict[str, Any]:
    """Step 0 of ``stream`` cut into rows of ``seq_len`` (the byte-level kinds' path, padded for zigzag)."""
    model = tiny_model("llama", attn_implementation="ring", vocab_size=vocab_size)
    return step_loss_and_grads(model, _data(PackedSequences(stream, seq_len), micro))


def _data(samples: Any, micro: int) -> TrainData:
    return TrainData(samples, micro_batch=micro, grad_accum=1, dp=1, dp_rank=0, cp=dist.get_world_size(),
                     cp_rank=dist.get_rank(), shuffle=False, seed=0)


def held_out_loss(docs: Sequence[Document], seq_len: int, micro: int, *, packing: bool) -> dict[str, Any]:
    """The loop's :func:`~megatron_ring.training.loop.evaluate` of ``docs`` (rows of :class:`DocumentRows`,
    ``micro`` rows a round) on the tiny ``"ring"`` model; and whether it left the model in training mode."""
    from megatron_ring.training.deepspeed_engine import DeepSpeedTrainer
    from megatron_ring.training.loop import evaluate

    model = tiny_model("llama", attn_implementation="ring")
    groups = SimpleNamespace(cp=dist.group.WORLD, dp_cp=dist.group.WORLD, layout=SimpleNamespace(pp=1))
    engine = DeepSpeedTrainer(None, groups, torch.device("cpu"), model=model, token_loss=causal_lm_token_loss)
    loss, tokens = evaluate(engine, _data(DocumentRows(docs, seq_len, packing=packing, source="test"), micro), groups,
                            torch.device("cpu"))
    return {"loss": loss, "tokens": tokens, "training": model.training}
