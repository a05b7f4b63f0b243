"""Ring attention: exact attention over a sequence sharded across a context-parallel group.

Each rank keeps its queries and meets every K/V block in turn, as a transport brings them
(transport.py: the relay ring, direct transfers, or a gather); the partial results are merged by
log-sum-exp (Note [Log-sum-exp merge] in block.py). Activation memory per rank is O(L/P); with the
ring no rank ever holds the whole sequence's K/V.

:func:`ring_forward` and :func:`ring_backward` are the two loops, plain functions over a checked
:class:`~megatron_ring.attention.call.RingCall`; :class:`_RingFunction` is their autograd
Function and :func:`run_ring` the call of it on ``[batch, seq_local, heads, head_dim]`` tensors.
The custom ops of torch.compile (ops.py) and the all-to-all comms (alltoall.py) call them too.

Note [Heads-first blocks]
~~~~~~~~~~~~~~~~~~~~~~~~~
The caller's ``[b, s, h, d]`` tensors put a token's heads side by side, so one head's rows are
``h * d`` elements apart. The block kernels read a head's rows block by block, and on CPU they
take 0.90-0.96x the time (forward, and forward+backward; h = 8, the 4096 x 4096 and 4096 x 2048
blocks of a zigzag ring at L = 16k, P = 4) when those rows are adjacent
(``python -m megatron_ring.perf.bench.block --layouts``). So every block kernel reads heads-first
``[b, h, s, d]`` storage: q is copied once per pass (and dout in backward), and the transport
copies the K/V it sends (in forward the relay piece by piece, Note [Forward memory] in relay.py).
The output and dq are written into ``[b, s, h, d]`` storage, as the caller's layout, and need no
copy back. A copy costs about 1 % of such a block's time per tensor. Autograd saves the caller's
q, k, v, not copies: a forward keeps nothing of its own beyond its output and lse.
"""
from __future__ import annotations

import torch

from megatron_ring.attention.block import block_backward, block_forward, compute_dtype, merge_into
from megatron_ring.attention.call import RingCall
from megatron_ring.attention.direct import DirectTransfers
from megatron_ring.attention.gather import GatheredBlocks
from megatron_ring.attention.relay import RelayRing
from megatron_ring.attention.schedule import StepPlan
from megatron_ring.attention.transport import KVTransport, active_stats, gather_stacked, now


def transport_for(call: RingCall) -> KVTransport:
    """The transport of a ``p2p`` / ``all_gather`` call: the relay ring, direct transfers of the rows
    a window or documents read (Note [Direct transfers] in direct.py), or the gather."""
    group, rank, size = call.place.flat, call.place.rank, call.place.size
    if call.comm == "all_gather":
        return GatheredBlocks(group, rank, size)
    if call.schedule.sparse:
        return DirectTransfers(group, rank, size, call.schedule)
    return RelayRing(group, rank, size)


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


def ring_forward(call: RingCall, transport: KVTransport, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 key_masks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: out ``[batch, heads_q, seq_local, head_dim]`` (a view of ``[b, s, h, d]``
    memory) in the compute dtype, lse ``[batch, heads_q, seq_local]``; q/k/v ``[batch, heads,
    seq_local, head_dim]`` of any strides, copied heads-first here and by the transport (Note
    [Heads-first blocks])."""
    stats = active_stats()
    t0 = now(q.device) if stats else 0.0
    b, hq, s, d = q.shape
    group = hq // k.shape[1]
    out = _alloc_bshd(b, hq, s, d, compute_dtype(q.dtype), q.device)
    lse = torch.full((b, hq, s), float("-inf"), dtype=out.dtype, device=q.device)
    at, qg = None, q
    for src, heads, k_src, v_src in transport.blocks(k, v):
        qh = slice(heads.start * group, heads.stop * group)  # the query heads of these K/V heads
        if qh != at:  # a new head group (Note [Forward memory] in relay.py): its queries, heads-first
            at, qg = qh, q[:, qh].contiguous()
        for plan in call.schedule.plans[src]:
            c0 = now(q.device) if stats else 0.0
            key_mask, visible = _masks(key_masks, src, plan, q.device)
            o, l = block_forward(qg[:, :, plan.q], k_src[:, :, plan.k], v_src[:, :, plan.k], causal=plan.causal,
                                 scale=call.scale, backend=call.backend, key_mask=key_mask, visible=visible)
            merge_into(out[:, qh, plan.q], lse[:, qh, plan.q], o, l)
            del o, l  # free this block's output before the next kernel allocates its own
            if stats:
                stats.compute_s += now(q.device) - c0
    if stats:
        stats.calls += 1
        stats.total_s += now(q.device) - t0
    return out, lse


def ring_backward(call: RingCall, transport: KVTransport, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                  key_masks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in the inputs' dtypes, ``[batch, heads, seq_local, head_dim]`` (dq a view of
    ``[b, s, h, d]`` memory); q, out and dout heads-first and contiguous, k and v of any strides (the
    transport copies them), ``lse`` from :func:`ring_forward`."""
    stats = active_stats()
    t0 = now(q.device) if stats else 0.0
    b, hq, s, d = q.shape
    ct = compute_dtype(q.dtype)
    dq = _alloc_bshd(b, hq, s, d, ct, q.device)
    dkv = torch.zeros((2, *k.shape), dtype=ct, device=q.device)
    for src, k_src, v_src, outbox in transport.blocks_and_grads(k, v, dkv):
        for plan in call.schedule.plans[src]:
            c0 = now(q.device) if stats else 0.0
            key_mask, visible = _masks(key_masks, src, plan, q.device)
            dq_b, dk_b, dv_b = block_backward(
                dout[:, :, plan.q], q[:, :, plan.q], k_src[:, :, plan.k], v_src[:, :, plan.k], out[:, :, plan.q],
                lse[:, :, plan.q], causal=plan.causal, scale=call.scale, backend=call.backend, key_mask=key_mask,
                visible=visible)
            dq[:, :, plan.q] += dq_b
            del dq_b  # as in forward: not alive during the next block's kernel
            outbox.append((plan.k, dk_b, dv_b))
            if stats:
                stats.compute_s += now(q.device) - c0
    if stats:
        stats.total_s += now(q.device) - t0
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingFunction(torch.autograd.Function):
    """:func:`ring_forward` / :func:`ring_backward` for autograd; tensors ``[batch, heads, seq_local,
    head_dim]`` (views of BSHD inputs), run heads-first (Note [Heads-first blocks]). Each pass
    builds its own transport from the call."""

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
