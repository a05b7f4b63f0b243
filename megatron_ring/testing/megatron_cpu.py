"""Run megatron-core on CPU processes (gloo) for tests and CPU demos.

Megatron-core assumes CUDA in a few places that a GPT forward/backward touches:

* ``RotaryEmbedding.get_emb`` moves the RoPE frequencies to ``torch.cuda.current_device()``;
* ``get_pos_emb_on_this_cp_rank`` builds its index with ``pin_memory=True`` and ``.cuda()``;
* ``GlobalMemoryBuffer.get_tensor`` (DotProductAttention's score buffer) allocates on CUDA;
* ``get_default_causal_mask`` (the torch softmax path) builds the mask on ``"cuda"``;
* the CUDA RNG tracker (``get_cuda_rng_tracker().fork()`` around attention dropout) needs CUDA
  generator states.

:func:`apply_cpu_shims` replaces exactly these with device-agnostic equivalents (same numbers).
It is called by tests and CPU demos only; importing :mod:`megatron_ring` or its Megatron
integration never patches anything.
"""
from __future__ import annotations

import operator
from functools import lru_cache, reduce
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_ring.parallel.layout import ParallelLayout

_APPLIED = False


def _get_emb(self: Any, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """``RotaryEmbedding.get_emb`` without the move to CUDA: ``[max_seq_len, 1, 1, dim]``."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


def _get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """Megatron's zigzag slice of a position table, with the index on ``pos_emb``'s device."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def _get_tensor(self: Any, tensor_shape: Any, dtype: torch.dtype, name: str,
                mem_alloc_context: Optional[Callable[..., Any]] = None) -> torch.Tensor:
    """``GlobalMemoryBuffer.get_tensor`` allocating on CPU."""
    needed = reduce(operator.mul, tensor_shape, 1)
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < needed:
        buf = self.buffer[(name, dtype)] = torch.empty(needed, dtype=dtype)
    return buf[:needed].view(*tensor_shape)


@lru_cache(maxsize=8)
def _default_causal_mask(sq: int) -> torch.Tensor:
    """``[sq, sq]`` bool, True above the diagonal (masked), on CPU."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def apply_cpu_shims() -> None:
    """Patch megatron-core's CUDA-only calls listed in the module docstring (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core import utils as mcore_utils
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding
    from megatron.core.tensor_parallel import random as tp_random

    rotary_pos_embedding.RotaryEmbedding.get_emb = _get_emb
    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = _get_pos_emb_on_this_cp_rank
    mcore_utils.GlobalMemoryBuffer.get_tensor = _get_tensor
    fused_softmax.get_default_causal_mask = _default_causal_mask
    # The inference tracker's fork() is a no-op context: no CUDA generator is touched.
    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _APPLIED = True


def init_megatron_cpu(layout: ParallelLayout, *, seed: int = 1234) -> None:
    """Shim Megatron for CPU and (re)initialise its ``parallel_state`` for ``layout`` on gloo.

    ``torch.distributed`` must already be initialised (e.g. inside a
    :class:`megatron_ring.testing.gloo.GlooPool` worker) with ``layout.world_size`` ranks.
    """
    from megatron_ring.integrations.megatron_model import ensure_parallel_state

    apply_cpu_shims()
    layout.check_world_size(dist.get_world_size())
    ensure_parallel_state(layout)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# Pipeline-parallel forward/backward by hand (Megatron's schedules allocate on CUDA).


def stage_forward(model: torch.nn.Module, tokens: Optional[torch.Tensor], position_ids: torch.Tensor,
                  labels: Optional[torch.Tensor] = None) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """Run this rank's pipeline stage; returns (received input or None, stage output).

    ``tokens``/``position_ids``/``labels`` are this CP rank's ``[b, s_local]``. Activations
    ``[s_local, b, h]`` travel to the next stage with a blocking send (pp = 1: a plain forward).
    """
    from megatron.core import parallel_state as ps

    from megatron_ring.integrations.megatron_model import unwrap

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
    from megatron.core import parallel_state as ps

    if ps.is_pipeline_last_stage():
        (out.float().sum() * loss_scale).backward()
    else:
        grad = torch.empty_like(out)
        dist.recv(grad, src=ps.get_pipeline_model_parallel_next_rank())
        out.backward(grad)
    if inp is not None:
        dist.send(inp.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())


