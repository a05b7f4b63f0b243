"""Hugging Face transformers models with ring attention over a context-parallel (CP) group.

Everything goes through transformers' public extension points: an ``AttentionInterface`` entry
``"ring"``, its ``AttentionMaskInterface`` entry (without one, transformers hands custom attention
no mask at all and padded batches would be silently wrong), and a :class:`RingCache` (a ``Cache``).
No model code is patched::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="ring")
    logits = ring_forward(model, input_ids, attention_mask, group=cp_group)      # [batch, seq, vocab]
    tokens = ring_generate(model, input_ids, attention_mask, group=cp_group, max_new_tokens=32)

Every rank of the CP group calls these with the same *global* ``input_ids`` and gets the same
result; each rank embeds, projects and attends only its own zigzag shard of the prompt.

Note [Prefill, replay, decode]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``ring_generate`` runs the prompt itself (one forward over the local shard, ring attention,
global RoPE positions), then hands the filled :class:`RingCache` to ``model.generate``. The prompt's
last token lives on one rank only, so its logits cannot come from every rank. Instead the cache
forgets that one token's K/V and reports ``L - 1`` seen tokens: ``generate`` then "continues" the
prompt with its last token as an ordinary decode step, which every rank computes identically
(``decode_attention`` merges all shards). From there ``generate``'s own bookkeeping (positions
from the global mask, stopping, logits processors) is exactly the single-process one. Each decode
token's K/V is kept by exactly one rank, ``global_index % cp_size`` (round-robin); the others drop it.

Note [Padding]
~~~~~~~~~~~~~~
The core's ``key_padding_mask`` runs on the ``math`` and CPU ``sdpa`` kernels only (the CUDA fused
kernels take no mask), so this adapter applies padding in a way every kernel takes, exactly, by
one extra head dimension: queries get a 1, keys get 0 (kept) or ``-big`` (padding),
values get 0, so a padded key's score is ``score - scale * big`` and its softmax weight underflows
to exactly 0 (real keys' scores gain an exact 0). The extra dims are padded with zeros to keep
``head_dim`` a multiple of 8 for the fused kernels. It runs only for batches that have padding, and
costs one copy of q/k/v (of the local cache, per decode step). Prompts whose length is not a
multiple of ``2 * cp`` are left-padded the same way.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import inspect
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from transformers import AttentionInterface, GenerationConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface

from megatron_ring.attention.decode import decode_attention
from megatron_ring.attention.ring import ring_attention
from megatron_ring.attention.sharding import chunks_per_rank, shard_sequence, unshard_sequence

ATTN_IMPLEMENTATION = "ring"
SHARDING = "zigzag"  # causal LMs: zigzag balances the ring (Note [Zigzag sharding] in attention/sharding.py)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CPContext",
    "RingCache",
    "cp_context",
    "enable_ring_attention",
    "register",
    "ring_forward",
    "ring_generate",
]


# --------------------------------------------------------------------------------------------
# The active CP context: how the attention function learns its group during a model call.
# --------------------------------------------------------------------------------------------

@dataclass
class CPContext:
    """The CP group of the running model call and what the attention function must do.

    ``phase`` is ``"prefill"`` (local tokens of a zigzag-sharded sequence: ring attention) or
    ``"decode"`` (new tokens identical on all ranks against ``cache``: decode attention).
    ``total_len`` is the longest global sequence this call can reach (sliding-window check).
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int
    phase: str = "prefill"
    cache: "RingCache | None" = None
    total_len: int = 0


_ACTIVE: contextvars.ContextVar[CPContext | None] = contextvars.ContextVar("megatron_ring_cp_context", default=None)


def _group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("group was given but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


@contextlib.contextmanager
def cp_context(group: dist.ProcessGroup | None = None, *, total_len: int = 0) -> Iterator[CPContext]:
    """Make ``group`` the CP group of ring-attention model calls inside the ``with`` block.

    :func:`ring_forward` and :func:`ring_generate` open it for you. Use it directly to run a
    ``"ring"`` model forward (prefill) on inputs you sharded yourself: zigzag shards of
    ``input_ids``, the padding mask (or None on every rank) and *global* ``position_ids``;
    ``total_len`` is the global length for the sliding-window check (default: local x cp).
    """
    rank, size = _group_rank_size(group)
    token = _ACTIVE.set(CPContext(group, rank, size, total_len=total_len))
    try:
        yield _ACTIVE.get()  # type: ignore[misc]
    finally:
        _ACTIVE.reset(token)


def _active() -> CPContext:
    ctx = _ACTIVE.get()
    if ctx is None:
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} needs a context-parallel context: call the model through "
            "megatron_ring.hf.ring_forward / ring_generate, or inside `with megatron_ring.hf.cp_context(group):`"
        )
    return ctx


# --------------------------------------------------------------------------------------------
# The sharded KV cache.
# --------------------------------------------------------------------------------------------

