"""The table and the plot of ``megatron-ring bench train-memory`` (its ``train_memory.json`` as a mapping)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from megatron_ring.perf.bench.memory_cap import MIB

TABLE_COLUMNS = ["cp", "longest seq_len", "ratio to first cp", "ratio per doubling", "peak per rank (MiB)",
                 "weights + grads + AdamW (MiB)", "rest: activations, logits, ring (MiB)", "rest per local token (KiB)",
                 "trials"]


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:.1f}"


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def table_rows(points: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """One row per cp: its longest length (``>=`` at the ceiling), ratios, peak, its static part (weights,
    gradients, AdamW states: the same at every cp) and the rest, also per local token (``seq_len / cp``)."""
    rows = []
    for p in points:
        static = None if p["peak_bytes"] is None else p["weights_bytes"] + p["grads_bytes"] + p["optimizer_bytes"]
        rest = None if static is None else p["peak_bytes"] - static
        local_tokens = p["longest_seq_len"] // p["cp"]
        rows.append([p["cp"], (">= " if p["at_ceiling"] else "") + str(p["longest_seq_len"]),
                     _ratio(p["ratio_to_first"]), _ratio(p["ratio_per_doubling"]), _mib(p["peak_bytes"]),
                     _mib(static), _mib(rest), "-" if rest is None else f"{rest / local_tokens / 1024:.1f}",
                     len(p["trials"])])
    return rows


def plot_train_memory(result: Mapping[str, Any], path: Path) -> Path:
    """Two panels: (a) the longest length by cp against linear growth from the first cp; (b) every
    trial's peak per rank against the rank's tokens (``seq_len / cp``), the cap as a line. PNG at ``path``."""
    points = result["points"]
    cap = result["cap_bytes"] / MIB
    load = ", ".join(f"{x:.1f}" for x in result["load_1_5_15_start"])
    fig = Figure(figsize=(13, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(f"longest trainable sequence under a {cap:g} MiB cap per process: {result['model_config']} "
                 f"({result['dtype']}), one step with AdamW\n{result['machine']['cpu']}, "
                 f"{result['machine']['cores']} cores, load at start {load}", fontsize=9)
    ax, trials_ax = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    cps = [p["cp"] for p in points]
    ax.plot(cps, [p["longest_seq_len"] for p in points], marker="o", label="measured")
    first = points[0]
    ax.plot(cps, [first["longest_seq_len"] * cp / first["cp"] for cp in cps], linestyle="--", color="grey",
            label="linear in cp (2x per doubling)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(cps, [str(cp) for cp in cps])
    ax.set_yticks([p["longest_seq_len"] for p in points], [str(p["longest_seq_len"]) for p in points])
    ax.minorticks_off()
    ax.set_xlabel("cp (processes)")
    ax.set_ylabel("longest seq_len that trains (tokens)")
    ax.set_title("(a) longest sequence by cp", fontsize=9)
    ax.legend(fontsize=8)
    for i, p in enumerate(points):
        trials = sorted(p["trials"], key=lambda t: t["seq_len"])
        trials_ax.plot([t["seq_len"] // p["cp"] for t in trials], [max(t["peak_bytes_per_rank"]) / MIB for t in trials],
                       marker="o", color=f"C{i % 10}", label=f"cp {p['cp']}")
        over = [t for t in trials if not t["fits"]]
        trials_ax.scatter([t["seq_len"] // p["cp"] for t in over], [max(t["peak_bytes_per_rank"]) / MIB for t in over],
                          marker="x", s=80, color="black", zorder=3, label="over the cap" if i == 0 else None)
    trials_ax.axhline(cap, color="red", linestyle=":", label=f"cap {cap:g} MiB")
    trials_ax.set_xlabel("tokens of one rank (seq_len / cp)")
    trials_ax.set_ylabel("peak per rank, max over ranks (MiB)")
    trials_ax.set_title("(b) every trial of the search: peak per rank vs the rank's tokens", fontsize=9)
    trials_ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
