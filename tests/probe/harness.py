"""The probe sweep's checks: a user action under a hard timeout, then no hang, no abort, no raw
traceback for a user error, no half-written file and no leftover process."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLOW = os.environ.get("MEGATRON_RING_PROBE_SLOW") == "1"
slow = pytest.mark.skipif(not SLOW, reason="slow probe case: MEGATRON_RING_PROBE_SLOW=1 (python scripts/probe.py --slow)")


@dataclass
class Outcome:
    code: int
    out: str
    err: str


def run_cli(*args: str, timeout_s: float = 60, env: Optional[dict[str, str]] = None, cwd: Path = ROOT) -> Outcome:
    """``python -m megatron_ring.cli ARGS`` in a session of its own, killed at ``timeout_s`` (a hang
    fails the case); afterwards nothing of the session may still run."""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                "DS_ACCELERATOR": "cpu", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "megatron_ring.cli", *args], cwd=cwd, env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"hang: `megatron-ring {' '.join(args)}` still ran after {timeout_s:.0f} s\n{err[-2000:]}")
    assert_no_leftover(proc.pid)
    assert proc.returncode >= 0, f"aborted by signal {-proc.returncode}:\n{err[-2000:]}"
    return Outcome(proc.returncode, out, err)


def run_in_process(argv: list[str], capsys: pytest.CaptureFixture) -> Outcome:
    """``megatron-ring ARGV`` as ``cli.main(ARGV)`` in this process, from the repository root (an
    argparse error's SystemExit is its exit status), with what it printed."""
    from megatron_ring.cli import main

    capsys.readouterr()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    finally:
        os.chdir(cwd)
    out, err = capsys.readouterr()
    return Outcome(code, out, err)


def assert_no_leftover(session: int, grace_s: float = 3.0) -> None:
    """No process of the session ``session`` still runs ``grace_s`` after the command ended (one being
    torn down, e.g. multiprocessing's resource tracker after its parent, gets that long); a leftover
    is killed."""
    import time

    deadline = time.monotonic() + grace_s
    while _session_processes(session) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _session_processes(session)
    if left:
        os.killpg(session, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"


def _session_processes(session: int) -> list[tuple[int, str]]:
    """(pid, command line tail) of the live processes of session ``session``."""
    import psutil

    left = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if os.getsid(proc.pid) == session and proc.info["status"] != psutil.STATUS_ZOMBIE:  # exited, unreaped
                left.append((proc.pid, " ".join(proc.info["cmdline"] or ())[-120:]))
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue
    return left


def assert_usage_error(outcome: Outcome, *needles: str) -> None:
    """Exit status 2, no traceback, and every needle in the error output."""
    assert outcome.code == 2, f"exit {outcome.code}, not 2:\n{outcome.err[-2000:]}"
    assert_clean(outcome.err)
    for needle in needles:
        assert needle in outcome.err, f"{needle!r} not in:\n{outcome.err[-2000:]}"


def assert_clean(text: str) -> None:
    assert "Traceback (most recent call last)" not in text, f"raw traceback for a user error:\n{text[-3000:]}"


def assert_no_partial_files(folder: Path) -> None:
    """No temporary leftovers, and every JSON file parses."""
    assert not [p for p in folder.rglob("*") if p.name.endswith(".tmp") or ".tmp." in p.name], "half-written files"
    for path in folder.rglob("*.json"):
        json.loads(path.read_text())


def train_config(tmp_path: Path, **section: Any) -> dict[str, Any]:
    """A 2-rank (cp 2) training config on the tiny model and the repository's docs."""
    ring = {"model": str(ROOT / "configs" / "megatron" / "tiny_ring_cp2.yaml"), "layout": {"cp": 2}, "seq_len": 32,
            "steps": 2, "data": {"kind": "text", "paths": [str(ROOT / "docs")]},
            "checkpoint": {"dir": str(tmp_path / "ckpt"), "save_interval": 1}, "log": {"progress": False}}
    ring.update(section)
    return {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": 0}, "steps_per_print": 10**6, "megatron_ring": ring}
