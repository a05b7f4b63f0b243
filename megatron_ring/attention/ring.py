"""Ring attention: exact attention over a sequence sharded across a context-parallel group.

Each rank keeps its queries and meets every K/V block in turn, as a transport brings them (transport.py: the relay ring,
direct transfers, or a gather); the partial results are merged by log-sum-exp (Note [Log-sum-exp merge] in block.py).
Activation memory per rank is O(L/P); with the ring no rank ever holds the whole sequence's K/V.

:func:`ring_forward` and :func:`ring_backward` are the one loop of every variant (Note [Pieces]), plain functions over
a checked :class:`~megatron_ring.attention.call.RingCall`; :class:`_RingFunction` is their autograd Function,
:func:`run_ring` its call on ``[batch, seq_local, heads, head_dim]`` tensors; the custom ops (ops.py) call them too.

Note [Pieces]
~~~~~~~~~~~~~
The loops know one unit of work, the :class:`~megatron_ring.attention.schedule.Piece`: some query heads with their K/V
heads, some rows, and a :class:`~megatron_ring.attention.schedule.Schedule` over those rows. A transport yields
``(src, piece, k_src, v_src)``: the piece's K/V of block ``src``, in the piece's heads and rows; the loop runs the
piece's plans for ``src`` on it. A plain, windowed or packed call is one whole piece (every head, every row, in place);
the relay's forward cuts it into head groups (Note [Forward memory] in relay.py), one ring each; a dilated call has one
piece per (pair, phase) with compact rows (Note [Dilated attention as one ring call] in dilated.py), whose queries are
gathered into compact storage, merged into the output at the end of forward and scattered back by ``index_add_`` in
backward. So the dilated plan and the relay's head groups are schedules, not loops, and each transport moves pieces
without knowing why. Statistics wrap the transport's iteration (``transport.timed``); the loops hold no timing code.

Note [Heads-first blocks]
~~~~~~~~~~~~~~~~~~~~~~~~~
The caller's ``[b, s, h, d]`` tensors put a token's heads side by side, so one head's rows are ``h * d`` elements apart.
The block kernels read a head's rows block by block, and on CPU they take 0.90-0.96x the time (forward, and
forward+backward; h = 8, the 4096 x 4096 and 4096 x 2048 blocks of a zigzag ring at L = 16k, P = 4) when those rows are
adjacent (``python -m megatron_ring.perf.bench.block --layouts``). So every block kernel reads heads-first
``[b, h, s, d]`` storage: q is copied once per pass (and dout in backward), and the transport copies the K/V it sends
(in forward the relay piece by piece, Note [Forward memory] in relay.py). The output and dq are written into
``[b, s, h, d]`` storage, as the caller's layout, and need no copy back. A copy costs about 1 % of such a block's time
per tensor. Autograd saves the caller's q, k, v, not copies: a forward keeps nothing of its own beyond its output and
lse.
"""
from __future__ import annotations

import torch

from megatron_ring.attention.block import block_backward, block_forward, compute_dtype, merge_into
from megatron_ring.attention.call import RingCall
from megatron_ring.attention.dilated_schedule import row_index
from megatron_ring.attention.dilated_transport import DilatedPieces
from megatron_ring.attention.direct import DirectTransfers
from megatron_ring.attention.gather import GatheredBlocks
from megatron_ring.attention.relay import RelayRing
from megatron_ring.attention.schedule import Piece, StepPlan
from megatron_ring.attention.transport import KVTransport, gather_stacked, timed


def transport_for(call: RingCall) -> KVTransport:
    """The transport of a ``p2p`` / ``all_gather`` call: the relay, direct transfers of the rows a window or documents
    read (Note [Direct transfers] in direct.py), the gather, or a dilated call's pieces through them."""
    group, rank, size = call.place.flat, call.place.rank, call.place.size
    if call.dilation is not None:
        return DilatedPieces(group, rank, size, call.pieces, call.comm)
    piece = call.pieces[0]
    if call.comm == "all_gather":
        return GatheredBlocks(group, rank, size, piece)
    if piece.schedule.sparse:
        return DirectTransfers(group, rank, size, piece)
    return RelayRing(group, rank, size, piece, call.relay_pieces)


