"""``megatron-ring bench train-memory``: the longest sequence one rank can train under a fixed memory cap, by cp.

In each trial a gloo pool of cp processes (tp = pp = dp = 1) trains the same Megatron GPT (a
``configs/megatron`` YAML, its dtype and attention as shipped, ``parallel.cp`` and ``seq_length``
set per trial; a YAML naming a checkpoint, e.g. ``configs/megatron/smollm2_memory.yaml``, gives that
model's architecture) for one step: forward, backward, the gradient all-reduce over CP and an AdamW step
whose states already exist (:mod:`~megatron_ring.perf.bench.train_memory_worker`). A trial fits when
no rank's peak exceeds the cap (Note [What the cap counts] in perf/bench/memory_cap.py); the
longest fitting length is searched with steps doubling away from a start, then bisection, over
multiples of ``--unit`` (:mod:`~megatron_ring.perf.bench.length_search`), each cp starting from the
previous cp's limit scaled linearly (a prediction; the search finds the limit from any start).

Note [A fresh pool per trial]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every trial runs in new processes: a warm-up step at one unit (not measured) takes the one-time
initialisations (code pages, lazily built state) into the baseline, then the measured step. A
process that has already trained a longer sequence keeps some anonymous memory that grows with
the length (8 MiB after one step at 2560 tokens on this model: kernel scratch, caches) and a
later, shorter trial in it would reuse that memory unseen: measured in one process, the same
trial read 257 MiB first and 252 MiB after. A pool per trial makes every trial independent of the
search's history, at the cost of a process start (megatron-core's import) per trial.
A rank that fails, or whose warm-up or measured step outlives ``--trial-timeout-s``, stops the
benchmark, its pool killed.
"""
from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from megatron_ring.config import output_problem
from megatron_ring.perf.bench.length_search import LengthSearch, longest_fitting
from megatron_ring.perf.bench.memory_cap import MIB, MemoryCapExceeded, check_cap, check_cap_bytes
from megatron_ring.runtime.args import positive_float, positive_int, usage_error

DEFAULT_MODEL = "configs/megatron/long_ring_cp2.yaml"


def check_plan(model_data: dict[str, Any], *, cps: Sequence[int], unit: int, start: int, ceiling: int,
               cap_bytes: int) -> None:
    """ValueError (ConfigError) naming the field, its value and what is allowed, before any process starts."""
    from megatron_ring.perf.bench.train_memory_worker import model_config

    check_cap_bytes(cap_bytes)
    if not cps or any(cp < 1 for cp in cps) or len(set(cps)) != len(cps):
        raise ValueError(f"cp = {list(cps)}: give distinct positive CP sizes")
    for cp in cps:
        if unit % (2 * cp):
            allowed = math.lcm(*(2 * c for c in cps))
            raise ValueError(f"unit = {unit} is not divisible by 2 * cp = {2 * cp} for cp = {cp} (zigzag sharding: "
                             f"every tried seq_len is a multiple of unit); use a multiple of {allowed}")
    for name, value in (("start", start), ("ceiling", ceiling)):
        if value % unit or value < unit:
            raise ValueError(f"{name} = {value} is not a positive multiple of unit = {unit}")
    if start > ceiling:
        raise ValueError(f"start = {start} is above ceiling = {ceiling}")
    for cp in cps:
        model_config(model_data, cp=cp, seq_len=ceiling)  # the longest length must fit the model's positions


