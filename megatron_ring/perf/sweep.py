"""``megatron-ring sweep``: the baseline and the ring config of a pair over prompt lengths (and batches).

Every (batch, prompt length) point gets a derived config of each side (``OUT/configs``, the
workload overridden, the model path made absolute), validated like any run before the first launch.
Then, point by point, each repeat runs the baseline and then the ring config under a real launcher
(:func:`~megatron_ring.inference.compare.run_config`), so slow drift of the machine hits both sides
alike. Outputs, all under ``OUT``::

    runs/<config>_L<len>_b<batch>_r<rep>.json   each run's result (and .log)
    sweep.json                                  per point: median/min/max per side, ring/baseline ratios,
                                                crossovers, provenance (schema: SweepResult)
    sweep_ratios.png, sweep_latency.png, sweep_memory.png

    megatron-ring sweep cpu --lengths 16 32 48 --repeats 1
    megatron-ring sweep A.json B.json --lengths 1024 4096 16384 --batches 1 4 --out-dir results/sweep
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import pairwise
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence

from pydantic import Field

from megatron_ring.config import ConfigError, StrictModel, load_mapping
from megatron_ring.config.shipped import find_config
from megatron_ring.runtime.args import positive_int, usage_error
from megatron_ring.inference import compare
from megatron_ring.inference.main import load_spec
from megatron_ring.inference.metrics import rank_max
from megatron_ring.inference.schema import InferenceSpec, find_model_file
from megatron_ring.perf.predict import make_predictor
from megatron_ring.perf.sweep_plots import plot_sweep
from megatron_ring.integrations.deepspeed.config import SECTION, split_config
from megatron_ring.runtime.reporting import progress, write_json_atomic

SWEEP_SCHEMA = "megatron_ring.perf.sweep/1"
SIDES = ("baseline", "ring")
MEASURED: dict[str, tuple[str, float]] = {
    "tps": ("overall_tps", 1.0),
    "ttft_s": ("ttft_ms", 1e-3),
    "tpot_s": ("tpot_p50_ms", 1e-3),
}
"""Sweep field -> (metric of a run's result, factor to the sweep's unit). Besides these, ``peak_mem_bytes``
(the maximum over ranks)."""
CROSSOVER_METRICS = ("tps", "ttft_s", "tpot_s")

Predict = Callable[[Path, int, int, int], dict[str, float]]
"""``predict(config_path, prompt_len, batch, new_tokens) -> {"ttft_s", "tpot_s", "tps"}``."""


# --- the schema of sweep.json ------------------------------------------------------------------

class Spread(StrictModel):
    """Median, minimum and maximum of one quantity over the repeats of a point."""

    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        return cls(median=statistics.median(values), min=min(values), max=max(values))


class SideStats(StrictModel):
    """One side at one point: overall TPS (tok/s), TTFT and TPOT p50 (s), peak memory per rank (bytes, max)."""

    tps: Spread
    ttft_s: Spread
    tpot_s: Spread
    peak_mem_bytes: Spread
    runs: list[str] = Field(..., description="result files of the repeats, relative to sweep.json")


class Ratios(StrictModel):
    """ring median / baseline median."""

    tps: float
    ttft_s: float
    tpot_s: float
    peak_mem_bytes: float


class TimingFields(StrictModel):
    """TTFT and TPOT (s) and TPS of one side at one point: a prediction, or its relative error."""

    ttft_s: float
    tpot_s: float
    tps: float


class Point(StrictModel):
    prompt_len: int
    batch: int
    new_tokens: int
    baseline: SideStats
    ring: SideStats
    ratio: Ratios
    predicted: Optional[dict[Literal["baseline", "ring"], TimingFields]] = None
    relative_error: Optional[dict[Literal["baseline", "ring"], TimingFields]] = Field(
        None, description="(predicted - measured median) / measured median, per side and quantity")


class SideInfo(StrictModel):
    config: str
    name: str
    layout: str
    world_size: int


class Machine(StrictModel):
    hostname: str
    cpu_count: Optional[int]
    platform: str
    threads_per_rank: dict[Literal["baseline", "ring"], Optional[int]] = Field(
        ..., description="torch threads of rank 0, read from each side's first run")


class Provenance(StrictModel):
    command: str
    git_commit: Optional[str]
    date: str = Field(..., description="start of the sweep, UTC ISO 8601")
    machine: Machine
    load_before: list[float] = Field(..., description="os.getloadavg() before the first run (1, 5, 15 min)")
    load_after: list[float]
    noisy: bool = Field(..., description="the 1-minute load exceeded the core count before the sweep, or the core "
                        "count plus the sweep's own processes after it")


class SweepResult(StrictModel):
    """The whole ``sweep.json``."""

    schema_id: Literal["megatron_ring.perf.sweep/1"] = Field(SWEEP_SCHEMA, alias="schema")
    baseline: SideInfo
    ring: SideInfo
    launcher: str
    repeats: int
    new_tokens: Optional[int] = Field(..., description="the --new-tokens override, None when the configs' own")
    points: list[Point]
    crossover: dict[str, dict[str, list[float]]] = Field(
        ..., description="metric -> batch -> prompt lengths where ring/baseline crosses 1.0")
    provenance: Provenance


def load_sweep(path: str | Path) -> SweepResult:
    """Read and validate a stored ``sweep.json`` (ConfigError naming what is wrong)."""
    return SweepResult.parse(json.loads(Path(path).read_text()), where=f"sweep result {str(path)!r}")


# --- planning: points, derived configs, validation ------------------------------------------

@dataclass(frozen=True)
class SweepPoint:
    prompt_len: int
    batch: int
    new_tokens: int

    @property
    def tag(self) -> str:
        return f"L{self.prompt_len}_b{self.batch}"


def load_side(config: Path) -> InferenceSpec:
    """A pair's config, validated for the world size of its own layout."""
    return load_spec(config, world_size=compare.world_size_of(config))


