"""A configured GPT vs the same model at cp = 1: loss, logits and gradients on one batch.

``python -m megatron_ring.megatron CONFIG.yaml`` under torchrun runs it on CPU processes and
prints the differences (docs/megatron.md).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_ring.config.gpt import GPTConfig
from megatron_ring.integrations.megatron.batches import gather_logits, get_batch_on_this_cp_rank
from megatron_ring.integrations.megatron.packed import get_thd_batch_on_this_cp_rank, pack_documents
from megatron_ring.integrations.megatron.model import build_gpt_model, full_state_dict, global_name, \
    is_gated_fc1, load_full_state_dict, shard_of, unwrap
from megatron_ring.integrations.megatron.pipeline import stage_backward, stage_forward
from megatron_ring.integrations.megatron.state import init_megatron
from megatron_ring.parallel.groups import leave_distributed
from megatron_ring.parallel.layout import ParallelLayout


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (half-precision gradients: elementwise rounding is too coarse for max-abs)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _worst_gradient(model: Any, cp_group: Any, ref_grads: dict[str, torch.Tensor], dtype: str) -> tuple[float, str]:
    """The largest error of a parameter gradient summed over the CP group against the cp = 1 reference's
    (max-abs relative in fp32, relative L2 otherwise), and that parameter's name."""
    worst, worst_name = 0.0, ""
    for name, param in unwrap(model).named_parameters():
        grad = param.grad.float().clone()
        dist.all_reduce(grad, group=cp_group)
        key = global_name(model, name)
        ref_grad = shard_of(param, ref_grads[key], gated=is_gated_fc1(model, key))
        err = rel_max(grad, ref_grad) if dtype == "fp32" else rel_l2(grad, ref_grad)
        if err > worst:
            worst, worst_name = err, name
    return worst, worst_name


def cp1_reference(cfg_data: dict[str, Any], *, batch: int = 2, seed: int = 1234) -> dict[str, Any]:
    """The cp = 1 side of :func:`compare_to_reference`: ``cfg_data``'s model unsharded (tp = pp = cp = 1,
    attention local, same dtype) on the whole batch, built on this rank under a ``dp = world`` parallel_state.

    Returns ``loss`` (float tensor), ``logits`` and ``grads`` (float32, by parameter name) and the full
    state dict ``weights``. It does not depend on ``cfg_data``'s ``parallel`` or ``attention``, so
    configs that differ only there can share one (pass it as ``compare_to_reference(reference=)``).
    """
    world = dist.get_world_size()
    ref_cfg = GPTConfig.parse({**cfg_data, "attention": "local", "parallel": {"tp": 1, "pp": 1, "cp": 1}})
    tokens, labels, position_ids = _batch(ref_cfg, batch, seed)
    init_megatron(ParallelLayout(dp=world), seed=seed)
    ref = build_gpt_model(ref_cfg)
    ref_loss_tok = ref(tokens, position_ids, None, labels=labels)
    ref_loss = ref_loss_tok.float().mean()
    ref_loss.backward()
    ref_grads = {name: p.grad.float().clone() for name, p in unwrap(ref).named_parameters()}
    with torch.no_grad():
        ref_logits = ref(tokens, position_ids, None).float()
    return {"loss": ref_loss.detach(), "logits": ref_logits, "grads": ref_grads, "weights": full_state_dict(ref)}


