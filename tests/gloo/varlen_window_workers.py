"""Gloo workers for sliding windows and packed documents (importable, so spawned workers unpickle them)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ring import decode_attention, ring_attention, shard_sequence
from megatron_ring.attention.transport import ring_stats
from megatron_ring.attention.reference import attention_reference, rel_err
from tests.gloo.workers import errors_vs_reference, padding_mask


def _inputs(shape_q, shape_kv, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape_q, generator=gen).to(dtype)
    k = torch.randn(*shape_kv, generator=gen).to(dtype)
    v = torch.randn(*shape_kv, generator=gen).to(dtype)
    dout = torch.randn(*shape_q, generator=gen).to(dtype)
    return q, k, v, dout


def ring_vs_reference(seq, heads_q, heads_kv, head_dim, causal, window, sharding, comm, dtype, backend, *,
                      doc_lengths=None, batch=2, padded=False):
    """Relative errors of this rank's (out, dq, dk, dv) against the float64 reference, with
    ``window_size=window``; ``doc_lengths``: packed documents (``seq`` ignored), else ``[batch, seq]``;
    ``padded``: a key padding mask too. Also returns the forward+backward bytes this rank sent."""
    rank, size = dist.get_rank(), dist.get_world_size()
    cu = None
    if doc_lengths is not None:
        cu = torch.tensor([0, *torch.tensor(doc_lengths).cumsum(0).tolist()], dtype=torch.int32)
        total = int(cu[-1])
        q, k, v, dout = _inputs((total, heads_q, head_dim), (total, heads_kv, head_dim), dtype)
        mask = padding_mask(2, total)[1] if padded else None
        dim = 0
    else:
        q, k, v, dout = _inputs((batch, seq, heads_q, head_dim), (batch, seq, heads_kv, head_dim), dtype)
        mask = padding_mask(batch, seq) if padded else None
        dim = 1
    qg, kg, vg = (t.to(torch.float64).requires_grad_() for t in (q, k, v))
    ref = attention_reference(qg, kg, vg, causal=causal, key_padding_mask=mask, window_size=window, cu_seqlens=cu)
    ref.backward(dout.to(torch.float64))

    def shard(t):
        return shard_sequence(t, rank, size, dim=0 if t.dim() == 1 else dim, sharding=sharding, cu_seqlens=cu)

    ql, kl, vl = (shard(t).detach().requires_grad_() for t in (q, k, v))
    with ring_stats() as stats:
        out = ring_attention(ql, kl, vl, causal=causal, sharding=sharding, comm=comm, backend=backend,
                             key_padding_mask=None if mask is None else shard(mask), window_size=window,
                             cu_seqlens=cu)
        out.backward(shard(dout))
    return errors_vs_reference(out, (ql, kl, vl), ref, (qg, kg, vg), shard, dtype), stats.bytes_sent


def traffic(seq, window, sharding, causal=True, doc_lengths=None):
    """``(steps, bytes)`` this rank sent in one forward and backward with ``window_size=window``."""
    rank, size = dist.get_rank(), dist.get_world_size()
    cu = None if doc_lengths is None else torch.tensor([0, *torch.tensor(doc_lengths).cumsum(0).tolist()],
                                                       dtype=torch.int32)
    shape = (seq, 2, 8) if cu is not None else (1, seq, 2, 8)
    q, k, v, dout = _inputs(shape, shape, torch.float32)
    dim = 0 if cu is not None else 1
    ql, kl, vl = (shard_sequence(t, rank, size, dim=dim, sharding=sharding, cu_seqlens=cu).requires_grad_()
                  for t in (q, k, v))
    with ring_stats() as stats:
        out = ring_attention(ql, kl, vl, causal=causal, sharding=sharding, window_size=window, cu_seqlens=cu)
        out.backward(shard_sequence(dout, rank, size, dim=dim, sharding=sharding, cu_seqlens=cu))
    return stats.steps, stats.bytes_sent


def decode_window_vs_reference(lengths, window, heads_q, heads_kv, q_len, dtype, padded=False, batch=2):
    """Decode over a cache dealt round-robin (token i on rank i mod P, so positions are not
    contiguous per rank) with ``window_size=window``; the queries are the last ``q_len`` positions."""
    rank, size = dist.get_rank(), dist.get_world_size()
    total = lengths
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, q_len, heads_q, 8, generator=gen).to(dtype)
    k = torch.randn(batch, total, heads_kv, 8, generator=gen).to(dtype)
    v = torch.randn(batch, total, heads_kv, 8, generator=gen).to(dtype)
    mask = padding_mask(batch, total) if padded else None
    q_pos = torch.arange(total - q_len, total)
    mine = torch.arange(rank, total, size)
    out = decode_attention(q, k[:, mine], v[:, mine], window_size=window, q_positions=q_pos, k_positions=mine,
                           key_padding_mask=None if mask is None else mask[:, mine])
    # reference: the queries as the last q_len rows of a full-length query block
    qf = torch.zeros(batch, total, heads_q, 8, dtype=dtype)
    qf[:, total - q_len:] = q
    ref = attention_reference(qf, k, v, key_padding_mask=mask, window_size=window)[:, total - q_len:]
    gathered = [torch.empty_like(out) for _ in range(size)]
    dist.all_gather(gathered, out.contiguous())
    return {"err": rel_err(out, ref), "identical": all(torch.equal(g, out) for g in gathered)}


def bad_call(kind):
    """The error one bad ``ring_attention`` argument raises (on every rank, same message)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    total = 8 * size
    cu = torch.tensor([0, 4 * size, total], dtype=torch.int32)
    x = torch.randn(total // size, 2, 4)
    kwargs = {"cu_seqlens": cu}
    if kind == "cu_int64":
        kwargs["cu_seqlens"] = cu.long()
    elif kind == "cu_not_monotone":
        kwargs["cu_seqlens"] = torch.tensor([0, total, 4 * size, total], dtype=torch.int32)
    elif kind == "cu_wrong_total":
        kwargs["cu_seqlens"] = torch.tensor([0, 4 * size, total + 2 * size], dtype=torch.int32)
    elif kind == "cu_not_divisible":
        kwargs["cu_seqlens"] = torch.tensor([0, 4 * size - 1, total], dtype=torch.int32)
    elif kind == "cu_4d":
        x = x[None]
    elif kind == "window_negative":
        kwargs["window_size"] = (-2, 0)
    elif kind == "window_not_pair":
        kwargs["window_size"] = 4
    elif kind == "window_on_one_rank":
        kwargs["window_size"] = (4, 0) if rank == 0 else (-1, -1)
    elif kind == "cu_on_one_rank":
        kwargs["cu_seqlens"] = cu if rank == 0 else torch.tensor([0, total], dtype=torch.int32)
    try:
        ring_attention(x, x, x, causal=True, **kwargs)
    except (ValueError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"
