"""MegatronRunner: greedy generation from a real Megatron-core GPT is token-identical across layouts.

Prefill shards the prompt zigzag over CP ranks (ring attention, each rank caches its own tokens'
K/V); decode appends each new token's K/V on one CP rank (ragged shards) and merges per-rank
partial attention with decode_attention. The reference recomputes Megatron's plain GPTModel
forward over the whole sequence at every step (no cache, tp = pp = cp = 1).
"""
from __future__ import annotations

from functools import partial, update_wrapper
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("pydantic")

from megatron_ring.config import ConfigError, load_mapping  # noqa: E402
from megatron_ring.parallel.layout import ParallelLayout  # noqa: E402
from megatron_ring.testing.gloo import WorkerError, runs_per_size  # noqa: E402
from tests.integration import megatron_workers  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks")]

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "megatron"
TINY = load_mapping(CONFIGS / "tiny_local.yaml")


def _model(attention: str, layout: ParallelLayout, parallel: dict[str, Any] | None = None,
           **model: Any) -> dict[str, Any]:
    return {**TINY, "attention": attention, "model": {**TINY["model"], **model},
            "parallel": {"tp": layout.tp, "pp": layout.pp, "cp": layout.cp, **(parallel or {})}}


LAYOUTS = {
    "local-dp4": ("local", ParallelLayout(dp=4)),
    "ring-cp4": ("ring", ParallelLayout(cp=4)),
    "ring-cp2-dp2": ("ring", ParallelLayout(cp=2, dp=2)),
    "local-tp2-pp2": ("local", ParallelLayout(tp=2, pp=2)),
    "ring-tp2-cp2": ("ring", ParallelLayout(tp=2, cp=2)),
    "ring-pp2-cp2": ("ring", ParallelLayout(pp=2, cp=2)),
    "ring-tp2-cp2-sp": ("ring", ParallelLayout(tp=2, cp=2), {"sequence_parallel": True}),
    "ring-tp2-pp2-sp": ("ring", ParallelLayout(tp=2, pp=2), {"sequence_parallel": True}),
}
"""name -> (attention, layout[, more parallel keys]); with sequence parallelism prefill runs split over TP
(between pipeline stages too) and decode without (Note [Sequence parallelism in the runner])."""


MODELS = {"rope-gqa": {"num_query_groups": 2}, "learned-mha": {"position_embedding": "learned_absolute"},
          "rope-gqa-window5": {"num_query_groups": 2, "window_size": [5, 0]}}
RUN_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def greedy(gloo_pool: Any) -> Any:
    """Every model's reference and layout tokens on the pool of 4, in one pool call (layouts made once each)."""
    cases = {model_id: {"reference": _model("local", ParallelLayout(dp=4), **model),
                        "layouts": {name: (_model(attention, layout, *extra, **model), layout)
                                    for name, (attention, layout, *extra) in LAYOUTS.items()}}
             for model_id, model in MODELS.items()}
    run = update_wrapper(partial(megatron_workers.greedy_across_layouts, cases), megatron_workers.greedy_across_layouts)
    return runs_per_size(gloo_pool, run, RUN_TIMEOUT_S)


def _tokens(per_rank: list[Any], model_id: str, name: str) -> list[Any]:
    """Every rank's tokens of one run; WorkerError with the tracebacks of the ranks where it failed."""
    failed = {rank: out[model_id][name][1] for rank, out in enumerate(per_rank) if not out[model_id][name][0]}
    if failed:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
        raise WorkerError(f"{model_id} {name} failed on ranks {sorted(failed)}:\n{text}")
    return [out[model_id][name][1] for out in per_rank]


@pytest.mark.parametrize("model_id", list(MODELS))
def test_greedy_tokens_identical_across_layouts(greedy: Any, model_id: str) -> None:
    per_rank = greedy(4)
    reference = _tokens(per_rank, model_id, "reference")[0]
    for name in LAYOUTS:
        tokens = _tokens(per_rank, model_id, name)
        assert all(t == reference for t in tokens), (name, tokens, reference)


def test_check_model_validates_before_building() -> None:
    from megatron_ring.inference.runners.gpt import check_model

    layout = ParallelLayout(cp=2)
    summary = check_model(_model("ring", layout), layout, batch=2, prompt_len=48, new_tokens=16, dtype="fp32")
    assert summary["attention"] == "ring" and summary["num_layers"] == 2 and summary["parameters"] > 0
    with pytest.raises(ConfigError, match=r"parallel.cp = 2 but megatron_ring.layout.cp = 4"):
        check_model(_model("ring", layout), ParallelLayout(cp=4), batch=2, prompt_len=48, new_tokens=16, dtype="fp32")
    with pytest.raises(ConfigError, match=r"48 \+ 20 - 1 = 67 exceeds model.seq_length = 64"):
        check_model(_model("ring", layout), layout, batch=2, prompt_len=48, new_tokens=20, dtype="fp32")
    with pytest.raises(ConfigError, match=r"model.num_attention_heads = 4 is not divisible by parallel.tp = 3"):
        check_model(_model("local", ParallelLayout(tp=3)), ParallelLayout(tp=3), batch=1, prompt_len=8, new_tokens=2,
                    dtype="fp32")
    with pytest.raises(ConfigError, match=r"model.dilation = \[\[16, 2\]\]: the runner's decode attends to every"):
        check_model(_model("ring", layout, dilation=[[16, 2]]), layout, batch=1, prompt_len=32, new_tokens=2,
                    dtype="fp32")
    with pytest.raises(ConfigError) as err:  # every problem at once, the dtype included
        check_model(_model("ring", layout), ParallelLayout(cp=4), batch=2, prompt_len=48, new_tokens=20, dtype="bf16")
    for needle in ("(3 problems)", "parallel.cp = 2 but megatron_ring.layout.cp = 4", "exceeds model.seq_length",
                   "DeepSpeed's dtype selects bf16", "dtype = 'fp32'"):
        assert needle in str(err.value), str(err.value)
