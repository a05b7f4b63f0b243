"""MegatronRunner: greedy generation from a real Megatron-core GPT is token-identical across layouts.

Prefill shards the prompt zigzag over CP ranks (ring attention, each rank caches its own tokens'
K/V); decode appends each new token's K/V on one CP rank (ragged shards) and merges per-rank
partial attention with decode_attention. The reference recomputes Megatron's plain GPTModel
forward over the whole sequence at every step (no cache, tp = pp = cp = 1).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("pydantic")

from megatron_ring.config import ConfigError, load_mapping  # noqa: E402
from megatron_ring.parallel.layout import ParallelLayout  # noqa: E402
from tests.integration import megatron_workers  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("megatron")]

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "megatron"
TINY = load_mapping(CONFIGS / "tiny_local.yaml")


def _model(attention: str, layout: ParallelLayout, **model: Any) -> dict[str, Any]:
    return {**TINY, "attention": attention, "model": {**TINY["model"], **model},
            "parallel": {"tp": layout.tp, "pp": layout.pp, "cp": layout.cp}}


LAYOUTS = {
    "local-dp4": ("local", ParallelLayout(dp=4)),
    "ring-cp4": ("ring", ParallelLayout(cp=4)),
    "ring-cp2-dp2": ("ring", ParallelLayout(cp=2, dp=2)),
    "local-tp2-pp2": ("local", ParallelLayout(tp=2, pp=2)),
    "ring-tp2-cp2": ("ring", ParallelLayout(tp=2, cp=2)),
    "ring-pp2-cp2": ("ring", ParallelLayout(pp=2, cp=2)),
}


@pytest.mark.parametrize("model", [{"num_query_groups": 2}, {"position_embedding": "learned_absolute"},
                                   {"num_query_groups": 2, "window_size": [5, 0]}],
                         ids=["rope-gqa", "learned-mha", "rope-gqa-window5"])
def test_greedy_tokens_identical_across_layouts(gloo_pool: Any, model: dict[str, Any]) -> None:
    pool = gloo_pool(4)
    reference = pool.run(megatron_workers.generate_without_cache, _model("local", ParallelLayout(dp=4), **model))[0]
    for name, (attention, layout) in LAYOUTS.items():
        tokens = pool.run(megatron_workers.generate_with_runner, _model(attention, layout, **model), layout)
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
    with pytest.raises(ConfigError) as err:  # every problem at once, the dtype included
        check_model(_model("ring", layout), ParallelLayout(cp=4), batch=2, prompt_len=48, new_tokens=20, dtype="bf16")
    for needle in ("(3 problems)", "parallel.cp = 2 but megatron_ring.layout.cp = 4", "exceeds model.seq_length",
                   "DeepSpeed's dtype selects bf16", "dtype = 'fp32'"):
        assert needle in str(err.value), str(err.value)
