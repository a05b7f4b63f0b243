"""The plots of a sweep (``sweep.json`` as a mapping), written as PNG next to it (matplotlib, Agg canvas).

* ``sweep_ratios.png``  ring / baseline of TPS, TTFT and TPOT vs prompt length, parity line, crossovers
* ``sweep_latency.png`` TTFT and TPOT of both sides vs prompt length, min/max error bars, predictions dashed
* ``sweep_memory.png``  peak memory per rank of both sides vs prompt length, min/max error bars
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter

from megatron_ring.perf.sweep.schema import SIDES

Predicted = Mapping[str, Mapping[tuple[int, int], Mapping[str, float]]]
"""side -> (prompt_len, batch) -> {"ttft_s", "tpot_s", ...}."""

RATIO_LABELS = {"tps": "TPS overall", "ttft_s": "TTFT", "tpot_s": "TPOT p50"}
MS, MIB = 1e3, 2.0 ** -20


def plot_sweep(summary: Mapping[str, Any], out_dir: Path, *, predicted: Optional[Predicted] = None) -> list[Path]:
    """Write the three plots of ``summary`` to ``out_dir``; return their paths."""
    return [plot_ratios(summary, out_dir / "sweep_ratios.png"),
            plot_latency(summary, out_dir / "sweep_latency.png", predicted),
            plot_memory(summary, out_dir / "sweep_memory.png")]


def plot_ratios(summary: Mapping[str, Any], path: Path) -> Path:
    """(a) ring / baseline of the medians vs L, one line per metric and batch, crossovers marked."""
    fig, (ax,) = _figure(summary, "ring / baseline", 1)
    colours = _colours()
    ax.axhline(1.0, color="0.4", linestyle=":", linewidth=1.2, label="1.0 (parity)")
    for batch in _batches(summary):
        points = _points(summary, batch)
        lengths = [p["prompt_len"] for p in points]
        for metric, label in RATIO_LABELS.items():
            colour = next(colours)
            found = summary["crossover"][metric][str(batch)]
            where = ", ".join(f"L ≈ {x:,.0f}" for x in found) if found else "none in range"
            ax.plot(lengths, [p["ratio"][metric] for p in points], marker="o", color=colour,
                    label=f"{label}{_batch_tag(summary, batch)}: crossover {where}")
            if found:
                ax.plot(found, [1.0] * len(found), linestyle="none", marker="X", markersize=11, color=colour,
                        markeredgecolor="black")
    _length_axis(ax, summary)
    ax.set_ylabel("ring / baseline (median over repeats)")
    ax.text(0.01, 0.01, "TPS > 1: ring faster; TTFT, TPOT < 1: ring faster", transform=ax.transAxes, fontsize=8,
            color="0.3")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_latency(summary: Mapping[str, Any], path: Path, predicted: Optional[Predicted]) -> Path:
    """(b) TTFT and TPOT p50 of both sides vs L with min/max bars; predictions as dashed lines."""
    fig, axes = _figure(summary, "latency", 2)
    for ax, field, label in zip(axes, ("ttft_s", "tpot_s"), ("TTFT (ms)", "TPOT p50 (ms)")):
        colours = _colours()
        for batch in _batches(summary):
            points = _points(summary, batch)
            lengths = [p["prompt_len"] for p in points]
            for side in SIDES:
                colour = next(colours)
                name = f"{summary[side]['name']}{_batch_tag(summary, batch)}"
                _errorbars(ax, lengths, [p[side][field] for p in points], MS, colour, f"{name} measured")
                if predicted is not None:
                    ax.plot(lengths, [predicted[side][p["prompt_len"], batch][field] * MS for p in points],
                            linestyle="--", marker="x", color=colour, label=f"{name} predicted")
        _length_axis(ax, summary)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(LogFormatter())
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_memory(summary: Mapping[str, Any], path: Path) -> Path:
    """(c) peak memory per rank (max over ranks) of both sides vs L with min/max bars."""
    fig, (ax,) = _figure(summary, "peak memory per rank", 1)
    colours = _colours()
    for batch in _batches(summary):
        points = _points(summary, batch)
        for side in SIDES:
            _errorbars(ax, [p["prompt_len"] for p in points], [p[side]["peak_mem_bytes"] for p in points], MIB,
                       next(colours), f"{summary[side]['name']}{_batch_tag(summary, batch)}")
    _length_axis(ax, summary)
    ax.set_ylabel("peak memory per rank, max over ranks (MiB)")
    ax.legend(fontsize=8)
    return _save(fig, path)


# --- helpers ---------------------------------------------------------------------------------

def _figure(summary: Mapping[str, Any], what: str, panels: int) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(max(9, 7 * panels), 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    machine = summary["provenance"]["machine"]
    noisy = " — NOISY (load average above the core count)" if summary["provenance"]["noisy"] else ""
    fig.suptitle(f"{what}: {summary['baseline']['name']} vs {summary['ring']['name']}{noisy}\n"
                 f"baseline {summary['baseline']['layout']}; ring {summary['ring']['layout']}\n"
                 f"{machine['hostname']}, {machine['cpu_count']} cores, {summary['repeats']} repeat(s) per point",
                 fontsize=9)
    return fig, [fig.add_subplot(1, panels, i + 1) for i in range(panels)]


def _colours() -> Iterator[str]:
    """Distinct colours, one per series (matplotlib's ten-colour cycle)."""
    n = 0
    while True:
        yield f"C{n % 10}"
        n += 1


def _batches(summary: Mapping[str, Any]) -> list[int]:
    return sorted({p["batch"] for p in summary["points"]})


def _points(summary: Mapping[str, Any], batch: int) -> list[Mapping[str, Any]]:
    return sorted((p for p in summary["points"] if p["batch"] == batch), key=lambda p: p["prompt_len"])


def _batch_tag(summary: Mapping[str, Any], batch: int) -> str:
    """`` (B=4)`` when the sweep has several batches, else nothing."""
    return f" (B={batch})" if len(_batches(summary)) > 1 else ""


def _errorbars(ax: Axes, lengths: list[int], spreads: list[Mapping[str, float]], factor: float, colour: str,
               label: str) -> None:
    """Medians joined by a line, min..max as error bars, all times ``factor``."""
    medians = [s["median"] * factor for s in spreads]
    below = [(s["median"] - s["min"]) * factor for s in spreads]
    above = [(s["max"] - s["median"]) * factor for s in spreads]
    ax.errorbar(lengths, medians, yerr=[below, above], marker="o", capsize=3, color=colour, label=label)


def _length_axis(ax: Axes, summary: Mapping[str, Any]) -> None:
    lengths = sorted({p["prompt_len"] for p in summary["points"]})
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
    ax.set_xlabel("prompt length L (tokens, log2 scale)")
    ax.grid(True, alpha=0.3)


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
