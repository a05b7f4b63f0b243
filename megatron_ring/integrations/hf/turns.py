"""Conversations of a transformers model over a CP group: ragged first turns, follow-up turns, decode steps.

Every rank calls these with the same global token ids; each conversation keeps one
:class:`~megatron_ring.integrations.hf.cache.RingCache` (batch 1) sharded over the ranks, and
every function returns the logits of the conversation's last token, identical on every rank.

* :func:`ring_prefill_documents`: first turns of several conversations of any lengths in one
  packed row (``cu_seqlens``, each document sharded zigzag on its own, Note [Packed sequences]),
  no padding to the longest; each document's K/V become its own cache.
* :func:`ring_extend`: a follow-up turn against a conversation's cache (Note [Pass-KV or pass-Q]
  in attention/turn.py): new token ``i`` runs on rank ``i % cp`` and stays in its shard.
* :func:`ring_decode_step`: one token, run on every rank, against the cache (decode attention);
  :func:`ring_decode_rows`: one token of each of several conversations in one forward, each row
  against its own cache (``decode_attention_rows``: no shard is padded or copied).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

from megatron_ring.attention.sharding import chunks_per_rank, shard_sequence
from megatron_ring.attention.turn import TURN_MODES
from megatron_ring.integrations.hf.attention import check_model
from megatron_ring.integrations.hf.cache import RingCache
from megatron_ring.integrations.hf.context import SHARDING, CPContext, cp_context
from megatron_ring.integrations.hf.inputs import pad_id
from megatron_ring.integrations.hf.packed import pack_rows
from megatron_ring.integrations.hf.peer_errors import telling_peers


class _Collected(Cache):
    """A cache that only records each layer's K/V of one forward (the packed prefill's local shard)."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[DynamicLayer() for _ in range(num_layers)])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        layer.keys, layer.values = key_states, value_states
        return key_states, value_states


def _check_ids(name: str, ids: object) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0 or ids.dtype not in (
            torch.int32, torch.int64):
        raise ValueError(f"{name} must be a non-empty 1-D int tensor of token ids, got "
                         f"{getattr(ids, 'shape', type(ids).__name__)}")
    return ids.long()


def _broadcast_from(ctx: CPContext, logits: torch.Tensor | None, owner: int, shape: tuple[int, ...],
                    like: torch.Tensor) -> torch.Tensor:
    """``logits`` of rank ``owner`` on every rank (float32)."""
    out = logits.float().contiguous() if logits is not None else like.new_empty(shape, dtype=torch.float32)
    if ctx.size > 1:
        dist.broadcast(out, group=ctx.group, group_src=owner)
    return out


@torch.no_grad()
def ring_prefill_documents(model: PreTrainedModel, documents: list[torch.Tensor],
                           group: dist.ProcessGroup | None = None) -> list[tuple[RingCache, torch.Tensor]]:
    """First turns of ``documents`` (1-D token ids each, any lengths) in one packed ring prefill.

    Returns, per document, its :class:`RingCache` and the float32 logits ``[vocab]`` after its last
    token, the same on every rank. Each document is padded at its end to a multiple of ``2 * cp``
    (never to the longest); the padding's K/V are not kept.
    """
    check_model(model)
    if not documents:
        raise ValueError("ring_prefill_documents needs at least one document")
    docs = [_check_ids(f"documents[{i}]", d) for i, d in enumerate(documents)]
    device = docs[0].device
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(d.numel(), device=device) for d in docs])[None]
    layers = model.config.get_text_config().num_hidden_layers
    with cp_context(group) as ctx:
        row = pack_rows(ids, positions, chunks_per_rank(SHARDING) * ctx.size, pad_id(model))
        ctx.cu_seqlens = row.cu_seqlens
        local_ids, local_pos = row.shard(ctx.rank, ctx.size)
        columns = torch.arange(row.input_ids.shape[1], device=device)[None]
        shards = [shard_sequence(columns, r, ctx.size, dim=1, cu_seqlens=row.cu_seqlens)[0] for r in range(ctx.size)]
        local_index = shards[ctx.rank]
        starts = row.cu_seqlens.tolist()
        lasts = [starts[j] + d.numel() - 1 for j, d in enumerate(docs)]  # packed column of each last token
        owners = [next(r for r in range(ctx.size) if bool((shards[r] == c).any())) for c in lasts]
        held = [int((local_index == c).nonzero()[0]) if owners[j] == ctx.rank else -1 for j, c in enumerate(lasts)]
        keep = torch.tensor([h for h in held if h >= 0], dtype=torch.long, device=device)
        collected = _Collected(layers)
        with telling_peers(ctx, model):
            out = model(input_ids=local_ids, position_ids=local_pos, cache=collected, use_cache=True,
                        logits_to_keep=keep)
        ctx.cu_seqlens = None
        results = []
        vocab = out.logits.shape[-1]
        mine = iter(out.logits[0])
        for j, doc in enumerate(docs):
            in_doc = (local_index >= starts[j]) & (local_index < starts[j] + doc.numel())
            logits = _broadcast_from(ctx, next(mine) if held[j] >= 0 else None, owners[j], (vocab,), out.logits)
            results.append((_cache_of(collected, in_doc, local_index[in_doc] - starts[j], doc.numel(), ctx), logits))
    return results