def plan_points(specs: dict[str, InferenceSpec], lengths: Sequence[int], batches: Sequence[int] | None,
                new_tokens: int | None) -> list[SweepPoint]:
    """Every (batch, length) point; batch and new_tokens default to the configs' own, which must then agree."""
    def shared(field: str, flag: str) -> int:
        values = {side: getattr(spec.ring.workload, field) for side, spec in specs.items()}
        if len(set(values.values())) > 1:
            raise ConfigError(f"the configs disagree on workload.{field} ({values}); give {flag}")
        return values["baseline"]

    new_tokens = new_tokens if new_tokens is not None else shared("new_tokens", "--new-tokens")
    batches = sorted(set(batches)) if batches else [shared("batch", "--batches")]
    return [SweepPoint(length, batch, new_tokens) for batch in batches for length in sorted(set(lengths))]


def derive_config(config: Path, point: SweepPoint, out_dir: Path) -> Path:
    """Write ``config`` with the point's workload and an absolute model path to ``out_dir``; return its path."""
    deepspeed, ours = split_config(load_mapping(config), where=f"config {str(config)!r}")
    ours = dict(ours)
    ours.pop("output", None)
    model = dict(ours.get("model") or {})
    if isinstance(model.get("config"), str):
        model["config"] = str(find_model_file(model["config"], config.parent).resolve())
    ours["model"] = model
    ours["workload"] = {**(ours.get("workload") or {}), "prompt_len": point.prompt_len, "batch": point.batch,
                        "new_tokens": point.new_tokens}
    return write_json_atomic(out_dir / f"{config.stem}_{point.tag}.json", {**deepspeed, SECTION: ours})


def derive_all(configs: dict[str, Path], points: Sequence[SweepPoint],
               out_dir: Path) -> dict[tuple[str, SweepPoint], Path]:
    """The derived config of every side and point, each validated; one ConfigError naming every bad point."""
    derived, errors = {}, []
    for point in points:
        for side, config in configs.items():
            try:
                derived[side, point] = path = derive_config(config, point, out_dir)
                load_side(path)
            except ConfigError as err:
                errors.append(f"point L={point.prompt_len} batch={point.batch} ({side} {config.name}): {err}")
    if errors:
        raise ConfigError("sweep rejected before any launch:\n" + "\n".join(errors))
    return derived


# --- running ---------------------------------------------------------------------------------

Runs = dict[tuple[str, SweepPoint], list[tuple[str, dict[str, Any]]]]
"""(side, point) -> [(result file relative to the out dir, result)] in repeat order."""


