"""Rank functions for the all-to-all comms (``a2a``, ``a2a+p2p``): collectives, bytes and bad input."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ring import ParallelLayout, init_parallel, ring_attention, shard_sequence
from megatron_ring.costs import comm_choice
from megatron_ring.costs.traffic import a2a_bytes
from megatron_ring.attention.transport import ring_stats


def _groups(a2a_size):
    return init_parallel(ParallelLayout(cp=dist.get_world_size(), cp_a2a=a2a_size)).cp_groups


def collectives_and_bytes(comm, a2a_size, heads_q, heads_kv, causal, pieces=None):
    """``(counts, bytes)`` of one forward and one backward: all_to_all_single calls, p2p batches and
    all-gathers; bytes sent as ring_stats counts them and as :func:`a2a_bytes` predicts. ``pieces``: the
    relay's pieces per hop set by ``comm_choice.PIECES`` (None: the cost model's)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    counts = {"all_to_all": 0, "p2p_batches": 0, "all_gather": 0}
    names = {"all_to_all_single": "all_to_all", "batch_isend_irecv": "p2p_batches",
             "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather"}
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def counting(name):
        def wrapper(*args, **kwargs):
            counts[names[name]] += 1
            return saved[name](*args, **kwargs)
        return wrapper

    group = _groups(a2a_size)
    seq, batch, head_dim = 4 * size, 2, 8
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seq, heads_q, head_dim, generator=gen)
    k, v = (torch.randn(batch, seq, heads_kv, head_dim, generator=gen) for _ in range(2))
    ql, kl, vl = (shard_sequence(t, rank, size).requires_grad_() for t in (q, k, v))
    for n in saved:
        setattr(dist, n, counting(n))
    comm_choice.PIECES = pieces
    try:
        with ring_stats() as fwd_stats:
            out = ring_attention(ql, kl, vl, group, causal=causal, comm=comm, check_consistency=False)
        forward = dict(counts)
        with ring_stats() as bwd_stats:
            out.sum().backward()
        backward = {key: counts[key] - forward[key] for key in counts}
    finally:
        comm_choice.PIECES = None
        for n, fn in saved.items():
            setattr(dist, n, fn)
    a = size if comm == "a2a" else a2a_size
    shape = dict(seq_local=seq // size, batch=batch, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
                 element_size=4, a2a_size=a, ring_size=size // a)
    return {"forward": forward, "backward": backward,
            "bytes": (fwd_stats.bytes_sent, bwd_stats.bytes_sent),
            "predicted": (a2a_bytes(**shape), a2a_bytes(**shape, backward=True))}


def outcome(case):
    """This rank's ``(exception type, message)`` (or ``("ok", shape)``) for a bad call ``case``."""
    rank = dist.get_rank()
    q = torch.randn(1, 4, 4, 8)
    kwargs = dict(causal=True)
    group = None
    if case == "heads_not_divisible":
        q = torch.randn(1, 4, 6, 8)
        kwargs["comm"] = "a2a"
    elif case == "hybrid_without_groups":
        kwargs["comm"] = "a2a+p2p"
    elif case == "hybrid_causal_differs":
        group, kwargs = _groups(2), dict(comm="a2a+p2p", causal=rank != 1)
    elif case == "hybrid_tuple_rejected_on_rank_3":
        g = _groups(2)
        group, kwargs["comm"] = (g.a2a, g.ring), "a2a+p2p"
        if rank == 3:
            q = q.to(torch.int32)
    elif case == "p2p_over_a_bare_tuple":
        g = _groups(2)
        group, kwargs["comm"] = (g.a2a, g.ring), "p2p"
    try:
        return "ok", tuple(ring_attention(q, q if q.dtype != torch.int32 else q, q, group, **kwargs).shape)
    except (TypeError, ValueError) as err:
        return type(err).__name__, str(err)


def prefill_then_decode(comm, a2a_size, flat):
    """Prefill (causal) with ``comm``, cache this rank's K/V shard as the caller passed it, append the
    new token's K/V on rank 0, decode it: errors of both against float64, and whether every rank
    decoded the same bits. ``flat``: pass CPGroups with its cp group, else the bare ``(a2a, ring)``."""
    from megatron_ring import decode_attention
    from megatron_ring.attention.reference import attention_reference, rel_err

    rank, size = dist.get_rank(), dist.get_world_size()
    g = _groups(a2a_size)
    group = g if flat else (g.a2a, g.ring)  # decode over the flat group, or over the two levels
    prefill_group = g if comm != "a2a+p2p" else group
    gen = torch.Generator().manual_seed(4)
    seq, heads_q, heads_kv, d = 4 * size, 4, 2, 8
    q, k, v = (torch.randn(2, seq + 1, h, d, generator=gen) for h in (heads_q, heads_kv, heads_kv))
    ql, kl, vl = (shard_sequence(t[:, :seq], rank, size) for t in (q, k, v))
    out = ring_attention(ql, kl, vl, prefill_group, causal=True, comm=comm)
    ref = attention_reference(q, k, v, causal=True)
    k_cache, v_cache = kl, vl
    if rank == 0:
        k_cache, v_cache = torch.cat((kl, k[:, seq:]), 1), torch.cat((vl, v[:, seq:]), 1)
    new = decode_attention(q[:, seq:], k_cache, v_cache, group)
    gathered = [torch.empty_like(new) for _ in range(size)]
    dist.all_gather(gathered, new.contiguous())
    return {"prefill": rel_err(out, shard_sequence(ref[:, :seq], rank, size)), "decode": rel_err(new, ref[:, seq:]),
            "identical": all(torch.equal(x, new) for x in gathered)}
