"""Ring attention: exact attention over a sequence sharded across a context-parallel group.

Each rank keeps its queries and passes its K/V block around the ring with point-to-point
send/recv; after P-1 rotations every query has met every key block, and the partial results are
merged by log-sum-exp (Note [Log-sum-exp merge] in merge.py). Activation memory per rank is
O(L/P); no rank ever holds the whole sequence's K/V.

Note [Overlap and double buffering]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
At step t the ring posts the send of the current K/V and the receive of the next *before*
computing on the current block, and waits only after the compute: the transfer hides behind the
attention math when compute >= communication (L/P above the crossover). Step 0 sends the
caller's own K/V; two receive buffers (one for P = 2), allocated once per call, alternate after
that. The buffer being received into was last read at step t-1, whose communication has
completed, so there is no hazard. Only the ``heads_kv`` heads travel, heads-first (Note
[Heads-first blocks]) in the caller's dtype (bf16 for bf16 models) in forward; the backward's
dK/dV accumulator travels in fp32, twice the bytes of bf16 K/V.

Backward runs a second ring: K/V rotate as in forward, and a gradient accumulator (fp32) travels
one step behind them, collecting every rank's dK/dV contribution for that block; a final
transfer carries it home to the block's owner.

Note [Heads-first blocks]
~~~~~~~~~~~~~~~~~~~~~~~~~
The caller's ``[b, s, h, d]`` tensors put a token's heads side by side, so one head's rows are
``h * d`` elements apart. The block kernels read a head's rows block by block, and on CPU they
take 0.90-0.96x the time (forward, and forward+backward; h = 8, the 4096 x 4096 and 4096 x 2048
blocks of a zigzag ring at L = 16k, P = 4) when those rows are adjacent
(``python -m megatron_ring.perf.bench_block --layouts``). So q, k, v and dout are copied once per
call into ``[b, h, s, d]`` storage, K/V blocks travel so, and every block kernel of the call reads
them there; the output and dq are written into ``[b, s, h, d]`` storage, as the caller's layout,
and need no copy back. A copy costs about 1 % of such a block's time per tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_ring.attention.allgather import GatheredKV, all_gather_stacked
from megatron_ring.attention.alltoall import a2a_attention, check_a2a_heads
from megatron_ring.attention.auto_comm import choose_comm_for_shapes
from megatron_ring.attention.block import block_backward, block_forward, compute_dtype, resolve_backend
from megatron_ring.attention.comms import A2A_COMMS, COMM_CHOICES, CPGroups, CPPlace, cp_place
from megatron_ring.attention.checks import check_choice, check_key_padding_mask, check_qkv, check_tokens
from megatron_ring.attention.direct import DirectP2P
from megatron_ring.attention.handshake import Field, agree_place, choice_field, flag_field, scale_field, tensor_fields
from megatron_ring.attention.instrument import active_stats, now, wait_all
from megatron_ring.attention.merge import merge_into
from megatron_ring.attention.opaque import call_op
from megatron_ring.attention.schedule import RankSchedule, StepPlan, step_plan
from megatron_ring.attention.sharding import SHARDINGS, check_divisible
from megatron_ring.attention.sparse_call import SparseCall, packed_as_batch, prepare_sparse, sparse_fields

_KV_TAG, _GRAD_TAG = 0, 1


class P2PRing:
    """K/V rotation over a process group with ``batch_isend_irecv``; guards its own buffers."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self._sent_steps = self._sent_bytes = 0
        if size > 1:
            self.next = dist.get_global_rank(group, (rank + 1) % size) if group is not None else (rank + 1) % size
            self.prev = dist.get_global_rank(group, (rank - 1) % size) if group is not None else (rank - 1) % size
        self._grad_bufs: torch.Tensor | None = None
        self._grad_work: list[dist.Work] = []
        self._grad_step = 0

    def _exchange(self, send: tuple[torch.Tensor, ...], recv: tuple[torch.Tensor, ...], tag: int) -> list[dist.Work]:
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for t in recv]
        self._sent_steps += 1
        self._sent_bytes += sum(t.numel() * t.element_size() for t in send)
        return dist.batch_isend_irecv(ops)

    def take_traffic(self) -> tuple[int, int]:
        """``(steps, bytes)`` this rank sent since the last call."""
        traffic = (self._sent_steps, self._sent_bytes)
        self._sent_steps = self._sent_bytes = 0
        return traffic

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(src, k_src, v_src)`` for t = 0..P-1, each ``[batch, heads_kv, seq_local, head_dim]``.

        ``k``/``v`` travel heads-first (Note [Heads-first blocks]): the first send reads ``k``/``v``
        (no copy when they are contiguous) and at most two receive buffers are allocated (one when
        P = 2). The next block's transfer is in flight while the caller computes on the yielded one.
        """
        cur = (k.contiguous(), v.contiguous())
        spare: list[tuple[torch.Tensor, torch.Tensor]] = []
        for step in range(self.size):
            works: list[dist.Work] = []
            if step < self.size - 1:
                if len(spare) < min(2, self.size - 1):
                    spare.append((torch.empty_like(cur[0]), torch.empty_like(cur[1])))
                nxt = spare[step % len(spare)]
                works = self._exchange(cur, nxt, _KV_TAG)
            yield (self.rank - step) % self.size, cur[0], cur[1]
            wait_all(works, k.device)
            if works:
                cur = nxt

    def start_grads(self, kv_shape: torch.Size, dtype: torch.dtype, device: torch.device) -> None:
        self._grad_bufs = torch.zeros((2, *kv_shape), dtype=dtype, device=device)
        self._grad_work, self._grad_step = [], 0

    def add_grads(self, src: int, grads: Sequence[tuple[StepPlan, torch.Tensor, torch.Tensor]]) -> None:
        """Add this step's dK/dV pieces ``(plan, dk, dv)`` to the travelling accumulator of block
        ``src`` and pass it on."""
        assert self._grad_bufs is not None
        step = self._grad_step
        wait_all(self._grad_work, self._grad_bufs.device)
        acc = self._grad_bufs[step % 2]
        for plan, dk, dv in grads:
            acc[0][:, :, plan.k] += dk
            acc[1][:, :, plan.k] += dv
        if self.size > 1:
            self._grad_work = self._exchange((acc,), (self._grad_bufs[(step + 1) % 2],), _GRAD_TAG)
        self._grad_step += 1

    def finish_grads(self) -> torch.Tensor:
        """This rank's own ``[2, batch, heads_kv, seq_local, head_dim]`` gradient, once home."""
        assert self._grad_bufs is not None
        wait_all(self._grad_work, self._grad_bufs.device)
        grads = self._grad_bufs[self._grad_step % 2] if self.size > 1 else self._grad_bufs[0]
        self._grad_bufs, self._grad_work = None, []
        return grads


