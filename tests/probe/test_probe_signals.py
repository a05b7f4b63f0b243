"""Probe sweep, interrupted commands: a signal to ``compare``, ``sweep`` or ``calibrate`` alone (not to
its process group) stops every process of the job within 15 s, the command exits ``128 + signal``,
and no result file is half-written or left over from another run (Note [Stopping a launched job]
in megatron_ring/runtime/job.py)."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import pytest

from megatron_ring.runtime.reporting import write_json_atomic
from tests.probe.harness import ROOT, assert_clean, assert_no_leftover, assert_no_partial_files, slow

pytestmark = pytest.mark.launcher

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
BOUND_S = 15.0
TOY = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "ffn_hidden_size": 64, "vocab_size": 64}


def toy_pair(folder: Path) -> tuple[Path, Path]:
    """A baseline (cp 1) and a ring (cp 2) toy config whose runs take minutes (many repeats)."""
    paths = []
    for name, cp in (("toy_base", 1), ("toy_ring_cp2", 2)):
        cfg = {"dtype": "fp32", "replace_with_kernel_inject": False,
               "megatron_ring": {"model": {"runner": "toy", "config": TOY}, "layout": {"cp": cp},
                                 "workload": {"batch": 1, "prompt_len": 8, "new_tokens": 64, "warmup": 0,
                                              "repeats": 100000}}}
        paths.append(write_json_atomic(folder / f"{name}.json", cfg))
    return paths[0], paths[1]


def job_processes(marker: str) -> list[int]:
    """Pids of the processes whose command line names ``marker`` (a path only this case uses)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if any(marker in arg for arg in proc.info["cmdline"] or ()):
            found.append(proc.info["pid"])
    return found


def interrupt(argv: list[str], started: Callable[[], bool], working: Callable[[Path], bool], sig: signal.Signals,
              marker: str, ready_s: float = 240) -> tuple[int, float, str]:
    """Run ``megatron-ring ARGV`` in a session of its own, send ``sig`` to the command alone once
    ``started()`` and then ``working(stdout)``, the job into its work (``stdout``: a file the command's
    standard output goes to); return (exit status, seconds from the signal to the exit, stderr).
    Afterwards no process of the session nor any naming ``marker`` may run."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    scratch = tempfile.TemporaryDirectory(prefix="probe_signals_")
    stdout = Path(scratch.name) / "stdout"
    with stdout.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "megatron_ring.cli", *argv], cwd=ROOT, env=env, text=True,
                                stdout=sink, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + ready_s
        for ready, what in ((started, "the job never got going"), (lambda: working(stdout), "the job never got to work")):
            while not ready():
                assert proc.poll() is None, f"exited {proc.returncode} before the signal:\n{proc.stderr.read()[-3000:]}"
                assert time.monotonic() < deadline, what
                time.sleep(0.1)
        proc.send_signal(sig)
        sent = time.monotonic()
        try:
            _, err = proc.communicate(timeout=BOUND_S + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`megatron-ring {' '.join(argv)}` still ran {BOUND_S + 30:.0f} s after {sig.name}")
        elapsed = time.monotonic() - sent
        left = job_processes(marker)
        assert not left, f"job processes left {elapsed:.1f} s after {sig.name}: {left}"
    finally:
        for pid in job_processes(marker):
            os.kill(pid, signal.SIGKILL)
        assert_no_leftover(proc.pid)
        scratch.cleanup()
    return proc.returncode, elapsed, err


def ranks_running(marker: str, count: int) -> Callable[[], bool]:
    """True once ``count`` ranks of the inference entry point with ``marker`` on their command line run."""
    import psutil

    def check() -> bool:
        ranks = []
        for pid in job_processes(marker):
            with contextlib.suppress(psutil.NoSuchProcess):
                cmdline = psutil.Process(pid).cmdline()
                if "megatron_ring.inference.main" in cmdline and any(a.startswith("--local_rank") for a in cmdline):
                    ranks.append(pid)
        return len(ranks) >= count
    return check


def log_shows(folder: Path, needle: str) -> Callable[[Path], bool]:
    """True once a launcher log (``*.log``) under ``folder`` shows ``needle``."""
    def check(_stdout: Path) -> bool:
        return any(needle in log.read_text(errors="replace") for log in folder.rglob("*.log"))
    return check


def prints(needle: str) -> Callable[[Path], bool]:
    """True once the command's standard output shows ``needle``."""
    return lambda stdout: needle in stdout.read_text(errors="replace")


WORKING = "request 1/"
"""Rank 0's progress bar (in the launcher log) once its first measured request started: into the work."""


