"""Choose the ring's communication (``"p2p"`` or ``"all_gather"``) from a cost model: ``comm="auto"``.

Pure Python, no torch: :func:`choose_comm` sees only shapes, the ring size and a
:class:`CommCosts` (effective FLOP/s, link bandwidths, fixed latencies), so it is the same on
every rank and cheap enough to run on every call.

Note [When does the ring beat all-gather?]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Let a rank hold ``c = L/P`` tokens of each sequence (batch ``B``, ``H`` query heads, ``H_kv``
key/value heads, head dim ``d``, ``s`` bytes per element). One ring step computes one Q block
against one K/V block and moves one K/V block::

    t_comp = alpha * 4 * B * c^2 * H * d / F        (alpha = 1/2 causal, 1 otherwise)
    t_comm = 2 * B * c * H_kv * d * s / W

They are equal at the crossover ``c* = (s/2) * (F/W) * (H_kv/H) / alpha`` — for 2-byte
elements ``c* = (F/W) * (H_kv/H) / alpha``. With ``o`` the fixed cost of one ring step (p2p
latency, kernel launch, merge) and ``o_ag`` that of one all-gather::

    T_p2p = t_comp + (P - 1) * max(t_comp, t_comm) + P * o
    T_ag  = o_ag + (P - 1) * t_comm * W / W_ag + P * t_comp + o

Both move the same bytes; the ring hides them behind compute, all-gather pays them up front but
pays the fixed costs once instead of P times. Without fixed costs ``T_p2p <= T_ag`` always, so
the ring wins whenever ``c >= c*`` (all communication hidden) and all-gather only wins when the
local chunk is so short that per-step latency dominates. The rule is therefore:

1. ``P == 1``: ``"p2p"`` (no communication either way);
2. the gathered K/V (``P`` times the local K/V) exceeds ``memory_budget_bytes``: ``"p2p"``;
3. otherwise the smaller of ``T_p2p`` and ``T_ag``; ties go to ``"p2p"`` (O(L/P) memory).

The rule only looks at the forward pass; the backward of the same call uses the same choice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Comm = Literal["p2p", "all_gather"]


def _positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class CommCosts:
    """Effective (achieved, not peak) costs of one rank, as the cost model needs them.

    Build one from a hardware profile with
    :meth:`megatron_ring.perf.hardware.HardwareProfile.comm_costs`; :data:`DEFAULT_COSTS` holds
    the two the ring uses when it is given none.
    """

    flops_per_s: float
    """Achieved attention FLOP/s of one rank in the compute dtype."""
    p2p_bytes_per_s: float
    """Achieved bytes/s of one ring send (one direction, one neighbour)."""
    allgather_bytes_per_s: float
    """Achieved bytes/s each rank receives during an all-gather (NCCL's ``algbw``)."""
    step_latency_s: float = 0.0
    """Fixed cost of one ring step: p2p latency, kernel launch, the merge."""
    collective_latency_s: float = 0.0
    """Fixed cost of one all-gather collective."""
    memory_budget_bytes: float | None = None
    """Largest gathered K/V (bytes, per rank) that all-gather may allocate; ``None``: no limit."""

    def __post_init__(self) -> None:
        _positive("CommCosts.flops_per_s", self.flops_per_s)
        _positive("CommCosts.p2p_bytes_per_s", self.p2p_bytes_per_s)
        _positive("CommCosts.allgather_bytes_per_s", self.allgather_bytes_per_s)
        _positive("CommCosts.step_latency_s", self.step_latency_s, allow_zero=True)
        _positive("CommCosts.collective_latency_s", self.collective_latency_s, allow_zero=True)
        if self.memory_budget_bytes is not None:
            _positive("CommCosts.memory_budget_bytes", self.memory_budget_bytes)


DEFAULT_COSTS: dict[str, CommCosts] = {
    # H100 SXM, bf16: 989 TFLOP/s x 0.55 attention efficiency; NVLink 450 GB/s per direction x 0.8.
    # Must equal HardwareProfile.load("h100-sxm").comm_costs() (checked by tests/unit/test_auto_comm.py).
    "cuda": CommCosts(flops_per_s=989e12 * 0.55, p2p_bytes_per_s=450e9 * 0.8, allgather_bytes_per_s=450e9 * 0.8,
                      step_latency_s=25e-6, collective_latency_s=40e-6),
    # One CPU core per rank, fp32, gloo on loopback; equals
    # HardwareProfile.load("cpu-gloo").comm_costs("fp32", ranks=2).
    "cpu": CommCosts(flops_per_s=69e9 * 0.84, p2p_bytes_per_s=1.1e9, allgather_bytes_per_s=1.1e9,
                     step_latency_s=200e-6, collective_latency_s=400e-6),
}
"""Costs used by ``comm="auto"`` when the caller gives none, keyed by device type."""


def work_fraction(causal: bool) -> float:
    """``alpha``: the share of a full Q-block x K/V-block product a causal ring step computes on average."""
    return 0.5 if causal else 1.0


def crossover_tokens(costs: CommCosts, *, heads_q: int, heads_kv: int, causal: bool, element_size: int) -> float:
    """``c*``: the local tokens per rank (``L/P``) at which one ring step's compute equals its communication."""
    _check_heads(heads_q, heads_kv)
    _positive("element_size", element_size)
    ratio = costs.flops_per_s / costs.p2p_bytes_per_s
    return (element_size / 2) * ratio * (heads_kv / heads_q) / work_fraction(causal)


@dataclass(frozen=True)
class CommChoice:
    """What :func:`choose_comm` picked, and why (for logs and the planner)."""

    comm: Comm
    reason: str
    crossover_tokens: float
    p2p_s: float
    all_gather_s: float


def _check_heads(heads_q: int, heads_kv: int) -> None:
    for name, value in (("heads_q", heads_q), ("heads_kv", heads_kv)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if heads_q % heads_kv:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})")


