"""Run a sweep: every point's runs, in order, with their provenance; write ``sweep.json`` and its plots.

:func:`run_sweep` checks every derived config (points.py) and prediction before the first
launch; :func:`repredict` rewrites a stored sweep's predictions without running anything.
"""
from __future__ import annotations

import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from megatron_ring.config import ConfigError
from megatron_ring.config.shipped import find_config
from megatron_ring.inference import compare
from megatron_ring.inference.schema import InferenceSpec
from megatron_ring.perf.sweep.plots import plot_sweep
from megatron_ring.perf.sweep.points import Runs, SweepPoint, derive_all, load_side, plan_points
from megatron_ring.perf.sweep.schema import SIDES, Machine, Provenance, SideInfo, SweepResult, load_sweep
from megatron_ring.perf.sweep.summary import Predict, crossovers, predictions, relative_errors, summarise_point
from megatron_ring.runtime.reporting import progress, write_json_atomic


RUNS, STAGING = "runs", "runs.partial"
"""Where a sweep's run results end up (``sweep.json`` names them ``runs/<name>.json``), and where they
are written until the sweep is complete (Note [A sweep replaces the last one whole])."""


def run_points(derived: dict[tuple[str, SweepPoint], Path], points: Sequence[SweepPoint], *, repeats: int,
               out_dir: Path, launcher: str) -> Runs:
    """Point by point, repeat by repeat: the baseline, then the ring config (results in ``out_dir/runs.partial``)."""
    runs: Runs = {key: [] for key in derived}
    staging = out_dir / STAGING
    shutil.rmtree(staging, ignore_errors=True)  # a stopped sweep's runs
    staging.mkdir(parents=True)
    bar = progress(len(points) * repeats * len(SIDES), enabled=True, desc="sweep")
    for point in points:
        for rep in range(repeats):
            for side in SIDES:
                config = derived[side, point]
                bar.set_postfix_str(f"{side} L={point.prompt_len} b={point.batch} r{rep}")
                name = f"{config.stem}_r{rep}"
                result = compare.run_config(config, staging, launcher=launcher, name=name)
                runs[side, point].append((f"{RUNS}/{name}.json", result))
                bar.update()
    bar.close()
    return runs


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
    publish_runs(out_dir)
    write_outputs(summary, out_dir)
    return summary


def publish_runs(out_dir: Path) -> None:
    """Replace the last sweep's ``sweep.json`` and ``runs/`` by this sweep's staged runs.

    Note [A sweep replaces the last one whole]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Runs go to ``runs.partial/`` while the sweep runs, so a sweep stopped half-way (a signal, a
    failed run) leaves the last complete sweep in ``out_dir`` as it was. Once every run is done,
    the old ``sweep.json`` goes first, then the old ``runs/``, then the staged runs take its name,
    and the new ``sweep.json`` is written (atomically) last: whatever moment a stop hits, the
    folder never holds a ``sweep.json`` with runs of another sweep.
    """
    (out_dir / "sweep.json").unlink(missing_ok=True)
    shutil.rmtree(out_dir / RUNS, ignore_errors=True)
    (out_dir / STAGING).rename(out_dir / RUNS)


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
