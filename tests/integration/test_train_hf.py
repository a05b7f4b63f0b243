"""A transformers causal LM trains under the ring exactly like without it, and ZeRO-3 like ZeRO-0.

A tiny random Llama (GQA, RoPE, built offline from a config) trains for a few AdamW steps on the
licence corpus with a global batch of 4 sequences: on one process with transformers' own sdpa
attention, at cp = 1 x dp = 4 (sdpa), and at cp = 2 x dp = 2 with ring attention (zigzag shards,
two micro-batches accumulated), each under DeepSpeed's engine with our mpu. Per-step losses and the
final weights must agree within 1e-5 relative; so must ZeRO-3 and ZeRO-0 at cp = 2 x dp = 2, and a
ZeRO-3 run saved after 2 steps and resumed for a third with the uninterrupted one (the ZeRO-3 test's
run, trained once: train_workers.once).
Workers: tests/integration/zero3_workers.py (weights gathered under ZeRO-3).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from tests.integration import train_workers, zero3_workers  # noqa: E402
from tests.integration.test_train_equivalence import ROOT, assert_same  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks"), pytest.mark.slow]

STEPS = 3
TINY_LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256}
LAYOUTS = {  # name -> (world size, layout, attention, micro batch, grad accumulation); global batch 4
    "single": (1, {"cp": 1, "dp": 1}, "sdpa", 2, 2),
    "cp1-dp4": (4, {"cp": 1, "dp": 4}, "sdpa", 1, 1),
    "cp2-dp2": (4, {"cp": 2, "dp": 2}, "ring", 1, 2),
}


def hf_config(layout: str, stage: int, **section: Any) -> tuple[int, dict[str, Any]]:
    """``(world size, training config)`` of the tiny Llama for ``layout`` and ZeRO ``stage`` (fp32);
    ``section`` overrides keys of the ``megatron_ring`` section."""
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
            **section,
        },
    }


def run_hf(pools: Any, layout: str, stage: int, **section: Any) -> dict[str, Any]:
    world, raw = hf_config(layout, stage, **section)
    results = pools(world).run(zero3_workers.run_gathered, raw, str(ROOT), timeout_s=300)
    assert len({tuple(r["losses"]) for r in results}) == 1, "ranks disagree on the step losses"
    return results[0]


def run_hf_once(pools: Any, layout: str, stage: int) -> dict[str, Any]:
    """:func:`run_hf` of :data:`STEPS` steps, trained once per test process (train_workers.once)."""
    return train_workers.once(hf_config(layout, stage)[1], lambda: run_hf(pools, layout, stage),
                              how=f"run_gathered {ROOT}")


@pytest.fixture(scope="module")
def single(gloo_pool: Any) -> dict[str, Any]:
    return run_hf(gloo_pool, "single", 0)


@pytest.mark.parametrize("layout", ["cp1-dp4", "cp2-dp2"])
def test_transformers_model_trains_like_one_process(gloo_pool: Any, single: dict[str, Any], layout: str) -> None:
    assert len(single["losses"]) == STEPS
    assert_same(run_hf(gloo_pool, layout, 0), single, f"{layout} ZeRO-0")


def test_transformers_zero3_trains_like_zero0(gloo_pool: Any, single: dict[str, Any]) -> None:
    assert_same(run_hf_once(gloo_pool, "cp2-dp2", 3), single, "cp2-dp2 ZeRO-3")


def test_transformers_zero3_resume_equals_uninterrupted(gloo_pool: Any, tmp_path: Path) -> None:
    """2 steps, saved; resumed for step 3, which runs on the loaded (partitioned) Adam moments and
    step count: the uninterrupted run's losses and weights."""
    full = run_hf_once(gloo_pool, "cp2-dp2", 3)
    ckpt = {"dir": str(tmp_path / "ckpt"), "save_interval": 0}
    first = run_hf(gloo_pool, "cp2-dp2", 3, steps=2, checkpoint=ckpt)
    second = run_hf(gloo_pool, "cp2-dp2", 3, steps=STEPS, checkpoint=ckpt)
    assert first["start_step"] == 0 and second["start_step"] == 2 and len(second["losses"]) == STEPS - 2
    assert first["losses"] == full["losses"][:2]
    assert_same({"losses": first["losses"] + second["losses"], "weights": second["weights"]}, full, "resumed")