def check_stopped(code: int, elapsed: float, err: str, sig: signal.Signals, command: str) -> None:
    assert code == 128 + sig, f"exit {code}, not {128 + sig}:\n{err[-3000:]}"
    assert elapsed < BOUND_S, f"{elapsed:.1f} s from {sig.name} to the exit"
    assert f"[{command}] stopped by {sig.name}" in err, err[-3000:]
    assert_clean(err)


@needs_deepspeed
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=slow)], ids=["SIGTERM", "SIGINT"])
def test_signal_to_compare_alone_stops_its_ranks(tmp_path: Path, sig: signal.Signals) -> None:
    """The issue's case: the ranks ran on for 16-18 s and wrote their results after compare had exited."""
    base, ring = toy_pair(tmp_path / "configs")
    out = tmp_path / "out"
    out.mkdir()
    write_json_atomic(out / "toy_ring_cp2.json", {"left": "by an earlier compare"})
    code, elapsed, err = interrupt(["compare", str(base), str(ring), "--out-dir", str(out)],
                                   ranks_running(str(tmp_path), 1), log_shows(out, WORKING), sig, str(tmp_path))
    check_stopped(code, elapsed, err, sig, "compare")
    assert not (out / "toy_base.json").exists() and not (out / "toy_ring_cp2.json").exists(), \
        "a result of a stopped run, or an old one that would pair with the new"
    assert_no_partial_files(out)


@needs_deepspeed
@slow
def test_signal_to_sweep_alone_stops_its_ranks_and_keeps_the_last_sweep(tmp_path: Path) -> None:
    base, ring = toy_pair(tmp_path / "configs")
    out = tmp_path / "out"
    old = {"sweep.json": {"points": "of the last complete sweep"}, "runs/toy_base_L8_b1_r0.json": {"old": True}}
    for name, data in old.items():
        write_json_atomic(out / name, data)
    code, elapsed, err = interrupt(["sweep", str(base), str(ring), "--lengths", "8", "--repeats", "1",
                                    "--out-dir", str(out)], ranks_running(str(tmp_path), 1),
                                   log_shows(out, WORKING), signal.SIGTERM, str(tmp_path))
    check_stopped(code, elapsed, err, signal.SIGTERM, "sweep")
    for name, data in old.items():
        assert json.loads((out / name).read_text()) == data, f"{name} of the last sweep changed"
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["toy_base_L8_b1_r0.json"], "old and new runs mixed"
    assert_no_partial_files(out)


def test_signal_to_calibrate_alone_stops_its_ranks(tmp_path: Path) -> None:
    import psutil

    out = tmp_path / "profile.json"

    def workers_started() -> bool:  # the command and its 2 gloo ranks
        return any(len(psutil.Process(pid).children()) >= 2 for pid in job_processes(str(out)))
    code, elapsed, err = interrupt(["calibrate", "--quick", "--out", str(out)], workers_started,
                                   prints("calibrate: compute and memory"), signal.SIGTERM, str(out))
    check_stopped(code, elapsed, err, signal.SIGTERM, "calibrate")
    assert not list(tmp_path.iterdir()), "calibrate wrote something after the signal"


KILL_BOUND_S = 10.0
"""Issue 38: after SIGKILL of a command that starts ranks, none of its processes remains after 10 s."""


def killed_leaves_nothing(argv: list[str], started: Callable[[], bool], working: Callable[[Path], bool],
                          ready_s: float = 240) -> float:
    """Run ``megatron-ring ARGV``, SIGKILL the command alone once its job works (no handler can run), and
    return the seconds until every process it had started (launcher, ranks, pool workers) is gone."""
    import psutil

    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    scratch = tempfile.TemporaryDirectory(prefix="probe_sigkill_")
    stdout = Path(scratch.name) / "stdout"
    with stdout.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "megatron_ring.cli", *argv], cwd=ROOT, env=env,
                                stdout=sink, stderr=subprocess.DEVNULL, start_new_session=True)
    descendants: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + ready_s
        for ready in (started, lambda: working(stdout)):
            while not ready():
                assert proc.poll() is None and time.monotonic() < deadline, "the job never got to work"
                time.sleep(0.1)
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert descendants, "the command started no process"
        proc.kill()
        proc.wait()
        killed = time.monotonic()
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in descendants) \
                and time.monotonic() - killed < KILL_BOUND_S + 20:
            time.sleep(0.2)
        return time.monotonic() - killed
    finally:
        for p in descendants:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        scratch.cleanup()


