"""launch/train.py under the real DeepSpeed launcher (4 CPU processes, gloo): a rank killed
mid-training stops every other rank within 30 s naming it, and the last complete checkpoint stays
the one resume would take (Note [Complete checkpoints] in megatron_ring/training/checkpoint.py)."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.launcher]

ROOT = Path(__file__).resolve().parents[2]
DEEPSPEED = Path(sys.executable).parent / "deepspeed"
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None or not DEEPSPEED.exists()
    or importlib.util.find_spec("megatron") is None, reason="deepspeed launcher or megatron-core not installed")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def endless_config(tmp_path: Path) -> Path:
    """cp = 2 x dp = 2 on the tiny model, many steps, a checkpoint every 2 steps."""
    cfg = {
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1}, "steps_per_print": 10**6,
        "megatron_ring": {
            "name": "fault", "model": str(ROOT / "configs" / "megatron" / "tiny_ring_cp2.yaml"),
            "layout": {"cp": 2, "dp": 2}, "seq_len": 64, "steps": 100000,
            "data": {"kind": "text", "paths": [str(ROOT / "docs")]},
            "checkpoint": {"dir": str(tmp_path / "ckpt"), "save_interval": 2},
            "log": {"jsonl": str(tmp_path / "train.jsonl"), "progress": False},
        },
    }
    path = tmp_path / "fault.json"
    path.write_text(json.dumps(cfg))
    return path


def log_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


@needs_deepspeed
def test_killed_rank_stops_the_others_and_keeps_the_last_complete_checkpoint(tmp_path: Path) -> None:
    import psutil
    import torch

    from megatron_ring.training.checkpoint import COMPLETE, latest_checkpoint

    cmd = [str(DEEPSPEED), "--num_gpus", "4", "--master_port", str(free_port()), str(ROOT / "launch" / "train.py"),
           "--deepspeed_config", str(endless_config(tmp_path))]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read1(4096), b"")), daemon=True)
    reader.start()
    log = tmp_path / "train.jsonl"
    try:
        deadline = time.monotonic() + 200
        while not any(r.get("event") == "checkpoint" and r["step"] >= 4 for r in log_lines(log)):
            assert proc.poll() is None, b"".join(chunks).decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "training never reached its second checkpoint"
            time.sleep(0.2)
        pids = next(r for r in log_lines(log) if r.get("event") == "start")["pids"]
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        survivors = [psutil.Process(p) for p in (pids[0], pids[2], pids[3]) if psutil.pid_exists(p)]
        _, alive = psutil.wait_procs(survivors, timeout=30)
        assert not alive, f"ranks still running 30 s after the kill: {[p.pid for p in alive]}"
        assert time.monotonic() - killed_at < 30
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=5)
    out = b"".join(chunks).decode(errors="replace")
    assert proc.returncode != 0
    for rank in (0, 2, 3):
        lines = [ln for ln in out.splitlines() if f"[megatron_ring] rank {rank}:" in ln]
        assert lines and all("rank 1" in ln for ln in lines), f"rank {rank} did not name rank 1:\n{out[-3000:]}"
    tag = latest_checkpoint(tmp_path / "ckpt")
    assert tag is not None and int(tag[4:]) >= 4
    saved = json.loads((tmp_path / "ckpt" / tag / COMPLETE).read_text())
    assert saved["step"] == int(tag[4:])
    states = torch.load(tmp_path / "ckpt" / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    assert states["step"] == saved["step"] and states["module"]
    assert len(list((tmp_path / "ckpt" / tag).glob("zero_pp_rank_*_optim_states.pt"))) == 4