@dataclass(frozen=True)
class _Spec:
    rank: int
    size: int
    seq_local: int
    causal: bool
    sharding: str
    scale: float
    backend: str
    schedule: RankSchedule | None = None
    """Window / packed-documents plans (sparse_call.py); None for the plain schedule."""

    def plans(self, src: int) -> tuple[StepPlan, ...]:
        """This rank's work on the K/V block of ``src`` (empty: skip it)."""
        if self.schedule is not None:
            return self.schedule.plans[src]
        plan = step_plan(self.rank, src, self.size, self.seq_local, causal=self.causal, sharding=self.sharding)
        return () if plan is None else (plan,)


def _alloc_bshd(b: int, h: int, s: int, d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero ``[b, h, s, d]`` view over ``[b, s, h, d]`` memory, so the result needs no final copy."""
    return torch.zeros(b, s, h, d, dtype=dtype, device=device).transpose(1, 2)


def _block_mask(key_masks: torch.Tensor | None, src: int, plan: StepPlan) -> torch.Tensor | None:
    """The keys of block ``src`` that this step uses, from the gathered ``[P, batch, seq_local]`` masks."""
    return None if key_masks is None else key_masks[src][:, plan.k]


def _visible(plan: StepPlan, device: torch.device) -> torch.Tensor | None:
    """The plan's band as a bool ``[q, k]`` mask (None when the block is full or causal)."""
    return None if plan.band is None else plan.band.visible(plan.q.stop - plan.q.start, plan.k.stop - plan.k.start, device)


class _RingAttention(torch.autograd.Function):
    """Autograd wrapper; tensors are ``[batch, heads, seq_local, head_dim]`` (views of BSHD input),
    run heads-first (Note [Heads-first blocks])."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: P2PRing | GatheredKV | DirectP2P,
                spec: _Spec, key_masks: torch.Tensor | None) -> torch.Tensor:
        stats = active_stats()
        t0 = now(q.device) if stats else 0.0
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        b, hq, s, d = q.shape
        ct = compute_dtype(q.dtype)
        out = _alloc_bshd(b, hq, s, d, ct, q.device)
        lse = torch.full((b, hq, s), float("-inf"), dtype=ct, device=q.device)
        for src, k_src, v_src in comm.blocks(k, v):
            for plan in spec.plans(src):
                c0 = now(q.device) if stats else 0.0
                o, l = block_forward(q[:, :, plan.q], k_src[:, :, plan.k], v_src[:, :, plan.k],
                                     causal=plan.causal, scale=spec.scale, backend=spec.backend,
                                     key_mask=_block_mask(key_masks, src, plan), visible=_visible(plan, q.device))
                merge_into(out[:, :, plan.q], lse[:, :, plan.q], o, l)
                del o, l  # free this block's output before the next kernel allocates its own
                if stats:
                    stats.compute_s += now(q.device) - c0
        result = out.to(q.dtype)
        steps, sent = comm.take_traffic()
        if stats:
            stats.calls += 1
            stats.steps += steps
            stats.bytes_sent += sent
            stats.total_s += now(q.device) - t0
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.comm, ctx.spec, ctx.key_masks = comm, spec, key_masks
        return result

    @staticmethod
    def backward(ctx, dout: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        q, k, v, dout = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous()  # the op saves views
        comm: P2PRing | GatheredKV | DirectP2P = ctx.comm
        spec: _Spec = ctx.spec
        stats = active_stats()
        t0 = now(q.device) if stats else 0.0
        ct = compute_dtype(q.dtype)
        b, hq, s, d = q.shape
        dq = _alloc_bshd(b, hq, s, d, ct, q.device)
        comm.start_grads(torch.Size((2, *k.shape)), ct, q.device)
        for src, k_src, v_src in comm.blocks(k, v):
            grads = []
            for plan in spec.plans(src):
                c0 = now(q.device) if stats else 0.0
                dq_b, dk_b, dv_b = block_backward(
                    dout[:, :, plan.q], q[:, :, plan.q], k_src[:, :, plan.k], v_src[:, :, plan.k],
                    out[:, :, plan.q], lse[:, :, plan.q], causal=plan.causal, scale=spec.scale, backend=spec.backend,
                    key_mask=_block_mask(ctx.key_masks, src, plan), visible=_visible(plan, q.device),
                )
                dq[:, :, plan.q] += dq_b
                del dq_b  # as in forward: not alive during the next block's kernel
                grads.append((plan, dk_b, dv_b))
                if stats:
                    stats.compute_s += now(q.device) - c0
            comm.add_grads(src, grads)
            del grads
        dkv = comm.finish_grads()
        steps, sent = comm.take_traffic()
        if stats:
            stats.steps += steps
            stats.bytes_sent += sent
            stats.total_s += now(q.device) - t0
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


@dataclass(frozen=True)
class _Call:
    """A checked ``ring_attention`` call: its spec and the comm it runs with (``"auto"`` resolved)."""

    spec: _Spec
    comm: str
    masked: bool
    sparse: SparseCall


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, place: CPPlace, *, causal: bool,
             softmax_scale: float | None, sharding: str, comm: str, backend: str,
             key_padding_mask: torch.Tensor | None, window_size: object = (-1, -1),
             cu_seqlens: torch.Tensor | None = None) -> _Call:
    """Every local check of a call (TypeError/ValueError naming the field), before any collective."""
    rank, size = place.rank, place.size
    check_qkv(q, k, v, same_seq=True)
    check_tokens(q, "seq_local", "ring_attention", "at least one token per rank")
    check_key_padding_mask(key_padding_mask, k)
    check_choice("sharding", sharding, SHARDINGS)
    check_choice("comm", comm, COMM_CHOICES)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive number or None, got {softmax_scale!r}")
    seq_local, masked = q.shape[1], key_padding_mask is not None
    if size > 1 and cu_seqlens is None:
        check_divisible(seq_local * size, size, sharding, what=f"global sequence length (seq_local {seq_local} x cp {size})")
    sparse = prepare_sparse(rank, size, seq_local, causal=causal, sharding=sharding, window_size=window_size,
                            cu_seqlens=cu_seqlens)
    spec = _Spec(
        rank=rank, size=size, seq_local=seq_local, causal=causal, sharding=sharding,
        scale=float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        backend=resolve_backend(backend, q.device, q.dtype, q.shape[-1], masked=masked or sparse.windowed),
        schedule=sparse.schedule,
    )
    if comm in A2A_COMMS:
        check_a2a_heads(q.shape[2], place.a2a_size(comm), comm)
        if sparse.schedule is not None:
            raise ValueError(f"comm={comm!r} does not support window_size or cu_seqlens; allowed with them: "
                             "'p2p', 'all_gather', 'auto' (which then runs 'p2p')")
    if comm == "auto" and sparse.schedule is not None:
        comm = "p2p"  # it moves only the rows the plans read (Note [Direct transfers] in direct.py)
    if comm == "auto" and q.shape[0] > 0:  # an empty batch moves nothing
        comm = choose_comm_for_shapes(tuple(q.shape), tuple(k.shape), size, causal=causal,
                                      element_size=q.element_size(), device_type=q.device.type,
                                      candidates=place.comms(), a2a_size=place.hier[0][2] if place.hier else None)
    return _Call(spec, comm, masked, sparse)


def _fields(q: torch.Tensor, k: torch.Tensor, call: _Call, comm: str) -> list[Field]:
    """What every rank must agree on (Note [Cross-rank handshake]); ``comm`` as requested."""
    spec = call.spec
    return [*tensor_fields(q, k, "seq_local"), flag_field("causal", spec.causal),
            choice_field("sharding", spec.sharding, SHARDINGS), choice_field("comm", comm, COMM_CHOICES),
            scale_field(spec.scale), flag_field("key_padding_mask", call.masked, ("None", "a mask")),
            *sparse_fields(call.sparse)]


def _empty_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The ``[0, seq_local, heads_q, head_dim]`` output of an empty batch, in the autograd graph of
    q, k and v (whose gradients are then empty too); nothing moves."""
    return q + (k.sum() + v.sum()).to(q.dtype)  # sums over no element: 0


def ring_channel(group: dist.ProcessGroup | None, spec: _Spec, comm: str,
                 key_padding_mask: torch.Tensor | None) -> tuple[P2PRing | GatheredKV | DirectP2P, torch.Tensor | None]:
    """The channel the K/V of a ``p2p`` / ``all_gather`` call travel on over ``group``, and the key masks
    of the group's ranks (``[P, batch, seq_local]``, all-gathered), or None without a mask."""
    channel: P2PRing | GatheredKV | DirectP2P = GatheredKV(group, spec.rank, spec.size)
    if comm == "p2p":
        channel = (P2PRing(group, spec.rank, spec.size) if spec.schedule is None
                   else DirectP2P(group, spec.rank, spec.size, spec.schedule))
    key_masks = None
    if key_padding_mask is not None:
        key_masks = all_gather_stacked(key_padding_mask.to(torch.uint8), group, spec.size).bool()
    return channel, key_masks


def _ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None, spec: _Spec, comm: str,
          key_padding_mask: torch.Tensor | None) -> torch.Tensor:
    """The ring (``p2p`` or ``all_gather``) over ``group`` on checked BSHD inputs, rank and size from ``spec``."""
    channel, key_masks = ring_channel(group, spec, comm, key_padding_mask)
    out = _RingAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), channel, spec, key_masks)
    return out.transpose(1, 2)


