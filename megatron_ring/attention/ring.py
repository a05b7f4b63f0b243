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
completed, so there is no hazard. Only the ``heads_kv`` heads travel, in the caller's layout and
dtype (bf16 for bf16 models) in forward; the backward's dK/dV accumulator travels in fp32, twice
the bytes of bf16 K/V.

Backward runs a second ring: K/V rotate as in forward, and a gradient accumulator (fp32) travels
one step behind them, collecting every rank's dK/dV contribution for that block; a final
transfer carries it home to the block's owner.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_ring.attention.allgather import GatheredKV, all_gather_stacked
from megatron_ring.attention.auto_comm import choose_comm_for_shapes
from megatron_ring.attention.block import block_backward, block_forward, compute_dtype, resolve_backend
from megatron_ring.attention.checks import (check_choice, check_key_padding_mask, check_qkv, check_tokens,
                                            group_rank_size)
from megatron_ring.attention.handshake import Field, agree, choice_field, flag_field, scale_field, tensor_fields
from megatron_ring.attention.instrument import active_stats, now
from megatron_ring.attention.merge import merge_into
from megatron_ring.attention.opaque import call_op
from megatron_ring.attention.schedule import StepPlan, step_plan
from megatron_ring.attention.sharding import SHARDINGS, check_divisible

COMMS: tuple[str, ...] = ("p2p", "all_gather", "auto")
_KV_TAG, _GRAD_TAG = 0, 1


