"""Checkpoints that cannot be trusted are refused, naming the file (2 gloo ranks, cp = 2).

A saved checkpoint records every file's size and SHA-256 in complete.json; resume refuses a
bit-flipped or truncated file on every rank, a change of layout naming both, and a non-finite loss
stops every rank without saving that step (Note [Complete checkpoints] in
megatron_ring/training/checkpoint.py). Write failures name the real cause.
"""
from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("deepspeed")

from megatron_ring.training.checkpoint import (COMPLETE, CheckpointError, latest_checkpoint,  # noqa: E402
                                               save_checkpoint, write_failure_cause)
from tests.integration import train_workers  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "mp_rank_00_model_states.pt"


def config(tmp_path: Path, steps: int, layout: dict[str, int] | None = None, **section: Any) -> dict[str, Any]:
    ring = {"model": str(ROOT / "configs" / "megatron" / "tiny_ring_cp2.yaml"), "layout": layout or {"cp": 2},
            "seq_len": 32, "steps": steps, "data": {"kind": "text", "paths": [str(ROOT / "docs")]},
            "checkpoint": {"dir": str(tmp_path / "ckpt"), "save_interval": 1}, "log": {"progress": False}}
    ring.update(section)
    return {"train_batch_size": 2 if (layout or {}).get("dp", 1) == 2 else 1, "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": 0}, "steps_per_print": 10**6, "megatron_ring": ring}


def run(pool: Any, raw: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
    return pool.run(train_workers.run_or_refuse, raw, str(ROOT), timeout_s=240, **kw)


def errors(results: list[dict[str, Any]]) -> str:
    found = [r.get("error") for r in results]
    assert all(found) and len(set(found)) == 1, f"every rank must refuse alike: {found}"
    return found[0]


def test_checkpoints_record_digests_and_refuse_damage(gloo_pool: Any, tmp_path: Path) -> None:
    pool = gloo_pool(2)
    assert all(r["losses"] and "error" not in r for r in run(pool, config(tmp_path, 2)))
    tag = tmp_path / "ckpt" / latest_checkpoint(tmp_path / "ckpt")
    files = json.loads((tag / COMPLETE).read_text())["files"]
    assert MODEL in files and files[MODEL]["bytes"] == (tag / MODEL).stat().st_size

    data = bytearray((tag / MODEL).read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    (tag / MODEL).write_bytes(bytes(data))
    err = errors(run(pool, config(tmp_path, 3)))
    assert err.startswith("CheckpointError") and str(tag / MODEL) in err and "SHA-256" in err, err

    (tag / MODEL).write_bytes(bytes(data[:100]))
    err = errors(run(pool, config(tmp_path, 3)))
    assert str(tag / MODEL) in err and f"has 100 bytes, the checkpoint wrote {files[MODEL]['bytes']}" in err, err
    assert latest_checkpoint(tmp_path / "ckpt") == tag.name, "a refused resume saves nothing"


@pytest.mark.probe
def test_resume_refuses_another_layout_naming_both(gloo_pool: Any, tmp_path: Path) -> None:
    pool = gloo_pool(2)
    run(pool, config(tmp_path, 1))
    err = errors(run(pool, config(tmp_path, 2, layout={"cp": 1, "dp": 2})))
    assert err.startswith("ConfigError") and "tp=1 x cp=2 x dp=1 x pp=1" in err and "tp=1 x cp=1 x dp=2 x pp=1" in err


@pytest.mark.probe
def test_overwrite_starts_a_new_lineage_alone(gloo_pool: Any, tmp_path: Path) -> None:
    """resume: false + overwrite: true into a folder of 3 steps: the old steps are deleted first, so the
    new run's single step is all the folder holds (and a resume would take it, not the old step 3)."""
    pool = gloo_pool(2)
    first = run(pool, config(tmp_path, 3))
    assert latest_checkpoint(tmp_path / "ckpt") == "step00000003"
    again = run(pool, config(tmp_path, 1, checkpoint={"dir": str(tmp_path / "ckpt"), "save_interval": 1,
                                                      "resume": False, "overwrite": True}))
    assert again[0]["start_step"] == 0 and again[0]["losses"] == first[0]["losses"][:1]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.is_dir()) == ["step00000001"]


def test_nonfinite_loss_stops_without_saving_the_step(gloo_pool: Any, tmp_path: Path) -> None:
    pool = gloo_pool(2)
    err = errors(run(pool, config(tmp_path, 4), nan_at_call=3))
    assert err.startswith("TrainingStopped") and "step 3: the global loss is nan" in err and "step00000002" in err
    assert latest_checkpoint(tmp_path / "ckpt") == "step00000002"


def test_nonfinite_loss_may_train_on_but_is_never_saved(gloo_pool: Any, tmp_path: Path) -> None:
    results = run(gloo_pool(2), config(tmp_path, 3, stop_on_nonfinite_loss=False), nan_at_call=3)
    assert all(len(r["losses"]) == 3 for r in results), results
    assert latest_checkpoint(tmp_path / "ckpt") == "step00000002", "the non-finite last step must not be saved"


class RefusingEngine:
    def save(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0; iostream error")


def test_write_failures_name_the_real_cause(tmp_path: Path, monkeypatch: Any) -> None:
    real_open = Path.open

    def full_disk(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self.name.startswith(".megatron_ring_probe"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", full_disk)
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(RefusingEngine(), tmp_path, 7, {})
    text = str(err.value)
    assert "saving step 7 into" in text and "the file system is full" in text and "stays None" in text, text
    assert not list(tmp_path.glob(".megatron_ring_probe*"))
    monkeypatch.setattr(Path, "open", real_open)
    assert write_failure_cause(tmp_path, RuntimeError("x")) == "RuntimeError: x", "a writable place keeps the error"
