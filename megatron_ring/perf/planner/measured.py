"""The planner against measured attention points: predicted time of a ``bench attention`` point and the comparison."""
from __future__ import annotations

from typing import Any

from megatron_ring.costs.comm_choice import BWD_COMPUTE_FACTOR, predict_times, ring_step_s
from megatron_ring.attention.comms import A2A_COMMS
from megatron_ring.costs.traffic import GRAD_ELEMENT_SIZE, kv_block_bytes
from megatron_ring.perf.planner.dilated_cost import predict_dilated_point
from megatron_ring.perf.planner.hardware import DTYPE_BYTES, HardwareProfile

def predict_attention_point(point: dict[str, Any], hw: HardwareProfile) -> dict[str, float]:
    """Predicted time (s) of one bench point (keys as written by :mod:`megatron_ring.perf.bench.attention`) on ``hw``.

    Forward uses :func:`~megatron_ring.costs.comm_choice.predict_times`; the backward adds
    ``BWD_COMPUTE_FACTOR`` x the compute and, for p2p, a second K/V rotation plus the fp32
    gradient accumulator (the ring's backward, see ring.py). A dilated point (``dilation``) is
    counted from its schedule (dilated_cost.py).
    """
    p, seq = int(point["P"]), int(point["L"])
    s = DTYPE_BYTES[point.get("dtype", "fp32")]
    impl = point["impl"]
    cp = 1 if impl == "single" else p
    ranks = cp
    if hw.cpu_cores and point.get("threads"):  # a rank gets min(threads, cores / ranks) cores
        ranks = max(cp, hw.cpu_cores // int(point["threads"]))
    costs = hw.comm_costs(point.get("dtype", "fp32"), ranks=ranks)
    if point.get("dilation"):
        return predict_dilated_point(point, costs)
    shape = dict(seq_local=seq // cp, cp_size=cp, batch=int(point["batch"]), heads_q=int(point["heads"]),
                 heads_kv=int(point["heads_kv"]), head_dim=int(point["head_dim"]), causal=bool(point["causal"]),
                 element_size=s)
    comm = "all_gather" if impl == "all_gather" else "p2p"
    fwd = predict_times(**shape, costs=costs)[comm]
    if point["mode"] == "fwd":
        return {"time_s": fwd}
    step_comp = ring_step_s(costs, **shape)[0] * BWD_COMPUTE_FACTOR
    block = {k: shape[k] for k in ("batch", "seq_local", "heads_kv", "head_dim")}
    step_comm = (kv_block_bytes(**block, element_size=s) + kv_block_bytes(**block, element_size=GRAD_ELEMENT_SIZE)) \
        / costs.p2p_bytes_per_s
    bwd = cp * step_comp if cp == 1 else step_comp + (cp - 1) * max(step_comp, step_comm) + \
        cp * costs.step_latency_s + step_comm
    return {"time_s": fwd + bwd}


def compare_measured(bench: dict[str, Any], hw: HardwareProfile) -> list[dict[str, Any]]:
    """One row per bench point: measured median and predicted time, and their ratio."""
    rows = []
    for point in bench.get("points", []):
        if point.get("impl") in ("ulysses", *A2A_COMMS) or point.get("median_s") is None:  # ring model only
            continue
        predicted = predict_attention_point(point, hw)["time_s"]
        rows.append({k: point[k] for k in ("impl", "mode", "causal", "L", "P", "dtype")} |
                    {"measured_s": point["median_s"], "predicted_s": predicted,
                     "measured_over_predicted": point["median_s"] / predicted})
    return rows
