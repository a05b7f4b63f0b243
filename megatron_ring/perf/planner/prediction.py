"""What the planner says about one layout: :class:`Prediction` (times, memory, the ring step) and its findings."""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_ring.perf.planner.hardware import HardwareProfile
from megatron_ring.perf.planner.inputs import PlanInput
from megatron_ring.perf.report import fmt_bytes, fmt_time


@dataclass
class RingStep:
    """One step of the CP ring, per rank, for one prefill micro-batch and one layer."""

    tokens_per_rank: int
    compute_s: float
    comm_s: float
    crossover_tokens: float
    link: str
    comm: str
    exposed_s: float
    """Ring time of the layer beyond its compute (communication and step latency not hidden)."""
    comm_times: dict[str, float] = field(default_factory=dict)
    """Predicted attention forward time of one layer for every comm (``inf``: it cannot run);
    ``a2a+p2p`` with a2a groups of the CP ranks of one node (Note [All-to-all in the cost model])."""


@dataclass
class Memory:
    """Bytes per rank (the most loaded pipeline stage)."""

    weights: float
    kv_cache: float
    activations: float
    total: float
    usable: float
    fits: bool


@dataclass
class Prediction:
    """Everything the planner says about one layout."""

    name: str
    label: str
    layout: dict[str, int]
    hardware: str
    per_layer: dict[str, dict[str, float]]
    flops_per_token: float
    ring: RingStep | None
    memory: Memory
    prefill_s: float
    ttft_s: float
    prefill_tps: float
    tpot_s: float
    decode_tps: float
    e2e_tps: float
    roofline_prefill_tps: float
    breakdown_ms: dict[str, float]
    max_batch: int
    max_prompt_len: int
    terms_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    """``{"ttft": {term: ms}, "tpot": {term: ms}}``: the summands of TTFT and TPOT."""
    findings: list[str] = field(default_factory=list)

    def dominant(self, metric: str) -> str:
        """The largest term of ``metric`` ("ttft" or "tpot")."""
        terms = self.terms_ms[metric]
        return max(terms, key=terms.__getitem__)


def findings(p: PlanInput, pred: Prediction, hw: HardwareProfile, a2a_size: int) -> list[str]:
    """The lines that matter about ``pred``: does it fit, what fits, is the ring step compute- or
    communication-bound, a faster CP comm (``a2a_size``: the a2a group of ``a2a+p2p``), the dominant terms."""
    lay, w, mem = p.layout, p.workload, pred.memory
    out = []
    total_kv = mem.kv_cache * lay.world_size if p.model.num_kv_heads >= lay.tp else None
    aggregate = hw.memory_bytes * (1 if hw.cpu_cores else lay.world_size)
    if total_kv is not None and total_kv > aggregate:
        out.append(f"KV cache of the workload is {fmt_bytes(total_kv)} but the {lay.world_size} ranks hold "
                   f"{fmt_bytes(aggregate)} in all: it cannot fit on any layout of this size")
    if not mem.fits:
        out.append(f"does NOT fit: {fmt_bytes(mem.total)} per rank (weights {fmt_bytes(mem.weights)}, KV cache "
                   f"{fmt_bytes(mem.kv_cache)}, activations {fmt_bytes(mem.activations)}) > usable {fmt_bytes(mem.usable)}")
    else:
        out.append(f"fits: {fmt_bytes(mem.total)} of {fmt_bytes(mem.usable)} usable per rank")
    out.append(f"what fits at prompt_len={w.prompt_len}: batch <= {pred.max_batch}; "
               f"at batch={w.batch}: prompt_len <= {pred.max_prompt_len}")
    if pred.ring is not None:
        r = pred.ring
        bound = "compute-bound, communication hidden" if r.tokens_per_rank >= r.crossover_tokens else \
            "communication-bound"
        out.append(f"ring step: L/P = {r.tokens_per_rank} vs c* = {r.crossover_tokens:.0f} on the {r.link} link "
                   f"({bound}; compute {fmt_time(r.compute_s)}, K/V transfer {fmt_time(r.comm_s)} per step)")
        best = min(r.comm_times, key=r.comm_times.__getitem__)
        if best != r.comm and r.comm_times[best] < r.comm_times[r.comm]:
            out.append(f"CP comm: {best} is predicted faster than {r.comm} ({fmt_time(r.comm_times[best])} vs "
                       f"{fmt_time(r.comm_times[r.comm])} per layer forward, a2a group {a2a_size}); "
                       "--cp-comm auto picks it")
    for metric, total in (("ttft", pred.ttft_s), ("tpot", pred.tpot_s)):
        term = pred.dominant(metric)
        out.append(f"{metric.upper()} is dominated by {term} ({pred.terms_ms[metric][term] / (1e3 * total):.0%})")
    return out
