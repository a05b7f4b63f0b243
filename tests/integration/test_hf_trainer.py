"""transformers' Trainer with ring attention (RingTrainer) trains exactly like transformers' own Trainer at cp 1.

A tiny random Llama (GQA, RoPE, byte tokenizer) trains for 3 AdamW steps on rows of the licence
corpus of 16 to 32 tokens (11 of the 16 lengths not a multiple of 2 * cp = 4; each row right-padded
to the longest of its micro-batch), global batch 4 (2 rows per micro-batch, 2 micro-batches accumulated). The reference is
transformers' own ``Trainer`` with sdpa attention in one process, without DeepSpeed; against it,
``RingTrainer`` at cp 2 under DeepSpeed ZeRO-1 (the shipped configs/deepspeed/trainer_cp2.json) and
ZeRO-3, and at cp 2 x dp 2 under DDP (no DeepSpeed, one row per micro-batch) with gradient
checkpointing (the ring recomputed in the backward). Per-step logged
losses and the final weights must agree within 1e-5 relative (fp32).
Workers: tests/integration/trainer_workers.py.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from tests.integration import trainer_workers, train_workers  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks")]

ROOT = Path(__file__).resolve().parents[2]
REL_TOL = 1e-5
STEPS = 3
ZERO1 = json.loads((ROOT / "configs" / "deepspeed" / "trainer_cp2.json").read_text())
ZERO3 = {**ZERO1, "zero_optimization": {"stage": 3, "overlap_comm": False}}


def run(pool: Any, out: Path, *, cp: int, attention: str, micro: int, deepspeed: dict | None,
        **extra: Any) -> dict[str, Any]:
    ours = {"model": str(out / "tiny-llama"), "cp": cp, "attention": attention,
            "data": str(ROOT / "data" / "corpus"), "seq_len": 32, "rows": 16}
    training = {"output_dir": str(out / "trainer"), "max_steps": STEPS, "per_device_train_batch_size": micro,
                "gradient_accumulation_steps": 2, "learning_rate": 1e-3, "warmup_steps": 0, "logging_steps": 1,
                "report_to": "none", "save_strategy": "no", "disable_tqdm": True, "seed": 3,
                "deepspeed": deepspeed, "use_cpu": deepspeed is None, **extra}
    results = pool.run(trainer_workers.train, ours, training, timeout_s=300)
    assert len({tuple(r["losses"]) for r in results}) == 1, "ranks disagree on the logged losses"
    assert len(results[0]["losses"]) == STEPS
    return results[0]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory, gloo_pool: Any) -> Path:
    folder = tmp_path_factory.mktemp("trainer")
    gloo_pool(1).run(trainer_workers.write_tiny_llama, str(folder / "tiny-llama"), timeout_s=120)
    return folder


@pytest.fixture(scope="module")
def reference(gloo_pool: Any, out: Path) -> dict[str, Any]:
    """transformers' own Trainer, sdpa, one process, no DeepSpeed."""
    return run(gloo_pool(1), out, cp=1, attention="sdpa", micro=2, deepspeed=None)


@pytest.mark.parametrize("zero", ["zero1", "zero3"])
def test_ring_trainer_cp2_deepspeed_equals_cp1(gloo_pool: Any, out: Path, reference: dict[str, Any], zero: str) -> None:
    got = run(gloo_pool(2), out, cp=2, attention="ring", micro=2, deepspeed=ZERO1 if zero == "zero1" else ZERO3)
    train_workers.assert_same_training(got, reference, f"cp2 {zero}", loss_tol=REL_TOL, weight_tol=REL_TOL)


def test_ring_trainer_cp2_dp2_ddp_recomputed_equals_cp1(gloo_pool: Any, out: Path, reference: dict[str, Any]) -> None:
    """DDP instead of DeepSpeed, two DP groups, and every layer recomputed in the backward (its ring too)."""
    got = run(gloo_pool(4), out, cp=2, attention="ring", micro=1, deepspeed=None, activation_checkpointing=True)
    train_workers.assert_same_training(got, reference, "cp2 dp2 DDP recomputed", loss_tol=REL_TOL, weight_tol=REL_TOL)
