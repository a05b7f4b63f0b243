"""Decode against a KV cache sharded over the ranks of a context-parallel group.

Note [Decode from a sharded KV cache]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
After a ring prefill every rank holds the K/V of its own tokens. Weights are replicated over CP ranks, so every rank
computes the same new token and the same query. Each rank attends that query to its own cache shard (a shard may be
empty), giving ``(o_r, lse_r)``; one all-gather of these small partial results
(``P x [batch, heads, q_len, head_dim + 1]``) and a log-sum-exp merge give the exact attention on every rank. No K/V
moves during decode; the caller appends each new token's K/V to one rank only (round-robin keeps the shards balanced)::

    rank 0: q . [K0 | new0]  -> (o0, lse0) \\
    rank 1: q . [K1 | new1]  -> (o1, lse1)  }-- all_gather --> merge -> o (same on all ranks)
    rank 2: q . [K2]         -> (o2, lse2) /

With a sliding window, each rank masks its shard by positions (``q_positions`` vs ``k_positions``, any order, e.g.
round-robin), so a query sees only the cached keys inside its window; a rank whose whole shard is outside contributes
``lse = -inf`` (weight 0).

Note [Decode after an all-to-all prefill]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``comm="a2a"`` and ``"a2a+p2p"`` take and return the same sequence-sharded tensors as ``"p2p"`` (the all-to-all is
internal to the call), so the K/V a layer caches after its prefill are its own tokens on every head, as after a ring
prefill, and decode is the same all-gather merge whatever comm the prefill used. We keep that layout rather than
re-laying the cache out by heads: a head-sharded cache would need the new token's q (all heads) sent to every rank and
the outputs gathered back, the same bytes as the merge, but with ``heads_kv < P`` it stores each replicated K/V head
``lcm(heads_kv, P) / heads_kv`` times, and the per-token append would need an all-to-all of every new token's K/V. Given
hierarchical groups (``CPGroups`` without ``cp``), the merge runs in two all-gathers, within each a2a group and then
across the ring groups; the log-sum-exp merge is associative, and the result is identical on every rank.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ring.attention.block import block_forward, compute_dtype, merge_stacked, resolve_backend
from megatron_ring.attention.call import (
    CPPlace, check_key_padding_mask, check_qkv, check_scale, check_tokens, check_window, cp_place, prepare,
)
from megatron_ring.attention.comms import CPGroups
from megatron_ring.attention.handshake import Field, field, flag_field, scale_field, tensor_fields
from megatron_ring.attention.opaque import call_op
from megatron_ring.attention.transport import gather_stacked
from megatron_ring.attention.window import NO_WINDOW, check_positions, positions_visible


@dataclass(frozen=True)
class DecodeCall:
    """A checked ``decode_attention`` call: the softmax scale, the block kernel and, with a window,
    the bool ``[q_len, s_local]`` mask of the cached keys each query sees."""

    scale: float
    backend: str
    visible: torch.Tensor | None


def decode_call(q: torch.Tensor, k_local: torch.Tensor, v_local: torch.Tensor, *, softmax_scale: float | None,
                backend: str, key_padding_mask: torch.Tensor | None, window_size: object,
                q_positions: object, k_positions: object) -> tuple[DecodeCall, list[Field]]:
    """Every local check of a call, its record and its handshake fields: what every rank must agree on
    (Note [Cross-rank handshake]); not the shard length ``s_local`` nor ``k_positions`` (both differ between ranks). The
    kernel is resolved on every rank, even one with an empty shard, so that a rank that cannot run it raises with the
    others (through the handshake) instead of leaving them in the all-gather."""
    check_qkv(q, k_local, v_local, same_seq=False)
    check_tokens(q, "q_len", "decode_attention", "at least one query token")
    check_key_padding_mask(key_padding_mask, k_local)
    scale = check_scale(softmax_scale, q.shape[-1])
    window = check_window(window_size)
    visible, positions = None, 0
    if window != NO_WINDOW:
        needed = " when window_size is given"
        q_pos = check_positions("q_positions", q_positions, q.shape[1], "q_len", needed)
        k_pos = check_positions("k_positions", k_positions, k_local.shape[1], "s_local", needed)
        visible = positions_visible(q_pos.to(q.device), k_pos.to(q.device), window)
        positions = zlib.crc32(str(q_pos.tolist()).encode())
    masked = key_padding_mask is not None
    kernel = resolve_backend(backend, q.device, q.dtype, q.shape[-1], masked=masked or visible is not None)
    fields = [*tensor_fields(q, k_local, "q_len"), scale_field(scale),
              flag_field("key_padding_mask", masked, ("None", "a mask")),
              field("window_size[0]", window[0]), field("window_size[1]", window[1]),
              field("q_positions", positions, lambda code: "unused" if code == 0 else f"values with crc32 {code:#010x}")]
    return DecodeCall(scale, kernel, visible), fields


def _fill(part: torch.Tensor, qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: DecodeCall, blind: bool,
          key_mask: torch.Tensor | None, visible: torch.Tensor | None) -> None:
    """Write out and lse of heads-first ``qh`` over one shard k, v ``[b, s, hkv, d]`` into ``part``
    ``[b, hq, q, d + 1]``; ``blind`` (the shard is empty, or no query sees any of it): a zero output and lse -inf."""
    d = qh.shape[-1]
    if blind:
        part[..., :d], part[..., d] = 0, float("-inf")
    else:
        part[..., :d], part[..., d] = block_forward(qh, k.transpose(1, 2), v.transpose(1, 2), causal=False,
                                                    scale=call.scale, backend=call.backend, key_mask=key_mask,
                                                    visible=visible)


def _gather_merge(part: torch.Tensor, place: CPPlace) -> torch.Tensor:
    """Every rank's ``[b, h, q, d + 1]`` (out, lse) partial merged, over the flat group or the two levels."""
    d = part.shape[-1] - 1
    levels = [(place.flat, place.size)] if place.has_flat else [(g, n) for g, _, n in place.hier or ()]
    for group, size in levels:
        parts = gather_stacked(part, group, size)
        out, lse = merge_stacked(parts[..., :d], parts[..., d])
        part = torch.cat((out, lse.unsqueeze(-1)), dim=-1)
    return part[..., :d]


