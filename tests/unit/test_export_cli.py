"""``megatron-ring export``: what it refuses (one line, exit status 2) and where it sends a checkpoint.

The round trips themselves (a ZeRO-3 checkpoint of a transformers model -> ``from_pretrained``) are in
``tests/integration/test_train_hf_pretrained.py``; here the engine a checkpoint names (or, for a marker
older than that, its files) picks the exporter.
"""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from megatron_ring.cli import main
from megatron_ring.training.checkpoint import checkpoint_engine
from megatron_ring.training.export import export_checkpoint


def complete_step(root: Path, step: int, **marker: Any) -> Path:
    tag_dir = root / f"step{step:08d}"
    tag_dir.mkdir(parents=True)
    (tag_dir / "complete.json").write_text(json.dumps({"tag": tag_dir.name, "step": step, **marker}))
    return tag_dir


def test_export_refuses_what_is_not_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert "CHECKPOINT = " in capsys.readouterr().err
    (tmp_path / "step00000002").mkdir()
    assert main(["export", str(tmp_path / "step00000002"), str(tmp_path / "out")]) == 2
    assert "has no complete.json" in capsys.readouterr().err
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "is not a training checkpoint" in capsys.readouterr().err


def test_export_refuses_a_full_out_dir_and_a_gpt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tag_dir = complete_step(tmp_path / "ckpt", 4, engine="deepspeed")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert main(["export", str(tag_dir), str(tmp_path / "new")]) == 2
    assert "holds no transformers model" in capsys.readouterr().err


def test_megatron_checkpoints_go_to_the_megatron_exporter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The latest complete step of engine 'megatron' goes to ``export_megatron_checkpoint(dir, tag, out)``."""
    calls = []
    module = types.ModuleType("megatron_ring.training.export_megatron")
    module.export_megatron_checkpoint = (  # type: ignore[attr-defined]
        lambda d, tag, out: calls.append((d, tag, out)) or out)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    complete_step(tmp_path / "ckpt", 2, engine="megatron")
    complete_step(tmp_path / "ckpt", 10, engine="megatron")
    (tmp_path / "ckpt" / "step00000012").mkdir()  # unfinished: never taken
    assert export_checkpoint(tmp_path / "ckpt", tmp_path / "out") == tmp_path / "out"
    assert calls == [(tmp_path / "ckpt", "step00000010", tmp_path / "out")]


def test_a_marker_without_engine_is_told_by_its_files(tmp_path: Path) -> None:
    old = complete_step(tmp_path, 1)
    assert checkpoint_engine({}, old) == "megatron"
    (old / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert checkpoint_engine({}, old) == "deepspeed"
    with pytest.raises(ValueError, match="engine = 'jax'"):
        checkpoint_engine({"engine": "jax"}, old)
