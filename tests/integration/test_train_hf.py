"""A transformers causal LM trains under the ring exactly like without it, and ZeRO-3 like ZeRO-0.

A tiny random Llama (GQA, RoPE, built offline from a config) trains for a few AdamW steps on the
licence corpus with a global batch of 4 sequences: on one process with transformers' own sdpa
attention, at cp = 1 x dp = 4 (sdpa), and at cp = 2 x dp = 2 with ring attention (zigzag shards,
two micro-batches accumulated), each under DeepSpeed's engine with our mpu. Per-step losses and the
final weights must agree within 1e-5 relative; so must ZeRO-3 and ZeRO-0 at cp = 2 x dp = 2.
Workers: tests/integration/zero3_workers.py (weights gathered under ZeRO-3).
"""
from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from tests.integration import zero3_workers  # noqa: E402
from tests.integration.test_train_equivalence import ROOT, assert_same  # noqa: E402

pytestmark = pytest.mark.integration

STEPS = 3
TINY_LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256}
LAYOUTS = {  # name -> (world size, layout, attention, micro batch, grad accumulation); global batch 4
    "single": (1, {"cp": 1, "dp": 1}, "sdpa", 2, 2),
    "cp1-dp4": (4, {"cp": 1, "dp": 4}, "sdpa", 1, 1),
    "cp2-dp2": (4, {"cp": 2, "dp": 2}, "ring", 1, 2),
}


def hf_config(layout: str, stage: int) -> tuple[int, dict[str, Any]]:
    """``(world size, training config)`` of the tiny Llama for ``layout`` and ZeRO ``stage`` (fp32)."""
    world, sizes, attention, micro, accum = LAYOUTS[layout]
    return world, {
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "overlap_comm": False},
        "steps_per_print": 10**6,
        "megatron_ring": {
            "transformers": {"config": TINY_LLAMA, "attention": attention},
            "layout": sizes, "seq_len": 64, "steps": STEPS,
            "data": {"kind": "text", "paths": [str(ROOT / "data" / "corpus")], "seed": 7},
            "log": {"progress": False},
        },
    }


def run_hf(pools: Any, layout: str, stage: int) -> dict[str, Any]:
    world, raw = hf_config(layout, stage)
    results = pools(world).run(zero3_workers.run_gathered, raw, str(ROOT), timeout_s=300)
    assert len({tuple(r["losses"]) for r in results}) == 1, "ranks disagree on the step losses"
    assert len(results[0]["losses"]) == STEPS
    return results[0]


@pytest.fixture(scope="module")
def single(gloo_pool: Any) -> dict[str, Any]:
    return run_hf(gloo_pool, "single", 0)


@pytest.mark.parametrize("layout", ["cp1-dp4", "cp2-dp2"])
def test_transformers_model_trains_like_one_process(gloo_pool: Any, single: dict[str, Any], layout: str) -> None:
    assert_same(run_hf(gloo_pool, layout, 0), single, f"{layout} ZeRO-0")


def test_transformers_zero3_trains_like_zero0(gloo_pool: Any, single: dict[str, Any]) -> None:
    assert_same(run_hf(gloo_pool, "cp2-dp2", 3), single, "cp2-dp2 ZeRO-3")