class P2PRing:
    """K/V rotation over a process group with ``batch_isend_irecv``; guards its own buffers."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.bytes_per_step = 0
        if size > 1:
            self.next = dist.get_global_rank(group, (rank + 1) % size) if group is not None else (rank + 1) % size
            self.prev = dist.get_global_rank(group, (rank - 1) % size) if group is not None else (rank - 1) % size
        self._grad_bufs: torch.Tensor | None = None
        self._grad_work: list[dist.Work] = []
        self._grad_step = 0

    def _exchange(self, send: tuple[torch.Tensor, ...], recv: tuple[torch.Tensor, ...], tag: int) -> list[dist.Work]:
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for t in recv]
        return dist.batch_isend_irecv(ops)

    def _wait(self, works: list[dist.Work], device: torch.device) -> None:
        stats = active_stats()
        start = now(device) if stats else 0.0
        for work in works:
            work.wait()
        if stats:
            stats.wait_s += now(device) - start

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(src, k_src, v_src)`` for t = 0..P-1, each ``[batch, heads_kv, seq_local, head_dim]``.

        ``k``/``v`` are BHSD views of the caller's ``[batch, seq_local, heads_kv, head_dim]`` tensors,
        which travel in that layout: the first send reads the caller's memory (no copy when it is
        contiguous) and at most two receive buffers are allocated (one when P = 2). The next block's
        transfer is in flight while the caller computes on the yielded one.
        """
        cur = (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
        self.bytes_per_step = 2 * cur[0].numel() * cur[0].element_size()
        spare: list[tuple[torch.Tensor, torch.Tensor]] = []
        for step in range(self.size):
            works: list[dist.Work] = []
            if step < self.size - 1:
                if len(spare) < min(2, self.size - 1):
                    spare.append((torch.empty_like(cur[0]), torch.empty_like(cur[1])))
                nxt = spare[step % len(spare)]
                works = self._exchange(cur, nxt, _KV_TAG)
            yield (self.rank - step) % self.size, cur[0].transpose(1, 2), cur[1].transpose(1, 2)
            self._wait(works, k.device)
            if works:
                cur = nxt

    def start_grads(self, kv_shape: torch.Size, dtype: torch.dtype, device: torch.device) -> None:
        self._grad_bufs = torch.zeros((2, *kv_shape), dtype=dtype, device=device)
        self._grad_work, self._grad_step = [], 0

    def add_grads(self, src: int, plan: StepPlan | None, dk: torch.Tensor | None, dv: torch.Tensor | None) -> None:
        """Add this step's dK/dV to the travelling accumulator of block ``src`` and pass it on."""
        assert self._grad_bufs is not None
        step = self._grad_step
        self._wait(self._grad_work, self._grad_bufs.device)
        acc = self._grad_bufs[step % 2]
        if plan is not None:
            acc[0][:, :, plan.k] += dk
            acc[1][:, :, plan.k] += dv
        if self.size > 1:
            self._grad_work = self._exchange((acc,), (self._grad_bufs[(step + 1) % 2],), _GRAD_TAG)
        self._grad_step += 1

    def finish_grads(self) -> torch.Tensor:
        """This rank's own ``[2, batch, heads_kv, seq_local, head_dim]`` gradient, once home."""
        assert self._grad_bufs is not None
        self._wait(self._grad_work, self._grad_bufs.device)
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

    def plan(self, src: int) -> StepPlan | None:
        return step_plan(self.rank, src, self.size, self.seq_local, causal=self.causal, sharding=self.sharding)


def _alloc_bshd(b: int, h: int, s: int, d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero ``[b, h, s, d]`` view over ``[b, s, h, d]`` memory, so the result needs no final copy."""
    return torch.zeros(b, s, h, d, dtype=dtype, device=device).transpose(1, 2)


def _block_mask(key_masks: torch.Tensor | None, src: int, plan: StepPlan) -> torch.Tensor | None:
    """The keys of block ``src`` that this step uses, from the gathered ``[P, batch, seq_local]`` masks."""
    return None if key_masks is None else key_masks[src][:, plan.k]


class _RingAttention(torch.autograd.Function):
    """Autograd wrapper; tensors are ``[batch, heads, seq_local, head_dim]`` (views of BSHD input)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: P2PRing | GatheredKV,
                spec: _Spec, key_masks: torch.Tensor | None) -> torch.Tensor:
        stats = active_stats()
        t0 = now(q.device) if stats else 0.0
        b, hq, s, d = q.shape
        ct = compute_dtype(q.dtype)
        out = _alloc_bshd(b, hq, s, d, ct, q.device)
        lse = torch.full((b, hq, s), float("-inf"), dtype=ct, device=q.device)
        for src, k_src, v_src in comm.blocks(k, v):
            plan = spec.plan(src)
            if plan is None:
                continue
            c0 = now(q.device) if stats else 0.0
            o, l = block_forward(q[:, :, plan.q], k_src[:, :, plan.k], v_src[:, :, plan.k],
                                 causal=plan.causal, scale=spec.scale, backend=spec.backend,
                                 key_mask=_block_mask(key_masks, src, plan))
            merge_into(out[:, :, plan.q], lse[:, :, plan.q], o, l)
            del o, l  # free this block's output before the next kernel allocates its own
            if stats:
                stats.compute_s += now(q.device) - c0
        result = out.to(q.dtype)
        if stats:
            stats.calls += 1
            stats.steps += spec.size - 1
            stats.bytes_sent += comm.bytes_per_step * (spec.size - 1)
            stats.total_s += now(q.device) - t0
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.comm, ctx.spec, ctx.key_masks = comm, spec, key_masks
        return result

    @staticmethod
    def backward(ctx, dout: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        comm: P2PRing | GatheredKV = ctx.comm
        spec: _Spec = ctx.spec
        stats = active_stats()
        t0 = now(q.device) if stats else 0.0
        ct = compute_dtype(q.dtype)
        b, hq, s, d = q.shape
        dq = _alloc_bshd(b, hq, s, d, ct, q.device)
        comm.start_grads(torch.Size((2, *k.shape)), ct, q.device)
        for src, k_src, v_src in comm.blocks(k, v):
            plan = spec.plan(src)
            dk_b = dv_b = None
            if plan is not None:
                c0 = now(q.device) if stats else 0.0
                dq_b, dk_b, dv_b = block_backward(
                    dout[:, :, plan.q], q[:, :, plan.q], k_src[:, :, plan.k], v_src[:, :, plan.k],
                    out[:, :, plan.q], lse[:, :, plan.q], causal=plan.causal, scale=spec.scale, backend=spec.backend,
                    key_mask=_block_mask(ctx.key_masks, src, plan),
                )
                dq[:, :, plan.q] += dq_b
                del dq_b  # as in forward: not alive during the next block's kernel
                if stats:
                    stats.compute_s += now(q.device) - c0
            comm.add_grads(src, plan, dk_b, dv_b)
        dkv = comm.finish_grads()
        if stats:
            grad_bytes = dkv.numel() * dkv.element_size()
            stats.steps += 2 * spec.size - 1 if spec.size > 1 else 0
            stats.bytes_sent += comm.bytes_per_step * (spec.size - 1) + (grad_bytes * spec.size if spec.size > 1 else 0)
            stats.total_s += now(q.device) - t0
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


@dataclass(frozen=True)
class _Call:
    """A checked ``ring_attention`` call: its spec and the comm it runs with (``"auto"`` resolved)."""

    spec: _Spec
    comm: str
    masked: bool


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, size: int, *, causal: bool,
             softmax_scale: float | None, sharding: str, comm: str, backend: str,
             key_padding_mask: torch.Tensor | None) -> _Call:
    """Every local check of a call (TypeError/ValueError naming the field), before any collective."""
    check_qkv(q, k, v, same_seq=True)
    check_tokens(q, "seq_local", "ring_attention", "at least one token per rank")
    check_key_padding_mask(key_padding_mask, k)
    check_choice("sharding", sharding, SHARDINGS)
    check_choice("comm", comm, COMMS)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive number or None, got {softmax_scale!r}")
    seq_local, masked = q.shape[1], key_padding_mask is not None
    if size > 1:
        check_divisible(seq_local * size, size, sharding, what=f"global sequence length (seq_local {seq_local} x cp {size})")
    spec = _Spec(
        rank=rank, size=size, seq_local=seq_local, causal=causal, sharding=sharding,
        scale=float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        backend=resolve_backend(backend, q.device, q.dtype, q.shape[-1], masked=masked),
    )
    if comm == "auto" and q.shape[0] > 0:  # an empty batch moves nothing
        comm = choose_comm_for_shapes(tuple(q.shape), tuple(k.shape), size, causal=causal,
                                      element_size=q.element_size(), device_type=q.device.type)
    return _Call(spec, comm, masked)


def _fields(q: torch.Tensor, k: torch.Tensor, call: _Call, comm: str) -> list[Field]:
    """What every rank must agree on (Note [Cross-rank handshake]); ``comm`` as requested."""
    spec = call.spec
    return [*tensor_fields(q, k, "seq_local"), flag_field("causal", spec.causal),
            choice_field("sharding", spec.sharding, SHARDINGS), choice_field("comm", comm, COMMS),
            scale_field(spec.scale), flag_field("key_padding_mask", call.masked, ("None", "a mask"))]


def _empty_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The ``[0, seq_local, heads_q, head_dim]`` output of an empty batch, in the autograd graph of
    q, k and v (whose gradients are then empty too); nothing moves."""
    return q + (k.sum() + v.sum()).to(q.dtype)  # sums over no element: 0


@dataclass(frozen=True)
class _Run:
    """A call ready to run: its checked spec, the channel its K/V travel on and the gathered key masks."""

    call: _Call
    channel: P2PRing | GatheredKV
    key_masks: torch.Tensor | None


def _start(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None, *, causal: bool,
           softmax_scale: float | None, sharding: str, comm: str, backend: str,
           key_padding_mask: torch.Tensor | None, check_consistency: bool) -> _Run | None:
    """Checks and handshake of a ``ring_attention`` call (raising on every rank alike), then its
    channel and gathered key masks; None for an empty batch (nothing moves)."""
    rank, size = group_rank_size(group)
    call: _Call | None = None
    error: Exception | None = None
    try:
        call = _prepare(q, k, v, rank, size, causal=causal, softmax_scale=softmax_scale, sharding=sharding,
                        comm=comm, backend=backend, key_padding_mask=key_padding_mask)
    except Exception as err:  # raised below, once the other ranks know (they must not wait for this one)
        error = err
    if check_consistency and size > 1:
        agree("ring_attention", None if call is None else _fields(q, k, call, comm), group, size, q)
    if call is None:
        assert error is not None
        raise error
    if q.shape[0] == 0:
        return None
    channel = P2PRing(group, rank, size) if call.comm == "p2p" else GatheredKV(group, rank, size)
    key_masks = None
    if key_padding_mask is not None:
        key_masks = all_gather_stacked(key_padding_mask.to(torch.uint8), group, size).bool()
    return _Run(call, channel, key_masks)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                   causal: bool = False, softmax_scale: float | None = None, sharding: str = "zigzag",
                   comm: str = "p2p", backend: str = "auto", key_padding_mask: torch.Tensor | None = None,
                   check_consistency: bool = True) -> torch.Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Args:
        q: ``[batch, seq_local, heads_q, head_dim]``, this rank's queries.
        k, v: ``[batch, seq_local, heads_kv, head_dim]``; ``heads_q % heads_kv == 0`` (GQA/MQA).
        group: the context-parallel group; its ranks in group order form the ring. None = world
            (or a single process when torch.distributed is not initialised). ValueError on a
            process that is not a member.
        causal: causal mask on *global* positions.
        softmax_scale: defaults to ``1/sqrt(head_dim)``.
        sharding: ``"zigzag"`` (rank r holds chunks r and 2P-1-r of 2P; Megatron's split) or
            ``"contiguous"`` (chunk r of P). See Note [Zigzag sharding].
        comm: ``"p2p"`` (the ring), ``"all_gather"`` (the baseline) or ``"auto"`` (chosen per call from
            the shapes and a cost model: Note [When does the ring beat all-gather?] in auto_comm.py).
        backend: local block kernel, ``"auto"``, ``"math"``, ``"sdpa"`` or ``"flash_attn"`` (see block.py).
        key_padding_mask: None, or bool ``[batch, seq_local]`` sharded like k (True = a real token,
            False = padding that no query may see), given on every rank of the group or on none.
            The masks are all-gathered once per call (one byte per token); a query that sees no
            key gets a zero output. With a mask, ``auto`` uses the CPU ``sdpa`` kernel or ``math``.
        check_consistency: first check, with one small all-gather, that every rank passed the same
            shapes, dtype, device type, causal, sharding, comm, scale and mask presence, and raise
            ValueError on every rank naming what differs (or which rank rejected its inputs):
            Note [Cross-rank handshake] in handshake.py. Must be the same on every rank; with
            False, a rank whose input differs or is rejected aborts or hangs the others.

    Returns:
        ``[batch, seq_local, heads_q, head_dim]`` in q's dtype; differentiable w.r.t. q, k, v. An
        empty batch (batch 0) gives an empty result; ``seq_local``, heads or ``head_dim`` of 0 are
        a ValueError.
    """
    options = dict(causal=causal, softmax_scale=softmax_scale, sharding=sharding, comm=comm, backend=backend,
                   check_consistency=check_consistency)
    if torch.compiler.is_compiling():  # one opaque custom op: Note [torch.compile] in ops.py
        through_op = call_op("ring_attention", (q, k, v), group, {"key_padding_mask": key_padding_mask}, options)
        if through_op is not None:
            return through_op[0]
    run = _start(q, k, v, group, key_padding_mask=key_padding_mask, **options)
    if run is None:
        return _empty_batch(q, k, v)
    out = _RingAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), run.channel, run.call.spec,
                               run.key_masks)
    return out.transpose(1, 2)