class RingCacheLayer(DynamicLayer):
    """One layer of a :class:`RingCache`: this rank's K/V ``[batch, heads_kv, n_local, head_dim]``.

    ``columns`` (int64 ``[n_local]``) are the global token indices of the local entries, in order;
    ``seen`` counts the tokens of the whole (global) sequence, on every rank.
    """

    is_croppable = False

    def __init__(self, owner: "RingCache") -> None:
        super().__init__()
        self.owner = owner
        self.columns: torch.Tensor | None = None
        self.seen = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this rank's share of the new K/V ``[batch, heads_kv, q_len, head_dim]``; return the local shard."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        plan = self.owner.prefill_plan
        if plan is not None:
            columns, global_len = plan
            if self.seen:
                raise ValueError(f"RingCache already holds {self.seen} tokens; a ring prefill needs an empty cache")
            if key_states.shape[-2] != columns.numel():
                raise ValueError(f"prefill K/V have {key_states.shape[-2]} local tokens, expected {columns.numel()}")
            self.keys, self.values = key_states, value_states
            self.columns, self.seen = columns.to(key_states.device), global_len
            return self.keys, self.values
        if key_states.shape[-2] != 1:
            raise ValueError(
                f"RingCache decodes one token per step, got {key_states.shape[-2]} (assisted or chunked decoding "
                "is not supported)"
            )
        index, self.seen = self.seen, self.seen + 1
        if index % self.owner.cp_size == self.owner.cp_rank:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            new = torch.tensor([index], dtype=torch.long, device=key_states.device)
            self.columns = new if self.columns is None else torch.cat([self.columns, new])
        return self.keys, self.values

    def forget_last(self) -> None:
        """Drop the last global token seen, on whichever rank holds it."""
        if self.columns is not None and self.columns.numel() and int(self.columns[-1]) == self.seen - 1:
            self.keys, self.values = self.keys[..., :-1, :], self.values[..., :-1, :]
            self.columns = self.columns[:-1]
        self.seen -= 1

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("RingCache cannot be cropped (assisted decoding is not supported with ring attention)")


class RingCache(Cache):
    """A KV cache sharded over the ranks of a CP group (see Note [Prefill, replay, decode]).

    After a ring prefill each rank holds the K/V of its own zigzag shard of the prompt; every decode
    token's K/V is kept by exactly one rank (``index % cp_size``). ``get_seq_length()`` is global.
    """

    def __init__(self, num_layers: int, cp_rank: int, cp_size: int) -> None:
        super().__init__(layers=[RingCacheLayer(self) for _ in range(num_layers)])
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.prefill_plan: tuple[torch.Tensor, int] | None = None

    @contextlib.contextmanager
    def prefill(self, columns: torch.Tensor, global_len: int) -> Iterator[None]:
        """Inside the block, ``update`` stores the whole local shard (global indices ``columns``)."""
        self.prefill_plan = (columns, global_len)
        try:
            yield
        finally:
            self.prefill_plan = None

    def forget_last(self) -> None:
        """Forget the last token in every layer (the replay step of ``ring_generate`` re-adds it)."""
        for layer in self.layers:
            layer.forget_last()


# --------------------------------------------------------------------------------------------
# The attention function and its mask function.
# --------------------------------------------------------------------------------------------

def _big(scale: float, dtype: torch.dtype) -> float:
    """Padding bias: makes ``exp(scale * (score - big))`` exactly 0 without overflowing ``dtype``."""
    return min(1e4 / scale, torch.finfo(dtype).max / 8)


def _mask_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold a key mask (bool ``[batch, s_k]``, True = attend) into extra head dims (Note [Padding]).

    q ``[b, s_q, hq, d]``, k/v ``[b, s_k, hkv, d]`` -> the same with ``d + e``, ``e`` in 1..8 so that
    ``d + e`` stays a multiple of 8 (fused kernels need it). Only the first extra dim is non-zero.
    """
    extra = 8 - q.shape[-1] % 8
    q_extra = q.new_zeros(q.shape[:-1] + (extra,))
    q_extra[..., 0] = 1
    k_extra = k.new_zeros(k.shape[:-1] + (extra,))
    k_extra[..., 0].masked_fill_(~key_mask.to(k.device)[:, :, None], -_big(scale, k.dtype))
    return (torch.cat([q, q_extra], dim=-1), torch.cat([k, k_extra], dim=-1),
            torch.cat([v, v.new_zeros(v.shape[:-1] + (extra,))], dim=-1))


def _check_module_call(module: torch.nn.Module, seq_len: int, dropout: float, kwargs: dict[str, Any]) -> None:
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True is not supported with ring attention (weights are never materialised)")
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise ValueError("ring attention for transformers supports causal decoders only, got is_causal=False")
    if dropout:
        raise ValueError(f"attention dropout must be 0 with ring attention, got {dropout} (call model.eval())")
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}={kwargs[name]!r} is not supported with ring attention; allowed: None")
    window = kwargs.get("sliding_window")
    if window is not None and seq_len > window:
        raise ValueError(
            f"sliding_window={window} is shorter than the sequence ({seq_len} tokens); ring attention is exact "
            "full causal attention, so it supports sliding windows only when the whole sequence fits in the window"
        )


def ring_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry ``"ring"``.

    query ``[batch, heads_q, q_len, head_dim]``, key/value ``[batch, heads_kv, kv_len, head_dim]``
    (this rank's tokens), attention_mask the 2-D padding mask from :func:`ring_mask` or None.
    Returns ``([batch, q_len, heads_q, head_dim], None)``. Whether a mask is given must agree on all
    ranks (the wrappers pass None exactly when the global mask has no padding): the masked path
    changes the shapes that the ranks exchange.
    """
    ctx = _active()
    _check_module_call(module, ctx.total_len or query.shape[2] * ctx.size, dropout, kwargs)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if ctx.phase == "decode" and ctx.cache is None:
        raise ValueError("the decode phase needs the RingCache of the running generate in the CP context")
    key_mask = attention_mask
    if key_mask is not None:
        if key_mask.dim() != 2:
            raise ValueError(f"ring attention takes a 2-D padding mask [batch, seq], got shape {tuple(key_mask.shape)}")
        if ctx.phase == "decode":
            columns = ctx.cache.layers[module.layer_idx].columns
            key_mask = key_mask[:, columns.to(key_mask.device)] if columns is not None else key_mask[:, :0]
    d = q.shape[-1]
    if key_mask is not None:
        q, k, v = _mask_keys(q, k, v, key_mask.bool(), scale)
    if ctx.phase == "decode":
        out = decode_attention(q, k, v, ctx.group, softmax_scale=scale)
    else:
        out = ring_attention(q, k, v, ctx.group, causal=True, softmax_scale=scale, sharding=SHARDING)
    return out[..., :d], None


