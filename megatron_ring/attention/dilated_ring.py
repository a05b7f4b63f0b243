"""Dilated attention over the CP group: one ring call whose merge covers every (pair, phase) piece
of every block (Note [Dilated attention as one ring call] in dilated.py).

Per piece, the rank's queries are gathered once per pass into compact ``[batch, heads_piece,
rows, head_dim]`` storage, each K/V block arrives as its compact rows (dilated_transport.py), and
each plan of the piece's schedule runs ``block_forward`` on it, merged into the piece's running
(out, lse). At the end all pieces merge into one (out, lse) per (query, head): LongNet's weighting.
Backward gathers the *merged* out and lse into each piece's compact rows, so ``block_backward``
returns each block's exact share; dQ and dK/dV go back to their rows by ``index_add_``.
"""
from __future__ import annotations

from typing import Iterator

import torch

from megatron_ring.attention.block import block_backward, block_forward, compute_dtype, merge_into
from megatron_ring.attention.call import RingCall
from megatron_ring.attention.dilated_schedule import Piece, dilated_schedule_for, row_index
from megatron_ring.attention.dilated_transport import DilatedGather, DilatedTransfers, PieceBlocks
from megatron_ring.attention.transport import active_stats, now

Transport = DilatedTransfers | DilatedGather


def pieces_of(call: RingCall, q: torch.Tensor, k: torch.Tensor) -> tuple[Piece, ...]:
    """The pieces of a dilated call on q ``[b, heads_q, seq_local, d]``, k ``[b, heads_kv, .., d]``."""
    assert call.dilation is not None
    return dilated_schedule_for(call.place.rank, call.place.size, q.shape[2], q.shape[1], k.shape[1], call.dilation,
                                causal=call.causal, sharding=call.sharding)


def transport_for(call: RingCall, pieces: tuple[Piece, ...]) -> Transport:
    """The transport of one pass: the pieces' rows point to point (``p2p``), or the whole gather."""
    place = call.place
    kind = DilatedGather if call.comm == "all_gather" else DilatedTransfers
    return kind(place.flat, place.rank, place.size, pieces)


def _gather(x: torch.Tensor, piece: Piece, rank: int) -> torch.Tensor:
    """``x[:, piece.q]`` ``[b, heads, seq_local, ...]`` at the piece's compact rows of ``rank`` (a copy)."""
    return x[:, piece.q].index_select(2, row_index(piece.runs[rank], x.device))


def _kernel_calls(pieces: tuple[Piece, ...], src: int,
                  blocks: PieceBlocks) -> Iterator[tuple[int, slice, slice, slice, slice, bool]]:
    """``(piece, q heads, q rows, kv heads, kv rows, causal)`` of every kernel call on block ``src``
    (heads relative to the piece's, kv rows relative to the rows that arrived)."""
    for i, (_, first) in blocks.items():
        for plan in pieces[i].schedule.plans[src]:
            rows = slice(plan.k.start - first, plan.k.stop - first)
            for group in pieces[i].groups:
                qh, kh = pieces[i].within(group)
                yield i, qh, plan.q, kh, rows, plan.causal