def run_train_memory(model_data: dict[str, Any], *, cps: Sequence[int], cap_bytes: int, unit: int, start: int,
                     ceiling: int, seed: int = 0, trial_timeout_s: float = 300.0,
                     progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One point per cp (ascending): the longest fitting ``seq_len``, its peak and static bytes, every trial."""
    from megatron_ring.perf.bench.train_memory_worker import train_step_peak
    from megatron_ring.runtime.pool import GlooPool

    check_plan(model_data, cps=cps, unit=unit, start=start, ceiling=ceiling, cap_bytes=cap_bytes)
    points: list[dict[str, Any]] = []
    for cp in sorted(cps):
        trials: list[dict[str, Any]] = []

        def fits(seq_len: int) -> bool:
            t0 = time.perf_counter()
            with GlooPool(cp, timeout_s=trial_timeout_s) as pool:  # Note [A fresh pool per trial]
                pool.run(train_step_peak, model_data, unit, seed)
                ranks = pool.run(train_step_peak, model_data, seq_len, seed)
            peaks = [r["peak_bytes"] for r in ranks]
            trial = {"seq_len": seq_len, "peak_bytes_per_rank": peaks, "seconds": time.perf_counter() - t0,
                     **{k: ranks[0][k] for k in ("weights_bytes", "grads_bytes", "optimizer_bytes")}}
            try:
                check_cap(peaks, cap_bytes, seq_len=seq_len, cp=cp)
                trial["fits"] = True
            except MemoryCapExceeded as err:
                trial.update(fits=False, over_cap=str(err))
            trials.append(trial)
            progress(f"cp {cp}  seq_len {seq_len:>7}  peak {max(peaks) / MIB:7.1f} MiB  "
                     f"{'fits' if trial['fits'] else 'over the cap'}  ({trial['seconds']:.1f} s with the start)")
            return trial["fits"]

        search = longest_fitting(fits, unit=unit, start=_first_length(points, cp, unit, start, ceiling),
                                 ceiling=ceiling)
        points.append(_point(cp, search, trials))
    _add_ratios(points)
    return points


def _first_length(points: Sequence[dict[str, Any]], cp: int, unit: int, start: int, ceiling: int) -> int:
    """``start`` for the first cp; after it the previous cp's limit times the growth of cp, in whole units."""
    if not points or not points[-1]["longest_seq_len"]:
        return start
    predicted = points[-1]["longest_seq_len"] * cp // points[-1]["cp"] // unit * unit
    return min(max(predicted, unit), ceiling)


def _point(cp: int, search: LengthSearch, trials: list[dict[str, Any]]) -> dict[str, Any]:
    best = next((t for t in trials if t["seq_len"] == search.longest and t["fits"]), None)
    return {"cp": cp, "longest_seq_len": search.longest, "at_ceiling": search.at_ceiling,
            "peak_bytes": None if best is None else max(best["peak_bytes_per_rank"]),
            **{k: None if best is None else best[k] for k in ("weights_bytes", "grads_bytes", "optimizer_bytes")},
            "trials": trials}


def _add_ratios(points: list[dict[str, Any]]) -> None:
    """``ratio_to_first`` (longest over the smallest cp's) and ``ratio_per_doubling`` (to the previous cp,
    as a factor per doubling of cp: ``(L_cp / L_prev) ** (1 / log2(cp / prev))``)."""
    first = points[0]["longest_seq_len"]
    for prev, point in zip([None] + points[:-1], points):
        point["ratio_to_first"] = point["longest_seq_len"] / first if first else None
        point["ratio_per_doubling"] = None
        if prev is not None and prev["longest_seq_len"]:
            ratio = point["longest_seq_len"] / prev["longest_seq_len"]
            point["ratio_per_doubling"] = ratio ** (1 / math.log2(point["cp"] / prev["cp"]))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megatron-ring bench train-memory", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a configs/megatron YAML (its parallel.cp is set per run); "
                    "one naming a checkpoint trains that checkpoint's architecture")
    ap.add_argument("--cp", dest="cps", type=positive_int, nargs="+", default=[1, 2, 4], help="CP sizes (processes)")
    ap.add_argument("--cap-mib", type=positive_float, default=256.0,
                    help="memory cap per process, MiB above its baseline (Note [What the cap counts])")
    ap.add_argument("--unit", type=positive_int, default=64,
                    help="tried lengths are multiples of this; divisible by 2 * every cp")
    ap.add_argument("--start", type=positive_int, default=1024, help="first length tried at the smallest cp")
    ap.add_argument("--ceiling", type=positive_int, default=1 << 17, help="longest length tried")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trial-timeout-s", type=positive_float, default=300.0,
                    help="per step (the warm-up and the measured one); past it the ranks are killed")
    ap.add_argument("--out-dir", default="results/train_memory", help="train_memory.json and train_memory.png")
    ap.add_argument("--replot", action="store_true",
                    help="run nothing: the table and the plot again from --out-dir's train_memory.json")
    return ap


def bench_train_memory_main(argv: list[str] | None = None) -> int:
    """``megatron-ring bench train-memory``: check, run, write JSON and the plot, print the table."""
    from megatron_ring.config.shipped import find_config
    from megatron_ring.config.strict import load_mapping
    from megatron_ring.perf.bench.harness import machine_description
    from megatron_ring.runtime.reporting import write_json_atomic

    parser = _parser()
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir)
    if args.replot:
        stored = out_dir / "train_memory.json"
        if not stored.is_file():
            return usage_error(parser.prog, f"--replot: {str(stored)!r} does not exist; run without --replot first")
        return _report(load_mapping(stored), out_dir)
    cap_bytes = int(args.cap_mib * MIB)
    problem = output_problem({"--out-dir": (args.out_dir, True)})
    if problem is not None:
        return usage_error(parser.prog, problem)
    try:
        path = find_config(args.model, kind="megatron")
        model_data = load_mapping(path)
        check_plan(model_data, cps=args.cps, unit=args.unit, start=args.start, ceiling=args.ceiling,
                   cap_bytes=cap_bytes)
    except ValueError as err:  # ConfigError included
        return usage_error(parser.prog, err)
    load_start = os.getloadavg()
    points = run_train_memory(model_data, cps=args.cps, cap_bytes=cap_bytes, unit=args.unit, start=args.start,
                              ceiling=args.ceiling, seed=args.seed, trial_timeout_s=args.trial_timeout_s)
    result = {"argv": argv if argv is not None else [], "model_config": str(args.model),
              "model": model_data.get("model"), "dtype": model_data.get("dtype"),
              "attention": model_data.get("attention"), "cap_bytes": cap_bytes, "unit": args.unit,
              "step": "forward, backward, gradient all-reduce over cp, AdamW step (states made before the step)",
              "counted": "every byte the step adds to the process: weights, gradients, AdamW states, activations, "
                         "logits, ring buffers, gloo copies (Note [What the cap counts])",
              "machine": machine_description(), "load_1_5_15_start": list(load_start),
              "load_1_5_15_end": list(os.getloadavg()), "points": points}
    write_json_atomic(out_dir / "train_memory.json", result)
    return _report(result, out_dir)


def _report(result: dict[str, Any], out_dir: Path) -> int:
    """Plot ``result`` to ``out_dir/train_memory.png`` and print its table."""
    from megatron_ring.perf.bench.train_memory_report import TABLE_COLUMNS, plot_train_memory, table_rows
    from megatron_ring.perf.report import print_table

    plot = plot_train_memory(result, out_dir / "train_memory.png")
    title = (f"longest trainable seq_len per rank under a {result['cap_bytes'] / MIB:g} MiB cap "
             f"({Path(result['model_config']).name}, {result['dtype']})")
    print_table(title, TABLE_COLUMNS, table_rows(result["points"]))
    print(f"wrote {out_dir / 'train_memory.json'} and {plot}")
    return 0
