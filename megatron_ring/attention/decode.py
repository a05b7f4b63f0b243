"""Decode against a KV cache sharded over the ranks of a context-parallel group.

Note [Decode from a sharded KV cache]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
After a ring prefill every rank holds the K/V of its own tokens. Weights are replicated over CP
ranks, so every rank computes the same new token and the same query. Each rank attends that query
to its own cache shard (a shard may be empty), giving ``(o_r, lse_r)``; one all-gather of these
small partial results (``P x [batch, heads, q_len, head_dim + 1]``) and a log-sum-exp merge give
the exact attention on every rank. No K/V moves during decode; the caller appends each new
token's K/V to one rank only (round-robin keeps the shards balanced)::

    rank 0: q . [K0 | new0]  -> (o0, lse0) \\
    rank 1: q . [K1 | new1]  -> (o1, lse1)  }-- all_gather --> merge -> o (same on all ranks)
    rank 2: q . [K2]         -> (o2, lse2) /
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_ring.attention.allgather import all_gather_stacked
from megatron_ring.attention.block import block_forward, compute_dtype, resolve_backend
from megatron_ring.attention.checks import check_key_padding_mask, check_qkv, check_tokens, group_rank_size
from megatron_ring.attention.handshake import Field, agree, flag_field, scale_field, tensor_fields
from megatron_ring.attention.merge import merge_stacked
from megatron_ring.attention.opaque import call_op


def _prepare(q: torch.Tensor, k_local: torch.Tensor, v_local: torch.Tensor, *, softmax_scale: float | None,
             backend: str, key_padding_mask: torch.Tensor | None) -> tuple[float, str]:
    """Every local check of a call, before any collective; returns ``(scale, kernel)``.

    The kernel is resolved on every rank, even one with an empty shard, so that a rank that cannot
    run it raises with the others (through the handshake) instead of leaving them in the all-gather.
    """
    check_qkv(q, k_local, v_local, same_seq=False)
    check_tokens(q, "q_len", "decode_attention", "at least one query token")
    check_key_padding_mask(key_padding_mask, k_local)
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive number or None, got {softmax_scale!r}")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return scale, resolve_backend(backend, q.device, q.dtype, q.shape[-1], masked=key_padding_mask is not None)


def _fields(q: torch.Tensor, k_local: torch.Tensor, scale: float, masked: bool) -> list[Field]:
    """What every rank must agree on (Note [Cross-rank handshake]); not the shard length ``s_local``."""
    return [*tensor_fields(q, k_local, "q_len"), scale_field(scale),
            flag_field("key_padding_mask", masked, ("None", "a mask"))]


def decode_attention(q: torch.Tensor, k_local: torch.Tensor, v_local: torch.Tensor,
                     group: dist.ProcessGroup | None = None, *, softmax_scale: float | None = None,
                     backend: str = "auto", key_padding_mask: torch.Tensor | None = None,
                     check_consistency: bool = True) -> torch.Tensor:
    """Attention of new queries over the union of every rank's cache shard.

    Args:
        q: ``[batch, q_len, heads_q, head_dim]``, identical on all ranks of ``group``.
        k_local, v_local: this rank's cache shard ``[batch, s_local, heads_kv, head_dim]``;
            ``s_local`` may differ between ranks and may be 0. Every cached key is visible to every
            query (append the new tokens' K/V before calling).
        group: the context-parallel group (None = world, or one process without torch.distributed);
            ValueError on a process that is not a member.
        key_padding_mask: None, or bool ``[batch, s_local]`` for this rank's shard (True = a real
            token), given on every rank or on none; a query that sees no real key on any rank
            (also: the cache is empty on every rank) gets a zero output.
        check_consistency: first check, with one small all-gather, that every rank passed the same
            batch, q_len, heads, head_dim, dtype, device type, scale and mask presence, and raise
            ValueError on every rank naming what differs (Note [Cross-rank handshake] in
            handshake.py). Must be the same on every rank. In a decode loop it doubles the
            collectives per call; pass False once the first step has agreed.

    Returns:
        ``[batch, q_len, heads_q, head_dim]`` in q's dtype, identical on all ranks. Not differentiable.
        An empty batch gives an empty result; ``q_len``, heads or ``head_dim`` of 0 are a ValueError.
    """
    if torch.compiler.is_compiling():  # one opaque custom op: Note [torch.compile] in ops.py
        options = dict(softmax_scale=softmax_scale, backend=backend, check_consistency=check_consistency)
        through_op = call_op("decode_attention", (q, k_local, v_local), group,
                             {"key_padding_mask": key_padding_mask}, options)
        if through_op is not None:
            return through_op
    _, size = group_rank_size(group)
    prepared: tuple[float, str] | None = None
    error: Exception | None = None
    try:
        prepared = _prepare(q, k_local, v_local, softmax_scale=softmax_scale, backend=backend,
                            key_padding_mask=key_padding_mask)
    except Exception as err:  # raised below, once the other ranks know (they must not wait for this one)
        error = err
    if check_consistency and size > 1:
        fields = None if prepared is None else _fields(q, k_local, prepared[0], key_padding_mask is not None)
        agree("decode_attention", fields, group, size, q)
    if prepared is None:
        assert error is not None
        raise error
    scale, kernel = prepared
    if q.shape[0] == 0:
        return torch.empty_like(q)
    with torch.no_grad():
        qh, kh, vh = q.transpose(1, 2), k_local.transpose(1, 2), v_local.transpose(1, 2)
        ct = compute_dtype(q.dtype)
        b, hq, tq, d = qh.shape
        part = torch.empty(b, hq, tq, d + 1, dtype=ct, device=q.device)
        if kh.shape[2] == 0:
            part[..., :d] = 0
            part[..., d] = float("-inf")
        else:
            out, lse = block_forward(qh, kh, vh, causal=False, scale=scale, key_mask=key_padding_mask,
                                     backend=kernel)
            part[..., :d] = out
            part[..., d] = lse
        parts = all_gather_stacked(part, group, size)
        merged, _ = merge_stacked(parts[..., :d], parts[..., d])
        return merged.to(q.dtype).transpose(1, 2)
