"""``ring_attention`` and ``decode_attention`` as torch.library custom ops, for torch.compile.

Note [torch.compile]
~~~~~~~~~~~~~~~~~~~~
Dynamo cannot trace the eager entry points: the handshake reads its gathered table back to Python (``.tolist()``,
data-dependent), ``batch_isend_irecv`` returns ``Work`` handles (and P2P ops are not compiled by default), and the
autograd Function carries a Python channel object, which the autograd HOP refuses ("Unsafe side effect"). Under torch
2.13 that is 8 graph breaks per ring call and no ``fullgraph=True``.

So while dynamo traces (``torch.compiler.is_compiling()``), each entry point becomes *one* opaque op:
``megatron_ring::ring_attention`` (forward; returns the output and the log-sum-exp for the backward),
``megatron_ring::ring_attention_backward`` and ``megatron_ring::decode_attention``. At run time an op runs the eager
code unchanged: the local checks, the cross-rank handshake (Note [Cross-rank handshake]: a bad input still raises the
same error on every rank, before any data moves), the p2p ring or the all-gather merge. For the trace, its fake
implementation gives the output shapes from the inputs' alone, never raising, so a rank never fails at trace time while
the others wait in a collective; any error comes from the op at run time, on every rank. The process group and keyword
arguments cross as strings (opaque.py). Consequences:

* no graph break in ``ring_attention`` / ``decode_attention``, so ``fullgraph=True`` works and a model's graph runs
  through its attention layers; the ops are opaque, so inductor fuses the code around them, not the ring's own block
  kernels (which are already the fused ``sdpa`` or flash kernels);
* the decode op's output shape does not depend on the cache shard length, so a decode step whose
  shard grows adds no guard on it (mark it dynamic, or let dynamo do so after the first change);
* the backward op repeats the call's local checks (no handshake: eager backward has none either) and, with a
  ``key_padding_mask``, all-gathers the masks again (one byte per token) instead of keeping them from the forward.

The ops call the ring's forward and backward loops (ring.py), so they exist once.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_ring.attention.block import compute_dtype
from megatron_ring.attention.call import prepare_ring
from megatron_ring.attention.decode import decode_attention
from megatron_ring.attention.opaque import read_call
from megatron_ring.attention.ring import key_masks_of, ring_backward, ring_forward, transport_for

Tensor = torch.Tensor


def _lse_shape(q: Tensor) -> tuple[int, ...]:
    """``[batch, heads_q, seq_local]`` of a 4-D q ``[batch, seq_local, heads_q, head_dim]``; ``(0,)`` for
    another q (which the op rejects at run time)."""
    return (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else (0,)


@torch.library.custom_op("megatron_ring::ring_attention", mutates_args=())
def ring_attention_op(q: Tensor, k: Tensor, v: Tensor, extras: list[Tensor | None], group: str,
                      options: str) -> tuple[Tensor, Tensor]:
    """``ring_attention`` -> (out ``[batch, seq_local, heads_q, head_dim]``, lse ``[batch, heads_q, seq_local]`` in the
    compute dtype)."""
    pg, kwargs = read_call(group, options, extras)
    call, (q, k, v, mask) = prepare_ring(q, k, v, pg, **kwargs)
    if q.shape[0] == 0:
        return q.new_zeros(q.shape), q.new_zeros(_lse_shape(q), dtype=compute_dtype(q.dtype))
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # copied heads-first by the ring (Note [Heads-first blocks])
    out, lse = ring_forward(call, transport_for(call), qh, kh, vh, key_masks_of(call, mask))
    return out.to(q.dtype).transpose(1, 2).contiguous(), lse


@ring_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, extras: list[Tensor | None], group: str, options: str) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q), dtype=compute_dtype(q.dtype))


@torch.library.custom_op("megatron_ring::ring_attention_backward", mutates_args=())
def ring_attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                               extras: list[Tensor | None], group: str,
                               options: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), each in its input's shape, dtype and ``[batch, seq_local, heads, head_dim]`` layout."""
    pg, kwargs = read_call(group, options, extras)
    call, (q, k, v, mask) = prepare_ring(q, k, v, pg, **{**kwargs, "check_consistency": False})
    if q.shape[0] == 0:
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    qh, oh, dh = (t.transpose(1, 2).contiguous() for t in (q, out, dout))
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # copied heads-first by the transport
    dq, dk, dv = ring_backward(call, transport_for(call), qh, kh, vh, oh, lse, dh, key_masks_of(call, mask))
    return dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous(), dv.transpose(1, 2).contiguous()


@ring_attention_backward_op.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, extras: list[Tensor | None],
      group: str, options: str) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, extras, group, options = inputs
    ctx.save_for_backward(q, k, v, *output, *extras)
    ctx.group, ctx.options = group, options


def _backward(ctx: Any, dout: Tensor, _dlse: Tensor) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse, *extras = ctx.saved_tensors
    dq, dk, dv = ring_attention_backward_op(dout, q, k, v, out, lse, extras, ctx.group, ctx.options)
    # the gradient of ``extras`` mirrors how autograd flattened it: a list when it holds a tensor, else one leaf
    no_grads = [None] * len(extras) if any(e is not None for e in extras) else None
    return dq, dk, dv, no_grads, None, None


ring_attention_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("megatron_ring::decode_attention", mutates_args=())
def decode_attention_op(q: Tensor, k_local: Tensor, v_local: Tensor, extras: list[Tensor | None], group: str,
                        options: str) -> Tensor:
    """``decode_attention`` -> ``[batch, q_len, heads_q, head_dim]``, identical on every rank."""
    pg, kwargs = read_call(group, options, extras)
    return decode_attention(q, k_local, v_local, pg, **kwargs).contiguous()


@decode_attention_op.register_fake
def _(q: Tensor, k_local: Tensor, v_local: Tensor, extras: list[Tensor | None], group: str, options: str) -> Tensor:
    return q.new_empty(q.shape)