def ring_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
              mask_function: Any = None, attention_mask: torch.Tensor | None = None,
              **kwargs: Any) -> torch.Tensor | None:
    """``AttentionMaskInterface`` entry ``"ring"``: hand the 2-D padding mask through unchanged.

    The causal structure lives in the ring (on global positions), so only padding is needed: in
    prefill the mask is this rank's shard ``[batch, seq_local]``, in decode the global mask
    ``[batch, seen + 1]`` that ``generate`` keeps (the attention function picks the local columns).
    """
    return attention_mask


def register() -> None:
    """Register ``"ring"`` with transformers' ``AttentionInterface`` and ``AttentionMaskInterface`` (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, ring_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ring_mask)


register()


# --------------------------------------------------------------------------------------------
# Running a model under a CP group.
# --------------------------------------------------------------------------------------------

def enable_ring_attention(model: PreTrainedModel) -> PreTrainedModel:
    """Switch ``model`` to ``attn_implementation="ring"`` after checking that it can run it; return it."""
    _check_model(model, require_ring=False)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def _check_model(model: PreTrainedModel, *, require_ring: bool = True) -> None:
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    config = model.config.get_text_config()
    if config.is_encoder_decoder or not getattr(config, "is_causal", True):
        raise ValueError(f"ring attention supports causal decoder-only models, got {type(model).__name__} "
                         f"(is_encoder_decoder={config.is_encoder_decoder}, is_causal={getattr(config, 'is_causal', True)})")
    if getattr(config, "output_attentions", False):
        raise ValueError("config.output_attentions=True is not supported with ring attention; allowed: False")
    impl = config._attn_implementation
    if require_ring and impl != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"model has attn_implementation={impl!r}; ring_forward / ring_generate need {ATTN_IMPLEMENTATION!r}: "
            f"load it with attn_implementation={ATTN_IMPLEMENTATION!r} or call enable_ring_attention(model)"
        )


def _check_window(model: PreTrainedModel, total_len: int) -> None:
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or ["sliding_attention"])
    if window is not None and sliding and total_len > window:
        raise ValueError(
            f"config.sliding_window={window} is shorter than the sequence ({total_len} tokens); ring attention is "
            "exact full causal attention, so sliding windows are supported only when the whole sequence fits"
        )


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
    _check_model(model)
    input_ids, attention_mask = _check_ids(input_ids, attention_mask)
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    with cp_context(group) as ctx:
        ids, mask, pos, pad = _pad_left(input_ids, attention_mask, position_ids,
                                        chunks_per_rank(SHARDING) * ctx.size, _pad_id(model))
        ctx.total_len = input_ids.shape[1]
        _check_window(model, ctx.total_len)
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
    _check_model(model)
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
        _check_window(model, ctx.total_len)
        text_config = model.config.get_text_config()
        cache = RingCache(text_config.num_hidden_layers, ctx.rank, ctx.size)
        local_ids, local_mask, local_pos = _shard(ctx, ids, mask, pos)
        extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        with cache.prefill(_local_columns(ctx, seq, ids.device), seq):
            model(input_ids=local_ids, attention_mask=None if bool(mask.all()) else local_mask,
                  position_ids=local_pos, cache=cache, use_cache=True, **extra)
        cache.forget_last()
        ctx.phase, ctx.cache = "decode", cache
        out = model.generate(ids, attention_mask=mask, cache=cache, generation_config=config, **model_kwargs)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    return sequences[:, pad:]
