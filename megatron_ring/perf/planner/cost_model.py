"""An analytical model of one inference job: FLOPs, bytes, ring crossover, memory per rank, TTFT/TPOT/TPS.

:class:`Planner` evaluates a :class:`~megatron_ring.perf.planner.inputs.PlanInput` on a hardware profile
(:mod:`megatron_ring.perf.planner.hardware`) into a :class:`~megatron_ring.perf.planner.prediction.Prediction`;
``megatron-ring plan`` (:mod:`megatron_ring.perf.planner.plan_cli`) is its command line.

Note [The cost model]
~~~~~~~~~~~~~~~~~~~~~
Per layer, with ``b`` sequences of ``L`` tokens (``s`` bytes per element, ``P = cp``)::

    qkv_proj   2 b L d (H + 2 H_kv) d_h          out_proj  2 b L H d_h d
    mlp        2 b L d F (2, or 3 when gated)     attention 4 b L^2 H d_h * alpha   (alpha = 1/2 causal)

Linear layers split over ``tp * cp`` ranks (TP splits weights, CP splits tokens); attention
splits the same way and runs as a ring of ``P`` steps whose per-step compute and K/V transfer
are those of :mod:`megatron_ring.costs.comm_choice` (crossover ``c*``). Each op costs
``max(FLOPs / achieved FLOP/s, bytes / achieved HBM bandwidth)``. TP adds two all-reduces of the
hidden states per layer (not overlapped), PP a send per stage boundary and a pipeline fill of
``pp - 1`` micro-batches. Prefill runs ``batch / micro_batch`` micro-batches; TTFT is the prefill
of the whole batch (static batching). Decode reads every weight and the whole KV cache once per
step: the linear layers are replicated on CP ranks (weights are not sharded by CP), the KV cache
is, and the CP partial results are merged by one small collective per layer. LM head, norms,
RoPE and embeddings are left out of the time (they are < 1 % here) but the embeddings count in
memory. Activation memory assumes a flash-style kernel (no ``L x L`` scores) and one layer live
at a time, as in inference.

Note [Model terms that follow the Megatron runner]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Checked against what ``inference/runners/gpt.py`` does (``predict.py`` evaluates its configs):

* Every term is one summand of TTFT or TPOT (``Prediction.terms_ms``), so the dominant one can
  be named. TTFT = ``(micro_batches + pp - 1)`` x (stage time + PP send) + one "step" per
  micro-batch (with pp, the runner prefills one sequence per micro-batch); TPOT = ``(dm + pp - 1)``
  x (stage time of ``b / dm`` sequences) + ``(dm + pp - 2)`` sends + one step, where a decode step
  runs ``dm = min(pp, b)`` pipelined micro-batches (1 without pp).
* Fixed host costs: ``layer_overhead_s`` per layer per pass and ``step_overhead_s`` per pass
  (embedding, final norm, LM head, sampling), both measured by ``megatron-ring calibrate`` from a
  real Megatron layer; they dominate the tiny CPU models (a d=64 layer does ~0.1 MFLOP per token
  but costs about a millisecond of Python). 0 in the bundled GPU profiles, which were not
  calibrated this way.
* "step" also holds the LM head (last token of each sequence only, as the runner computes it) and
  "step_comm" the per-pass collectives: the TP all-reduce of the vocab-parallel embedding, the
  TP all-gather of the logits, the broadcast of the new ids along PP (and along CP after prefill).
* The PP send carries the whole hidden state ``[s, b, h]`` from each TP rank (no scatter-gather
  over TP), so it is no longer divided by ``tp`` (it was).
* Decode's CP merge is one all-gather of ``(o, lse)``, ``[b, heads, 1, head_dim + 1]`` fp32 per
  rank: ``latency + (cp - 1) x bytes / bandwidth`` (it was one rank's bytes, not ``cp - 1``).
* Collectives use the profile's measured all-reduce / all-gather bandwidth and latency when it
  has them (``HardwareProfile.collective_s``), the link otherwise.
* Local attention (``cp = 1``) is not a ring step: it no longer pays ``p2p_latency_s``.
* CPU profiles: ranks share the cores and the memory bandwidth. Ranks that compute at once are
  ``world / pp`` when the stages take turns (one micro-batch), all ranks when several micro-batches
  pipeline; a rank runs ``cores // world`` torch threads (as the launch sets them), so it never
  gets more than that many cores even while the other stage waits; FLOP/s, bandwidth and host overheads are scaled by that share
  (``HardwareProfile.flops(ranks=)``, ``hbm(ranks=)``, ``host_slowdown(ranks=)``). Before, each
  rank was given the whole machine. GPU profiles are unaffected.

Not modelled: collective latency growing with the group size (the profile's latency is a
2-rank measurement when calibrated), gloo's CPU time competing with compute, and the KV-cache
append.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from megatron_ring.costs.comm_choice import CommCosts, choose_comm, crossover_tokens, predict_times, ring_step_s
from megatron_ring.costs.traffic import kv_block_bytes
from megatron_ring.perf.planner.hardware import HardwareProfile
from megatron_ring.perf.planner.inputs import PlanInput, layer_costs
from megatron_ring.perf.planner.prediction import Memory, Prediction, RingStep, findings


class Planner:
    """Evaluates :class:`PlanInput` on one :class:`HardwareProfile`."""

    def __init__(self, hw: HardwareProfile) -> None:
        self.hw = hw

    # -- topology ------------------------------------------------------------------------------
    def _cross_node(self, span: int) -> bool:
        """Whether a group of ``span`` consecutive ranks leaves one node."""
        return span > self.hw.devices_per_node

    def _link_name(self, cross: bool) -> str:
        return "inter-node" if cross else "intra-node"

    # -- pieces --------------------------------------------------------------------------------
    def _kv_heads_rank(self, p: PlanInput) -> int:
        return max(1, p.model.num_kv_heads // p.layout.tp)

    @staticmethod
    def decode_micro_batches(p: PlanInput) -> int:
        """Micro-batches of a decode step: ``pp`` with pipeline stages (the runner's Note [Pipelined
        micro-batches]), at most one per sequence; 1 without."""
        return min(p.layout.pp, p.workload.batch)

    def active_ranks(self, p: PlanInput, phase: str) -> int:
        """How many ranks share the machine in ``phase`` ("prefill" or "decode"): the ranks computing at
        once, and on CPU profiles at least ``cores / threads`` (a rank runs ``cores // world`` torch
        threads, so it never gets more cores than that); see the Note on CPU profiles."""
        lay = p.layout
        micro_batches = p.workload.batch // p.workload.micro_batch if phase == "prefill" else self.decode_micro_batches(p)
        active = lay.world_size if micro_batches > 1 else lay.world_size // lay.pp
        cores = self.hw.cpu_cores
        if cores is None:
            return active
        return max(active, math.ceil(cores / max(1, cores // lay.world_size)))

    def ring_step(self, p: PlanInput) -> RingStep:
        """The CP ring's per-step compute and communication for one micro-batch, one layer."""
        lay, m, w = p.layout, p.model, p.workload
        cross = self._cross_node(lay.tp * lay.cp)
        costs = self.node_costs(p, cross)
        heads_q, heads_kv = m.num_heads // lay.tp, self._kv_heads_rank(p)
        c = w.prompt_len // lay.cp
        shape = dict(seq_local=c, cp_size=lay.cp, batch=w.micro_batch, heads_q=heads_q, heads_kv=heads_kv,
                     head_dim=m.head_dim, causal=p.causal, element_size=p.element_size)
        comm = p.cp_comm if p.cp_comm != "auto" else choose_comm(**shape, costs=costs, a2a_size=self.a2a_size(p)).comm
        times = predict_times(**shape, costs=costs, a2a_size=self.a2a_size(p))
        step_compute, step_comm = ring_step_s(costs, **shape)
        ring_costs = replace(costs, p2p_bytes_per_s=costs.links(lay.cp)[0])  # the flat ring's slowest link
        c_star = crossover_tokens(ring_costs, heads_q=heads_q, heads_kv=heads_kv, causal=p.causal,
                                  element_size=p.element_size)
        exposed = times[comm] - lay.cp * step_compute if lay.cp > 1 else 0.0
        return RingStep(c, step_compute, step_comm if lay.cp > 1 else 0.0, c_star, self._link_name(cross), comm,
                        exposed, times)

    def node_costs(self, p: PlanInput, cross: bool) -> CommCosts:
        """The CP group's :class:`CommCosts`: intra-node links, and the inter-node link with the CP ranks
        per node when the group spans nodes (ranks order tp fastest, so a node holds
        ``devices_per_node // tp`` CP ranks)."""
        costs = self.hw.comm_costs(p.dtype, cross_node=cross, ranks=self.active_ranks(p, "prefill"))
        if not cross:
            return costs
        intra = self.hw.comm_costs(p.dtype, cross_node=False, ranks=self.active_ranks(p, "prefill"))
        return replace(intra, inter_node_bytes_per_s=costs.p2p_bytes_per_s,
                       ranks_per_node=max(1, self.hw.devices_per_node // p.layout.tp))

    def a2a_size(self, p: PlanInput) -> int:
        """The a2a group of ``a2a+p2p``: the layout's ``cp_a2a``, else the CP ranks of one node."""
        if p.layout.cp_a2a is not None:
            return p.layout.cp_a2a
        return math.gcd(p.layout.cp, max(1, self.hw.devices_per_node // p.layout.tp))

    def memory(self, p: PlanInput) -> Memory:
        """Weights, KV cache and peak prefill activations per rank; whether they fit."""
        lay, m, w, s = p.layout, p.model, p.workload, p.element_size
        layers = m.num_layers // lay.pp
        emb = m.embedding_params() if lay.pp == 1 else m.embedding_params() / (1 if m.tie_embeddings else 2)
        weights = s * (layers * m.params_per_layer() + emb) / lay.tp
        hkv = self._kv_heads_rank(p)
        kv = 2.0 * w.batch * (w.prompt_len + w.new_tokens) * layers * hkv * m.head_dim * s / lay.cp
        mb, c = w.micro_batch, w.prompt_len // lay.cp
        hq = m.num_heads // lay.tp
        kv_block = kv_block_bytes(batch=mb, seq_local=c, heads_kv=hkv, head_dim=m.head_dim, element_size=s)
        ring_buffers = kv_block * (2 if lay.cp > 1 else 1) if p.cp_comm != "all_gather" else kv_block * lay.cp
        attn_phase = mb * c * (hq + 2 * hkv) * m.head_dim * s + ring_buffers + mb * c * hq * (m.head_dim + 1) * 4
        mlp_phase = 2.0 * mb * c * (m.ffn_hidden_size // lay.tp) * s * (2 if m.gated_mlp else 1)
        acts = 2.0 * mb * c * m.hidden_size * s + max(attn_phase, mlp_phase)
        total = weights + kv + acts
        usable = self.hw.usable_memory(ranks=lay.world_size)
        return Memory(weights, kv, acts, total, usable, total <= usable)

    def _op_time(self, flops: float, nbytes: float, dtype: str, kind: str, ranks: int) -> float:
        return max(flops / self.hw.flops(dtype, kind=kind, ranks=ranks), nbytes / self.hw.hbm(ranks=ranks))

    def _step_terms(self, p: PlanInput, seqs: int, tokens: int, ranks: int, *, prefill: bool) -> tuple[float, float]:
        """(host + LM head, collectives) of one forward pass outside the layers: ``seqs`` sequences of
        ``tokens`` tokens per rank; the LM head runs on the last token of each sequence."""
        lay, m, s, hw = p.layout, p.model, p.element_size, self.hw
        vocab = m.vocab_size // lay.tp
        head = self._op_time(2.0 * seqs * m.hidden_size * vocab, vocab * m.hidden_size * s, p.dtype, "matmul", ranks)
        tp_cross = self._cross_node(lay.tp)
        comm = hw.collective_s("all_reduce", seqs * tokens * m.hidden_size * s, lay.tp, cross_node=tp_cross)
        comm += hw.collective_s("all_gather", seqs * vocab * 4, lay.tp, cross_node=tp_cross)
        for size, needed in ((lay.pp, True), (lay.cp, prefill)):
            if size > 1 and needed:  # a broadcast of the new ids: latency only
                comm += hw.collective_latency_s
        return head + hw.step_overhead_s * hw.host_slowdown(ranks=ranks), comm

    # -- the whole job -------------------------------------------------------------------------
    def predict(self, p: PlanInput) -> Prediction:
        """Times, throughput, memory and findings for one layout."""
        lay, m, w, s = p.layout, p.model, p.workload, p.element_size
        hw = self.hw
        layers = m.num_layers // lay.pp
        mb, c = w.micro_batch, w.prompt_len // lay.cp
        split = lay.tp * lay.cp
        ranks = self.active_ranks(p, "prefill")
        costs = layer_costs(m, mb, w.prompt_len, s, p.causal)
        t_lin = sum(self._op_time(costs[op]["flops"] / split, costs[op]["bytes"] / split, p.dtype, "matmul", ranks)
                    for op in ("qkv_proj", "out_proj", "mlp"))
        ring = self.ring_step(p)
        t_attn = lay.cp * ring.compute_s + ring.exposed_s
        tp_cross = self._cross_node(lay.tp)
        t_tp = 2 * hw.collective_s("all_reduce", mb * c * m.hidden_size * s, lay.tp, cross_node=tp_cross)
        t_ovh = hw.layer_overhead_s * hw.host_slowdown(ranks=ranks)
        pp_cross = self._cross_node(lay.tp * lay.cp * lay.dp)
        pp_link = hw.link_bytes_per_s(cross_node=pp_cross)
        t_send = 0.0 if lay.pp == 1 else hw.p2p_latency_s + mb * c * m.hidden_size * s / pp_link
        micro_batches = w.batch // mb
        fill = micro_batches + lay.pp - 1
        t_step, t_step_comm = self._step_terms(p, mb, c, ranks, prefill=True)
        ttft_terms = {
            "linear": fill * layers * t_lin, "attention": fill * layers * lay.cp * ring.compute_s,
            "ring_comm": fill * layers * ring.exposed_s, "tp_comm": fill * layers * t_tp, "pp_send": fill * t_send,
            "layer_overhead": fill * layers * t_ovh, "step": micro_batches * t_step,
            "step_comm": micro_batches * t_step_comm,
        }
        prefill = sum(ttft_terms.values())

        # decode: one token per sequence; with pp, `dm` micro-batches of `db` sequences pipelined
        ranks = self.active_ranks(p, "decode")
        dm = self.decode_micro_batches(p)
        db = -(-w.batch // dm)
        ctx = w.prompt_len + w.new_tokens / 2
        lin_flops = 2.0 * db * m.params_per_layer() / lay.tp
        lin_bytes = m.params_per_layer() * s / lay.tp
        t_dlin = self._op_time(lin_flops, lin_bytes, p.dtype, "matmul", ranks)
        hq, hkv = m.num_heads // lay.tp, self._kv_heads_rank(p)
        att_flops = 4.0 * db * ctx / lay.cp * hq * m.head_dim
        att_bytes = 2.0 * db * ctx / lay.cp * hkv * m.head_dim * s
        t_datt = self._op_time(att_flops, att_bytes, p.dtype, "attention", ranks)
        t_merge = hw.collective_s("all_gather", db * hq * (m.head_dim + 1) * 4, lay.cp,
                                  cross_node=self._cross_node(lay.tp * lay.cp))
        t_dtp = 2 * hw.collective_s("all_reduce", db * m.hidden_size * s, lay.tp, cross_node=tp_cross)
        t_dovh = hw.layer_overhead_s * hw.host_slowdown(ranks=ranks)
        t_dsend = 0.0 if lay.pp == 1 else hw.p2p_latency_s + db * m.hidden_size * s / pp_link
        t_dstep, t_dstep_comm = self._step_terms(p, w.batch, 1, ranks, prefill=False)
        dlayers = (dm + lay.pp - 1) * layers  # layer times on the critical path of a pipelined step
        tpot_terms = {
            "linear": dlayers * t_dlin, "attention": dlayers * t_datt, "cp_merge": dlayers * t_merge,
            "tp_comm": dlayers * t_dtp, "pp_send": (dm + lay.pp - 2) * t_dsend,
            "layer_overhead": dlayers * t_dovh, "step": t_dstep, "step_comm": t_dstep_comm,
        }
        tpot = sum(tpot_terms.values())

        replicas = lay.dp
        prompt_tokens = replicas * w.batch * w.prompt_len
        total_time = prefill + (w.new_tokens - 1) * tpot
        global_costs = layer_costs(m, 1, w.prompt_len, s, p.causal)
        flops_per_token = m.num_layers * sum(v["flops"] for v in global_costs.values()) / w.prompt_len
        peak = hw.flops(p.dtype, kind="matmul", ranks=lay.world_size) / hw.matmul_efficiency
        roofline = lay.world_size * peak / flops_per_token
        pred = Prediction(
            name=p.name, label=p.label, layout=lay.sizes(), hardware=hw.name, per_layer=costs,
            flops_per_token=flops_per_token, ring=ring if lay.cp > 1 else None, memory=self.memory(p),
            prefill_s=prefill, ttft_s=prefill, prefill_tps=prompt_tokens / prefill, tpot_s=tpot,
            decode_tps=replicas * w.batch / tpot,
            e2e_tps=replicas * w.batch * (w.prompt_len + w.new_tokens) / total_time,
            roofline_prefill_tps=roofline,
            breakdown_ms={
                "prefill_linear_per_layer": 1e3 * t_lin, "prefill_attention_per_layer": 1e3 * t_attn,
                "prefill_tp_comm_per_layer": 1e3 * t_tp, "prefill_pp_send": 1e3 * t_send,
                "decode_linear_per_layer": 1e3 * t_dlin, "decode_attention_per_layer": 1e3 * t_datt,
                "decode_comm_per_layer": 1e3 * (t_merge + t_dtp),
                "layer_overhead_prefill": 1e3 * t_ovh, "layer_overhead_decode": 1e3 * t_dovh,
            },
            terms_ms={"ttft": {k: 1e3 * v for k, v in ttft_terms.items()},
                      "tpot": {k: 1e3 * v for k, v in tpot_terms.items()}},
            max_batch=self.max_fit(p, "batch"), max_prompt_len=self.max_fit(p, "prompt_len"),
        )
        pred.findings = findings(p, pred, hw, self.a2a_size(p))
        return pred

    def max_fit(self, p: PlanInput, what: str) -> int:
        """Largest ``batch`` (multiple of micro_batch) or ``prompt_len`` (multiple of 2*cp) that fits; 0 if none."""
        w = p.workload
        if what == "batch":
            unit = w.micro_batch

            def make(n: int) -> PlanInput:
                return replace(p, workload=replace(w, batch=n * unit))
        elif what == "prompt_len":
            unit = 2 * p.layout.cp if p.layout.cp > 1 else 1

            def make(n: int) -> PlanInput:
                return replace(p, workload=replace(w, prompt_len=n * unit))
        else:
            raise ValueError(f"what must be 'batch' or 'prompt_len', got {what!r}")
        return unit * _largest(lambda n: self.memory(make(n)).fits)


def _largest(ok: Callable[[int], bool]) -> int:
    """Largest n >= 1 with ok(n) (ok monotone decreasing), 0 when ok(1) is false."""
    if not ok(1):
        return 0
    lo, hi = 1, 2
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 40:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