def run_points(derived: dict[tuple[str, SweepPoint], Path], points: Sequence[SweepPoint], *, repeats: int,
               out_dir: Path, launcher: str) -> Runs:
    """Point by point, repeat by repeat: the baseline, then the ring config."""
    runs: Runs = {key: [] for key in derived}
    (out_dir / "runs").mkdir(parents=True, exist_ok=True)
    bar = progress(len(points) * repeats * len(SIDES), enabled=True, desc="sweep")
    for point in points:
        for rep in range(repeats):
            for side in SIDES:
                config = derived[side, point]
                bar.set_postfix_str(f"{side} L={point.prompt_len} b={point.batch} r{rep}")
                name = f"{config.stem}_r{rep}"
                result = compare.run_config(config, out_dir / "runs", launcher=launcher, name=name)
                runs[side, point].append((f"runs/{name}.json", result))
                bar.update()
    bar.close()
    return runs


# --- summarising -----------------------------------------------------------------------------

def measured(result: dict[str, Any], field: str) -> float:
    """One sweep field of one run's result."""
    if field == "peak_mem_bytes":
        return rank_max(result, "peak_mem_bytes")
    key, factor = MEASURED[field]
    return result["metrics"][key] * factor


def side_stats(runs: list[tuple[str, dict[str, Any]]]) -> SideStats:
    fields = (*MEASURED, "peak_mem_bytes")
    return SideStats(**{f: Spread.of([measured(result, f) for _, result in runs]) for f in fields},
                     runs=[path for path, _ in runs])


def relative_errors(predicted: dict[str, TimingFields], stats: dict[str, SideStats]) -> dict[str, TimingFields]:
    """(predicted - measured median) / measured median, per side and quantity."""
    def error(side: str, field: str) -> float:
        measured_median = getattr(stats[side], field).median
        return (getattr(predicted[side], field) - measured_median) / measured_median

    return {side: TimingFields(**{f: error(side, f) for f in TimingFields.model_fields}) for side in predicted}


def _timing(prediction: dict[str, Any]) -> dict[str, Any]:
    """The fields of a prediction the sweep compares (a predictor may say more, e.g. its dominant terms)."""
    return {field: prediction.get(field) for field in TimingFields.model_fields}


def predictions(predict: Predict, configs: dict[str, Path], points: Sequence[SweepPoint]
                ) -> dict[SweepPoint, dict[str, TimingFields]]:
    """The hook's prediction for every point and side, validated (ConfigError naming the point)."""
    return {p: {side: TimingFields.parse(_timing(predict(config, p.prompt_len, p.batch, p.new_tokens)),
                                         where=f"prediction for {side} at L={p.prompt_len} batch={p.batch}")
                for side, config in configs.items()}
            for p in points}


def summarise_point(point: SweepPoint, runs: Runs, predicted: dict[str, TimingFields] | None) -> Point:
    stats = {side: side_stats(runs[side, point]) for side in SIDES}
    ratio = Ratios(**{f: getattr(stats["ring"], f).median / getattr(stats["baseline"], f).median
                      for f in Ratios.model_fields})
    return Point(prompt_len=point.prompt_len, batch=point.batch, new_tokens=point.new_tokens, **stats, ratio=ratio,
                 predicted=predicted, relative_error=relative_errors(predicted, stats) if predicted else None)


def crossings(lengths: Sequence[float], ratios: Sequence[float]) -> list[float]:
    """Prompt lengths where ``ratios`` (at sorted ``lengths``) equals or crosses 1.0.

    Between two neighbouring points the ratio is interpolated linearly in log2(L), i.e. along the
    straight segment the plots draw on their log2 axis.
    """
    found = [float(length) for length, ratio in zip(lengths, ratios) if ratio == 1.0]
    for (l0, r0), (l1, r1) in pairwise(zip(lengths, ratios)):
        if (r0 - 1.0) * (r1 - 1.0) < 0:
            t = (1.0 - r0) / (r1 - r0)
            found.append(2 ** (math.log2(l0) + t * (math.log2(l1) - math.log2(l0))))
    return sorted(found)


