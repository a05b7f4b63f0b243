"""The sweep as text: one row per point, and the planner's errors beside the measurements."""
from __future__ import annotations

from megatron_ring.perf.sweep.schema import SIDES, SweepResult

COLUMNS: tuple[tuple[str, str, float], ...] = (
    ("tps", "TPS", 1.0), ("ttft_s", "TTFT ms", 1e3), ("tpot_s", "TPOT ms", 1e3), ("peak_mem_bytes", "mem MiB", 2**-20))
"""(field, header, factor to the shown unit) of the sweep table."""


def format_sweep_table(summary: SweepResult) -> str:
    """One row per point: L, batch, then baseline and ring medians and ring/baseline for each quantity."""
    heads = ["L", "batch"] + [f"{head} {what}" for _, head, _ in COLUMNS for what in ("base", "ring", "x")]
    rows = [heads]
    for p in summary.points:
        row = [str(p.prompt_len), str(p.batch)]
        for field, _, factor in COLUMNS:
            row += [f"{getattr(p.baseline, field).median * factor:,.3f}",
                    f"{getattr(p.ring, field).median * factor:,.3f}", f"{getattr(p.ratio, field):.3f}"]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(heads))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"medians over {summary.repeats} repeat(s); x = ring / baseline; TPS overall tok/s, TPOT p50, "
                 "memory = peak per rank (max over ranks)")
    if any(p.relative_error for p in summary.points):
        lines += ["", format_error_table(summary)]
    return "\n".join(lines)


def format_error_table(summary: SweepResult) -> str:
    """One row per point and side: the planner's TTFT and TPOT beside the measured medians, and the error."""
    rows = [["L", "batch", "side", "TTFT ms meas", "TTFT ms pred", "err", "TPOT ms meas", "TPOT ms pred", "err"]]
    for p in summary.points:
        if not (p.predicted and p.relative_error):
            continue
        for side in SIDES:
            measured, predicted, error = getattr(p, side), p.predicted[side], p.relative_error[side]
            rows.append([str(p.prompt_len), str(p.batch), side]
                        + [cell for field in ("ttft_s", "tpot_s") for cell in (
                            f"{getattr(measured, field).median * 1e3:,.2f}", f"{getattr(predicted, field) * 1e3:,.2f}",
                            f"{getattr(error, field):+.0%}")])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("planner vs measured: err = (predicted - measured median) / measured median")
    return "\n".join(lines)
