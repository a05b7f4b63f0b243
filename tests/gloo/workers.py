"""Functions run on every rank of a gloo pool (importable, so spawned workers can unpickle them)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ring import decode_attention, ring_attention, shard_sequence
from megatron_ring.costs import comm_choice
from megatron_ring.attention.reference import attention_reference, rel_err


def _inputs(batch, seq, heads_q, heads_kv, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads_q, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, seq, heads_kv, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, seq, heads_kv, head_dim, generator=gen).to(dtype)
    dout = torch.randn(batch, seq, heads_q, head_dim, generator=gen).to(dtype)
    return q, k, v, dout


def padding_mask(batch, seq, seed=3):
    """``[batch, seq]`` bool, True = real token: row 0 left-padded by a third, row 1 random holes,
    row 2 (when batch > 2) all padding, so no query of it sees a key; further rows all real."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, seq, dtype=torch.bool)
    mask[0, : seq // 3] = False
    if batch > 1:
        mask[1] = torch.rand(seq, generator=gen) < 0.7
    if batch > 2:
        mask[2] = False
    return mask


def errors_vs_reference(out, local, ref, ref_inputs, shard, dtype):
    """Check the dtypes and shapes of a ring call's output and gradients (``local``: its q, k, v leaves,
    after the backward) and return their relative errors against the float64 ``ref`` and the gradients
    of ``ref_inputs``, each sharded with ``shard``."""
    ql, kl, vl = local
    qg, kg, vg = ref_inputs
    assert out.dtype == dtype and out.shape == ql.shape
    assert ql.grad.dtype == dtype and kl.grad.shape == kl.shape
    return {
        "out": rel_err(out, shard(ref)), "dq": rel_err(ql.grad, shard(qg.grad)),
        "dk": rel_err(kl.grad, shard(kg.grad)), "dv": rel_err(vl.grad, shard(vg.grad)),
    }


def cp_group(comm, a2a_size=None):
    """The ``group`` argument for ``comm`` over the world: None, or the hierarchical groups of
    ``ParallelLayout(cp=world, cp_a2a=a2a_size)`` (created once per pool, init_parallel caches them)."""
    if comm != "a2a+p2p" and a2a_size is None:
        return None
    from megatron_ring import ParallelLayout, init_parallel

    return init_parallel(ParallelLayout(cp=dist.get_world_size(), cp_a2a=a2a_size)).cp_groups


def ring_vs_reference(seq, heads_q, heads_kv, head_dim, causal, sharding, comm, dtype, backend, batch=2,
                      padded=False, a2a_size=None):
    """Relative errors of this rank's (out, dq, dk, dv) against the float64 global reference
    (``padded``: with :func:`padding_mask` as the key padding mask; ``a2a_size``: the a2a groups of
    ``comm="a2a+p2p"``, and then the same CPGroups object serves every comm)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = _inputs(batch, seq, heads_q, heads_kv, head_dim, dtype)
    mask = padding_mask(batch, seq) if padded else None
    qg, kg, vg = (t.to(torch.float64).requires_grad_() for t in (q, k, v))
    ref = attention_reference(qg, kg, vg, causal=causal, key_padding_mask=mask)
    ref.backward(dout.to(torch.float64))

    def shard(t):
        return shard_sequence(t, rank, size, sharding=sharding)

    ql, kl, vl = (shard(t).detach().requires_grad_() for t in (q, k, v))
    out = ring_attention(ql, kl, vl, cp_group(comm, a2a_size), causal=causal, sharding=sharding, comm=comm,
                         backend=backend, key_padding_mask=None if mask is None else shard(mask))
    out.backward(shard(dout))
    return errors_vs_reference(out, (ql, kl, vl), ref, (qg, kg, vg), shard, dtype)


def ring_vs_reference_flash_attn_standin(*args, **kwargs):
    """ring_vs_reference with backend "flash_attn" served by the CPU stand-in of the package
    (tests/unit/flash_attn_standin.py); the worker's modules are restored afterwards."""
    import sys

    from megatron_ring.attention import block, flash_attn_backend
    from tests.unit import flash_attn_standin

    saved_modules = {name: sys.modules.get(name) for name in ("flash_attn", "flash_attn.flash_attn_interface")}
    saved_problem = block.flash_attn_problem
    sys.modules.update(flash_attn_standin.modules("2.7.4.post1"))
    flash_attn_backend._load.cache_clear()
    block.flash_attn_problem = lambda device, dtype, head_dim: None
    try:
        return ring_vs_reference(*args, backend="flash_attn", **kwargs)
    finally:
        block.flash_attn_problem = saved_problem
        for name, module in saved_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        flash_attn_backend._load.cache_clear()


def decode_vs_reference(lengths, heads_q, heads_kv, head_dim, q_len, dtype, batch=2, padded=False):
    """Decode error on this rank; rank r holds a cache shard of ``lengths[r]`` tokens (0 allowed);
    ``padded``: with :func:`padding_mask` over the whole cache."""
    rank = dist.get_rank()
    total = sum(lengths)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, q_len, heads_q, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, total, heads_kv, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, total, heads_kv, head_dim, generator=gen).to(dtype)
    mask = padding_mask(batch, total) if padded else None
    start, end = sum(lengths[:rank]), sum(lengths[:rank + 1])
    out = decode_attention(q, k[:, start:end], v[:, start:end],
                           key_padding_mask=None if mask is None else mask[:, start:end])
    ref = attention_reference(q, k, v, key_padding_mask=mask)
    gathered = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, out.contiguous())
    identical = all(torch.equal(g, out) for g in gathered)
    return {"err": rel_err(out, ref), "identical": identical, "dtype": out.dtype, "shape": tuple(out.shape)}


