"""launch/trainer_finetune.py under the real DeepSpeed launcher: transformers' Trainer with ring
attention at cp 2 (2 CPU processes, gloo, ZeRO-1 from configs/deepspeed/trainer_cp2.json) finishes
and logs a finite loss for every step, the same on the Trainer's log and in OUTPUT_DIR/losses.json."""
from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.launcher]

ROOT = Path(__file__).resolve().parents[2]
DEEPSPEED = Path(sys.executable).parent / "deepspeed"
STEPS = 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("transformers") is None
                    or not DEEPSPEED.exists(), reason="deepspeed launcher or transformers not installed")
def test_trainer_example_under_the_deepspeed_launcher(tmp_path: Path) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    model = tmp_path / "tiny-llama"
    subprocess.run([sys.executable, "-m", "megatron_ring.testing.tiny_hf", "llama", str(model)], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=120)
    out = tmp_path / "out"
    cmd = [str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(free_port()),
           str(ROOT / "launch" / "trainer_finetune.py"), "--model", str(model), "--cp", "2",
           "--deepspeed", str(ROOT / "configs" / "deepspeed" / "trainer_cp2.json"), "--output_dir", str(out),
           "--max_steps", str(STEPS), "--per_device_train_batch_size", "2", "--logging_steps", "1",
           "--seq_len", "48", "--rows", "8", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    logged = [ast.literal_eval(m) for m in re.findall(r"\{'loss': [^}]*\}", text)]
    saved = json.loads((out / "losses.json").read_text())
    assert saved["cp"] == 2 and saved["dp"] == 1 and len(saved["losses"]) == STEPS, saved
    assert all(math.isfinite(x) for x in saved["losses"]), saved
    assert len(logged) == STEPS, text[-4000:]
    assert [float(entry["loss"]) for entry in logged] == pytest.approx(saved["losses"], rel=1e-3)