def _batch(cfg: GPTConfig, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens, labels and position ids both sides of :func:`compare_to_reference` run on."""
    m = cfg.model
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, m.vocab_size, (batch, m.seq_length), generator=gen)
    labels = torch.randint(0, m.vocab_size, (batch, m.seq_length), generator=gen)
    return tokens, labels, torch.arange(m.seq_length).expand(batch, -1)


def compare_to_reference(cfg_data: dict[str, Any], *, batch: int = 2, seed: int = 1234,
                         reference: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Same weights, same tokens: ``cfg_data``'s model vs the cp = 1 local-attention model.

    Every rank first builds the unsharded reference (tp = pp = cp = 1, attention local, same dtype),
    runs loss + backward on the whole batch, then builds the configured model, loads the same
    weights, runs its shard of the batch and compares loss, logits and every parameter gradient
    (summed over CP ranks, as Megatron's DP x CP reduction does). Returns relative errors: max-abs
    based for fp32, L2-norm based for the gradients of half-precision models.

    ``reference``: :func:`cp1_reference` of a config with the same model and dtype, made with the same
    ``batch`` and ``seed`` (callers comparing many layouts of one model compute it once); None: made here.
    """
    cfg = GPTConfig.parse(cfg_data)
    world = dist.get_world_size()
    tokens, labels, position_ids = _batch(cfg, batch, seed)
    n_tokens = batch * cfg.model.seq_length
    if reference is None:
        reference = cp1_reference(cfg_data, batch=batch, seed=seed)
    ref_loss, ref_logits, ref_grads = reference["loss"], reference["logits"], reference["grads"]

    init_megatron(cfg.check_world_size(world), seed=seed)
    model = build_gpt_model(cfg)
    load_full_state_dict(model, reference["weights"])
    part = get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels, "position_ids": position_ids})
    inp, out = stage_forward(model, part["tokens"], part["position_ids"], part["labels"])
    result: dict[str, Any] = {"rank": dist.get_rank()}
    cp_group = ps.get_context_parallel_group()
    if ps.is_pipeline_last_stage():
        loss_sum = out.detach().float().sum()
        dist.all_reduce(loss_sum, group=cp_group)
        result["loss"] = float(loss_sum / n_tokens)
        result["ref_loss"] = ref_loss.item()
        result["loss_err"] = abs(result["loss"] - result["ref_loss"]) / abs(result["ref_loss"])
    stage_backward(inp, out, 1.0 / n_tokens)
    result["grad_err"], result["grad_worst"] = _worst_gradient(model, cp_group, ref_grads, cfg.dtype)
    with torch.no_grad():
        _, logits = stage_forward(model, part["tokens"], part["position_ids"])
    if ps.is_pipeline_last_stage():
        result["logits_err"] = rel_max(gather_logits(logits.float()), ref_logits)
    return result


def cp1_packed_reference(cfg_data: dict[str, Any], doc_lengths: Sequence[int], *,
                         seed: int = 1234) -> dict[str, Any]:
    """The cp = 1 side of :func:`compare_packed_to_reference`: every document alone through ``cfg_data``'s
    model unsharded (tp = pp = cp = 1, attention local), built on this rank under a ``dp = world`` parallel_state.

    Returns ``loss`` (float, summed over documents, per real token), ``logits`` (the documents' real
    tokens, concatenated), ``grads`` (float32, by parameter name) and the full state dict ``weights``;
    like :func:`cp1_reference`, shareable by configs that differ only in ``parallel`` or ``attention``.
    """
    world = dist.get_world_size()
    ref_cfg = GPTConfig.parse({**cfg_data, "attention": "local", "parallel": {"tp": 1, "pp": 1, "cp": 1}})
    docs = _documents(ref_cfg, doc_lengths, seed)
    n_tokens = sum(doc_lengths)
    init_megatron(ParallelLayout(dp=world), seed=seed)
    ref = build_gpt_model(ref_cfg)
    ref_logits, ref_loss = [], 0.0
    for doc in docs:
        tokens, labels, positions = doc["tokens"][None], doc["labels"][None], torch.arange(len(doc["tokens"]))[None]
        doc_loss = ref(tokens, positions, None, labels=labels).float().sum() / n_tokens
        doc_loss.backward()
        ref_loss += float(doc_loss)
        with torch.no_grad():
            ref_logits.append(ref(tokens, positions, None)[0].float())
    ref_grads = {name: p.grad.float().clone() for name, p in unwrap(ref).named_parameters()}
    return {"loss": ref_loss, "logits": torch.cat(ref_logits), "grads": ref_grads, "weights": full_state_dict(ref)}


def _documents(cfg: GPTConfig, doc_lengths: Sequence[int], seed: int) -> list[dict[str, torch.Tensor]]:
    """The documents (tokens, labels) both sides of :func:`compare_packed_to_reference` run on."""
    vocab = cfg.model.vocab_size
    gen = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, vocab, (n,), generator=gen),
             "labels": torch.randint(0, vocab, (n,), generator=gen)} for n in doc_lengths]


