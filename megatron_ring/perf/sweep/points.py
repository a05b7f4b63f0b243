"""The points of a sweep and each side's derived config per point, validated before any launch."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from megatron_ring.config import ConfigError, load_mapping
from megatron_ring.inference import compare
from megatron_ring.inference.main import load_spec
from megatron_ring.inference.schema import InferenceSpec, find_model_file
from megatron_ring.integrations.deepspeed.config import SECTION, split_config
from megatron_ring.runtime.reporting import write_json_atomic


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


Runs = dict[tuple[str, SweepPoint], list[tuple[str, dict[str, Any]]]]
"""(side, point) -> [(result file relative to the out dir, result)] in repeat order."""
