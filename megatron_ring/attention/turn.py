"""A follow-up turn prefilled against a KV cache sharded over the CP group: ``turn_attention``.

Note [Pass-KV or pass-Q]
~~~~~~~~~~~~~~~~~~~~~~~~
After a ring prefill (and decode) every rank holds the K/V of its own share of a conversation. A new turn of ``T``
tokens (a follow-up question) is split over the ranks too: new token ``i`` of the conversation goes to rank ``i % P``,
the rule decode appends by, so the shards stay balanced and every rank runs the model's projections and MLP on ``T / P``
tokens. Each rank appends its new tokens' K/V to its shard, then its new queries must meet every rank's shard, causally
(a key is visible iff its position is at most the query's). Two exact ways, as in Meta's context-parallel inference
(Yang et al., 2024):

* **pass-KV**: the K/V shards travel around the ring (``P - 1`` steps, the next transfer in flight
  while a block computes); each rank merges its own queries' partial results. It moves the
  whole cache, ``2 * heads_kv * S / P`` values per step, whatever ``T`` is.
* **pass-Q**: the queries travel instead: one all-gather of every rank's new queries
  (``heads_q * T`` values in all), each rank attends all of them to its own shard, and one
  all-to-all returns each partial ``(out, lse)`` to the rank that owns the query, which merges
  them by log-sum-exp. It moves ``O(T)``, not ``O(S)``, but nothing overlaps the compute.

Both compute the same FLOPs. For a short question after a long document (``T << S``) pass-Q moves a few kilobytes where
pass-KV moves the cache; when the turn itself is long (a second document) pass-KV's transfers hide behind its compute
and pass-Q's exposed all-gather and all-to-all of ``T`` rows cost more. ``mode="auto"`` takes the cheaper by
:func:`turn_times` (the cost model of ``comm="auto"``: achieved FLOP/s, link bandwidths and latencies), computed from
global sizes only, so every rank picks the same mode.

Every rank first all-gathers its ``(q_len, s_local)`` (they differ between ranks), and each
transfer is sized from that table. Positions travel with the blocks they describe (pass-KV) or
with the queries (pass-Q); causality and a sliding window are masks on positions, in any order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ring.costs.comm_choice import DEFAULT_COSTS, CommCosts, attention_flops
from megatron_ring.attention.block import block_forward, compute_dtype, merge_into, merge_stacked, resolve_backend
from megatron_ring.attention.call import check_qkv, check_scale, check_window, cp_place, prepare
from megatron_ring.attention.handshake import Field, choice_field, field, scale_field, table_device, tensor_fields
from megatron_ring.attention.transport import gather_stacked, post, wait_all
from megatron_ring.attention.window import check_positions, positions_visible

TURN_MODES: tuple[str, ...] = ("auto", "pass_kv", "pass_q")
TAG = 4242
"""Tag of the pass-KV ring's transfers (K/V, then positions)."""


@dataclass(frozen=True)
class TurnChoice:
    """What ``mode="auto"`` picked and the predicted seconds of both modes."""

    mode: str
    pass_kv_s: float
    pass_q_s: float


def turn_times(costs: CommCosts, *, new_tokens: int, kv_tokens: int, cp_size: int, batch: int, heads_q: int,
               heads_kv: int, head_dim: int, element_size: int) -> TurnChoice:
    """Predicted attention seconds of one layer of a turn (Note [Pass-KV or pass-Q]) and the cheaper mode. new_tokens:
    the turn's tokens over all ranks (``T``); kv_tokens: cached plus new tokens over all ranks (``S``). Each rank holds
    ``T / P`` queries and ``S / P`` keys; a block is one rank's queries against one rank's keys. Ties go to pass-KV."""
    p = cp_size
    q_local, s_local = new_tokens / p, kv_tokens / p
    block = attention_flops(batch=batch, q_len=q_local, k_len=s_local, heads=heads_q, head_dim=head_dim,
                            causal=False) / costs.flops_per_s
    ring, gather, _ = costs.links(p)
    kv_bytes = 2 * batch * heads_kv * s_local * head_dim * element_size
    pass_kv = block + (p - 1) * max(block, costs.step_latency_s + kv_bytes / ring)
    q_bytes = batch * heads_q * new_tokens * head_dim * element_size
    gather_s = costs.collective_latency_s + q_bytes * (p - 1) / p / gather if p > 1 else 0.0
    partial_bytes = batch * heads_q * new_tokens * (head_dim + 1) * 4  # fp32 (out, lse)
    pass_q = gather_s + p * block + costs.alltoall_s(partial_bytes, p)
    return TurnChoice("pass_kv" if pass_kv <= pass_q else "pass_q", pass_kv, pass_q)


@dataclass(frozen=True)
class TurnCall:
    """A checked ``turn_attention`` call."""

    scale: float
    backend: str
    left: int
    mode: str
    q_positions: torch.Tensor
    k_positions: torch.Tensor