@dataclass(frozen=True)
class Run:
    """A checked ``ring_attention`` call after its handshake: q/k/v and the key mask as a batch
    (packed documents as a batch of one), the call and where this rank sits in the CP groups."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_padding_mask: torch.Tensor | None
    call: _Call
    place: CPPlace


def start(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | CPGroups | tuple | None, *,
          causal: bool, softmax_scale: float | None, sharding: str, comm: str, backend: str,
          key_padding_mask: torch.Tensor | None, window_size: object = (-1, -1),
          cu_seqlens: torch.Tensor | None = None, check_consistency: bool) -> Run | None:
    """Checks and handshake of a ``ring_attention`` call (raising on every rank alike); None for an
    empty batch (nothing moves)."""
    place = cp_place(group, comm)
    call: _Call | None = None
    error: Exception | None = None
    try:
        q, k, v, key_padding_mask = packed_as_batch(q, k, v, key_padding_mask, cu_seqlens)  # type: ignore[assignment]
        call = _prepare(q, k, v, place, causal=causal, softmax_scale=softmax_scale, sharding=sharding,
                        comm=comm, backend=backend, key_padding_mask=key_padding_mask, window_size=window_size,
                        cu_seqlens=cu_seqlens)
    except Exception as err:  # raised below, once the other ranks know (they must not wait for this one)
        error = err
    if check_consistency and place.size > 1:
        agree_place("ring_attention", None if call is None else _fields(q, k, call, comm), place, q)
    if call is None:
        assert error is not None
        raise error
    if q.shape[0] == 0:
        return None
    return Run(q, k, v, key_padding_mask, call, place)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup | CPGroups | tuple | None = None, *,
                   causal: bool = False, softmax_scale: float | None = None, sharding: str = "zigzag",
                   comm: str = "p2p", backend: str = "auto", key_padding_mask: torch.Tensor | None = None,
                   window_size: tuple[int, int] = (-1, -1), cu_seqlens: torch.Tensor | None = None,
                   check_consistency: bool = True) -> torch.Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Args:
        q: ``[batch, seq_local, heads_q, head_dim]``, this rank's queries; with ``cu_seqlens``
            packed ``[tokens_local, heads_q, head_dim]``.
        k, v: ``[batch, seq_local, heads_kv, head_dim]`` (packed: ``[tokens_local, heads_kv,
            head_dim]``); ``heads_q % heads_kv == 0`` (GQA/MQA).
        group: the context-parallel group; its ranks in group order form the ring. None = world
            (or a single process when torch.distributed is not initialised). ValueError on a
            process that is not a member. For ``comm="a2a+p2p"``: ``(a2a_group, ring_group)`` or a
            :class:`~megatron_ring.attention.alltoall.CPGroups` (``init_parallel(...).cp_groups``),
            whose ``cp`` field also serves the other comms.
        causal: causal mask on *global* positions.
        softmax_scale: defaults to ``1/sqrt(head_dim)``.
        sharding: ``"zigzag"`` (rank r holds chunks r and 2P-1-r of 2P; Megatron's split) or
            ``"contiguous"`` (chunk r of P). See Note [Zigzag sharding].
        comm: ``"p2p"`` (the ring), ``"all_gather"`` (the baseline), ``"a2a"`` (Ulysses: all-to-all
            to heads, local attention; ``heads_q % cp == 0``), ``"a2a+p2p"`` (all-to-all inside
            the a2a groups, the ring across them; Note [All-to-all between sequence and heads] in
            alltoall.py) or ``"auto"`` (chosen per call among those ``group`` can run, from the
            shapes and a cost model: Note [When does the ring beat all-gather?] in auto_comm.py).
        backend: local block kernel, ``"auto"``, ``"math"``, ``"sdpa"`` or ``"flash_attn"`` (see block.py).
        key_padding_mask: None, or bool ``[batch, seq_local]`` sharded like k (True = a real token,
            False = padding that no query may see), given on every rank of the group or on none.
            The masks are all-gathered once per call (one byte per token); a query that sees no
            key gets a zero output. With a mask, ``auto`` uses the CPU ``sdpa`` kernel or ``math``.
            With ``cu_seqlens``: bool ``[tokens_local]``.
        window_size: ``(left, right)``, flash-attn's sliding window on global positions (inside
            each document with ``cu_seqlens``): the query at i sees the key at j iff
            ``i - left <= j <= i + right``, -1 = unbounded; with ``causal`` also ``j <= i``
            (Mistral's style). Blocks outside the window are skipped, and ``comm="p2p"`` moves only
            the rows some rank reads (Note [Direct transfers] in direct.py). A window that hides
            something needs a mask inside blocks: ``auto`` uses the CPU ``sdpa`` kernel or ``math``.
        cu_seqlens: None, or int32 ``[n_docs + 1]``: the global packed boundaries of documents
            (0, ..., total tokens), identical on every rank; each document's length divisible by
            2*cp (zigzag) or cp (contiguous), and each sharded on its own, as
            :func:`~megatron_ring.attention.sharding.shard_sequence` does with ``cu_seqlens``
            (Note [Packed documents (varlen)]). No query sees a key of another document. Its values
            are read on the host once per call.
        check_consistency: first check, with one small all-gather, that every rank passed the same
            shapes, dtype, device type, causal, sharding, comm, scale, mask presence, window and
            document boundaries, and raise
            ValueError on every rank naming what differs (or which rank rejected its inputs):
            Note [Cross-rank handshake] in handshake.py. Must be the same on every rank; with
            False, a rank whose input differs or is rejected aborts or hangs the others.

    Returns:
        ``[batch, seq_local, heads_q, head_dim]`` (packed: ``[tokens_local, heads_q, head_dim]``) in
        q's dtype; differentiable w.r.t. q, k, v. An
        empty batch (batch 0) gives an empty result; ``seq_local``, heads or ``head_dim`` of 0 are
        a ValueError.
    """
    options = dict(causal=causal, softmax_scale=softmax_scale, sharding=sharding, comm=comm, backend=backend,
                   window_size=window_size, check_consistency=check_consistency)
    if torch.compiler.is_compiling() and comm in ("p2p", "all_gather") and cu_seqlens is None:
        # one opaque custom op: Note [torch.compile] in ops.py
        through_op = call_op("ring_attention", (q, k, v), group, {"key_padding_mask": key_padding_mask}, options)
        if through_op is not None:
            return through_op[0]
    run = start(q, k, v, group, key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens, **options)
    if run is None:
        return _empty_batch(q, k, v)
    if run.call.comm in A2A_COMMS:
        return a2a_attention(run.q, run.k, run.v, run.place, run.call.comm, run.call.spec, run.key_padding_mask, _ring)
    out = _ring(run.q, run.k, run.v, run.place.flat, run.call.spec, run.call.comm, run.key_padding_mask)
    return out if cu_seqlens is None else out.squeeze(0)