def decode_attention(q: torch.Tensor, k_local: torch.Tensor, v_local: torch.Tensor,
                     group: dist.ProcessGroup | CPGroups | tuple | None = None, *, softmax_scale: float | None = None,
                     backend: str = "auto", key_padding_mask: torch.Tensor | None = None,
                     window_size: tuple[int, int] = (-1, -1), q_positions: torch.Tensor | None = None,
                     k_positions: torch.Tensor | None = None, check_consistency: bool = True) -> torch.Tensor:
    """Attention of new queries over the union of every rank's cache shard.

    Args:
        q: ``[batch, q_len, heads_q, head_dim]``, identical on all ranks of ``group``.
        k_local, v_local: this rank's cache shard ``[batch, s_local, heads_kv, head_dim]``; ``s_local`` may differ
            between ranks and may be 0. Every cached key is visible to every query (append the new tokens' K/V before
            calling).
        group: the context-parallel group (None = world, or one process without torch.distributed); ValueError on a
            process that is not a member. A ``CPGroups`` / ``(a2a, ring)`` tuple also serves, whatever comm the prefill
            used (Note [Decode after an all-to-all prefill]).
        key_padding_mask: None, or bool ``[batch, s_local]`` for this rank's shard (True = a real token), given on every
            rank or on none; a query that sees no real key on any rank (also: the cache is empty on every rank) gets a
            zero output.
        window_size: ``(left, right)``, flash-attn's sliding window on positions: query i sees cached key j iff
            ``q_positions[i] - left <= k_positions[j] <= q_positions[i] + right`` (-1 = unbounded; right = 0 for a
            causal window). Other than ``(-1, -1)`` it needs
        q_positions: int ``[q_len]``, the queries' global positions (the same on every rank), and
        k_positions: int ``[s_local]``, the positions of this rank's cached keys (any order).
        check_consistency: first check, with one small all-gather, that every rank passed the same batch, q_len, heads,
            head_dim, dtype, device type, scale, mask presence, window and q_positions, and raise ValueError on every
            rank naming what differs (Note [Cross-rank handshake] in handshake.py). Must be the same on every rank. In a
            decode loop it doubles the collectives per call; pass False once the first step has agreed.

    Returns:
        ``[batch, q_len, heads_q, head_dim]`` in q's dtype, identical on all ranks. Not differentiable. An empty batch
        gives an empty result; ``q_len``, heads or ``head_dim`` of 0 are a ValueError."""
    if torch.compiler.is_compiling():  # one opaque custom op: Note [torch.compile] in ops.py
        options = dict(softmax_scale=softmax_scale, backend=backend, window_size=window_size,
                       check_consistency=check_consistency)
        through_op = call_op("decode_attention", (q, k_local, v_local), group,
                             {"key_padding_mask": key_padding_mask, "q_positions": q_positions,
                              "k_positions": k_positions}, options)
        if through_op is not None:
            return through_op
    place = cp_place(group, "auto")
    call = prepare("decode_attention", place, check_consistency, q, lambda: decode_call(
        q, k_local, v_local, softmax_scale=softmax_scale, backend=backend, key_padding_mask=key_padding_mask,
        window_size=window_size, q_positions=q_positions, k_positions=k_positions))
    if q.shape[0] == 0:
        return torch.empty_like(q)
    with torch.no_grad():
        qh = q.transpose(1, 2)
        part = torch.empty(*qh.shape[:3], qh.shape[3] + 1, dtype=compute_dtype(q.dtype), device=q.device)
        _fill(part, qh, k_local, v_local, call, k_local.shape[1] == 0, key_padding_mask, call.visible)
        return _gather_merge(part, place).to(q.dtype).transpose(1, 2)


