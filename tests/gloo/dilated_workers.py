"""Gloo workers for dilated attention (importable, so spawned workers unpickle them)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ring import ring_attention, shard_sequence
from megatron_ring.attention.reference import dilated_reference, rel_err
from megatron_ring.attention.transport import ring_stats


def _inputs(batch, seq, heads_q, heads_kv, head_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads_q, head_dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, seq, heads_kv, head_dim, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(q.shape, generator=gen, dtype=torch.float64)


def dilated_vs_reference(seq, heads, pairs, causal, sharding, cases, batch=2, head_dim=8):
    """``{(dtype, comm, backend): {"out"|"dq"|"dk"|"dv": rel err}}`` for each ``(dtype, comm, backend)``
    of ``cases``: this rank's shard against the float64 reference (one reference for every case)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = _inputs(batch, seq, *heads, head_dim)
    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
    ref = dilated_reference(*leaves, pairs, causal=causal)
    ref.backward(dout)

    def shard(t):
        return shard_sequence(t, rank, size, sharding=sharding)

    errors = {}
    for dtype, comm, backend in cases:
        ql, kl, vl = (shard(t).to(dtype).requires_grad_() for t in (q, k, v))
        out = ring_attention(ql, kl, vl, causal=causal, sharding=sharding, comm=comm, backend=backend, dilation=pairs)
        out.backward(shard(dout).to(dtype))
        assert out.dtype == dtype and ql.grad.dtype == dtype and kl.grad.shape == kl.shape
        errors[(str(dtype), comm, backend)] = {
            name: rel_err(x, shard(y)) for name, x, y in
            (("out", out, ref), ("dq", ql.grad, leaves[0].grad), ("dk", kl.grad, leaves[1].grad),
             ("dv", vl.grad, leaves[2].grad))}
    return errors


def traffic(seq, heads, pairs, comm="p2p", causal=True, sharding="zigzag"):
    """``(steps, bytes)`` this rank sent in one forward and backward (pairs None: the plain ring)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = (shard_sequence(t, rank, size, sharding=sharding).float().requires_grad_()
                     for t in _inputs(1, seq, *heads, 8))
    with ring_stats() as stats:
        ring_attention(q, k, v, causal=causal, sharding=sharding, comm=comm, dilation=pairs).backward(dout)
    return stats.steps, stats.bytes_sent


def disagreeing(pairs_by_rank):
    """The error each rank raises when ranks pass different ``dilation`` (None = no error)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    q, k, v, _ = (shard_sequence(t, rank, size).float() for t in _inputs(1, 8 * size, 4, 2, 8))
    try:
        ring_attention(q, k, v, causal=True, dilation=pairs_by_rank[rank])
    except ValueError as err:
        return str(err)
    return None
