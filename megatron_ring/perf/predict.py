"""The planner's predictions of inference runs, and their error against measurements.

:func:`predict_inference` evaluates one DeepSpeed inference config (TP/PP baseline or ring) at a
workload as the Megatron runner serves it (``inference/runners/gpt.py``: the whole batch in one
prefill pass, then one decode step per new token); :func:`make_predictor` binds a hardware
profile for the sweep's ``predict(config, prompt_len, batch, new_tokens)`` hook, and
:func:`prediction_errors` compares a prediction with a measured point. TTFT, TPOT and TPS follow
:mod:`megatron_ring.inference.metrics` (TPS = overall TPS).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from megatron_ring.perf.cost_model import Planner, PlanInput, Prediction
from megatron_ring.perf.hardware import HardwareProfile
from megatron_ring.perf.plan_cli import load_plan_input

Predictor = Callable[[Path, int, int, int], dict[str, Any]]


def _profile(profile: str | Path | HardwareProfile) -> HardwareProfile:
    return profile if isinstance(profile, HardwareProfile) else HardwareProfile.load(profile)


def summary(plan: PlanInput, pred: Prediction) -> dict[str, Any]:
    """TTFT, TPOT, TPS (the metrics module's definitions), the dominant terms and every term of ``pred``."""
    w = plan.workload
    steps = w.new_tokens - 1
    sequences = plan.layout.dp * w.batch
    return {
        "ttft_s": pred.ttft_s, "tpot_s": pred.tpot_s,
        "tps": sequences * (w.prompt_len + steps) / (pred.ttft_s + steps * pred.tpot_s),
        "prefill_tps": pred.prefill_tps, "decode_tps": pred.decode_tps,
        "dominant": {"ttft": pred.dominant("ttft"), "tpot": pred.dominant("tpot")},
        "terms_ms": pred.terms_ms, "fits": pred.memory.fits, "memory_per_rank_bytes": pred.memory.total,
        "layout": pred.label, "profile": pred.hardware,
    }


def predict_inference(config: str | Path, *, prompt_len: int, batch: int, new_tokens: int,
                      profile: str | Path | HardwareProfile, micro_batch: int | None = None) -> dict[str, Any]:
    """The planner's prediction of one run of a DeepSpeed inference ``config`` (see :func:`summary`).

    ``micro_batch`` defaults to ``batch``: the runner prefills the whole batch in one pass, and its
    pipeline stages take turns (no micro-batch pipelining).
    """
    plan = load_plan_input(config, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                           micro_batch=micro_batch or batch)
    return summary(plan, Planner(_profile(profile)).predict(plan))


def make_predictor(profile: str | Path | HardwareProfile) -> Predictor:
    """``predict(config, prompt_len, batch, new_tokens) -> {"ttft_s", "tpot_s", "tps", ...}`` on ``profile``."""
    hw = _profile(profile)

    def predict(config: Path, prompt_len: int, batch: int, new_tokens: int) -> dict[str, Any]:
        return predict_inference(config, prompt_len=prompt_len, batch=batch, new_tokens=new_tokens, profile=hw)
    return predict


_MEASURED: dict[str, tuple[tuple[str, float], ...]] = {
    "ttft": (("ttft_s", 1.0), ("ttft_ms", 1e-3)),
    "tpot": (("tpot_s", 1.0), ("tpot_mean_ms", 1e-3)),
    "tps": (("tps", 1.0), ("overall_tps", 1.0)),
}
"""Where a measured point keeps each quantity: the predictor's keys, or the metrics module's."""


def _value(point: dict[str, Any], metric: str) -> float | None:
    for key, scale in _MEASURED[metric]:
        if point.get(key) is not None:
            return float(point[key]) * scale
    return None


def prediction_errors(measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, float]:
    """Relative errors ``(predicted - measured) / measured``: ``{"ttft_rel_err", "tpot_rel_err"}``, and
    ``"tps_rel_err"`` when both sides have a TPS.

    ``measured`` may use the predictor's keys (``ttft_s``, ``tpot_s``, ``tps``) or the metrics
    module's (``ttft_ms``, ``tpot_mean_ms``, ``overall_tps``).
    """
    out = {}
    for metric in ("ttft", "tpot", "tps"):
        meas, pred = _value(measured, metric), _value(predicted, metric)
        if meas is None or pred is None:
            if metric == "tps":
                continue
            raise ValueError(f"{metric} is missing: measured has {sorted(measured)}, predicted {sorted(predicted)}")
        if meas <= 0:
            raise ValueError(f"measured {metric} must be > 0, got {meas}")
        out[f"{metric}_rel_err"] = (pred - meas) / meas
    return out