def crossovers(points: Sequence[Point]) -> dict[str, dict[str, list[float]]]:
    """metric -> batch -> where its ring/baseline ratio crosses 1.0."""
    batches = sorted({p.batch for p in points})
    return {metric: {str(b): crossings([p.prompt_len for p in points if p.batch == b],
                                       [getattr(p.ratio, metric) for p in points if p.batch == b])
                     for b in batches}
            for metric in CROSSOVER_METRICS}


# --- provenance ------------------------------------------------------------------------------

def git_commit() -> str | None:
    """``git rev-parse HEAD`` of the checkout this package runs from, None outside one."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def is_noisy(load_before: Sequence[float], load_after: Sequence[float], cpu_count: int | None, own: int) -> bool:
    """Other work shared the cores: the 1-minute load average exceeded the core count before the
    sweep, or the core count plus the sweep's own ``own`` processes after it."""
    return cpu_count is not None and (load_before[0] > cpu_count or load_after[0] > cpu_count + own)


def settle(max_s: float, cpu_count: int | None) -> None:
    """Wait up to ``max_s`` seconds for the 1-minute load average to fall to half the cores (what
    earlier work left in it decays with a time constant of a minute)."""
    deadline = time.monotonic() + max_s
    while cpu_count and os.getloadavg()[0] > cpu_count / 2 and time.monotonic() < deadline:
        time.sleep(5)


# --- the sweep -------------------------------------------------------------------------------

def run_sweep(baseline: Path, ring: Path, *, lengths: Sequence[int], batches: Sequence[int] | None = None,
              repeats: int = 3, new_tokens: int | None = None, out_dir: Path, launcher: str = "deepspeed",
              predict: Predict | None = None, command: str | None = None, settle_s: float = 0.0) -> SweepResult:
    """Run the sweep, write ``sweep.json`` (validated) and the plots to ``out_dir``; return the summary.

    Every config and the ``predict`` hook are checked for every point before the first launch;
    then up to ``settle_s`` seconds pass waiting for a quiet machine (:func:`settle`).
    """
    configs = {"baseline": Path(baseline), "ring": Path(ring)}
    if configs["baseline"].stem == configs["ring"].stem:
        raise ConfigError(f"baseline and ring configs share the name {configs['ring'].stem!r}; their runs would "
                          "overwrite each other (copy one under another name)")
    specs = {side: load_side(config) for side, config in configs.items()}
    points = plan_points(specs, lengths, batches, new_tokens)
    derived = derive_all(configs, points, out_dir / "configs")
    predicted = predictions(predict, configs, points) if predict else {}
    settle(settle_s, os.cpu_count())
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    load_before = list(os.getloadavg())
    runs = run_points(derived, points, repeats=repeats, out_dir=out_dir, launcher=launcher)
    load_after = list(os.getloadavg())
    machine = Machine(hostname=socket.gethostname(), cpu_count=os.cpu_count(), platform=platform.platform(),
                      threads_per_rank={side: runs[side, points[0]][0][1].get("threads_per_rank") for side in SIDES})
    summary_points = [summarise_point(p, runs, predicted.get(p)) for p in points]
    summary = SweepResult(
        baseline=side_info(specs["baseline"]), ring=side_info(specs["ring"]), launcher=launcher, repeats=repeats,
        new_tokens=new_tokens, points=summary_points, crossover=crossovers(summary_points),
        provenance=Provenance(command=command or shlex.join(sys.argv), git_commit=git_commit(), date=started,
                              machine=machine, load_before=load_before, load_after=load_after,
                              noisy=is_noisy(load_before, load_after, machine.cpu_count,
                                             own=max(specs[side].layout.world_size for side in SIDES))))
    if summary.provenance.noisy:
        print(f"[sweep] WARNING: noisy machine: 1-minute load average {load_before[0]:.2f} before, "
              f"{load_after[0]:.2f} after the sweep, on {machine.cpu_count} cores; timings are unreliable",
              file=sys.stderr, flush=True)
    write_outputs(summary, out_dir)
    return summary


def write_outputs(summary: SweepResult, out_dir: Path) -> None:
    """``sweep.json`` (validated on the way back) and the plots, predictions dashed where there are any."""
    data = summary.model_dump(mode="json", by_alias=True)
    load_sweep(write_json_atomic(out_dir / "sweep.json", data))
    predicted = {side: {(p.prompt_len, p.batch): p.predicted[side].model_dump() for p in summary.points if p.predicted}
                 for side in SIDES}
    plot_sweep(data, out_dir, predicted=predicted if any(predicted.values()) else None)


