"""Tables (rich on a terminal, Markdown for the docs), JSON and PNG plots for the planner and benchmarks.

``rich`` and ``matplotlib`` are optional (the ``bench`` extra): without rich the tables print as
Markdown, without matplotlib :func:`plot_attention` says so and draws nothing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

Row = Sequence[Any]


def markdown_table(columns: Sequence[str], rows: Sequence[Row]) -> str:
    """A GitHub Markdown table."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Row]) -> None:
    """Print with rich when it is installed, as Markdown otherwise."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"\n{title}\n{markdown_table(columns, rows)}")
        return
    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(str(c) for c in row))
    Console(width=200).print(table)


def fmt_time(seconds: float) -> str:
    """``12.3 ms`` / ``4.56 s`` / ``78.9 us``."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def fmt_bytes(n: float) -> str:
    """Decimal units: ``3.36 TB``, ``80 GB``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_rate(n: float) -> str:
    """``1.2M`` / ``345k`` / ``12.3``."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


# ---------------------------------------------------------------------------------------------
# planner


def plan_rows(preds: Sequence[Any]) -> list[list[str]]:
    """Rows of the planner table, one column per :class:`~megatron_ring.perf.cost_model.Prediction`."""
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


# ---------------------------------------------------------------------------------------------
# benchmarks

BENCH_COLUMNS = ["impl", "mode", "causal", "L", "P", "pool", "median", "min", "max", "eff", "eff/core",
                 "exposed %", "peak mem/rank", "bytes sent/rank"]


def bench_rows(points: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Rows of the attention bench table."""
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}"

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    return [[p["impl"] + (f" {p['variant']}" if p.get("variant") else ""), p["mode"], "yes" if p["causal"] else "no", p["L"], p["P"], p.get("pool_P", p["P"]),
             fmt_time(p["median_s"]),
             fmt_time(p["min_s"]), fmt_time(p["max_s"]), num(p.get("efficiency")), num(p.get("efficiency_per_core")),
             pct(p.get("exposed_fraction")), fmt_bytes(p["peak_mem_bytes"]),
             "-" if p.get("bytes_sent") is None else fmt_bytes(p.get("bytes_sent_max", p["bytes_sent"]))]
            for p in points]


IMPL_COLORS = {"single": "black", "ring_p2p": "tab:blue", "all_gather": "tab:orange", "ulysses": "tab:green"}
POOL_STYLES = {1: "-", 2: "-", 4: "--", 8: ":", 16: "-."}


def plot_attention(points: Sequence[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """PNG plots, one panel per mode: time vs L, efficiency vs P, memory vs L.

    Colour = implementation, line style = pool size P, marker = causal (o) or not (s).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install 'megatron_ring[bench]')")
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    modes = sorted({p["mode"] for p in points}, reverse=True)
    written = []
    for name, x_key, y_key, line_keys, ylabel, logy in (
        ("time_vs_L.png", "L", "median_s", ("impl", "causal", "pool_P"), "median time per call (s)", True),
        ("efficiency_vs_P.png", "P", "efficiency", ("impl", "causal", "L"), "T_single / (P * T)", False),
        ("memory_vs_L.png", "L", "peak_mem_bytes", ("impl", "causal", "pool_P"), "peak memory per rank (bytes)", True),
    ):
        fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 5), squeeze=False)
        for ax, mode in zip(axes[0], modes):
            lines: dict[tuple[Any, ...], list[tuple[float, float]]] = {}
            for p in points:
                if p["mode"] != mode or p.get(y_key) is None or (y_key == "efficiency" and p["impl"] == "single"):
                    continue
                key = tuple(p.get(k, p["P"]) for k in line_keys)
                lines.setdefault(key, []).append((p[x_key], p[y_key]))
            for key, pts in sorted(lines.items(), key=str):
                impl, causal, third = key
                pts.sort()
                style = "-" if x_key == "P" else POOL_STYLES.get(third, "-")
                label = f"{impl} {'causal' if causal else 'full'} " + (f"L={third}" if x_key == "P" else f"pool P={third}")
                ax.plot([a for a, _ in pts], [b for _, b in pts], linestyle=style, marker="o" if causal else "s",
                        color=IMPL_COLORS.get(impl), label=label, alpha=0.5 + 0.5 * (x_key != "P"))
            ax.set_title(mode)
            ax.set_xlabel(x_key)
            ax.set_ylabel(ylabel)
            ax.set_xscale("log", base=2)
            if logy:
                ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=6)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


NUMERICS_COLUMNS = ["dtype", "P", "causal", "fwd rel err", "dq rel err", "dk rel err", "dv rel err"]


def numerics_rows(points: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Rows of the numerics table."""
    return [[p["dtype"], p["P"], "yes" if p["causal"] else "no", f"{p['out']:.2e}", f"{p['dq']:.2e}",
             f"{p['dk']:.2e}", f"{p['dv']:.2e}"] for p in points]


def numerics_pivot(points: Sequence[dict[str, Any]]) -> str:
    """Markdown: one row per (dtype, causal, quantity), one column per ring size P."""
    ranks = sorted({p["P"] for p in points})
    cells = {(p["dtype"], p["causal"], p["P"]): p for p in points}
    rows = []
    for dtype in dict.fromkeys(p["dtype"] for p in points):
        for causal in (True, False):
            if not any((dtype, causal, r) in cells for r in ranks):
                continue
            for key, name in (("out", "out"), ("grads", "max(dq, dk, dv)")):
                vals = []
                for r in ranks:
                    p = cells.get((dtype, causal, r))
                    if p is None:
                        vals.append("-")
                        continue
                    v = p["out"] if key == "out" else max(p["dq"], p["dk"], p["dv"])
                    vals.append(f"{v:.2e}")
                rows.append([dtype, "yes" if causal else "no", name] + vals)
    return markdown_table(["dtype", "causal", "rel err of"] + [f"P={r}" for r in ranks], rows)
