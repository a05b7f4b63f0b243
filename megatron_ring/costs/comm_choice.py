"""Choose the CP communication (``"p2p"``, ``"all_gather"``, ``"a2a"``, ``"a2a+p2p"``) from a cost model, for
``comm="auto"``, and the relay's pieces per hop, for every ring call (Note [Pieces per hop]).

Arithmetic on numbers, no torch: :func:`choose_comm` sees only shapes, the ring size and a :class:`CommCosts`
(effective FLOP/s, link bandwidths, fixed latencies), so it is the same on every rank and cheap enough to run on
every call. Bytes come from traffic.py; a call given no costs uses those of its device's shipped hardware profile
(:data:`DEFAULT_PROFILES`, ``megatron_ring/profiles``), derived by :func:`profile_costs` exactly as the planner
derives them.

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

    T_p2p = t_comp + (P - 1) * max(t_comp, t_comm) + (P + (g - 1) * (P - 1)) * o
    T_ag  = o_ag + (P - 1) * t_comm * W / W_ag + P * t_comp + o

(``g``: the relay's head groups per block, Note [Pieces per hop]: each extra group is one more message per step,
Note [Forward memory] in attention/relay.py.) Both move the same bytes; the ring hides them behind compute,
all-gather pays them up front but pays the fixed costs once instead of P times. Without fixed costs
``T_p2p <= T_ag`` always, so the ring wins whenever ``c >= c*`` (all communication hidden) and all-gather only wins
when the local chunk is so short that per-step latency dominates. The rule is therefore:

1. ``P == 1``: ``"p2p"`` (no communication either way);
2. the gathered K/V (``P`` times the local K/V) exceeds ``memory_budget_bytes``: ``"p2p"``;
3. otherwise the smallest predicted time among the comms the call's groups can run; ties go to
   ``"p2p"``, then ``"a2a+p2p"``, ``"a2a"``, ``"all_gather"``.

The rule only looks at the forward pass; the backward of the same call uses the same choice.

Note [All-to-all in the cost model]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``a2a`` (Ulysses, alltoall.py) moves q, k, v to heads and the output back: per rank
``X = B*c*d*s*(2H + 2H')`` bytes with ``H' = lcm(H_kv, A)`` K/V heads after replication, of which
the share ``(A-1)/A`` leaves the rank, none of it hidden behind compute, then computes the whole
local attention (``P * t_comp``): ``T_a2a = 2*o_ag + (A-1)/A * X / W_a2a + P * t_comp + o``. It
needs ``H % P == 0`` (infinite time otherwise), pays two collective latencies instead of P step
latencies, and its bytes do not grow with P, so it wins at short L/P or many heads; the ring wins
when its transfers hide behind compute (``c >= c*``) and past the cap ``P <= H``.

``a2a+p2p`` with a2a groups of A (one node) and a ring of ``R = P/A`` across them: the all-to-all
above within the node, then a ring whose steps compute ``A * t_comp`` (A times the tokens on 1/A
of the heads) and send ``2*B*c*H'*d*s`` (the same K/V bytes as a p2p step when ``H' = H_kv``) over
the inter-node link ``W_inter``, so the ring hides A times more communication than the flat ring
across nodes. Nodes enter through ``ranks_per_node`` (CP ranks per node) and ``W_inter``: a
flat ring or all-gather that spans nodes runs at ``W_inter``; a flat all-to-all sends the share
``(P - n)/P`` of its bytes across nodes.

Note [Pieces per hop]
~~~~~~~~~~~~~~~~~~~~~
The relay's forward can move each K/V block in ``g`` head groups, one ring per group (Note [Forward memory] in
attention/relay.py): its two K/V buffers shrink to ``1/g`` of a block (a forward call holds about ``X + 6X/g`` for a
local q of ``X`` with ``H_kv = H``: 7X whole, 4X in halves), and it sends ``g * (P - 1)`` messages instead of
``P - 1``. The bytes are the same, so the trade is ``(g - 1) * (P - 1)`` extra message latencies ``o`` against buffer
memory. :func:`relay_pieces` takes the largest ``g`` (a divisor of ``H_kv``, at most :data:`MAX_RELAY_PIECES`) whose
extra latency stays within :data:`PIECES_LATENCY_SHARE` of the ring's predicted forward time at ``g = 1``::

    (g - 1) * (P - 1) * o <= share * (t_comp + (P - 1) * max(t_comp, t_comm) + P * o)

So long sequences split and short ones do not: memory where it is scarce, latency where it dominates. On the
shipped profiles (32 query and 8 K/V heads of 128, bf16, causal) an H100 ring of 8 splits from 16k tokens per rank
(a step takes about 5 ms there, a message 25 us); on the CPU profile (gloo, 200 us a message) 2 heads of 64 in fp32
split from 2k tokens per rank. Beyond 2 groups the buffers are no longer the largest term and each kernel call gets
fewer heads (on a GPU, fewer thread blocks), a cost the model does not see, hence the cap. :data:`PIECES` set to an
int overrides the rule (``gcd(PIECES, H_kv)`` groups). ``predict_times`` (so ``comm="auto"`` and the planner) counts
the messages of the chosen ``g``; the handshake compares each rank's ``g`` (an override set on one rank only is an
error on every rank, not relays that wait on each other).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from megatron_ring.costs import traffic
from megatron_ring.costs.comm_names import FLAT_COMMS, TIE_ORDER, Comm


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

    Build one from a hardware profile's numbers with :func:`profile_costs` (the planner's
    ``HardwareProfile.comm_costs``); :data:`DEFAULT_COSTS` holds the two the ring uses when it is
    given none.
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
    alltoall_bytes_per_s: float | None = None
    """Achieved bytes/s each rank sends during an all-to-all inside a node; ``None``: ``allgather_bytes_per_s``."""
    inter_node_bytes_per_s: float | None = None
    """Achieved bytes/s per rank between nodes; ``None``: the CP group is within one node."""
    ranks_per_node: int | None = None
    """CP ranks per node (the a2a group of ``a2a+p2p``); ``None``: every CP rank is on one node."""

    def __post_init__(self) -> None:
        _positive("CommCosts.flops_per_s", self.flops_per_s)
        _positive("CommCosts.p2p_bytes_per_s", self.p2p_bytes_per_s)
        _positive("CommCosts.allgather_bytes_per_s", self.allgather_bytes_per_s)
        _positive("CommCosts.step_latency_s", self.step_latency_s, allow_zero=True)
        _positive("CommCosts.collective_latency_s", self.collective_latency_s, allow_zero=True)
        for name in ("memory_budget_bytes", "alltoall_bytes_per_s", "inter_node_bytes_per_s"):
            if getattr(self, name) is not None:
                _positive(f"CommCosts.{name}", getattr(self, name))
        if self.ranks_per_node is not None and (isinstance(self.ranks_per_node, bool)
                                                or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1):
            raise ValueError(f"CommCosts.ranks_per_node must be an int >= 1 or None, got {self.ranks_per_node!r}")

    def links(self, ranks: int) -> tuple[float, float, float]:
        """``(ring, all-gather, all-to-all)`` bytes/s of a group of ``ranks`` adjacent CP ranks: the
        inter-node link when the group spans nodes (the all-to-all is then split by share, see
        :meth:`alltoall_s`)."""
        a2a = self.alltoall_bytes_per_s or self.allgather_bytes_per_s
        if self._spans(ranks):
            inter = self.inter_node_bytes_per_s or self.p2p_bytes_per_s
            return inter, inter, a2a
        return self.p2p_bytes_per_s, self.allgather_bytes_per_s, a2a

    def _spans(self, ranks: int) -> bool:
        return self.ranks_per_node is not None and ranks > self.ranks_per_node

    def alltoall_s(self, nbytes: float, ranks: int) -> float:
        """Time to send the ``(ranks-1)/ranks`` share of ``nbytes`` in one all-to-all over ``ranks`` adjacent ranks."""
        if ranks == 1:
            return 0.0
        _, _, a2a = self.links(ranks)
        local = min(ranks, self.ranks_per_node or ranks)
        inter = self.inter_node_bytes_per_s or self.p2p_bytes_per_s
        return self.collective_latency_s + nbytes / ranks * ((local - 1) / a2a + (ranks - local) / inter)


PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles"
"""The shipped hardware profiles, ``megatron_ring/profiles/*.json`` (package data; the planner reads them too)."""
DEFAULT_PROFILES: dict[str, tuple[str, str, int]] = {"cuda": ("h100-sxm", "bf16", 1), "cpu": ("cpu-gloo", "fp32", 2)}
"""Device type -> (shipped profile, dtype, ranks sharing the machine) of the costs ``comm="auto"`` uses when
given none: an H100 SXM node in bf16 (NVLink); one CPU core per rank, fp32, gloo on loopback."""


def achieved_flops(profile: Mapping[str, Any], dtype: str, *, kind: str = "attention", ranks: int = 1) -> float:
    """Achieved FLOP/s of one rank for ``kind`` ("matmul" or "attention") when ``ranks`` ranks run at once,
    from a hardware profile's numbers (the fields of the planner's ``HardwareProfile``).

    On GPU profiles each rank owns a device. On CPU profiles the ``cpu_cores`` are shared: a rank
    gets ``cpu_cores / ranks`` cores (at most all of them).
    """
    peak = profile["peak_flops"]
    if dtype not in peak:
        raise ValueError(f"dtype {dtype!r} has no peak_flops in profile {profile['name']!r}; allowed: {sorted(peak)}")
    if kind not in ("matmul", "attention"):
        raise ValueError(f"kind must be 'matmul' or 'attention', got {kind!r}")
    cores = profile.get("cpu_cores")
    share = 1.0 if cores is None else cores / max(1, ranks)
    return peak[dtype] * profile[f"{kind}_efficiency"] * share


def link_bytes_per_s(profile: Mapping[str, Any], *, cross_node: bool) -> float:
    """Achieved bytes/s per direction of one device's link inside a node or between nodes."""
    peak = profile["inter_node_bytes_per_s" if cross_node else "intra_node_bytes_per_s"]
    return peak * profile["link_efficiency"]


def profile_costs(profile: Mapping[str, Any], dtype: str = "bf16", *, cross_node: bool = False,
                  ranks: int = 1) -> CommCosts:
    """The :class:`CommCosts` of a hardware profile's numbers: the one derivation, for ``comm="auto"``'s
    defaults and the planner (``HardwareProfile.comm_costs``)."""
    link = link_bytes_per_s(profile, cross_node=cross_node)
    gather, latency = profile.get("allgather_bytes_per_s"), profile.get("allgather_latency_s")
    return CommCosts(flops_per_s=achieved_flops(profile, dtype, ranks=ranks), p2p_bytes_per_s=link,
                     allgather_bytes_per_s=link if cross_node or gather is None else gather,
                     step_latency_s=profile["p2p_latency_s"],
                     collective_latency_s=profile["collective_latency_s"] if latency is None else latency)


@lru_cache(maxsize=None)
def default_costs(device_type: str) -> CommCosts:
    """The costs of :data:`DEFAULT_PROFILES` for ``device_type`` (CUDA, else CPU), read from the shipped JSON once."""
    name, dtype, ranks = DEFAULT_PROFILES["cuda" if device_type == "cuda" else "cpu"]
    profile = json.loads((PROFILE_DIR / f"{name}.json").read_text())
    return profile_costs(profile, dtype, ranks=ranks)


class _DefaultCosts(Mapping[str, CommCosts]):
    """:data:`DEFAULT_COSTS`: :func:`default_costs` of each key of :data:`DEFAULT_PROFILES`, read on first use."""

    def __getitem__(self, device_type: str) -> CommCosts:
        if device_type not in DEFAULT_PROFILES:
            raise KeyError(device_type)
        return default_costs(device_type)

    def __iter__(self) -> Iterator[str]:
        return iter(DEFAULT_PROFILES)

    def __len__(self) -> int:
        return len(DEFAULT_PROFILES)


DEFAULT_COSTS: Mapping[str, CommCosts] = _DefaultCosts()
"""Costs used by ``comm="auto"`` when the caller gives none, keyed by device type (``"cuda"``, ``"cpu"``)."""


def work_fraction(causal: bool) -> float:
    """``alpha``: the share of a full Q-block x K/V-block product a causal ring step computes on average."""
    return 0.5 if causal else 1.0


def attention_flops(*, batch: int, q_len: int, k_len: int, heads: int, head_dim: int, causal: bool) -> float:
    """FLOPs of ``q_len`` queries against ``k_len`` keys on ``heads`` heads (two matmuls; ``alpha`` of them causal)."""
    return work_fraction(causal) * 4.0 * batch * q_len * k_len * heads * head_dim


BWD_COMPUTE_FACTOR = 2.5
"""Backward attention FLOPs / forward attention FLOPs (5 matmuls against 2, scores recomputed)."""


def ring_step_s(costs: CommCosts, *, seq_local: int, cp_size: int, batch: int, heads_q: int, heads_kv: int,
                head_dim: int, causal: bool, element_size: int) -> tuple[float, float]:
    """``(t_comp, t_comm)`` of one ring step over ``cp_size`` ranks: a Q block against a K/V block, and one
    K/V block (:func:`~megatron_ring.costs.traffic.kv_block_bytes`) sent on the ring's slowest link."""
    flops = attention_flops(batch=batch, q_len=seq_local, k_len=seq_local, heads=heads_q, head_dim=head_dim,
                            causal=causal)
    kv = traffic.kv_block_bytes(batch=batch, seq_local=seq_local, heads_kv=heads_kv, head_dim=head_dim,
                                element_size=element_size)
    return flops / costs.flops_per_s, kv / costs.links(cp_size)[0]


PIECES: int | None = None
"""The override of the relay's head groups per forward hop: ``None``, :func:`relay_pieces` chooses them per call
(Note [Pieces per hop]); an int >= 1 sets them for every call that follows (``gcd(PIECES, heads_kv)`` groups: 1,
whole blocks and the fewest messages; more, smaller buffers and one more message per group and hop). Read at every
call: ``megatron_ring.costs.comm_choice.PIECES = 1``."""
MAX_RELAY_PIECES = 2
"""The most head groups :func:`relay_pieces` splits a relay's forward block into (Note [Pieces per hop])."""
PIECES_LATENCY_SHARE = 0.02
"""The share of the ring's predicted forward time the extra messages of more pieces may cost (Note [Pieces per hop])."""


def relay_pieces(*, seq_local: int, cp_size: int, batch: int, heads_q: int, heads_kv: int, head_dim: int,
                 causal: bool, element_size: int, costs: CommCosts, override: int | None = None,
                 a2a_size: int = 1) -> int:
    """The relay's head groups per forward hop of a call over ``cp_size`` ranks holding ``seq_local`` tokens each: for
    ``p2p`` its ring; with ``a2a_size`` > 1 the ring an all-to-all comm runs over ``cp_size / a2a_size`` ranks, on A
    times the tokens and 1/A of the heads (``lcm(heads_kv, A) / A`` K/V heads). ``gcd(override, ring K/V heads)`` when
    ``override`` (:data:`PIECES`) is set, else the rule of Note [Pieces per hop]. ValueError naming ``PIECES`` for an
    override that is not an int >= 1."""
    a = a2a_size  # the ring's shape: A times the tokens on 1/A of the heads, over cp_size / A ranks
    seq_local, cp_size, heads_q = a * seq_local, cp_size // a, heads_q // a
    heads_kv = traffic.kv_heads_sent(heads_kv, a) // a
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, int) or override < 1:
            raise ValueError(f"megatron_ring.costs.comm_choice.PIECES must be an int >= 1 or None (the cost model "
                             f"chooses), got {override!r}")
        return math.gcd(override, heads_kv)
    if cp_size == 1:
        return 1
    t_comp, t_comm = ring_step_s(costs, seq_local=seq_local, cp_size=cp_size, batch=batch, heads_q=heads_q,
                                 heads_kv=heads_kv, head_dim=head_dim, causal=causal, element_size=element_size)
    whole = t_comp + (cp_size - 1) * max(t_comp, t_comm) + cp_size * costs.step_latency_s
    return max(g for g in range(1, min(MAX_RELAY_PIECES, heads_kv) + 1) if heads_kv % g == 0
               and (g - 1) * (cp_size - 1) * costs.step_latency_s <= PIECES_LATENCY_SHARE * whole)


@lru_cache(maxsize=1024)
def relay_pieces_for(seq_local: int, cp_size: int, batch: int, heads_q: int, heads_kv: int, head_dim: int,
                     causal: bool, element_size: int, device_type: str, a2a_size: int, override: int | None) -> int:
    """:func:`relay_pieces` of one ring call on ``device_type``'s default costs (:func:`default_costs`), cached per
    shape: what ``ring_attention`` runs on every call."""
    return relay_pieces(seq_local=seq_local, cp_size=cp_size, batch=batch, heads_q=heads_q, heads_kv=heads_kv,
                        head_dim=head_dim, causal=causal, element_size=element_size,
                        costs=default_costs(device_type), override=override, a2a_size=a2a_size)


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
    times: dict[str, float] = field(default_factory=dict)
    """Predicted forward time of every comm (``inf``: it cannot run this call)."""


def _check_heads(heads_q: int, heads_kv: int) -> None:
    for name, value in (("heads_q", heads_q), ("heads_kv", heads_kv)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if heads_q % heads_kv:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})")


def predict_times(*, seq_local: int, cp_size: int, batch: int, heads_q: int, heads_kv: int, head_dim: int,
                  causal: bool, element_size: int, costs: CommCosts, a2a_size: int | None = None) -> dict[str, float]:
    """Predicted forward time (s) of one attention call for each comm: ``{"p2p", "all_gather", "a2a", "a2a+p2p"}``.

    ``seq_local`` is the number of tokens this rank holds (``L/P``); ``a2a_size`` the a2a group of
    ``a2a+p2p`` (default ``costs.ranks_per_node``, else ``cp_size``); a comm that cannot run the
    call (heads not divisible) gets ``inf``. See the module Notes.
    """
    for name, value in (("seq_local", seq_local), ("cp_size", cp_size), ("batch", batch), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    _check_heads(heads_q, heads_kv)
    _positive("element_size", element_size)
    t_comp, t_comm = ring_step_s(costs, seq_local=seq_local, cp_size=cp_size, batch=batch, heads_q=heads_q,
                                 heads_kv=heads_kv, head_dim=head_dim, causal=causal, element_size=element_size)
    steps = cp_size - 1
    pieces = relay_pieces(seq_local=seq_local, cp_size=cp_size, batch=batch, heads_q=heads_q, heads_kv=heads_kv,
                          head_dim=head_dim, causal=causal, element_size=element_size, costs=costs, override=PIECES)
    messages = traffic.p2p_forward_messages(cp_size, pieces)
    p2p = t_comp + steps * max(t_comp, t_comm) + (1 + messages) * costs.step_latency_s
    gathered = traffic.all_gather_bytes(batch=batch, seq_local=seq_local, heads_kv=heads_kv, head_dim=head_dim,
                                        element_size=element_size, cp_size=cp_size)
    all_gather = (0.0 if steps == 0 else costs.collective_latency_s + gathered / costs.links(cp_size)[1]) \
        + cp_size * t_comp + costs.step_latency_s
    inner = a2a_size or min(cp_size, costs.ranks_per_node or cp_size)
    shape = dict(batch=batch, seq_local=seq_local, head_dim=head_dim, element_size=element_size)
    return {"p2p": p2p, "all_gather": all_gather,
            "a2a": _a2a_time(t_comp, cp_size, 1, shape, heads_q, heads_kv, causal, costs),
            "a2a+p2p": _a2a_time(t_comp, inner, cp_size // inner if cp_size % inner == 0 else 0, shape, heads_q,
                                 heads_kv, causal, costs)}


def _a2a_time(t_comp: float, a2a: int, ring: int, shape: dict[str, int], heads_q: int, heads_kv: int, causal: bool,
              costs: CommCosts) -> float:
    """Forward time of ``a2a`` (``ring`` 1) or ``a2a+p2p`` (Note [All-to-all in the cost model]); ``inf`` if it
    cannot run. ``shape``: batch, seq_local, head_dim, element_size."""
    if ring < 1 or heads_q % a2a:
        return math.inf
    h_kv = traffic.kv_heads_sent(heads_kv, a2a)
    moved = 2 * costs.alltoall_s(traffic.alltoall_payload(**shape, heads_q=heads_q, heads_kv=h_kv), a2a)
    step_comp = a2a * t_comp
    step_comm = traffic.kv_block_bytes(**shape, heads_kv=h_kv) / costs.links(a2a * ring)[0]
    pieces = relay_pieces(**shape, cp_size=a2a * ring, heads_q=heads_q, heads_kv=heads_kv, causal=causal, costs=costs,
                          override=PIECES, a2a_size=a2a)
    messages = traffic.p2p_forward_messages(ring, pieces)
    return moved + step_comp + (ring - 1) * max(step_comp, step_comm) + (1 + messages) * costs.step_latency_s


def choose_comm(*, seq_local: int, cp_size: int, batch: int, heads_q: int, heads_kv: int, head_dim: int,
                causal: bool, element_size: int, costs: CommCosts, candidates: Sequence[str] = TIE_ORDER,
                a2a_size: int | None = None) -> CommChoice:
    """Pick the fastest of ``candidates`` for one call by the rule of the module Note (``a2a+p2p`` only
    counts with ``a2a_size`` or ``costs.ranks_per_node``)."""
    times = predict_times(seq_local=seq_local, cp_size=cp_size, batch=batch, heads_q=heads_q, heads_kv=heads_kv,
                          head_dim=head_dim, causal=causal, element_size=element_size, costs=costs, a2a_size=a2a_size)
    c_star = crossover_tokens(costs, heads_q=heads_q, heads_kv=heads_kv, causal=causal, element_size=element_size)

    def pick(comm: str, reason: str) -> CommChoice:
        return CommChoice(comm, reason, c_star, times["p2p"], times["all_gather"], times)  # type: ignore[arg-type]

    if cp_size == 1:
        return pick("p2p", "cp_size == 1: no communication")
    allowed = [c for c in TIE_ORDER if c in candidates and not (c == "a2a+p2p" and a2a_size is None
                                                                 and costs.ranks_per_node is None)]
    note = ""
    gathered_bytes = cp_size * traffic.kv_block_bytes(batch=batch, seq_local=seq_local, heads_kv=heads_kv,
                                                      head_dim=head_dim, element_size=element_size)
    if costs.memory_budget_bytes is not None and gathered_bytes > costs.memory_budget_bytes and "all_gather" in allowed:
        allowed.remove("all_gather")
        note = f"; all_gather excluded: gathered K/V {gathered_bytes:.3g} B exceeds the memory budget " \
               f"{costs.memory_budget_bytes:.3g} B"
    best = min(allowed or ["p2p"], key=lambda c: times[c])  # min keeps the first of equal times
    others = ", ".join(f"{c} {times[c]:.3g} s" for c in allowed if c != best)
    if best == "all_gather":
        why = f"L/P = {seq_local} < c* = {c_star:.0f}: per-step latency dominates"
    else:
        why = f"L/P = {seq_local} {'>=' if seq_local >= c_star else '<'} c* = {c_star:.0f}"
    return pick(best, f"{why}: {best} {times[best]:.3g} s <= {others or 'no other candidate'}{note}")


def choose_comm_for_shapes(q_shape: tuple[int, ...], kv_shape: tuple[int, ...], cp_size: int, *, causal: bool,
                           element_size: int, device_type: str, costs: CommCosts | None = None,
                           candidates: Sequence[str] = FLAT_COMMS,
                           a2a_size: int | None = None) -> Comm:
    """``comm="auto"`` for ``ring_attention``: q ``[b, s_local, h_q, d]``, k/v ``[b, s_local, h_kv, d]``.

    ``costs`` defaults to ``DEFAULT_COSTS["cuda"]`` on CUDA devices and ``DEFAULT_COSTS["cpu"]`` otherwise.
    """
    if len(q_shape) != 4 or len(kv_shape) != 4:
        raise ValueError(f"q and k/v must be [batch, seq_local, heads, head_dim], got {tuple(q_shape)} and "
                         f"{tuple(kv_shape)}")
    batch, seq_local, heads_q, head_dim = (int(x) for x in q_shape)
    costs = costs or default_costs(device_type)
    return choose_comm(seq_local=seq_local, cp_size=cp_size, batch=batch, heads_q=heads_q,
                       heads_kv=int(kv_shape[2]), head_dim=head_dim, causal=causal, element_size=element_size,
                       costs=costs, candidates=candidates, a2a_size=a2a_size).comm