# ---------------------------------------------------------------------------------------------
# Workers for the integration tests (module-level so GlooPool can pickle them).


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (half-precision gradients: elementwise rounding is too coarse for max-abs)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare_to_reference(cfg_data: dict[str, Any], *, batch: int = 2, seed: int = 1234) -> dict[str, Any]:
    """Same weights, same tokens: ``cfg_data``'s model vs the cp = 1 local-attention model.

    Every rank first builds the unsharded reference (tp = pp = cp = 1, attention local, same dtype),
    runs loss + backward on the whole batch, then builds the configured model, loads the same
    weights, runs its shard of the batch and compares loss, logits and every parameter gradient
    (summed over CP ranks, as Megatron's DP x CP reduction does). Returns relative errors: max-abs
    based for fp32, L2-norm based for the gradients of half-precision models.
    """
    from megatron.core import parallel_state as ps

    from megatron_ring.config.gpt import GPTConfig
    from megatron_ring.integrations.megatron import gather_logits, get_batch_on_this_cp_rank
    from megatron_ring.integrations.megatron_model import build_gpt_model, full_state_dict, global_name, \
        load_full_state_dict, shard_of, unwrap

    cfg = GPTConfig.parse(cfg_data)
    world = dist.get_world_size()
    ref_cfg = GPTConfig.parse({**cfg_data, "attention": "local", "parallel": {"tp": 1, "pp": 1, "cp": 1}})
    m = cfg.model
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, m.vocab_size, (batch, m.seq_length), generator=gen)
    labels = torch.randint(0, m.vocab_size, (batch, m.seq_length), generator=gen)
    position_ids = torch.arange(m.seq_length).expand(batch, -1)
    n_tokens = batch * m.seq_length

    init_megatron_cpu(ParallelLayout(dp=world), seed=seed)
    ref = build_gpt_model(ref_cfg)
    ref_loss_tok = ref(tokens, position_ids, None, labels=labels)
    ref_loss = ref_loss_tok.float().mean()
    ref_loss.backward()
    ref_grads = {name: p.grad.float().clone() for name, p in unwrap(ref).named_parameters()}
    with torch.no_grad():
        ref_logits = ref(tokens, position_ids, None).float()
    weights = full_state_dict(ref)
    del ref

    init_megatron_cpu(cfg.check_world_size(world), seed=seed)
    model = build_gpt_model(cfg)
    load_full_state_dict(model, weights)
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
    worst, worst_name = 0.0, ""
    for name, param in unwrap(model).named_parameters():
        grad = param.grad.float().clone()
        dist.all_reduce(grad, group=cp_group)
        ref_grad = shard_of(param, ref_grads[global_name(model, name)])
        err = _rel(grad, ref_grad) if cfg.dtype == "fp32" else _rel_l2(grad, ref_grad)
        if err > worst:
            worst, worst_name = err, name
    result["grad_err"], result["grad_worst"] = worst, worst_name
    with torch.no_grad():
        _, logits = stage_forward(model, part["tokens"], part["position_ids"])
    if ps.is_pipeline_last_stage():
        result["logits_err"] = _rel(gather_logits(logits.float()), ref_logits)
    return result