def _cache_of(collected: _Collected, rows: torch.Tensor, columns: torch.Tensor, length: int,
              ctx: CPContext) -> RingCache:
    """A conversation's :class:`RingCache` from the packed prefill's local K/V: its ``rows``, at ``columns``."""
    cache = RingCache(len(collected.layers), ctx.rank, ctx.size)
    for source, layer in zip(collected.layers, cache.layers):
        layer.lazy_initialization(source.keys, source.values)
        layer.keys, layer.values = source.keys[..., rows, :], source.values[..., rows, :]
        layer.columns, layer.seen = columns.clone(), length
    cache.start_decode()
    return cache


@torch.no_grad()
def ring_extend(model: PreTrainedModel, cache: RingCache, ids: torch.Tensor, group: dist.ProcessGroup | None = None,
                *, mode: str = "auto") -> torch.Tensor:
    """Prefill a follow-up turn ``ids`` (1-D, the same on every rank) into the conversation's ``cache``.

    New token ``i`` (global index in the conversation) runs on CP rank ``i % cp``, attends every
    rank's shard by ``turn_attention`` (``mode``: ``"auto"``, ``"pass_kv"`` or ``"pass_q"``, Note
    [Pass-KV or pass-Q]) and stays in that rank's shard. Returns the float32 logits ``[vocab]`` after
    the turn's last token, the same on every rank.
    """
    check_model(model)
    ids = _check_ids("ids", ids)
    if mode not in TURN_MODES:
        raise ValueError(f"mode must be one of {list(TURN_MODES)}, got {mode!r}")
    with cp_context(group) as ctx:
        if cache.cp_size != ctx.size or cache.cp_rank != ctx.rank:
            raise ValueError(f"the cache was built on CP rank {cache.cp_rank} of {cache.cp_size}, this is rank "
                             f"{ctx.rank} of {ctx.size}")
        seen = cache.get_seq_length()
        positions = torch.arange(seen, seen + ids.numel(), device=ids.device)
        mine = positions % ctx.size == ctx.rank
        last = seen + ids.numel() - 1
        owner = last % ctx.size
        ctx.phase, ctx.cache, ctx.turn_positions, ctx.turn_mode = "turn", cache, positions[mine], mode
        local_ids, local_pos = ids[mine][None], positions[mine][None]
        if not bool(mine.any()):  # a model cannot run 0 tokens: one placeholder, neither attended nor kept
            local_ids, local_pos = ids[:1][None], positions[:1][None]
        keep = torch.tensor([local_ids.shape[1] - 1] if ctx.rank == owner else [], dtype=torch.long,
                            device=ids.device)
        with cache.turn(positions[mine], ids.numel()), telling_peers(ctx, model):
            out = model(input_ids=local_ids, position_ids=local_pos, cache=cache, use_cache=True,
                        logits_to_keep=keep)
        logits = out.logits[0, 0] if ctx.rank == owner else None
        return _broadcast_from(ctx, logits, owner, (out.logits.shape[-1],), out.logits)


@torch.no_grad()
def ring_decode_step(model: PreTrainedModel, cache: RingCache, token: int,
                     group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Append ``token`` to the conversation (its K/V on CP rank ``index % cp``); the float32 logits ``[vocab]``
    after it, the same on every rank (every rank runs the token; decode attention merges the shards)."""
    device = next(model.parameters()).device
    seen = cache.get_seq_length()
    with cp_context(group) as ctx:
        ctx.phase, ctx.cache = "decode", cache
        with telling_peers(ctx, model):
            out = model(input_ids=torch.tensor([[token]], device=device),
                        position_ids=torch.tensor([[seen]], device=device), cache=cache, use_cache=True)
    return out.logits[0, -1].float()


class _Rows(Cache):
    """The caches of several conversations as the rows of one decode forward: each layer's ``update`` hands
    each row's new K/V to its own conversation (kept by CP rank ``index % cp``); the attention function
    reads the rows' shards from the context (``CPContext.rows``), so what ``update`` returns is unused."""

    def __init__(self, caches: list[RingCache]) -> None:
        super().__init__(layers=[DynamicLayer() for _ in caches[0].layers])
        self.caches = caches

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        for j, cache in enumerate(self.caches):
            cache.layers[layer_idx].update(key_states[j:j + 1], value_states[j:j + 1])
        return key_states, value_states


@torch.no_grad()
def ring_decode_rows(model: PreTrainedModel, caches: list[RingCache], tokens: list[int],
                     group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """One decode step of each conversation in one forward: ``tokens[j]`` appended to ``caches[j]``.

    Returns the float32 logits ``[n, vocab]`` after each token, the same on every rank; each row equals
    :func:`ring_decode_step` of that conversation alone (up to the rounding of batched matmuls).
    """
    if len(caches) != len(tokens) or not caches:
        raise ValueError(f"ring_decode_rows needs one token per cache, got {len(tokens)} tokens for {len(caches)} "
                         "caches")
    device = next(model.parameters()).device
    seen = [cache.get_seq_length() for cache in caches]
    with cp_context(group) as ctx:
        ctx.phase, ctx.rows = "decode_rows", caches
        with telling_peers(ctx, model):
            out = model(input_ids=torch.tensor(tokens, device=device)[:, None],
                        position_ids=torch.tensor(seen, device=device)[:, None], cache=_Rows(caches), use_cache=True)
    return out.logits[:, -1].float()
