"""The planner's tables: predictions side by side, their findings, and measured vs predicted bench points."""
from __future__ import annotations

import math
from typing import Any, Sequence

from megatron_ring.attention.comms import COMMS
from megatron_ring.perf.report import fmt_bytes, fmt_rate, fmt_time, markdown_table, print_table


def plan_rows(preds: Sequence[Any]) -> list[list[str]]:
    """Rows of the planner table, one column per :class:`~megatron_ring.perf.planner.prediction.Prediction`."""
    def row(name: str, fn: Any) -> list[str]:
        return [name] + [fn(p) for p in preds]

    rows = [
        row("FLOPs per prompt token", lambda p: f"{p.flops_per_token / 1e9:.3g} GFLOP"),
        row("weights / rank", lambda p: fmt_bytes(p.memory.weights)),
        row("KV cache / rank", lambda p: fmt_bytes(p.memory.kv_cache)),
        row("activations / rank", lambda p: fmt_bytes(p.memory.activations)),
        row("total / usable", lambda p: f"{fmt_bytes(p.memory.total)} / {fmt_bytes(p.memory.usable)}"),
        row("fits", lambda p: "yes" if p.memory.fits else "NO"),
        row("max batch (this L)", lambda p: str(p.max_batch)),
        row("max prompt_len (this B)", lambda p: str(p.max_prompt_len)),
        row("ring L/P vs c*", lambda p: "-" if p.ring is None else
            f"{p.ring.tokens_per_rank} vs {p.ring.crossover_tokens:.0f} ({p.ring.link})"),
        row("ring step compute / comm", lambda p: "-" if p.ring is None else
            f"{fmt_time(p.ring.compute_s)} / {fmt_time(p.ring.comm_s)}"),
        *[row(f"attention fwd / layer: {comm}", lambda p, comm=comm: "-" if p.ring is None else
              (("n/a" if math.isinf(p.ring.comm_times[comm]) else fmt_time(p.ring.comm_times[comm]))
               + (" <- used" if p.ring.comm == comm else "")))
          for comm in COMMS],
        row("prefill linear / layer", lambda p: f"{p.breakdown_ms['prefill_linear_per_layer']:.4g} ms"),
        row("prefill attention / layer", lambda p: f"{p.breakdown_ms['prefill_attention_per_layer']:.4g} ms"),
        row("prefill TP comm / layer", lambda p: f"{p.breakdown_ms['prefill_tp_comm_per_layer']:.4g} ms"),
        row("TTFT (whole batch)", lambda p: fmt_time(p.ttft_s)),
        row("prefill TPS", lambda p: fmt_rate(p.prefill_tps)),
        row("prefill TPS at 100% peak", lambda p: fmt_rate(p.roofline_prefill_tps)),
        row("TPOT", lambda p: fmt_time(p.tpot_s)),
        row("decode TPS", lambda p: fmt_rate(p.decode_tps)),
        row("end-to-end TPS", lambda p: fmt_rate(p.e2e_tps)),
    ]
    return rows


def print_plan(inputs: Sequence[Any], preds: Sequence[Any], hw: Any) -> None:
    """The planner's table and findings."""
    first = inputs[0]
    w, m = first.workload, first.model
    title = (f"plan: {first.name} on {hw.name} — {m.num_layers} layers, d={m.hidden_size}, "
             f"{m.num_heads}x{m.head_dim} heads (kv {m.num_kv_heads}), ffn {m.ffn_hidden_size}, {first.dtype}; "
             f"batch {w.batch} x {w.prompt_len} tokens, {w.new_tokens} new, micro-batch {w.micro_batch}")
    print_table(title, ["metric"] + [p.label for p in preds], plan_rows(preds))
    for pred in preds:
        print(f"\n[{pred.label}]")
        for line in pred.findings:
            print(f"  - {line}")


def plan_markdown(preds: Sequence[Any], measured: Sequence[dict[str, Any]] | None = None) -> str:
    """The planner's table, findings and (optionally) the measured-vs-predicted table as Markdown."""
    parts = [markdown_table(["metric"] + [p.label for p in preds], plan_rows(preds))]
    for pred in preds:
        parts.append(f"**{pred.label}**\n\n" + "\n".join(f"- {line}" for line in pred.findings))
    if measured:
        parts.append(markdown_table(COMPARISON_COLUMNS, comparison_rows(measured)))
    return "\n\n".join(parts) + "\n"


COMPARISON_COLUMNS = ["impl", "mode", "causal", "L", "P", "dtype", "measured", "predicted", "meas/pred"]


def comparison_rows(rows: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """Rows of the measured-vs-predicted table."""
    return [[r["impl"], r["mode"], "yes" if r["causal"] else "no", r["L"], r["P"], r["dtype"],
             fmt_time(r["measured_s"]), fmt_time(r["predicted_s"]), f"{r['measured_over_predicted']:.2f}"]
            for r in rows]


def print_comparison(rows: Sequence[dict[str, Any]], hw_name: str) -> None:
    """Measured vs predicted bench points."""
    print_table(f"measured vs predicted ({hw_name})", COMPARISON_COLUMNS, comparison_rows(rows))
