"""The schema of ``sweep.json`` (:class:`SweepResult`), validated when written and when read back."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Literal, Optional, Sequence

from pydantic import Field

from megatron_ring.config import StrictModel

SWEEP_SCHEMA = "megatron_ring.perf.sweep/1"
SIDES = ("baseline", "ring")


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
