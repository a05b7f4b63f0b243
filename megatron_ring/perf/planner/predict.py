"""The planner's predictions of inference runs.

:func:`predict_inference` evaluates one DeepSpeed inference config (TP/PP baseline or ring) at a
workload as the Megatron runner serves it (``inference/runners/gpt.py``: prefill, pipelined over
micro-batches with pp, then one decode step per new token); :func:`make_predictor` binds a
hardware profile for the sweep's ``predict(config, prompt_len, batch, new_tokens)`` hook (the sweep
stores the errors against its measurements). TTFT, TPOT and TPS follow
:mod:`megatron_ring.inference.metrics` (TPS = overall TPS).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from megatron_ring.perf.planner.cost_model import Planner
from megatron_ring.perf.planner.hardware import HardwareProfile
from megatron_ring.perf.planner.inputs import PlanInput
from megatron_ring.perf.planner.plan_cli import load_plan_input
from megatron_ring.perf.planner.prediction import Prediction

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

    ``micro_batch`` (prefill sequences per micro-batch) defaults to what the runner does: one with
    pipeline stages (Note [Pipelined micro-batches] in ``inference/runners/gpt.py``), the whole batch
    without.
    """
    plan = load_plan_input(config, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, micro_batch=batch)
    if micro_batch is not None or plan.layout.pp > 1:
        plan = replace(plan, workload=replace(plan.workload, micro_batch=micro_batch or 1))
    return summary(plan, Planner(_profile(profile)).predict(plan))


def make_predictor(profile: str | Path | HardwareProfile) -> Predictor:
    """``predict(config, prompt_len, batch, new_tokens) -> {"ttft_s", "tpot_s", "tps", ...}`` on ``profile``."""
    hw = _profile(profile)

    def predict(config: Path, prompt_len: int, batch: int, new_tokens: int) -> dict[str, Any]:
        return predict_inference(config, prompt_len=prompt_len, batch=batch, new_tokens=new_tokens, profile=hw)
    return predict