def _turn_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float | None, backend: str,
               window_size: object, mode: str, q_positions: object, k_positions: object
               ) -> tuple[TurnCall, list[Field]]:
    check_qkv(q, k, v, same_seq=False)
    if mode not in TURN_MODES:
        raise ValueError(f"mode must be one of {list(TURN_MODES)}, got {mode!r}")
    left, right = check_window(window_size)
    if right != 0:
        raise ValueError(f"window_size = {window_size!r}: a turn is causal, so right must be 0; allowed: (left, 0) "
                         "with left >= -1 (-1 = unbounded)")
    q_pos = check_positions("q_positions", q_positions, q.shape[1], "q_len")
    k_pos = check_positions("k_positions", k_positions, k.shape[1], "s_local")
    scale = check_scale(softmax_scale, q.shape[-1])
    kernel = resolve_backend(backend, q.device, q.dtype, q.shape[-1], masked=True)
    fields = [*tensor_fields(q, k, None), scale_field(scale), field("window_size[0]", left),
              choice_field("mode", mode, TURN_MODES)]
    return TurnCall(scale, kernel, left, mode, q_pos.to(q.device), k_pos.to(q.device)), fields


def _attend(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor,
            call: TurnCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, hq, q, d], lse [b, hq, q])`` of heads-first q against k/v, causal on positions. Without a window, the
    keys that precede every query need no mask. When the keys are in ascending order (a cache appends by position), they
    are a prefix of the block. It runs unmasked, and only the rest (this turn's own tokens) is masked; the two parts
    merge by log-sum-exp. Query rows at position -1 (pass-Q's padding) are never read, so they do not count."""
    b, hq, tq, d = q.shape
    ct = compute_dtype(q.dtype)
    if tq == 0 or k.shape[2] == 0:
        return q.new_zeros(b, hq, tq, d, dtype=ct), q.new_full((b, hq, tq), float("-inf"), dtype=ct)
    real = q_pos[q_pos >= 0]
    first = int(real.min()) if real.numel() else -1
    seen = 0  # keys (a prefix of the block) that every real query sees
    if call.left < 0 and first >= 0:
        seen = int((k_pos <= first).sum())
        if seen < k_pos.numel() and not bool((k_pos[1:] >= k_pos[:-1]).all()):
            seen = 0  # not in order: one masked call
    if seen == k_pos.numel():
        out, lse = block_forward(q, k, v, causal=False, scale=call.scale, backend=call.backend)
        return out.to(ct), lse.to(ct)
    rest = slice(seen, None)
    visible = positions_visible(q_pos, k_pos[rest], (call.left, 0))
    out, lse = block_forward(q, k[:, :, rest], v[:, :, rest], causal=False, scale=call.scale, backend=call.backend,
                             visible=visible)
    out, lse = out.to(ct), lse.to(ct)
    if seen:
        early_out, early_lse = block_forward(q, k[:, :, :seen], v[:, :, :seen], causal=False, scale=call.scale,
                                             backend=call.backend)
        merge_into(out, lse, early_out, early_lse)
    return out, lse


def _pass_kv(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, call: TurnCall, group: dist.ProcessGroup | None,
             rank: int, size: int, sizes: list[list[int]]) -> torch.Tensor:
    """Pass-KV: every shard around the ring, merged into this rank's queries (heads-first ``[b, hq, q, d]``)."""
    b, hq, tq, d = qh.shape
    ct = compute_dtype(qh.dtype)
    out = qh.new_zeros(b, hq, tq, d, dtype=ct)
    lse = qh.new_full((b, hq, tq), float("-inf"), dtype=ct)
    block = torch.stack((kh, vh)).contiguous()  # [2, b, hkv, s, d]
    positions = call.k_positions.contiguous()
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    for step in range(size):
        works: list[dist.Work] = []
        if step < size - 1:
            src = (rank - step - 1) % size
            recv_block = block.new_empty((*block.shape[:3], sizes[src][1], d))
            recv_pos = positions.new_empty(sizes[src][1])
            works = post(group, [(nxt, block)], [(prv, recv_block)], TAG)
            works += post(group, [(nxt, positions)], [(prv, recv_pos)], TAG + 1)
        part_out, part_lse = _attend(qh, call.q_positions, block[0], block[1], positions, call)
        merge_into(out, lse, part_out, part_lse)
        if works:
            wait_all(works, qh.device)
            block, positions = recv_block, recv_pos
    return out


def _pass_q(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, call: TurnCall, group: dist.ProcessGroup | None,
            size: int, sizes: list[list[int]]) -> torch.Tensor:
    """Pass-Q: every rank's queries gathered, attended to this shard, partials returned by an all-to-all."""
    b, hq, tq, d = qh.shape
    longest = max(row[0] for row in sizes)
    padded = qh.new_zeros(b, hq, longest, d)
    padded[:, :, :tq] = qh
    pos = call.q_positions.new_full((longest,), -1)  # padding rows: position -1 sees no key (never read)
    pos[:tq] = call.q_positions
    queries = gather_stacked(padded, group, size)  # [P, b, hq, longest, d]
    q_positions = gather_stacked(pos, group, size)  # [P, longest]
    every = queries.permute(1, 2, 0, 3, 4).reshape(b, hq, size * longest, d)
    out, lse = _attend(every, q_positions.reshape(-1), kh, vh, call.k_positions, call)
    part = torch.cat((out, lse.unsqueeze(-1)), dim=-1).reshape(b, hq, size, longest, d + 1)
    send = part.permute(2, 0, 1, 3, 4).contiguous()  # [P, b, hq, longest, d + 1]: row r goes to rank r
    recv = send if size == 1 else torch.empty_like(send)
    if size > 1:
        dist.all_to_all_single(recv, send, group=group)
    merged, _ = merge_stacked(recv[..., :tq, :d], recv[..., :tq, d])
    return merged


def turn_attention(q: torch.Tensor, k_local: torch.Tensor, v_local: torch.Tensor,
                   group: dist.ProcessGroup | None = None, *, q_positions: torch.Tensor, k_positions: torch.Tensor,
                   mode: str = "auto", softmax_scale: float | None = None, backend: str = "auto",
                   window_size: tuple[int, int] = (-1, 0), costs: CommCosts | None = None,
                   check_consistency: bool = True) -> torch.Tensor:
    """Causal attention of this rank's share of a new turn over every rank's cache shard (Note [Pass-KV or pass-Q]).

    Args:
        q: ``[batch, q_len, heads_q, head_dim]``, this rank's new queries (``q_len`` may differ between ranks, be 0).
        k_local, v_local: ``[batch, s_local, heads_kv, head_dim]``, this rank's whole shard: its cached K/V and its new
            tokens' K/V, appended (``s_local`` may differ and may be 0).
        group: the CP group (None = world, or one process without torch.distributed).
        q_positions: int ``[q_len]``, the new queries' positions in the conversation; k_positions: int ``[s_local]``,
            the positions of this rank's keys (any order). Key ``j`` is visible to query ``i`` iff
            ``k_positions[j] <= q_positions[i]`` (and, with ``window_size=(left, 0)``,
            ``k_positions[j] >= q_positions[i] - left``).
        mode: ``"pass_kv"``, ``"pass_q"`` or ``"auto"`` (:func:`choose_turn_mode` with ``costs``, default
            ``DEFAULT_COSTS`` of the device type); the same on every rank.
        check_consistency: first check that every rank passed the same batch, heads, head_dim, dtype, scale, window and
            mode (Note [Cross-rank handshake]).

    Returns:
        ``[batch, q_len, heads_q, head_dim]`` in q's dtype: exactly the attention of these queries over the union of the
        shards. Not differentiable (inference)."""
    place = cp_place(group, "p2p")
    call = prepare("turn_attention", place, check_consistency, q, lambda: _turn_call(
        q, k_local, v_local, softmax_scale=softmax_scale, backend=backend, window_size=window_size, mode=mode,
        q_positions=q_positions, k_positions=k_positions))
    rank, size, flat = place.rank, place.size, place.flat
    shape = [q.shape[1], k_local.shape[1]]
    sizes = [shape] if size == 1 else gather_stacked(
        torch.tensor(shape, dtype=torch.int64, device=table_device(flat, q)), flat, size).tolist()
    chosen = choose_turn_mode(q, k_local, sizes, costs).mode if call.mode == "auto" else call.mode
    with torch.no_grad():
        qh, kh, vh = q.transpose(1, 2), k_local.transpose(1, 2), v_local.transpose(1, 2)
        out = _pass_kv(qh, kh, vh, call, flat, rank, size, sizes) if chosen == "pass_kv" else \
            _pass_q(qh, kh, vh, call, flat, size, sizes)
        return out.to(q.dtype).transpose(1, 2)


def choose_turn_mode(q: torch.Tensor, k_local: torch.Tensor, sizes: list[list[int]],
                     costs: CommCosts | None = None) -> TurnChoice:
    """:func:`turn_times` of a call from the ranks' ``[q_len, s_local]`` table (the same on every rank)."""
    costs = costs if costs is not None else DEFAULT_COSTS[q.device.type]
    return turn_times(costs, new_tokens=sum(r[0] for r in sizes), kv_tokens=sum(r[1] for r in sizes),
                      cp_size=len(sizes), batch=q.shape[0], heads_q=q.shape[2], heads_kv=k_local.shape[2],
                      head_dim=q.shape[3], element_size=q.element_size())