def compare_packed_to_reference(cfg_data: dict[str, Any], doc_lengths: Sequence[int], *,
                                seed: int = 1234, reference: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Same weights: ``cfg_data``'s model on one packed THD row of documents vs each document alone at cp = 1.

    The reference runs every document as its own sequence through the unsharded local-attention
    model (tp = pp = cp = 1, Megatron's ``DotProductAttention``) and sums token losses and
    gradients. The configured model (pp = 1) gets all documents packed in one row, each padded to
    a multiple of ``2 * cp`` (:func:`pack_documents`), split per document over the CP group
    (:func:`get_thd_batch_on_this_cp_rank`) and ``packed_seq_params``. Returns relative errors of
    loss, real-token logits and every parameter gradient (summed over CP ranks).

    ``reference``: :func:`cp1_packed_reference` of a config with the same model and dtype, made with the
    same ``doc_lengths`` and ``seed``; None: made here.
    """
    cfg = GPTConfig.parse(cfg_data)
    if cfg.parallel.pp != 1:
        raise ValueError(f"compare_packed_to_reference needs parallel.pp = 1, got {cfg.parallel.pp}")
    world = dist.get_world_size()
    docs = _documents(cfg, doc_lengths, seed)
    n_tokens = sum(doc_lengths)
    if reference is None:
        reference = cp1_packed_reference(cfg_data, doc_lengths, seed=seed)
    ref_loss, ref_grads = reference["loss"], reference["grads"]

    init_megatron(cfg.check_world_size(world), seed=seed)
    cp_group = ps.get_context_parallel_group()
    model = build_gpt_model(cfg)
    load_full_state_dict(model, reference["weights"])
    batch, params = pack_documents(docs, 2 * cfg.parallel.cp)
    part = get_thd_batch_on_this_cp_rank(batch, params.cu_seqlens_q_padded)
    loss_tok = model(part["tokens"], part["position_ids"], None, labels=part["labels"], packed_seq_params=params)
    loss_sum = (loss_tok.float() * part["loss_mask"]).sum()
    (loss_sum / n_tokens).backward()
    result: dict[str, Any] = {"rank": dist.get_rank()}
    total = loss_sum.detach().clone()
    dist.all_reduce(total, group=cp_group)
    result["loss_err"] = abs(float(total) / n_tokens - ref_loss) / abs(ref_loss)
    result["grad_err"], result["grad_worst"] = _worst_gradient(model, cp_group, ref_grads, cfg.dtype)
    with torch.no_grad():
        logits = model(part["tokens"], part["position_ids"], None, packed_seq_params=params).float()
    full = gather_logits(logits, cu_seqlens=params.cu_seqlens_q_padded)[0]
    real = batch["loss_mask"][0].bool()
    result["logits_err"] = rel_max(full[real], reference["logits"])
    return result


def check_config_main(argv: Optional[Sequence[str]] = None) -> int:
    """``torchrun --nproc_per_node N -m megatron_ring.megatron CONFIG.yaml``: CPU/gloo check of a config.

    Builds the config's model and the cp = 1 Megatron reference with the same weights, runs one
    batch through both and prints loss, logits and gradient differences (see docs/megatron.md).
    """
    import argparse
    import os
    from datetime import timedelta

    from megatron_ring.config import load_mapping

    parser = argparse.ArgumentParser(prog="python -m megatron_ring.megatron", description=check_config_main.__doc__)
    parser.add_argument("config", help="a configs/megatron YAML/JSON file")
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("start it with torchrun, e.g. torchrun --nproc_per_node 2 -m megatron_ring.megatron CONFIG")
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    result = compare_to_reference(load_mapping(args.config), batch=args.batch)
    results: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if dist.get_rank() == 0:
        for r in results:
            loss = f"loss {r['loss']:.6f} (cp=1 reference {r['ref_loss']:.6f}), logits rel err {r['logits_err']:.1e}, " \
                if "loss" in r else ""
            print(f"rank {r['rank']}: {loss}max grad rel err {r['grad_err']:.1e} ({r['grad_worst']})")
    leave_distributed()
    return 0