def predict_times(*, seq_local: int, cp_size: int, batch: int, heads_q: int, heads_kv: int, head_dim: int,
                  causal: bool, element_size: int, costs: CommCosts) -> dict[str, float]:
    """Predicted forward time (s) of one attention call for each comm: ``{"p2p": .., "all_gather": ..}``.

    ``seq_local`` is the number of tokens this rank holds (``L/P``); see the module Note.
    """
    for name, value in (("seq_local", seq_local), ("cp_size", cp_size), ("batch", batch), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    _check_heads(heads_q, heads_kv)
    _positive("element_size", element_size)
    t_comp = work_fraction(causal) * 4.0 * batch * seq_local**2 * heads_q * head_dim / costs.flops_per_s
    kv_bytes = 2.0 * batch * seq_local * heads_kv * head_dim * element_size
    t_comm = kv_bytes / costs.p2p_bytes_per_s
    steps = cp_size - 1
    p2p = t_comp + steps * max(t_comp, t_comm) + cp_size * costs.step_latency_s
    gathered = 0.0 if steps == 0 else costs.collective_latency_s + steps * kv_bytes / costs.allgather_bytes_per_s
    all_gather = gathered + cp_size * t_comp + costs.step_latency_s
    return {"p2p": p2p, "all_gather": all_gather}


def choose_comm(*, seq_local: int, cp_size: int, batch: int, heads_q: int, heads_kv: int, head_dim: int,
                causal: bool, element_size: int, costs: CommCosts) -> CommChoice:
    """Pick ``"p2p"`` or ``"all_gather"`` for one call by the rule of the module Note."""
    times = predict_times(seq_local=seq_local, cp_size=cp_size, batch=batch, heads_q=heads_q, heads_kv=heads_kv,
                          head_dim=head_dim, causal=causal, element_size=element_size, costs=costs)
    c_star = crossover_tokens(costs, heads_q=heads_q, heads_kv=heads_kv, causal=causal, element_size=element_size)

    def pick(comm: Comm, reason: str) -> CommChoice:
        return CommChoice(comm, reason, c_star, times["p2p"], times["all_gather"])

    if cp_size == 1:
        return pick("p2p", "cp_size == 1: no communication")
    gathered_bytes = 2.0 * batch * seq_local * cp_size * heads_kv * head_dim * element_size
    if costs.memory_budget_bytes is not None and gathered_bytes > costs.memory_budget_bytes:
        return pick("p2p", f"gathered K/V {gathered_bytes:.3g} B exceeds the memory budget "
                           f"{costs.memory_budget_bytes:.3g} B")
    if times["all_gather"] < times["p2p"]:
        return pick("all_gather", f"L/P = {seq_local} < c* = {c_star:.0f}: per-step latency dominates "
                                  f"(all_gather {times['all_gather']:.3g} s < p2p {times['p2p']:.3g} s)")
    where = ">=" if seq_local >= c_star else "<"
    return pick("p2p", f"L/P = {seq_local} {where} c* = {c_star:.0f}: p2p {times['p2p']:.3g} s <= "
                       f"all_gather {times['all_gather']:.3g} s")


def choose_comm_for_shapes(q_shape: tuple[int, ...], kv_shape: tuple[int, ...], cp_size: int, *, causal: bool,
                           element_size: int, device_type: str, costs: CommCosts | None = None) -> Comm:
    """``comm="auto"`` for ``ring_attention``: q ``[b, s_local, h_q, d]``, k/v ``[b, s_local, h_kv, d]``.

    ``costs`` defaults to ``DEFAULT_COSTS["cuda"]`` on CUDA devices and ``DEFAULT_COSTS["cpu"]`` otherwise.
    """
    if len(q_shape) != 4 or len(kv_shape) != 4:
        raise ValueError(f"q and k/v must be [batch, seq_local, heads, head_dim], got {tuple(q_shape)} and "
                         f"{tuple(kv_shape)}")
    batch, seq_local, heads_q, head_dim = (int(x) for x in q_shape)
    costs = costs or DEFAULT_COSTS["cuda" if device_type == "cuda" else "cpu"]
    return choose_comm(seq_local=seq_local, cp_size=cp_size, batch=batch, heads_q=heads_q,
                       heads_kv=int(kv_shape[2]), head_dim=head_dim, causal=causal, element_size=element_size,
                       costs=costs).comm