def key_masks_of(call: RingCall, key_padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Every rank's key padding mask, ``[P, batch, seq_local]`` bool (one all-gather), or None."""
    if key_padding_mask is None:
        return None
    return gather_stacked(key_padding_mask.to(torch.uint8), call.place.flat, call.place.size).bool()


def _alloc_bshd(b: int, h: int, s: int, d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero ``[b, h, s, d]`` view over ``[b, s, h, d]`` memory, so the result needs no final copy."""
    return torch.zeros(b, s, h, d, dtype=dtype, device=device).transpose(1, 2)


def _masks(key_masks: torch.Tensor | None, src: int, plan: StepPlan,
           device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(key_mask, visible)`` of one plan: the keys of block ``src`` it uses (from the gathered
    ``[P, batch, seq_local]`` masks) and its band as a bool ``[q, k]`` mask (None: full or causal)."""
    key_mask = None if key_masks is None else key_masks[src][:, plan.k]
    visible = None if plan.band is None else plan.band.visible(plan.q.stop - plan.q.start,
                                                               plan.k.stop - plan.k.start, device)
    return key_mask, visible


def _rows(piece: Piece, rank: int, xs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """``x[:, piece.q]`` of each ``x`` ``[batch, heads, seq_local, ...]`` at the piece's rows: views
    for a whole-row piece, compact copies for a dilated one (Note [Pieces])."""
    if piece.runs is None:
        return [x[:, piece.q] for x in xs]
    index = row_index(piece.runs[rank], xs[0].device)
    return [x[:, piece.q].index_select(2, index) for x in xs]


def ring_forward(call: RingCall, transport: KVTransport, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 key_masks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: out ``[batch, heads_q, seq_local, head_dim]`` (a view of ``[b, s, h, d]`` memory) in the compute
    dtype, lse ``[batch, heads_q, seq_local]``; q/k/v ``[batch, heads, seq_local, head_dim]`` of any strides, copied
    heads-first here (one piece at a time) and by the transport (Note [Heads-first blocks])."""
    b, hq, s, d = q.shape
    rank, ct = call.place.rank, compute_dtype(q.dtype)
    out = _alloc_bshd(b, hq, s, d, ct, q.device)
    lse = torch.full((b, hq, s), float("-inf"), dtype=ct, device=q.device)
    at, compact = None, {}  # compact: a dilated piece's (q, out, lse), merged into out at the end
    for src, piece, k_src, v_src in timed(transport.blocks(k, v), q.device, forward=True):
        if piece is not at:  # a new piece: its queries, heads-first (Note [Forward memory] in relay.py)
            at = piece
            if piece.runs is not None and id(piece) not in compact:
                (qc,) = _rows(piece, rank, (q,))
                compact[id(piece)] = (qc, torch.zeros(qc.shape, dtype=ct, device=q.device),
                                      torch.full(qc.shape[:3], float("-inf"), dtype=ct, device=q.device))
            qp, op, lp = compact[id(piece)] if piece.runs is not None else \
                (q[:, piece.q].contiguous(), out[:, piece.q], lse[:, piece.q])
        for plan in piece.schedule.plans[src]:
            key_mask, visible = _masks(key_masks, src, plan, q.device)
            for qh, kh in piece.groups:
                o, l = block_forward(qp[:, qh, plan.q], k_src[:, kh, plan.k], v_src[:, kh, plan.k],
                                     causal=plan.causal, scale=call.scale, backend=call.backend, key_mask=key_mask,
                                     visible=visible)
                merge_into(op[:, qh, plan.q], lp[:, qh, plan.q], o, l)
                del o, l  # free this block's output before the next kernel allocates its own
    for piece in call.pieces:  # the dilated merge of LongNet, in piece order
        if id(piece) in compact:
            index = row_index(piece.runs[rank], q.device)  # type: ignore[index]
            sub_out, sub_lse = _rows(piece, rank, (out, lse))
            merge_into(sub_out, sub_lse, *compact[id(piece)][1:])
            out[:, piece.q].index_copy_(2, index, sub_out)
            lse[:, piece.q].index_copy_(2, index, sub_lse)
    return out, lse


def ring_backward(call: RingCall, transport: KVTransport, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                  key_masks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in the inputs' dtypes, ``[batch, heads, seq_local, head_dim]`` (dq a view of ``[b, s, h, d]``
    memory); q, out and dout heads-first and contiguous, k and v of any strides (the transport copies them)."""
    b, hq, s, d = q.shape
    rank, ct = call.place.rank, compute_dtype(q.dtype)
    dq = _alloc_bshd(b, hq, s, d, ct, q.device)
    dkv = torch.zeros((2, *k.shape), dtype=ct, device=q.device)
    at, compact = None, {}  # compact: a dilated piece's (q, out, lse, dout, dq), dq added back at the end
    for src, piece, k_src, v_src, outbox in timed(transport.blocks_and_grads(k, v, dkv), q.device):
        if piece is not at:
            at = piece
            if piece.runs is not None and id(piece) not in compact:
                parts = _rows(piece, rank, (q, out, lse, dout))
                compact[id(piece)] = (*parts, torch.zeros(parts[0].shape, dtype=ct, device=q.device))
            qp, op, lp, gp, dqp = compact[id(piece)] if piece.runs is not None else \
                _rows(piece, rank, (q, out, lse, dout, dq))
        for plan in piece.schedule.plans[src]:
            key_mask, visible = _masks(key_masks, src, plan, q.device)
            for qh, kh in piece.groups:
                dq_b, dk_b, dv_b = block_backward(
                    gp[:, qh, plan.q], qp[:, qh, plan.q], k_src[:, kh, plan.k], v_src[:, kh, plan.k],
                    op[:, qh, plan.q], lp[:, qh, plan.q], causal=plan.causal, scale=call.scale, backend=call.backend,
                    key_mask=key_mask, visible=visible)
                dqp[:, qh, plan.q] += dq_b
                del dq_b  # as in forward: not alive during the next block's kernel
                outbox.append((kh, plan.k, dk_b, dv_b))
    for piece in call.pieces:
        if id(piece) in compact:
            dq[:, piece.q].index_add_(2, row_index(piece.runs[rank], q.device), compact[id(piece)][4])  # type: ignore[index]
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingFunction(torch.autograd.Function):
    """:func:`ring_forward` / :func:`ring_backward` for autograd; tensors ``[batch, heads, seq_local, head_dim]`` (views
    of BSHD inputs), run heads-first (Note [Heads-first blocks]). Each pass builds its own transport from the call."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: RingCall,  # type: ignore[override]
                key_masks: torch.Tensor | None) -> torch.Tensor:
        out, lse = ring_forward(call, transport_for(call), q, k, v, key_masks)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.call, ctx.key_masks = call, key_masks
        return result

    @staticmethod
    def backward(ctx, dout: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        q, dout = q.contiguous(), dout.contiguous()  # heads-first; k, v copied by the transport
        call: RingCall = ctx.call
        dq, dk, dv = ring_backward(call, transport_for(call), q, k, v, out, lse, dout, ctx.key_masks)
        return dq, dk, dv, None, None


def run_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: RingCall,
             key_padding_mask: torch.Tensor | None) -> torch.Tensor:
    """The ring (``p2p`` or ``all_gather``) of a checked call on ``[batch, seq_local, heads, head_dim]``
    inputs; differentiable, same layout out."""
    key_masks = key_masks_of(call, key_padding_mask)
    out = _RingFunction.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), call, key_masks)
    return out.transpose(1, 2)
