"""Bytes one rank sends for one attention call, for each comm: the one place these formulas live.

Pure Python, no torch. ``comm="auto"`` (comm_choice.py), the planner and the benchmarks all count
bytes here. A rank holds ``c = L/P`` tokens (batch ``b``, ``H`` query heads, ``H_kv`` K/V heads,
head dim ``d``, ``e`` bytes per element); one K/V block is ``kv = 2*b*c*H_kv*d*e`` bytes::

    p2p         forward (P-1) * kv                 backward (P-1) * kv + P * kv_fp32
    all_gather  forward (P-1) * kv                 backward (P-1) * kv + (P-1) * kv_fp32
    a2a         (A-1)/A * b*c*d*e * (2*H + 2*H')    each way, A = P, H' = lcm(H_kv, A)
    a2a+p2p     the same all-to-all over A, plus the ring over R = P/A on H' heads

p2p's forward sends its K/V in ``g`` messages per step (the relay's head groups, Note [Forward memory] in relay.py,
``g`` chosen by Note [Pieces per hop] in comm_choice.py): the same bytes in more messages. p2p's backward rotates
K/V again and an fp32 dK/dV accumulator P times (Note [The ring] in docs/design.md); all_gather's gathers K/V again
and reduces fp32 dK/dV to each owner. The all-to-all comms: Note [All-to-all between sequence and heads] in
attention/alltoall.py.
"""
from __future__ import annotations

import math

from megatron_ring.costs.comm_names import A2A_COMMS, COMMS

GRAD_ELEMENT_SIZE = 4
"""Bytes per element of the dK/dV the backward passes send (fp32 accumulators)."""


def p2p_forward_messages(cp_size: int, pieces: int) -> int:
    """Messages (batched sends) one rank posts in a plain p2p forward whose relay moves each block in ``pieces``
    head groups (``comm_choice.relay_pieces``): ``pieces * (P - 1)``."""
    return pieces * (cp_size - 1)


def kv_heads_sent(heads_kv: int, a2a_size: int) -> int:
    """``H' = lcm(heads_kv, a2a_size)``: the K/V heads an all-to-all over ``a2a_size`` ranks carries."""
    return heads_kv * a2a_size // math.gcd(heads_kv, a2a_size)


def kv_block_bytes(*, batch: int, seq_local: int, heads_kv: int, head_dim: int, element_size: int) -> float:
    """One rank's K and V: what one ring step sends."""
    return 2.0 * batch * seq_local * heads_kv * head_dim * element_size


def alltoall_payload(*, batch: int, seq_local: int, heads_q: int, heads_kv: int, head_dim: int,
                     element_size: int) -> float:
    """q, k, v (``heads_kv`` K/V heads) and the output of one rank: what the two all-to-alls of one pass hold."""
    return batch * seq_local * head_dim * element_size * (2 * heads_q + 2 * heads_kv)


def alltoall_bytes(*, batch: int, seq_local: int, heads_q: int, heads_kv: int, head_dim: int, element_size: int,
                   a2a_size: int) -> float:
    """The share ``(A-1)/A`` of :func:`alltoall_payload` that leaves the rank, ``heads_kv`` carried as they are."""
    payload = alltoall_payload(batch=batch, seq_local=seq_local, heads_q=heads_q, heads_kv=heads_kv,
                               head_dim=head_dim, element_size=element_size)
    return (a2a_size - 1) / a2a_size * payload


def p2p_bytes(*, batch: int, seq_local: int, heads_kv: int, head_dim: int, element_size: int, cp_size: int,
              backward: bool = False) -> float:
    """The ring's forward (or backward) pass over ``cp_size`` ranks."""
    shape = dict(batch=batch, seq_local=seq_local, heads_kv=heads_kv, head_dim=head_dim)
    sent = (cp_size - 1) * kv_block_bytes(**shape, element_size=element_size)
    if backward and cp_size > 1:
        sent += cp_size * kv_block_bytes(**shape, element_size=GRAD_ELEMENT_SIZE)
    return sent


def all_gather_bytes(*, batch: int, seq_local: int, heads_kv: int, head_dim: int, element_size: int, cp_size: int,
                     backward: bool = False) -> float:
    """The all-gather baseline's forward (or backward) pass over ``cp_size`` ranks."""
    shape = dict(batch=batch, seq_local=seq_local, heads_kv=heads_kv, head_dim=head_dim)
    sent = (cp_size - 1) * kv_block_bytes(**shape, element_size=element_size)
    if backward:
        sent += (cp_size - 1) * kv_block_bytes(**shape, element_size=GRAD_ELEMENT_SIZE)
    return sent


def a2a_bytes(*, seq_local: int, batch: int, heads_q: int, heads_kv: int, head_dim: int, element_size: int,
              a2a_size: int, ring_size: int, backward: bool = False) -> float:
    """``a2a`` (``ring_size`` 1) or ``a2a+p2p``: the all-to-all over ``a2a_size`` ranks, then the ring over
    ``ring_size`` on :func:`kv_heads_sent` heads (the K/V of ``a2a_size`` times the tokens on 1/A of them)."""
    h_kv = kv_heads_sent(heads_kv, a2a_size)
    moved = alltoall_bytes(batch=batch, seq_local=seq_local, heads_q=heads_q, heads_kv=h_kv, head_dim=head_dim,
                           element_size=element_size, a2a_size=a2a_size)
    return moved + p2p_bytes(batch=batch, seq_local=seq_local, heads_kv=h_kv, head_dim=head_dim,
                             element_size=element_size, cp_size=ring_size, backward=backward)


def bytes_sent(comm: str, *, batch: int, seq_local: int, heads_q: int, heads_kv: int, head_dim: int,
               element_size: int, cp_size: int, a2a_size: int | None = None, backward: bool = False) -> float:
    """Bytes one rank sends in one attention call's forward (or backward) pass with ``comm``.

    ``a2a_size`` is the a2a group of ``a2a+p2p`` (``a2a`` uses the whole CP group).
    """
    kv = dict(batch=batch, seq_local=seq_local, heads_kv=heads_kv, head_dim=head_dim, element_size=element_size,
              cp_size=cp_size, backward=backward)
    if comm not in COMMS:
        raise ValueError(f"comm must be one of {list(COMMS)}, got {comm!r}")
    if comm in A2A_COMMS:
        a2a = cp_size if comm == "a2a" else a2a_size
        if a2a is None or cp_size % a2a:
            raise ValueError(f"a2a_size must divide cp_size ({cp_size}) for comm={comm!r}, got {a2a!r}")
        return a2a_bytes(batch=batch, seq_local=seq_local, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
                         element_size=element_size, a2a_size=a2a, ring_size=cp_size // a2a, backward=backward)
    return (p2p_bytes if comm == "p2p" else all_gather_bytes)(**kv)