def _attention_config(**overrides: Any) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _expect_error(fn: Callable[[], Any]) -> str:
    """Run ``fn``; return ``"TypeName: message"`` of the ValueError/TypeError it raises ("" if none)."""
    try:
        fn()
    except (ValueError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return ""


def core_attention_cp1_cases(seq: int = 16, batch: int = 2) -> dict[str, Any]:
    """cp = 1: RingAttention vs Megatron's DotProductAttention on the same q/k/v, and its refusals.

    Returns relative errors per case and the error message of each unsupported call.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ring.integrations.megatron import RingAttention

    init_megatron_cpu(ParallelLayout(dp=dist.get_world_size()))
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(seq, batch, 4, 16, generator=gen)
    k = torch.randn(seq, batch, 2, 16, generator=gen)
    v = torch.randn(seq, batch, 2, 16, generator=gen)
    causal_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    errors: dict[str, float] = {}
    for case, mask_type, scale, mask in (("causal", AttnMaskType.causal, None, None),
                                         ("no_mask", AttnMaskType.no_mask, None, None),
                                         ("causal_scale", AttnMaskType.causal, 0.3, None),
                                         ("causal_explicit_mask", AttnMaskType.causal, None, causal_mask)):
        config = _attention_config()
        ref = DotProductAttention(config, 1, mask_type, "self", softmax_scale=scale)
        ring = RingAttention(config, 1, mask_type, "self", softmax_scale=scale)
        errors[case] = _rel(ring(q, k, v, mask), ref(q, k, v, mask))
    ring = RingAttention(_attention_config(), 1, AttnMaskType.causal, "self")
    training = RingAttention(_attention_config(attention_dropout=0.1), 1, AttnMaskType.causal, "self")
    training.train()
    refusals = {
        "attention_bias": _expect_error(lambda: ring(q, k, v, None, attention_bias=torch.zeros(1))),
        "arbitrary_mask": _expect_error(lambda: ring(q, k, v, torch.rand(1, 1, seq, seq) > 0.5)),
        "packed_seq_params": _expect_error(lambda: ring(q, k, v, None, packed_seq_params=object())),
        "dropout_training": _expect_error(lambda: training(q, k, v, None)),
        "padding_mask_type": _expect_error(lambda: RingAttention(_attention_config(), 1, AttnMaskType.padding, "self")),
        "cp_comm_type_a2a": _expect_error(
            lambda: RingAttention(_attention_config(), 1, AttnMaskType.causal, "self", cp_comm_type="a2a")),
        "window_size": _expect_error(
            lambda: RingAttention(_attention_config(window_size=(4, 0)), 1, AttnMaskType.causal, "self")),
    }
    training.eval()
    errors["dropout_eval"] = _rel(training(q, k, v, None), ring(q, k, v, None))
    return {"errors": errors, "refusals": refusals}


def core_attention_mask_cp_cases(seq: int = 16, batch: int = 2) -> dict[str, Any]:
    """cp = world: the CP-sharded causal mask is accepted (same output as no mask); others are refused."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ring.integrations.megatron import RingAttention, get_batch_on_this_cp_rank

    cp = dist.get_world_size()
    init_megatron_cpu(ParallelLayout(cp=cp))
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(seq // cp, batch, 4, 16, generator=gen) for _ in range(3))
    full_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    mask = get_batch_on_this_cp_rank({"attention_mask": full_mask})["attention_mask"]
    ring = RingAttention(_attention_config(num_query_groups=4, context_parallel_size=cp), 1,
                         AttnMaskType.causal, "self")
    return {
        "cp_rank": ps.get_context_parallel_rank(),
        "mask_err": _rel(ring(q, k, v, mask), ring(q, k, v, None)),
        "unsharded_mask": _expect_error(lambda: ring(q, k, v, full_mask)),
        "wrong_mask": _expect_error(lambda: ring(q, k, v, ~mask)),
    }


def batch_split_matches_megatron(seq: int = 16) -> bool:
    """Our get_batch_on_this_cp_rank equals megatron.core.utils.get_batch_on_this_cp_rank on this rank."""
    from megatron.core import utils as mcore_utils

    from megatron_ring.integrations.megatron import get_batch_on_this_cp_rank

    init_megatron_cpu(ParallelLayout(cp=dist.get_world_size()))
    batch = {
        "tokens": torch.arange(2 * seq).view(2, seq),
        "labels": torch.arange(2 * seq).view(2, seq) + 1,
        "loss_mask": torch.rand(2, seq),
        "position_ids": torch.arange(seq).expand(2, -1),
        "attention_mask": torch.rand(1, 1, seq, seq) > 0.5,
    }
    ours = get_batch_on_this_cp_rank(batch)
    theirs = mcore_utils.get_batch_on_this_cp_rank(dict(batch))
    return all(torch.equal(ours[key], theirs[key]) for key in batch)


def model_module_types(cfg_data: dict[str, Any]) -> dict[str, Any]:
    """Build ``cfg_data``'s model on this rank; return ``{module name: class name}`` and parameter names/shapes."""
    from megatron_ring.config.gpt import GPTConfig
    from megatron_ring.integrations.megatron_model import build_gpt_model

    cfg = GPTConfig.parse(cfg_data)
    init_megatron_cpu(cfg.check_world_size(dist.get_world_size()))
    model = build_gpt_model(cfg)
    return {
        "modules": {name: type(mod).__name__ for name, mod in model.named_modules()},
        "params": {name: tuple(p.shape) for name, p in model.named_parameters()},
    }


def generate_with_runner(cfg_data: dict[str, Any], layout: ParallelLayout, *, batch: int = 2, prompt_len: int = 16,
                         new_tokens: int = 6, seed: int = 1234, dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """Greedy tokens ``[batch][new_tokens]`` from :class:`MegatronRunner` (prefill + decode) for ``layout``."""
    from megatron_ring.inference.megatron_runner import build_runner
    from megatron_ring.parallel.groups import init_parallel

    groups = init_parallel(layout)
    runner = build_runner(cfg_data, groups, dtype=dtype, device=torch.device("cpu"), seed=seed, batch=batch,
                          prompt_len=prompt_len, new_tokens=new_tokens)
    prompt = torch.randint(0, runner.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    out = [runner.prefill(prompt)]
    for _ in range(new_tokens - 1):
        out.append(runner.decode(out[-1]))
    return torch.stack(out, dim=1).tolist()


def generate_without_cache(cfg_data: dict[str, Any], *, batch: int = 2, prompt_len: int = 16, new_tokens: int = 6,
                           seed: int = 1234) -> list[list[int]]:
    """Reference greedy tokens: Megatron's plain GPTModel forward over the whole sequence at every step.

    tp = pp = cp = 1 on every rank, local attention, no KV cache, weights of
    :func:`megatron_ring.inference.megatron_runner.draw_weights`.
    """
    from megatron_ring.config.gpt import GPTConfig
    from megatron_ring.inference.megatron_runner import draw_weights
    from megatron_ring.integrations.megatron_model import build_gpt_model

    cfg = GPTConfig.parse({**cfg_data, "attention": "local", "parallel": {"tp": 1, "pp": 1, "cp": 1}})
    init_megatron_cpu(ParallelLayout(dp=dist.get_world_size()), seed=seed)
    model = build_gpt_model(cfg)
    model.eval()
    draw_weights(model, seed)
    vocab = cfg.model.vocab_size
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for _ in range(new_tokens):
            positions = torch.arange(ids.shape[1]).expand(batch, -1)
            logits = model(ids, positions, None)
            ids = torch.cat([ids, logits[:, -1].float().argmax(dim=-1, keepdim=True)], dim=1)
    return ids[:, prompt_len:].tolist()


def parallel_view_matches_layout(layout: ParallelLayout) -> dict[str, Any]:
    """``parallel_from_megatron()`` after Megatron's init for ``layout``: its ranks and ring vs ``layout``'s."""
    from megatron_ring.integrations.megatron import parallel_from_megatron

    init_megatron_cpu(layout)
    view = parallel_from_megatron()
    rank = dist.get_rank()
    expected = {axis: layout.group_of(axis, rank) for axis in view.ranks}
    ring = layout.group_of("cp", rank)
    me = ring.index(rank)
    return {
        "layout_equal": view.layout == layout,
        "ranks_equal": view.ranks == expected,
        "ring_equal": (view.cp_rank, view.ring_next, view.ring_prev)
        == (me, ring[(me + 1) % len(ring)], ring[(me - 1) % len(ring)]),
    }