def decode_refuses_a_masked_flash_attn():
    """Every rank, also rank 0 with an empty cache shard, raises instead of waiting in the all-gather."""
    rank = dist.get_rank()
    q = torch.randn(1, 1, 4, 8)
    k = torch.randn(1, 0 if rank == 0 else 3, 2, 8)
    try:
        decode_attention(q, k, k, backend="flash_attn", key_padding_mask=torch.ones(1, k.shape[1], dtype=torch.bool))
    except ValueError as err:
        return str(err)
    return "no error"


def count_collectives(comm, causal, heads_kv=1, pieces=None, seq_local=4):
    """Number of batch_isend_irecv and all-gather calls made by one ring forward (then backward), with
    ``heads_kv`` K/V heads (and twice as many query heads), ``seq_local`` tokens per rank and ``comm_choice.PIECES``
    set to ``pieces`` (None: the cost model chooses the relay's pieces per hop)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    counts = {"p2p_batches": 0, "all_gather": 0}
    names = ["all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object"]
    saved = {n: getattr(dist, n) for n in names + ["batch_isend_irecv"]}

    def counting(name, key):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return saved[name](*args, **kwargs)
        return wrapper

    dist.batch_isend_irecv = counting("batch_isend_irecv", "p2p_batches")
    for n in names:
        setattr(dist, n, counting(n, "all_gather"))
    comm_choice.PIECES = pieces
    try:
        q, k, v, dout = _inputs(1, seq_local * size, 2 * heads_kv, heads_kv, 4, torch.float32)
        ql, kl, vl = (shard_sequence(t, rank, size).requires_grad_() for t in (q, k, v))
        out = ring_attention(ql, kl, vl, causal=causal, comm=comm)
        forward = dict(counts)
        out.backward(shard_sequence(dout, rank, size))
        backward = {key: counts[key] - forward[key] for key in counts}
    finally:
        comm_choice.PIECES = None
        for n, fn in saved.items():
            setattr(dist, n, fn)
    return forward, backward


def mismatched_shapes():
    """Rank 1 brings a different local length: every rank must raise, none may hang."""
    rank = dist.get_rank()
    seq_local = 4 if rank != 1 else 6
    q = torch.randn(1, seq_local, 2, 4)
    ring_attention(q, q, q, causal=True)


def odd_local_length_error():
    """Zigzag needs an even local length (global divisible by 2P): the error comes before any comm."""
    q = torch.randn(1, 3, 2, 4)
    try:
        ring_attention(q, q, q, causal=True)
    except ValueError as err:
        return str(err)
    return None


# --- Cross-rank handshake (Note [Cross-rank handshake]) and zero-size inputs ---------------------

RING_DEFAULTS = dict(batch=1, seq=4, heads_q=4, heads_kv=2, head_dim=8, dtype=torch.float32, causal=False,
                     sharding="zigzag", comm="p2p", softmax_scale=None, masked=False, requires_grad=False)
"""A consistent ring_attention call; :func:`mismatched_call` changes one field on some ranks."""
RING_CHANGES = dict(seq=8, batch=2, heads_q=8, heads_kv=1, head_dim=4, dtype=torch.bfloat16, causal=True,
                    sharding="contiguous", comm="all_gather", softmax_scale=0.5, masked=True, requires_grad=True)
DECODE_DEFAULTS = dict(batch=1, q_len=1, heads_q=4, heads_kv=2, head_dim=8, dtype=torch.float32,
                       softmax_scale=None, masked=False)
DECODE_CHANGES = dict(batch=2, q_len=2, heads_q=8, heads_kv=1, head_dim=4, dtype=torch.bfloat16,
                      softmax_scale=0.5, masked=True)


def _call_ring(a, group=None, check=True):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(a["batch"], a["seq"], a["heads_q"], a["head_dim"], generator=gen).to(a["dtype"])
    k = torch.randn(a["batch"], a["seq"], a["heads_kv"], a["head_dim"], generator=gen).to(a["dtype"])
    mask = torch.ones(a["batch"], a["seq"], dtype=torch.bool) if a["masked"] else None
    q.requires_grad_(a["requires_grad"])
    return ring_attention(q, k, k, group, causal=a["causal"], sharding=a["sharding"], comm=a["comm"],
                          softmax_scale=a["softmax_scale"], key_padding_mask=mask, backend="math",
                          check_consistency=check)


def _call_decode(a, s_local, group=None, check=True):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(a["batch"], a["q_len"], a["heads_q"], a["head_dim"], generator=gen).to(a["dtype"])
    k = torch.randn(a["batch"], s_local, a["heads_kv"], a["head_dim"], generator=gen).to(a["dtype"])
    mask = torch.ones(a["batch"], s_local, dtype=torch.bool) if a["masked"] else None
    return decode_attention(q, k, k, group, softmax_scale=a["softmax_scale"], key_padding_mask=mask,
                            check_consistency=check)


def _outcome(fn, *args, **kwargs):
    """``("ok", shape)`` or ``(exception type name, message)``."""
    try:
        return "ok", tuple(fn(*args, **kwargs).shape)
    except (TypeError, ValueError) as err:
        return type(err).__name__, str(err)


def mismatched_call(entry, field, odd_ranks, comm="p2p"):
    """``entry`` ("ring" or "decode") with ``field`` changed on ``odd_ranks``; this rank's outcome.
    Decode shards have a different length on every rank (legitimately)."""
    rank = dist.get_rank()
    if entry == "ring":
        args = dict(RING_DEFAULTS, comm=comm)
        if rank in odd_ranks:
            args[field] = RING_CHANGES[field]
        return _outcome(_call_ring, args)
    args = dict(DECODE_DEFAULTS)
    if rank in odd_ranks:
        args[field] = DECODE_CHANGES[field]
    return _outcome(_call_decode, args, rank + 1)


def pieces_set_on_one_rank(odd_rank, pieces):
    """A consistent ring call but for ``comm_choice.PIECES``, set to ``pieces`` on ``odd_rank`` alone; this rank's
    outcome."""
    comm_choice.PIECES = pieces if dist.get_rank() == odd_rank else None
    try:
        return _outcome(_call_ring, dict(RING_DEFAULTS))
    finally:
        comm_choice.PIECES = None


def consistent_calls_with_and_without_check(comm):
    """Ring (forward and backward) and decode, checked and unchecked: bitwise equal results."""
    rank, size = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = _inputs(2, 4 * size, 4, 2, 8, torch.float32)
    results = []
    for check in (True, False):
        ql, kl, vl = (shard_sequence(t, rank, size).requires_grad_() for t in (q, k, v))
        out = ring_attention(ql, kl, vl, causal=True, comm=comm, check_consistency=check)
        out.backward(shard_sequence(dout, rank, size))
        dec = decode_attention(q[:, :1], k[:, rank:2 * rank + 1], v[:, rank:2 * rank + 1], check_consistency=check)
        results.append((out, ql.grad, kl.grad, vl.grad, dec))
    return all(torch.equal(a, b) for a, b in zip(*results))


def count_collectives_unchecked(comm, causal):
    """:func:`count_collectives` with ``check_consistency=False``: the data collectives alone."""
    import functools

    global ring_attention
    checked = ring_attention
    ring_attention = functools.partial(checked, check_consistency=False)
    try:
        return count_collectives(comm, causal)
    finally:
        ring_attention = checked


def rejected_on_one_rank(entry, bad_rank):
    """``bad_rank`` passes input its own checks reject (int dtype); every rank's outcome, no hang."""
    rank = dist.get_rank()
    dtype = torch.int32 if rank == bad_rank else torch.float32
    q = torch.ones(1, 4, 2, 8, dtype=dtype)
    if entry == "ring":
        return _outcome(ring_attention, q, q, q)
    return _outcome(decode_attention, q[:, :1], q, q)