def dilated_forward(call: RingCall, pieces: tuple[Piece, ...], q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: out ``[b, heads_q, seq_local, d]`` (a view of ``[b, s, h, d]`` memory) in the
    compute dtype, lse ``[b, heads_q, seq_local]``; q/k/v heads-first views."""
    stats = active_stats()
    t0 = now(q.device) if stats else 0.0
    rank, ct = call.place.rank, compute_dtype(q.dtype)
    qc = [_gather(q, p, rank) for p in pieces]
    outs = [torch.zeros(x.shape, dtype=ct, device=q.device) for x in qc]
    lses = [torch.full(x.shape[:3], float("-inf"), dtype=ct, device=q.device) for x in qc]
    for src, blocks in transport_for(call, pieces).blocks(k, v):
        for i, qh, rows, kh, krows, causal in _kernel_calls(pieces, src, blocks):
            c0 = now(q.device) if stats else 0.0
            kv = blocks[i][0][:, :, kh, krows]
            o, l = block_forward(qc[i][:, qh, rows], kv[0], kv[1], causal=causal, scale=call.scale,
                                 backend=call.backend)
            merge_into(outs[i][:, qh, rows], lses[i][:, qh, rows], o, l)
            if stats:
                stats.compute_s += now(q.device) - c0
    b, hq, s, d = q.shape
    out = torch.zeros(b, s, hq, d, dtype=ct, device=q.device).transpose(1, 2)
    lse = torch.full((b, hq, s), float("-inf"), dtype=ct, device=q.device)
    for piece, o, l in zip(pieces, outs, lses):
        index = row_index(piece.runs[rank], q.device)
        sub_out, sub_lse = out[:, piece.q].index_select(2, index), lse[:, piece.q].index_select(2, index)
        merge_into(sub_out, sub_lse, o, l)
        out[:, piece.q].index_copy_(2, index, sub_out)
        lse[:, piece.q].index_copy_(2, index, sub_lse)
    if stats:
        stats.calls += 1
        stats.total_s += now(q.device) - t0
    return out, lse


def dilated_backward(call: RingCall, pieces: tuple[Piece, ...], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor,
                     dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` ``[b, heads, seq_local, d]`` in the inputs' dtypes from heads-first views and
    the merged ``out``/``lse`` of :func:`dilated_forward`."""
    stats = active_stats()
    t0 = now(q.device) if stats else 0.0
    rank, ct = call.place.rank, compute_dtype(q.dtype)
    qc, oc, lc, gc = ([_gather(x, p, rank) for p in pieces] for x in (q, out, lse, dout))
    dqc = [torch.zeros(x.shape, dtype=ct, device=q.device) for x in qc]
    dkv = torch.zeros((2, *k.shape), dtype=ct, device=q.device)
    for src, blocks, grads in transport_for(call, pieces).blocks_and_grads(k, v, dkv):
        for i, qh, rows, kh, krows, causal in _kernel_calls(pieces, src, blocks):
            c0 = now(q.device) if stats else 0.0
            kv = blocks[i][0][:, :, kh, krows]
            dq_b, dk_b, dv_b = block_backward(gc[i][:, qh, rows], qc[i][:, qh, rows], kv[0], kv[1], oc[i][:, qh, rows],
                                              lc[i][:, qh, rows], causal=causal, scale=call.scale,
                                              backend=call.backend)
            dqc[i][:, qh, rows] += dq_b
            grads[i][0][:, kh, krows] += dk_b
            grads[i][1][:, kh, krows] += dv_b
            if stats:
                stats.compute_s += now(q.device) - c0
    b, hq, s, d = q.shape
    dq = torch.zeros(b, s, hq, d, dtype=ct, device=q.device).transpose(1, 2)
    for piece, grad in zip(pieces, dqc):
        dq[:, piece.q].index_add_(2, row_index(piece.runs[rank], q.device), grad)
    if stats:
        stats.total_s += now(q.device) - t0
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _DilatedFunction(torch.autograd.Function):
    """:func:`dilated_forward` / :func:`dilated_backward` for autograd on heads-first views
    ``[batch, heads, seq_local, head_dim]`` of the caller's tensors."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: RingCall,  # type: ignore[override]
                pieces: tuple[Piece, ...]) -> torch.Tensor:
        out, lse = dilated_forward(call, pieces, q, k, v)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.call, ctx.pieces = call, pieces
        return result

    @staticmethod
    def backward(ctx, dout: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = dilated_backward(ctx.call, ctx.pieces, q, k, v, out, lse, dout)
        return dq, dk, dv, None, None


def run_dilated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: RingCall) -> torch.Tensor:
    """Dilated attention of a checked call (``call.dilation`` set) on ``[batch, seq_local, heads,
    head_dim]`` inputs; differentiable, same layout out."""
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = _DilatedFunction.apply(qh, kh, vh, call, pieces_of(call, qh, kh))
    return out.transpose(1, 2)
