"""Training under DeepSpeed on gloo: cp = 2 and tp = 2 x cp = 2 train exactly like cp = 1.

Four CPU ranks train the same tiny GPT on the same global batch of real text
for a few AdamW steps (text: the licence corpus under data/corpus, which does not change
with the docs), for ZeRO stages 0, 1 and 2: ring attention at cp = 2 (dp = 2, two micro-batches
accumulated) and tp = 2 x cp = 2 (dp = 1) against one reference, cp = 1 (Megatron's own attention,
dp = 4) under ZeRO-0, trained once per test run (train_workers.once; test_train_zero3.py shares it).
Per-step losses, the held-out loss of an ``eval`` section after every step and the final weights
must agree to fp32 precision. A resume test checks that
train 2 steps, save, restart, one more step on the loaded Adam states gives the uninterrupted
run's losses and weights (that run is test_cp_layouts_train_like_cp1[1]'s tp2-cp2 run, shared).
Workers: tests/integration/train_workers.py; the 4-rank pool is shared (tests/conftest.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("deepspeed")

from tests.integration import train_workers  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "configs" / "megatron"
REL_TOL = 1e-5
STEPS = 3

LAYOUTS = {  # name -> (model file, attention, layout, micro batch, grad accumulation); global batch 4
    "cp1-dp4": ("tiny_ring_tp2_cp2.yaml", "local", {"tp": 1, "cp": 1, "dp": 4}, 1, 1),
    "cp2-dp2": ("tiny_ring_tp2_cp2.yaml", "ring", {"tp": 1, "cp": 2, "dp": 2}, 1, 2),
    "tp2-cp2": ("tiny_ring_tp2_cp2.yaml", "ring", {"tp": 2, "cp": 2, "dp": 1}, 2, 2),
}


def config(layout: str, stage: int, **section: Any) -> dict[str, Any]:
    """A training config mapping for ``layout`` and ZeRO ``stage`` (fp32, constant-lr AdamW)."""
    model, attention, sizes, micro, accum = LAYOUTS[layout]
    ring = {"model": str(MODELS / model), "attention": attention, "layout": sizes, "seq_len": 64,
            "steps": STEPS, "data": {"kind": "text", "paths": [str(ROOT / "data" / "corpus")], "seed": 7},
            "eval": {"paths": [str(ROOT / "data" / "corpus" / "BSD.txt")], "interval": 1}, "log": {"progress": False}}
    ring.update(section)
    return {
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
        # eps 1e-4, not 1e-8: with a tiny eps Adam's first steps move a weight by ~lr*sign(g), so the
        # fp32 rounding of a near-zero gradient (which differs with the reduction order) would flip
        # it; a larger eps keeps the update a smooth function of the gradient.
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "overlap_comm": False},
        "steps_per_print": 10**6,
        "megatron_ring": ring,
    }


def run(pool: Any, raw: dict[str, Any]) -> dict[str, Any]:
    return train_workers.run_on_pool(pool, raw, str(ROOT))


def run_once(pool: Any, raw: dict[str, Any]) -> dict[str, Any]:
    """:func:`run`, trained once per test process for a given config (train_workers.once)."""
    return train_workers.run_once(pool, raw, str(ROOT))


def reference(pool: Any) -> dict[str, Any]:
    """cp = 1, dp = 4 under ZeRO-0: :data:`STEPS` steps, once per test process."""
    ref = run_once(pool, config("cp1-dp4", 0))
    assert len(ref["losses"]) == STEPS and ref["losses"][-1] < ref["losses"][0]
    assert sorted(ref["evals"]) == list(range(STEPS + 1)), ref["evals"]
    return ref


def assert_same(got: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    train_workers.assert_same_training(got, ref, what, loss_tol=REL_TOL, weight_tol=REL_TOL)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_cp_layouts_train_like_cp1(gloo_pool: Any, stage: int) -> None:
    """cp2-dp2 and tp2-cp2 under ZeRO-``stage`` against cp 1 under ZeRO-0 (the stages agree at cp 1)."""
    pool = gloo_pool(4)
    ref = reference(pool)
    for layout in ("cp2-dp2", "tp2-cp2"):
        assert_same(run_once(pool, config(layout, stage)), ref, f"{layout} ZeRO-{stage}")


def test_resume_equals_uninterrupted(gloo_pool: Any, tmp_path: Path) -> None:
    """tp2-cp2 ZeRO-1: 2 steps, saved; resumed for step 3, which runs on the loaded Adam moments and
    step count (bias correction 1 - 0.9^3): the uninterrupted run's losses and weights."""
    pool = gloo_pool(4)
    full = run_once(pool, config("tp2-cp2", 1))
    ckpt = {"dir": str(tmp_path / "ckpt"), "save_interval": 0}
    first = run(pool, config("tp2-cp2", 1, steps=2, checkpoint=ckpt))
    second = run(pool, config("tp2-cp2", 1, steps=STEPS, checkpoint=ckpt))
    assert first["start_step"] == 0 and second["start_step"] == 2 and len(second["losses"]) == STEPS - 2
    assert first["losses"] == full["losses"][:2]
    assert_same({"losses": first["losses"] + second["losses"], "weights": second["weights"]}, full, "resumed")


@pytest.mark.parametrize("layout", [{"tp": 2, "cp": 2, "dp": 1}, {"tp": 1, "cp": 2, "dp": 2}])
def test_process_group_collection_equals_megatrons(gloo_pool: Any, layout: dict[str, int]) -> None:
    for rank, groups in enumerate(gloo_pool(4).run(train_workers.group_ranks, layout)):
        assert groups["ours"] == groups["megatron"], f"rank {rank}"