@needs_deepspeed
def test_sigkill_of_compare_leaves_no_rank(tmp_path: Path) -> None:
    """The issue's case: the launched job kept running and would have written into --out-dir."""
    base, ring = toy_pair(tmp_path / "configs")
    out = tmp_path / "out"
    gone = killed_leaves_nothing(["compare", str(base), str(ring), "--out-dir", str(out)],
                                 ranks_running(str(tmp_path), 1), log_shows(out, WORKING))
    assert gone <= KILL_BOUND_S, f"processes of the killed compare ran {gone:.1f} s on"
    assert not (out / "toy_base.json").exists()


@slow
def test_sigkill_of_calibrate_leaves_no_pool_worker(tmp_path: Path) -> None:
    import psutil

    out = tmp_path / "profile.json"

    def workers_started() -> bool:
        return any(len(psutil.Process(pid).children()) >= 2 for pid in job_processes(str(out)))
    gone = killed_leaves_nothing(["calibrate", "--quick", "--out", str(out)], workers_started,
                                 prints("calibrate: compute and memory"))
    assert gone <= KILL_BOUND_S, f"pool workers of the killed calibrate ran {gone:.1f} s on"


def test_sigkill_of_bench_attention_leaves_no_pool_worker(tmp_path: Path) -> None:
    """The issue's case: the gloo pool's ranks of a killed ``bench attention`` were alive 150 s later."""
    import psutil

    out = tmp_path / "bench.json"

    def workers_started() -> bool:
        return any(len(psutil.Process(pid).children()) >= 2 for pid in job_processes(str(out)))
    gone = killed_leaves_nothing(["bench", "attention", "--L", "32768", "--P", "2", "--impl", "ring_p2p", "--mode",
                                  "fwd", "--repeats", "1000", "--no-plots", "--out", str(out)], workers_started,
                                 lambda _: True)
    assert gone <= KILL_BOUND_S, f"pool workers of the killed bench ran {gone:.1f} s on"
    assert not out.exists()


def _saving(ckpt: Path) -> list[Path]:
    """The step folders of ``ckpt`` being written: there, but without their complete marker yet."""
    from megatron_ring.training.checkpoint import COMPLETE

    return [d for d in ckpt.glob("step*") if d.is_dir() and not (d / COMPLETE).exists()]


@needs_deepspeed
@pytest.mark.timeout(240)
def test_sigterm_to_the_deepspeed_launcher_mid_save_leaves_no_rank_and_no_false_checkpoint(tmp_path: Path) -> None:
    """SIGTERM to the deepspeed launcher alone while the Megatron engine writes a checkpoint. DeepSpeed's
    runner exits without forwarding it; the ranks once ran 30 s more and wrote another step. Now they see
    their parent gone (Note [Orphaned ranks]) and stop within seconds, and the step being written keeps no
    complete marker: every step marked complete has every file it records, byte for byte."""
    pytest.importorskip("megatron.core")
    from megatron_ring.training.checkpoint import COMPLETE, file_digest
    from tests.integration.test_hung_rank import launcher_command

    ckpt = tmp_path / "ckpt"
    cfg = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1,
           "megatron_ring": {"engine": "megatron", "model": str(ROOT / "configs" / "megatron" / "tiny_ring_cp2.yaml"),
                             "layout": {"cp": 2}, "seq_len": 64, "steps": 100000,
                             "data": {"kind": "text", "paths": [str(ROOT / "docs")]},
                             "megatron": {"optimizer": {"type": "adam", "lr": 1e-3}},
                             "checkpoint": {"dir": str(ckpt), "save_interval": 1}, "log": {"progress": False}}}
    config = write_json_atomic(tmp_path / "mid_save.json", cfg)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "out.txt", "wb") as out:
        proc = subprocess.Popen(launcher_command("deepspeed", 2, "train.py", config), cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not _saving(ckpt) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        assert proc.poll() is None and _saving(ckpt), (tmp_path / "out.txt").read_text()[-3000:]
        os.kill(proc.pid, signal.SIGTERM)  # the launcher alone, as a job scheduler would
        signalled = time.monotonic()
        proc.wait(timeout=30)
        assert_no_leftover(proc.pid, grace_s=10.0 - (time.monotonic() - signalled))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    out_text = (tmp_path / "out.txt").read_text()
    assert "is gone; stopping" in out_text, out_text[-3000:]
    complete = [d for d in ckpt.glob("step*") if (d / COMPLETE).exists()]
    for tag_dir in complete:
        for name, want in json.loads((tag_dir / COMPLETE).read_text())["files"].items():
            got = file_digest(tag_dir / name)
            assert (got["bytes"], got["sha256"]) == (want["bytes"], want["sha256"]), (tag_dir, name)
    latest = (ckpt / "latest").read_text() if (ckpt / "latest").exists() else None
    assert latest is None or (ckpt / latest / COMPLETE).exists(), latest