def call_from_outside_the_group(entry):
    """All ranks build a group of ranks 0 and 1; every rank calls with it (rank 2 is no member)."""
    group = dist.new_group([0, 1])
    if entry == "ring":
        return _outcome(_call_ring, RING_DEFAULTS, group)
    return _outcome(_call_decode, DECODE_DEFAULTS, 3, group)


def zero_sized(entry, field, backend, zero_ranks=None):
    """``field`` ("batch", "seq", "heads", "heads_kv", "head_dim", "cache") set to 0 on ``zero_ranks``
    (all ranks when None); this rank's outcome, and for batch 0 the gradients' shapes."""
    rank, size = dist.get_rank(), dist.get_world_size()
    zero = zero_ranks is None or rank in zero_ranks
    dims = dict(batch=2, seq=4, heads=4, heads_kv=2, head_dim=8, cache=3)
    if zero:
        dims[field] = 0
    q = torch.randn(dims["batch"], dims["seq"], dims["heads"], dims["head_dim"], requires_grad=True)
    k = torch.randn(dims["batch"], dims["seq"] if entry == "ring" else dims["cache"], dims["heads_kv"],
                    dims["head_dim"], requires_grad=True)
    try:
        if entry == "ring":
            out = ring_attention(q, k, k, backend=backend, causal=True)
            out.sum().backward()
            return "ok", tuple(out.shape), tuple(q.grad.shape), tuple(k.grad.shape)
        out = decode_attention(q.detach()[:, :1] if field != "seq" else q.detach(), k.detach(), k.detach(),
                               backend=backend)
        return "ok", tuple(out.shape), float(out.abs().sum()), size
    except (TypeError, ValueError) as err:
        return type(err).__name__, str(err)


