"""``ring_attention``: the entry point of the core (``megatron_ring.ring_attention``): checks and handshake
(call.prepare_ring), then the ring (ring.run_ring) or, for ``comm="a2a"`` / ``"a2a+p2p"``, alltoall.py, which runs the
same ring over its ring group. docs/design.md reads one call through the files.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ring.attention.alltoall import a2a_attention
from megatron_ring.attention.call import prepare_ring
from megatron_ring.attention.comms import A2A_COMMS, RING_COMMS, CPGroups
from megatron_ring.attention.opaque import call_op
from megatron_ring.attention.ring import run_ring


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup | CPGroups | tuple | None = None, *,
                   causal: bool = False, softmax_scale: float | None = None, sharding: str = "zigzag",
                   comm: str = "p2p", backend: str = "auto", key_padding_mask: torch.Tensor | None = None,
                   window_size: tuple[int, int] = (-1, -1), cu_seqlens: torch.Tensor | None = None,
                   dilation: tuple | None = None, check_consistency: bool = True) -> torch.Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Args:
        q: ``[batch, seq_local, heads_q, head_dim]``, this rank's queries; with ``cu_seqlens``
            packed ``[tokens_local, heads_q, head_dim]``.
        k, v: ``[batch, seq_local, heads_kv, head_dim]`` (packed: ``[tokens_local, heads_kv,
            head_dim]``); ``heads_q % heads_kv == 0`` (GQA/MQA).
        group: the context-parallel group; its ranks in group order form the ring. None = world (or a single process
            when torch.distributed is not initialised). ValueError on a process that is not a member. For
            ``comm="a2a+p2p"``: ``(a2a_group, ring_group)`` or a :class:`~megatron_ring.attention.comms.CPGroups`
            (``init_parallel(...).cp_groups``), whose ``cp`` field also serves the other comms.
        causal: causal mask on *global* positions.
        softmax_scale: defaults to ``1/sqrt(head_dim)``.
        sharding: ``"zigzag"`` (rank r holds chunks r and 2P-1-r of 2P; Megatron's split) or
            ``"contiguous"`` (chunk r of P). See Note [Zigzag sharding].
        comm: ``"p2p"`` (the ring), ``"all_gather"`` (the baseline), ``"a2a"`` (Ulysses: all-to-all
            to heads, local attention; ``heads_q % cp == 0``), ``"a2a+p2p"`` (all-to-all inside
            the a2a groups, the ring across them; Note [All-to-all between sequence and heads] in
            alltoall.py) or ``"auto"`` (chosen per call among those ``group`` can run, from the
            shapes and a cost model: Note [When does the ring beat all-gather?] in costs/comm_choice.py).
        backend: local block kernel, ``"auto"``, ``"math"``, ``"sdpa"`` or ``"flash_attn"`` (see block.py).
        key_padding_mask: None, or bool ``[batch, seq_local]`` sharded like k (True = a real token, False = padding that
            no query may see), given on every rank of the group or on none. The masks are all-gathered once per call
            (one byte per token); a query that sees no key gets a zero output. With a mask, ``auto`` uses the CPU
            ``sdpa`` kernel or ``math``. With ``cu_seqlens``: bool ``[tokens_local]``.
        window_size: ``(left, right)``, flash-attn's sliding window on global positions (inside each document with
            ``cu_seqlens``): the query at i sees the key at j iff ``i - left <= j <= i + right``, -1 = unbounded; with
            ``causal`` also ``j <= i`` (Mistral's style). Blocks outside the window are skipped, and ``comm="p2p"``
            moves only the rows some rank reads (Note [Direct transfers] in direct.py). A window that hides something
            needs a mask inside blocks: ``auto`` uses the CPU ``sdpa`` kernel or ``math``.
        cu_seqlens: None, or int32 ``[n_docs + 1]``: the global packed boundaries of documents (0, ..., total tokens),
            identical on every rank; each document's length divisible by 2*cp (zigzag) or cp (contiguous), and each
            sharded on its own, as :func:`~megatron_ring.attention.sharding.shard_sequence` does with ``cu_seqlens``
            (Note [Packed documents (varlen)]). No query sees a key of another document. Its values are read on the host
            once per call.
        dilation: None, or LongNet's dilated attention: ``(segment_length, dilation)`` or a sequence of such pairs
            (dilated.py: each pair's segments, its phases by head group, the pairs merged by their softmax
            denominators); ``dilation <= heads_q``; not with a window, documents, a key padding mask or the all-to-all
            comms. ``comm="p2p"`` moves only the rows some rank reads (Note [Dilated attention as one ring call]).
        check_consistency: first check, with one small all-gather, that every rank passed the same shapes, dtype, device
            type, causal, sharding, comm, scale, mask presence, whether gradients are needed, window, document
            boundaries and dilation, and raise ValueError on every rank naming what differs (or which rank rejected its
            inputs): Note [Cross-rank handshake] in handshake.py. Must be the same on every rank; with False, a rank
            whose input differs or is rejected aborts or hangs the others.

    Returns:
        ``[batch, seq_local, heads_q, head_dim]`` (packed: ``[tokens_local, heads_q, head_dim]``) in q's dtype;
        differentiable w.r.t. q, k, v. An empty batch (batch 0) gives an empty result; ``seq_local``, heads or
        ``head_dim`` of 0 are a ValueError."""
    options = dict(causal=causal, softmax_scale=softmax_scale, sharding=sharding, comm=comm, backend=backend,
                   window_size=window_size, check_consistency=check_consistency)
    if torch.compiler.is_compiling() and comm in RING_COMMS and cu_seqlens is None and dilation is None:
        # one opaque custom op: Note [torch.compile] in ops.py
        through_op = call_op("ring_attention", (q, k, v), group, {"key_padding_mask": key_padding_mask}, options)
        if through_op is not None:
            return through_op[0]
    call, (qb, kb, vb, mask) = prepare_ring(q, k, v, group, key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens,
                                            dilation=dilation, **options)  # type: ignore[arg-type]
    if qb.shape[0] == 0:
        # the [0, seq_local, heads_q, head_dim] output, in the autograd graph of q, k and v (sums over no element: 0)
        return q + (k.sum() + v.sum()).to(q.dtype)
    if call.comm in A2A_COMMS:
        return a2a_attention(qb, kb, vb, call, mask)
    out = run_ring(qb, kb, vb, call, mask)
    return out if cu_seqlens is None else out.squeeze(0)
