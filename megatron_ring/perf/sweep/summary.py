"""From runs to the points of ``sweep.json``: medians, ratios, crossovers, the planner's predictions and errors."""
from __future__ import annotations

import math
from itertools import pairwise
from pathlib import Path
from typing import Any, Callable, Sequence

from megatron_ring.inference.metrics import rank_max
from megatron_ring.perf.sweep.points import Runs, SweepPoint
from megatron_ring.perf.sweep.schema import SIDES, Point, Ratios, SideStats, Spread, TimingFields

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
