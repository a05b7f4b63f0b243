"""The planner on the paper's workload: TP=8 x PP=2 baseline vs ring over cp=16, 16 GPUs.

``python -m megatron_ring.perf.planner.paper_scale [--hardware h100-sxm-nvlink-switch h100-sxm] [--out PREFIX]``
prints, per hardware profile, the configs' own workload (B = 128, L = 99872: it does not fit,
flagged) and the largest batch at that L that fits both layouts, with the ring/baseline ratios of
TPS (overall) and TPOT and the term that dominates TTFT and TPOT. ``--out PREFIX`` writes
``PREFIX.md`` and ``PREFIX.json``. Prefill is pipelined over micro-batches of one sequence
(``--micro-batch``), the planner's default: the fair schedule for the PP baseline.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from megatron_ring.config.shipped import find_config
from megatron_ring.perf.planner.cost_model import Planner
from megatron_ring.perf.planner.hardware import HardwareProfile
from megatron_ring.perf.planner.plan_cli import load_plan_input
from megatron_ring.perf.planner.predict import summary
from megatron_ring.perf.report import fmt_bytes, fmt_rate, fmt_time, markdown_table, print_table

BASELINE = "configs/deepspeed/paper_baseline_tp8_pp2.json"
RING = "configs/deepspeed/paper_ring_cp16.json"
PROFILES = ("h100-sxm-nvlink-switch", "h100-sxm")


def paper_scale_plan(baseline: str | Path = BASELINE, ring: str | Path = RING, *,
                     profiles: tuple[str, ...] = PROFILES, micro_batch: int = 1) -> list[dict[str, Any]]:
    """One entry per (profile, batch): both layouts' summaries and the ring/baseline ratios."""
    plans = [load_plan_input(find_config(c), micro_batch=micro_batch) for c in (baseline, ring)]  # cwd, else shipped
    out = []
    for name in profiles:
        planner = Planner(HardwareProfile.load(name))
        preds = [planner.predict(p) for p in plans]
        fit_batch = min(p.max_batch for p in preds) // micro_batch * micro_batch
        for batch, why in ((plans[0].workload.batch, "the configs' workload"), (fit_batch, "largest batch that fits")):
            if batch < 1:
                continue
            sized = [replace(p, workload=replace(p.workload, batch=batch)) for p in plans]
            base, ring_ = (summary(p, planner.predict(p)) for p in sized)
            out.append({"profile": name, "batch": batch, "case": why, "prompt_len": sized[0].workload.prompt_len,
                        "new_tokens": sized[0].workload.new_tokens, "micro_batch": micro_batch,
                        "baseline": base, "ring": ring_,
                        "tps_ratio": ring_["tps"] / base["tps"], "tpot_ratio": ring_["tpot_s"] / base["tpot_s"],
                        "ttft_ratio": ring_["ttft_s"] / base["ttft_s"]})
    return out


COLUMNS = ["profile", "B", "layout", "fits (mem/rank)", "TTFT", "TPOT", "TPS", "TTFT dominated by",
           "TPOT dominated by", "ring/baseline TPS", "ring/baseline TPOT"]


def rows(entries: list[dict[str, Any]]) -> list[list[str]]:
    """Table rows: two per entry (baseline, then ring with the ratios)."""
    out = []
    for e in entries:
        for side in ("baseline", "ring"):
            s = e[side]
            share = {m: s["terms_ms"][m][s["dominant"][m]] / (1e3 * s[f"{m}_s"]) for m in ("ttft", "tpot")}
            out.append([e["profile"], e["batch"], s["layout"],
                        f"{'yes' if s['fits'] else 'NO'} ({fmt_bytes(s['memory_per_rank_bytes'])})",
                        fmt_time(s["ttft_s"]), fmt_time(s["tpot_s"]), fmt_rate(s["tps"]),
                        *(f"{s['dominant'][m]} ({share[m]:.0%})" for m in ("ttft", "tpot")),
                        *((f"{e['tps_ratio']:.2f}", f"{e['tpot_ratio']:.2f}") if side == "ring" else ("", ""))])
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the table; with ``--out PREFIX`` write ``PREFIX.md`` and ``PREFIX.json``."""
    from megatron_ring.runtime.reporting import write_json_atomic

    ap = argparse.ArgumentParser(prog="python -m megatron_ring.perf.planner.paper_scale",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default=BASELINE)
    ap.add_argument("--ring", default=RING)
    ap.add_argument("--hardware", nargs="+", default=list(PROFILES))
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--out", help="write PREFIX.md and PREFIX.json")
    args = ap.parse_args(argv)
    entries = paper_scale_plan(args.baseline, args.ring, profiles=tuple(args.hardware), micro_batch=args.micro_batch)
    first = entries[0]
    title = (f"paper scale: L = {first['prompt_len']}, {first['new_tokens']} new tokens, micro-batch "
             f"{first['micro_batch']}; {args.baseline} vs {args.ring}")
    print_table(title, COLUMNS, rows(entries))
    if args.out:
        write_json_atomic(Path(f"{args.out}.json"), {"argv": sys.argv[1:] if argv is None else argv,
                                                     "entries": entries})
        Path(f"{args.out}.md").write_text(f"{title}\n\n{markdown_table(COLUMNS, rows(entries))}\n")
        print(f"wrote {args.out}.md and {args.out}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
