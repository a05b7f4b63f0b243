"""All-to-all ("Ulysses") context parallelism and its hybrid with the ring: ``comm="a2a"`` and ``"a2a+p2p"``.

Note [All-to-all between sequence and heads]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Rank c of a CP group of P holds the tokens of its shard (zigzag or contiguous, exactly as for ``comm="p2p"``) for every
head. One all-to-all over an *a2a group* of A ranks trades that for A times the tokens on 1/A of the heads: rank i sends
head group j of q, k, v to rank j and receives head group i of every member's tokens. The received tokens are put in the
order the attention after it needs, the attention runs, and the inverse all-to-all sends every token's output back to
the rank that holds it::

    [b, L/P, H, d] --a2a--> [b, A*L/P, H/A, d] --attention--> [b, A*L/P, H/A, d] --a2a--> [b, L/P, H, d]

* ``comm="a2a"`` (DeepSpeed-Ulysses): A = P, the attention is local on the full sequence, whose tokens are put in
  global order (undoing the caller's zigzag), so any block kernel runs it as one causal or full block: the ring of
  ring.py over one rank (one block, no transfer).
* ``comm="a2a+p2p"`` (Megatron's hierarchical CP, USP): P = A x R. Rank c is member ``c % A`` of a2a group ``c // A``
  (adjacent ranks, one node) and member ``c // A`` of ring group ``c % A``. After the all-to-all, the A shards of an a2a
  group are exactly the shard of ring rank ``c // A`` in the same sharding over R ranks (zigzag: the first chunks in
  member order, then the second chunks in reverse order), and ring.py's :func:`run_ring` runs over the ring group on
  H/A heads, unchanged.

The whole thing is differentiable: the backward of an all-to-all is the inverse all-to-all of the gradients. q, k and
v travel in one all-to-all (their head groups packed side by side), and so do dq, dk and dv in backward, except where
each is already its own send buffer. Copies per tensor and direction (Note [Heads-first after the all-to-all]): toward
heads, one to pack the send buffer and one to put the received tokens in order (:func:`_spans`) and heads-first; back
toward the sequence, one to pack (none with contiguous sharding, no ring and ``b == 1``: the output already is its send
buffer) and one to interleave the heads.

Note [Heads-first after the all-to-all]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
DeepSpeed-Ulysses hands its kernel ``[b, L, h/A, d]`` tensors as received (with contiguous shards and ``b == 1`` that
costs no copy after the all-to-all). Here q, k, v and dout are copied once after it anyway, to put zigzag tokens in
order, and that copy writes them heads-first (``[b, h/A, L, d]`` storage): the CPU flash kernel then reads each head's
rows at unit stride and took 0.90-1.00x the time of the ``[b, L, h/A, d]`` storage it is given otherwise (L = 16k, 2 or
4 heads, ``python -m megatron_ring.perf.bench.block --layouts``). So the copy is kept for contiguous shards too. The
ring of ``a2a+p2p`` runs heads-first as well (Note [Heads-first blocks] in ring.py), so it takes them as they are.

GQA: the a2a group needs ``heads_q % A == 0``. K/V heads are split A ways too; with ``heads_kv % A != 0`` each K/V head
is repeated, before the all-to-all, to ``h' = lcm(heads_kv, A)`` heads, the fewest that split A ways and keep every
query head's K/V head on its rank. When ``A % heads_kv == 0`` (MQA, or fewer K/V heads than ranks) every rank receives
exactly the one K/V head its queries use; when ``heads_kv % A == 0`` nothing is repeated. Bytes sent per rank per layer,
with ``s = L/P`` local tokens, ``e`` bytes per element (:func:`~megatron_ring.costs.traffic.a2a_bytes`)::

    forward   (A-1)/A * b*s*d*e * (2*heads_q + 2*h')      q, k, v out; the output back
              + (R-1) * 2*b*s*h'*d*e                        the ring over R (K/V on h'/A heads, A*s tokens)
    backward  (A-1)/A * b*s*d*e * (2*heads_q + 2*h')      dout out; dq, dk, dv back
              + (R-1) * 2*b*s*h'*d*e + R * 2*b*s*h'*d*4     the ring's K/V and fp32 dK/dV

against ``(P-1) * 2*b*s*heads_kv*d*e`` for the forward of ``p2p``. The replication costs ``h'/heads_kv`` times the K/V
bytes of the all-to-all (e.g. MQA at A = 4: 4x the K/V share). A ``key_padding_mask``: the a2a group all-gathers its
members' masks (one byte per token), puts them in the same order as the keys, and the ring takes them from there.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from megatron_ring.attention.call import CPPlace, RingCall, whole_piece
from megatron_ring.attention.ring import run_ring
from megatron_ring.attention.schedule import schedule_for
from megatron_ring.attention.sharding import local_positions
from megatron_ring.costs.traffic import kv_heads_sent
from megatron_ring.attention.transport import active_stats, count_sent, gather_stacked, now

class Span(NamedTuple):
    """``length`` consecutive tokens of the reordered sequence, from position ``start`` on, taken from position
    ``offset`` on of a2a member ``member``'s shard (a copy, not a document, unlike sharding.py's ``Segment``)."""

    start: int
    member: int
    offset: int
    length: int


@lru_cache(maxsize=64)
def _spans(seq_local: int, a2a_size: int, ring_size: int, ring_rank: int, sharding: str) -> tuple[Span, ...]:
    """Where the tokens of ring rank ``ring_rank``'s shard (over ``ring_size`` in ``sharding``) are among the a2a
    group's received shards, as the fewest runs of consecutive tokens, in token order. Zigzag over ``ring_size = 1``
    gives ``2 * a2a_size - 1`` spans (the last member's two chunks are adjacent); contiguous gives ``a2a_size`` runs of
    ``seq_local``. Copying runs is a few strided memcpys, 1.3-1.7x faster on CPU than a gather or scatter by index."""
    size, total = a2a_size * ring_size, a2a_size * ring_size * seq_local
    received = torch.cat([local_positions(total, ring_rank * a2a_size + i, size, sharding) for i in range(a2a_size)])
    where = torch.empty(total, dtype=torch.int64)
    where[received] = torch.arange(received.numel())
    found = where[local_positions(total, ring_rank, ring_size, sharding)].tolist()
    runs: list[Span] = []
    for n, at in enumerate(found):
        member, offset = divmod(at, seq_local)
        last = runs[-1] if runs else None
        if last is not None and last.member == member and last.offset + last.length == offset:
            runs[-1] = last._replace(length=last.length + 1)
        else:
            runs.append(Span(n, member, offset, 1))
    return tuple(runs)


class _Exchange:
    """The two all-to-alls of one a2a group; tensors are ``[batch, seq, heads, head_dim]``."""

    def __init__(self, group: dist.ProcessGroup | None, size: int, runs: tuple[Span, ...]) -> None:
        self.group, self.size, self.runs = group, size, runs

    def _all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return send
        stats = active_stats()
        start = now(send.device) if stats else 0.0
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        count_sent(1, send.numel() * send.element_size() * (self.size - 1) // self.size)
        if stats:
            elapsed = now(send.device) - start
            stats.wait_s += elapsed
            stats.total_s += elapsed
        return recv

    def _in_order(self, seq_local: int) -> bool:
        """Whether the received shards already are the sequence in order (contiguous sharding, no ring)."""
        return self.runs == tuple(Span(j * seq_local, j, 0, seq_local) for j in range(self.size))

    def to_heads(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``[b, s, h, d]`` each -> ``[b, A*s, h/A, d]`` in :func:`_spans`' order, heads-first (views of
        ``[b, h/A, A*s, d]``)."""
        a = self.size
        b, s, _, d = xs[0].shape
        widths = [x.shape[2] // a for x in xs]
        send = torch.empty(a, b, s, sum(widths), d, dtype=xs[0].dtype, device=xs[0].device)
        off = 0
        for x, w in zip(xs, widths):
            send[..., off:off + w, :].copy_(x.reshape(b, s, a, w, d).permute(2, 0, 1, 3, 4))
            off += w
        recv = self._all_to_all(send)  # [A, b, s, heads, d]: member j's tokens of this rank's head group
        outs, off = [], 0
        for w in widths:
            out = torch.empty(b, w, a * s, d, dtype=recv.dtype, device=recv.device).transpose(1, 2)
            for run in self.runs:
                out[:, run.start:run.start + run.length].copy_(
                    recv[run.member, :, run.offset:run.offset + run.length, off:off + w])
            outs.append(out)
            off += w
        return outs

    def to_seq(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Inverse of :meth:`to_heads`: ``[b, A*s, w, d]`` each -> ``[b, s, A*w, d]``."""
        a = self.size
        b, n, _, d = xs[0].shape
        s, widths = n // a, [x.shape[2] for x in xs]
        if b == 1 and self._in_order(s):  # each x (if contiguous) is its send buffer: one all-to-all each
            sends = [x.reshape(b, a, s, w, d).transpose(0, 1).contiguous() for x, w in zip(xs, widths)]
        else:  # one all-to-all; packing and ordering are one copy
            send, off = torch.empty(a, b, s, sum(widths), d, dtype=xs[0].dtype, device=xs[0].device), 0
            for x, w in zip(xs, widths):
                for run in self.runs:
                    send[run.member, :, run.offset:run.offset + run.length, off:off + w].copy_(
                        x[:, run.start:run.start + run.length])
                off += w
            sends = [send]
        outs = []
        for recv in map(self._all_to_all, sends):  # [A, b, s, heads, d]: member j's head group j
            off = 0
            while off < recv.shape[3]:
                w = widths[len(outs)]
                outs.append(recv[..., off:off + w, :].permute(1, 2, 0, 3, 4).reshape(b, s, a * w, d))
                off += w
        return outs


class _AllToAll(torch.autograd.Function):
    """``to_heads`` (or ``to_seq``) of several tensors in one all-to-all; backward is the inverse."""

    @staticmethod
    def forward(ctx, exchange: _Exchange, to_heads: bool, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.exchange, ctx.to_heads = exchange, to_heads
        outs = tuple(exchange.to_heads(xs) if to_heads else exchange.to_seq(xs))
        ctx.outs = [(o.shape, o.dtype, o.device) for o in outs]
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[override]
        filled = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                  for g, (shape, dtype, device) in zip(grads, ctx.outs)]
        return (None, None, *(ctx.exchange.to_seq(filled) if ctx.to_heads else ctx.exchange.to_heads(filled)))


def a2a_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: RingCall,
                  key_padding_mask: torch.Tensor | None) -> torch.Tensor:
    """``comm="a2a"`` or ``"a2a+p2p"`` on checked inputs: q ``[b, s, heads_q, d]``, k/v ``[b, s, heads_kv, d]`` ->
    ``[b, s, heads_q, d]``; the ring of ``a2a+p2p`` runs over the ring group on the head-sharded tensors
    (Note [All-to-all between sequence and heads])."""
    (ga, _, a), (gr, rr, r) = call.place.levels(call.comm)
    s, heads_kv = q.shape[1], k.shape[2]
    repeat = kv_heads_sent(heads_kv, a) // heads_kv
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    exchange = _Exchange(ga, a, _spans(s, a, r, rr, call.sharding))
    qh, kh, vh = _AllToAll.apply(exchange, True, q, k, v)
    ring_mask = None
    if key_padding_mask is not None:
        masks = gather_stacked(key_padding_mask.to(torch.uint8), ga, a).transpose(0, 1)  # [b, A, s]
        ring_mask = torch.cat([masks[:, span.member, span.offset:span.offset + span.length] for span in exchange.runs],
                              dim=1).bool()
    # the ring over the ring group; after "a2a" (r = 1) a ring of one block, the sequence in global order
    schedule = schedule_for(rr, r, a * s, None, causal=call.causal, sharding=call.sharding, window=(-1, -1))
    ring = replace(call, comm="p2p", place=CPPlace(rr, r, gr, True, None),
                   pieces=(whole_piece(schedule, qh.shape[2], kh.shape[2]),))
    out = run_ring(qh, kh, vh, ring, ring_mask)
    (result,) = _AllToAll.apply(exchange, False, out)
    return result
