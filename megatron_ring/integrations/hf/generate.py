"""Prefill and generation of a transformers model over a CP group: :func:`ring_forward`, :func:`ring_generate`.

Every rank of the CP group calls these with the same *global* ``input_ids`` and gets the same
result; each rank embeds, projects and attends only its own zigzag shard of the prompt. The
prompt runs as a ring prefill, then ``model.generate`` continues from the sharded
:class:`~megatron_ring.integrations.hf.cache.RingCache` (Note [Prefill, replay, decode] there).
"""
from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
import torch.distributed as dist
from transformers import GenerationConfig, PreTrainedModel

from megatron_ring.attention.sharding import chunks_per_rank, shard_sequence, unshard_sequence
from megatron_ring.integrations.hf.attention import check_model, check_window
from megatron_ring.integrations.hf.cache import RingCache
from megatron_ring.integrations.hf.context import SHARDING, CPContext, cp_context


def _pad_left(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, multiple: int,
              pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Left-pad ``[batch, seq]`` tensors to a multiple of ``multiple`` (mask 0, position 0); return the pad width."""
    pad = -input_ids.shape[1] % multiple
    if pad:
        def left(x: torch.Tensor, value: int) -> torch.Tensor:
            return torch.cat([x.new_full((x.shape[0], pad), value), x], dim=1)
        input_ids, attention_mask, position_ids = left(input_ids, pad_id), left(attention_mask, 0), left(position_ids, 0)
    return input_ids, attention_mask, position_ids, pad


def _check_ids(input_ids: object, attention_mask: object) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a 2-D tensor [batch, seq], got {getattr(input_ids, 'shape', type(input_ids))}")
    if attention_mask is None:
        return input_ids, torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must be a 2-D tensor shaped like input_ids {tuple(input_ids.shape)}, "
                         f"got {getattr(attention_mask, 'shape', type(attention_mask))}")
    return input_ids, attention_mask.long()


def _shard(ctx: CPContext, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [shard_sequence(t, ctx.rank, ctx.size, dim=1, sharding=SHARDING) for t in tensors]


def _local_columns(ctx: CPContext, seq_len: int, device: torch.device) -> torch.Tensor:
    return shard_sequence(torch.arange(seq_len, device=device)[None], ctx.rank, ctx.size, dim=1, sharding=SHARDING)[0]


def _gather_seq(ctx: CPContext, local: torch.Tensor) -> torch.Tensor:
    """All-gather ``[batch, seq_local, ...]`` over the CP group and undo the zigzag -> ``[batch, seq, ...]``."""
    if ctx.size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(ctx.size)]
    dist.all_gather(parts, local.contiguous(), group=ctx.group)
    return unshard_sequence(parts, dim=1, sharding=SHARDING)


@torch.no_grad()
def ring_forward(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, *, group: dist.ProcessGroup | None = None,
                 gather_logits: bool = True) -> torch.Tensor:
    """Logits of a causal LM over a sequence sharded across ``group`` (ring attention prefill).

    Call on every rank of ``group`` with the same global ``input_ids`` ``[batch, seq]`` (any length;
    it is left-padded to a multiple of ``2 * cp``), optional padding ``attention_mask`` and
    ``position_ids`` (default ``0..seq-1``, like the model's own forward). Returns the global logits
    ``[batch, seq, vocab]`` on every rank, or with ``gather_logits=False`` this rank's zigzag shard
    of the (padded) sequence ``[batch, seq_padded // cp, vocab]``.
    """
    check_model(model)
    input_ids, attention_mask = _check_ids(input_ids, attention_mask)
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    with cp_context(group) as ctx:
        ids, mask, pos, pad = _pad_left(input_ids, attention_mask, position_ids,
                                        chunks_per_rank(SHARDING) * ctx.size, _pad_id(model))
        ctx.total_len = input_ids.shape[1]
        check_window(model, ctx.total_len)
        local_ids, local_mask, local_pos = _shard(ctx, ids, mask, pos)
        out = model(input_ids=local_ids, attention_mask=None if bool(mask.all()) else local_mask,
                    position_ids=local_pos, use_cache=False)
        logits = out.logits
        if not gather_logits:
            return logits
        return _gather_seq(ctx, logits)[:, pad:]


def _pad_id(model: PreTrainedModel) -> int:
    config = model.config.get_text_config()
    for value in (getattr(model.generation_config, "pad_token_id", None), getattr(config, "pad_token_id", None),
                  getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


DEFAULT_NEW_TOKENS = 20  # generate's own default when neither max_new_tokens nor max_length is set
GREEDY_ONLY: dict[str, tuple[object, ...]] = {"num_beams": (None, 1), "do_sample": (None, False),
                                              "prefill_chunk_size": (None,)}


@torch.no_grad()
def ring_generate(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                  group: dist.ProcessGroup | None = None, generation_config: GenerationConfig | None = None,
                  **kwargs: Any) -> torch.Tensor:
    """Greedy ``model.generate`` with a ring-attention prefill and a KV cache sharded over ``group``.

    Call on every rank of ``group`` with the same global prompt ``input_ids`` ``[batch, seq]`` and
    optional padding ``attention_mask`` (left padding); other keyword arguments go to
    ``generate`` (``max_new_tokens``, ``eos_token_id``, ...). Returns ``[batch, seq + new]`` token
    ids, identical on every rank and equal to the single-process ``generate``. See
    Note [Prefill, replay, decode].
    """
    check_model(model)
    input_ids, attention_mask = _check_ids(input_ids, attention_mask)
    for name in ("cache", "past_key_values", "position_ids", "assistant_model", "streamer"):
        if kwargs.get(name) is not None:
            raise ValueError(f"ring_generate manages {name!r} itself; got {name}={type(kwargs[name]).__name__}")
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    model_kwargs = config.update(**kwargs)
    for name, allowed in GREEDY_ONLY.items():
        if getattr(config, name, None) not in allowed:
            raise ValueError(f"ring_generate supports greedy search only: {name}={getattr(config, name)!r}, "
                             f"allowed: {list(allowed)}")
    if config.use_cache is False or config.cache_implementation is not None:
        raise ValueError(f"ring_generate needs its own sharded cache: use_cache={config.use_cache!r}, "
                         f"cache_implementation={config.cache_implementation!r}; allowed: True, None")
    if config.output_attentions:
        raise ValueError("output_attentions=True is not supported with ring attention; allowed: False")
    # generate's own positions: count of real tokens so far (left padding gets 0)
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    with cp_context(group) as ctx:
        ids, mask, pos, pad = _pad_left(input_ids, attention_mask, position_ids,
                                        chunks_per_rank(SHARDING) * ctx.size, _pad_id(model))
        seq = ids.shape[1]
        if config.max_new_tokens is None:  # lengths count the prompt, which gained `pad` tokens
            config.max_new_tokens = config.max_length - input_ids.shape[1] if config.max_length else DEFAULT_NEW_TOKENS
            config.max_length = None
        if config.min_length:
            config.min_length += pad
        ctx.total_len = input_ids.shape[1] + config.max_new_tokens
        check_window(model, ctx.total_len)
        text_config = model.config.get_text_config()
        cache = RingCache(text_config.num_hidden_layers, ctx.rank, ctx.size)
        local_ids, local_mask, local_pos = _shard(ctx, ids, mask, pos)
        extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        with cache.prefill(_local_columns(ctx, seq, ids.device), seq):
            model(input_ids=local_ids, attention_mask=None if bool(mask.all()) else local_mask,
                  position_ids=local_pos, cache=cache, use_cache=True, **extra)
        cache.forget_last()
        cache.start_decode()
        ctx.phase, ctx.cache = "decode", cache
        out = model.generate(ids, attention_mask=mask, cache=cache, generation_config=config, **model_kwargs)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    return sequences[:, pad:]