def repredict(out_dir: Path, predict: Predict | None) -> SweepResult:
    """A stored sweep with new predictions (or none), its errors and plots rewritten; nothing is rerun.

    For a hardware profile measured after the sweep (``megatron-ring calibrate``). The configs are
    the stored paths, or the shipped configs of the same names where those paths do not exist.
    """
    summary = load_sweep(out_dir / "sweep.json")
    configs = {side: _stored_config(getattr(summary, side).config) for side in SIDES}
    points = [SweepPoint(p.prompt_len, p.batch, p.new_tokens) for p in summary.points]
    predicted = predictions(predict, configs, points) if predict else {}
    summary.points = [
        p.model_copy(update={"predicted": predicted.get(sp),
                             "relative_error": relative_errors(predicted[sp], {side: getattr(p, side) for side in SIDES})
                             if predict else None})
        for p, sp in zip(summary.points, points)]
    write_outputs(summary, out_dir)
    return summary


def _stored_config(path: str) -> Path:
    stored = Path(path)
    return stored if stored.is_file() else find_config(stored.name)


def side_info(spec: InferenceSpec) -> SideInfo:
    return SideInfo(config=str(spec.path), name=spec.name, layout=spec.layout.describe(),
                    world_size=spec.layout.world_size)


# --- output ----------------------------------------------------------------------------------

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


def sweep_main(argv: Sequence[str] | None = None) -> int:
    """Entry of ``megatron-ring sweep``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="megatron-ring sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="*", metavar="PAIR|CONFIG",
                        help=f"a pair name ({', '.join(sorted(compare.PAIRS))}) or baseline and ring config paths")
    parser.add_argument("--lengths", type=positive_int, nargs="+", help="prompt lengths (required unless --replot)")
    parser.add_argument("--batches", type=positive_int, nargs="+", default=None,
                        help="batch sizes (default: the configs' own)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs of each side per point")
    parser.add_argument("--new-tokens", type=positive_int, default=None, help="override the configs' new_tokens")
    parser.add_argument("--out-dir", default="results/sweep", help="where configs, runs, sweep.json and plots go")
    parser.add_argument("--launcher", choices=["deepspeed", "torchrun"], default="deepspeed")
    parser.add_argument("--settle", type=float, default=0.0, metavar="SECONDS",
                        help="first wait up to this long for the load average to fall to half the cores")
    parser.add_argument("--predict", metavar="PROFILE", default=None,
                        help="also predict every point with the planner on this hardware profile (a bundled name "
                             "or a JSON, e.g. one written by megatron-ring calibrate) and store the errors")
    parser.add_argument("--replot", metavar="DIR", default=None,
                        help="run nothing: recompute a stored sweep's predictions (with --predict, else drop them), "
                             "errors and plots in DIR")
    args = parser.parse_args(argv)
    if args.replot:
        if args.configs or args.lengths:
            parser.error("--replot takes no pair and no --lengths: it reads DIR/sweep.json")
        try:
            summary = repredict(Path(args.replot), make_predictor(args.predict) if args.predict else None)
        except (ConfigError, OSError) as err:
            return usage_error(parser.prog, err)
        print(format_sweep_table(summary))
        return 0
    if not args.configs or not args.lengths:
        parser.error("give a pair (or two configs) and --lengths")
    out_dir = Path(args.out_dir)
    try:
        baseline, ring = compare.resolve_pair(args.configs)
        summary = run_sweep(baseline, ring, lengths=args.lengths, batches=args.batches, repeats=args.repeats,
                            new_tokens=args.new_tokens, out_dir=out_dir, launcher=args.launcher,
                            predict=make_predictor(args.predict) if args.predict else None, settle_s=args.settle,
                            command=shlex.join(["megatron-ring", "sweep", *argv]))
    except ConfigError as err:
        return usage_error(parser.prog, err)
    except RuntimeError as err:
        print(f"[sweep] {err}", file=sys.stderr)
        return 1
    print()
    print(format_sweep_table(summary))
    print(f"\n[sweep] {out_dir / 'sweep.json'} and plots written")
    return 0


if __name__ == "__main__":
    sys.exit(sweep_main())