def different_entry_points():
    """Rank 0 calls ring_attention, the others decode_attention (same group)."""
    q = torch.ones(1, 4, 2, 8)
    if dist.get_rank() == 0:
        return _outcome(ring_attention, q, q, q)
    return _outcome(decode_attention, q[:, :1], q, q)


def gather_blocks_in_strided_groups():
    """:func:`start_gather_blocks` of two tensors over groups [0, 2] and [1, 3] (local rank != global
    rank), and over the world: ``(blocks are every member's tensors in group order, arrivals per source)``."""
    from megatron_ring.attention.gather import start_gather_blocks

    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    block = lambda r: torch.arange(6.0).view(2, 3) + 100 * r  # noqa: E731
    results = []
    for group, members in ((groups[rank % 2], [rank % 2, rank % 2 + 2]), (None, [0, 1, 2, 3])):
        gather = start_gather_blocks((block(rank), -block(rank)), group, members.index(rank), len(members))
        blocks = gather.wait()
        expected = [(block(m), -block(m)) for m in members]
        results.append((all(torch.equal(a, b) for got, want in zip(blocks, expected) for a, b in zip(got, want)),
                        [len(works) for works in gather.arrivals]))
    return results


def ring_vs_reference_gathering_by_collective(*args, **kwargs):
    """:func:`ring_vs_reference` with ``comm="all_gather"`` sending K/V by the all-gather collective,
    the path of backends other than gloo (Note [Pairwise gather on gloo])."""
    from megatron_ring.attention import gather

    saved = gather._sends_pairwise
    gather._sends_pairwise = lambda group: False
    try:
        return ring_vs_reference(*args, **kwargs)
    finally:
        gather._sends_pairwise = saved


def files_of_a_warm_call(heads_kv):
    """The project files (relative to the package) whose code a second, same-shaped plain p2p ring forward runs on
    this rank: the first call builds the schedule and chooses the relay's pieces, then both are cached."""
    import sys

    q, k, v, _ = _inputs(1, 64, 2 * heads_kv, heads_kv, 16, torch.float32)
    ring_attention(q, k, v, causal=True)
    seen = set()

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if "megatron_ring/" in name:
            seen.add(name.split("megatron_ring/", 1)[1])

    sys.setprofile(profile)
    try:
        ring_attention(q, k, v, causal=True)
    finally:
        sys.setprofile(None)
    return sorted(seen)