def decode_attention_rows(q: torch.Tensor, shards: list[tuple[torch.Tensor, torch.Tensor]],
                          group: dist.ProcessGroup | CPGroups | tuple | None = None, *,
                          softmax_scale: float | None = None, backend: str = "auto",
                          window_size: tuple[int, int] = (-1, -1), q_positions: torch.Tensor | None = None,
                          k_positions: list[torch.Tensor] | None = None, check_consistency: bool = True) -> torch.Tensor:
    """:func:`decode_attention` of ``n`` independent sequences at once, each against its own cache shard. Serving
    decodes the running conversations together: their shards have different lengths on each rank, so they cannot share
    one ``[batch, s_local, ...]`` tensor without padding every one to the longest (a copy of every cache, every step).
    Each row attends its own shard here, and one all-gather merges every row's partial result, as one call would.

    Args:
        q: ``[n, q_len, heads_q, head_dim]``, identical on all ranks of ``group``.
        shards: ``n`` pairs ``(k_j, v_j)``, this rank's shard of sequence ``j``, each ``[1, s_j, heads_kv, head_dim]``
            (``s_j`` may differ between rows and ranks, and be 0).
        window_size: as in :func:`decode_attention`; other than ``(-1, -1)`` it needs ``q_positions`` (int
            ``[n, q_len]``) and ``k_positions`` (``n`` int tensors ``[s_j]``).

    Returns:
        ``[n, q_len, heads_q, head_dim]`` in q's dtype, identical on all ranks. Not differentiable."""
    if not isinstance(shards, (list, tuple)) or len(shards) != q.shape[0]:
        raise ValueError(f"shards must be a list of {q.shape[0]} (k, v) pairs, one per row of q, got "
                         f"{len(shards) if isinstance(shards, (list, tuple)) else type(shards).__name__}")
    window = check_window(window_size)
    if window != NO_WINDOW and (q_positions is None or k_positions is None or len(k_positions) != len(shards)):
        raise ValueError("window_size other than (-1, -1) needs q_positions [n, q_len] and k_positions (n tensors)")
    place = cp_place(group, "auto")
    empty = q.new_empty(q.shape[0], 0, *shards[0][0].shape[2:]) if shards else q.new_empty(0, 0, 1, q.shape[-1])
    call = prepare("decode_attention", place, check_consistency, q, lambda: _rows_call(
        q, shards, empty, softmax_scale=softmax_scale, backend=backend, window=window))
    with torch.no_grad():
        qh = q.transpose(1, 2)
        part = torch.empty(*qh.shape[:3], qh.shape[3] + 1, dtype=compute_dtype(q.dtype), device=q.device)
        for j, (k, v) in enumerate(shards):
            visible = None
            if window != NO_WINDOW:
                visible = positions_visible(q_positions[j].to(q.device), k_positions[j].to(q.device), window)
            blind = k.shape[1] == 0 or (visible is not None and not bool(visible.any()))
            _fill(part[j:j + 1], qh[j:j + 1], k, v, call, blind, None, visible)
        return _gather_merge(part, place).to(q.dtype).transpose(1, 2)


def _rows_call(q: torch.Tensor, shards: list[tuple[torch.Tensor, torch.Tensor]], empty: torch.Tensor, *,
               softmax_scale: float | None, backend: str, window: tuple[int, int]) -> tuple[DecodeCall, list[Field]]:
    """The checks of :func:`decode_attention_rows`: each row's shard, then the call's record and fields
    (the window itself is compared; positions differ by row, so only their presence counts)."""
    for j, (k, v) in enumerate(shards):
        check_qkv(q[j:j + 1], k, v, same_seq=False)
    call, fields = decode_call(q, empty, empty, softmax_scale=softmax_scale, backend=backend, key_padding_mask=None,
                               window_size=NO_WINDOW, q_positions=None, k_positions=None)
    kernel = resolve_backend(backend, q.device, q.dtype, q.shape[-1], masked=window != NO_WINDOW)
    fields = fields + [field("rows window_size[0]", window[0]), field("rows window_size[1]", window[1])]
    return DecodeCall(call.scale, kernel, None), fields
