"""The cost of dilated attention (LongNet) per rank, counted from its schedule: FLOPs and bytes per
ring step, and a predicted time on a hardware profile (the planner's model of the pattern).

The dilated schedule (attention/dilated_schedule.py) is pure, so nothing is estimated: for each
(pair, phase) piece, ``plans[src]`` give the exact query x key products of every step and
``send_rows[t]`` the exact compact rows sent (Note [Dilated attention as one ring call]). Per step
``t`` a rank computes on block ``rank - t`` while the next message is in flight, so step ``t``
takes ``max(compute_t, comm_t)`` plus the step latency when it moves anything; ``all_gather``
moves every block whole, as the plain all-gather does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_ring.costs.comm_choice import BWD_COMPUTE_FACTOR, CommCosts
from megatron_ring.attention.dilated import check_dilation
from megatron_ring.attention.dilated_schedule import dilated_schedule_for
from megatron_ring.costs.traffic import GRAD_ELEMENT_SIZE
from megatron_ring.perf.planner.hardware import DTYPE_BYTES


@dataclass(frozen=True)
class DilatedSteps:
    """One rank's work per ring step ``t`` (``flops[t]`` forward, ``sent[t]`` K/V elements it sends
    at step t, ``received[t]`` those it receives), for batch 1 and head_dim 1 (scale by both)."""

    flops: tuple[float, ...]
    sent: tuple[int, ...]
    received: tuple[int, ...]


def dilated_steps(rank: int, size: int, seq: int, heads_q: int, heads_kv: int, pairs: Any, *, causal: bool,
                  sharding: str = "zigzag") -> DilatedSteps:
    """The per-step work of ``rank`` in a dilated call over ``size`` ranks (``seq`` global tokens)."""
    checked = check_dilation(pairs, heads_q, {})
    pieces = dilated_schedule_for(rank, size, seq // size, heads_q, heads_kv, checked, causal=causal,
                                  sharding=sharding)
    flops, sent, received = [0.0] * size, [0] * size, [0] * size
    for piece in pieces:
        heads, kv_heads = piece.q.stop - piece.q.start, piece.kv.stop - piece.kv.start
        for t in range(size):
            for plan in piece.schedule.plans[(rank - t) % size]:
                nq, nk = plan.q.stop - plan.q.start, plan.k.stop - plan.k.start
                flops[t] += 4.0 * heads * (nq * (nq + 1) / 2 if plan.causal else nq * nk)
            if t:
                for rows, total in ((piece.schedule.send_rows[t], sent), (piece.schedule.recv_rows[t], received)):
                    total[t] += 0 if rows is None else 2 * kv_heads * (rows.stop - rows.start)
    return DilatedSteps(tuple(flops), tuple(sent), tuple(received))


def predict_dilated_point(point: dict[str, Any], costs: CommCosts) -> dict[str, float]:
    """Predicted time (s, the busiest rank) and bytes sent by the busiest rank of one ``bench
    attention --dilation`` point with one rank's ``costs``."""
    impl, size, seq = point["impl"], int(point["P"]), int(point["L"])
    ranks = 1 if impl == "single" else size
    e, scale = DTYPE_BYTES[point.get("dtype", "fp32")], int(point["batch"]) * int(point["head_dim"])
    backward = point["mode"] == "fwd_bwd"
    times, sent = [], []
    for rank in range(ranks):
        steps = dilated_steps(rank, ranks, seq, int(point["heads"]), int(point["heads_kv"]), point["dilation"],
                              causal=bool(point["causal"]))
        if impl == "all_gather":
            moved = [0] + [2 * int(point["heads_kv"]) * (seq // ranks)] * (ranks - 1)
        else:
            moved = [max(s, r) for s, r in zip(steps.sent, steps.received)]
        passes = ((1.0, e),) + (((BWD_COMPUTE_FACTOR, e + GRAD_ELEMENT_SIZE),) if backward else ())  # K/V, dK/dV
        time = 0.0
        for factor, bytes_per in passes:
            for flops, elems in zip(steps.flops, moved):
                comm = elems * scale * bytes_per / costs.p2p_bytes_per_s
                time += max(flops * scale * factor / costs.flops_per_s, comm) + (costs.step_latency_s if elems else 0.0)
        times.append(time)
        if impl == "all_gather":  # counted as gather.py does: the ring's K/V volume, P reductions of fp32 dK/dV
            block = 2 * int(point["heads_kv"]) * (seq // ranks)
            kv_out, grads_out = (ranks - 1) * block, ranks * block if ranks > 1 else 0
        else:
            kv_out, grads_out = sum(steps.sent), sum(steps.received)
        sent.append(scale * (kv_out * e * (2 if backward else 1) + (grads_out * GRAD_ELEMENT_SIZE if backward else 0)))
    return {"time_s": max(times), "bytes_sent_max": float(max(sent))}
