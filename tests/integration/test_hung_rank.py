"""A rank that hangs (SIGSTOP) under the real DeepSpeed launcher, in inference and in training.

A stopped process ignores SIGTERM, so without the watchdog of Note [Lost ranks]
(megatron_ring/runtime/faults.py) the survivors block in their next collective and the launcher
waits for ever. With it, within ``peer_timeout_s + 15 s`` of the stop every survivor exits non-zero
naming the stalled rank, the stalled rank is killed, and the launcher returns.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.launcher]

ROOT = Path(__file__).resolve().parents[2]
DEEPSPEED = Path(sys.executable).parent / "deepspeed"
TORCHRUN = Path(sys.executable).parent / "torchrun"
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None or not DEEPSPEED.exists(),
                                     reason="deepspeed launcher not installed")
needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
probe_slow = pytest.mark.skipif(os.environ.get("MEGATRON_RING_PROBE_SLOW") != "1", reason=(
    "slow probe case: the same lost-rank path as a case the suite runs (python scripts/probe.py --slow): a "
    "non-zero rank found by its heartbeat under the deepspeed launcher is training's rank1; rank 0 hosting the "
    "store is inference's rank0_store_host"))

PEER_TIMEOUT_S = 2.0
"""Peer timeout of the mid-run cases: the monitors beat every 0.25 s, so 2 s of silence is 8 missed
beats (a slow rank still beats: Note [Lost ranks]), and an observer's own gap counts at most 1 s."""
START_UP_TIMEOUT_S = 1.0
"""Peer timeout of the start-up cases: before attach only a stopped sibling (/proc state T) counts,
which a slow rank never is, so the shortest timeout that still spans a few checks."""
BOUND_S = PEER_TIMEOUT_S + 15


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_pid(launcher_pid: int, script: str, local_rank: int) -> int | None:
    """The pid of the rank running ``script`` with ``local_rank``: the deepspeed launcher passes it as
    ``--local_rank=N``, torchrun as ``LOCAL_RANK`` in the environment."""
    import psutil

    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            cmdline, env = child.cmdline(), child.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if not any(arg.endswith(script) for arg in cmdline) or "python" not in Path(cmdline[0]).name:
            continue
        if f"--local_rank={local_rank}" in cmdline or env.get("LOCAL_RANK") == str(local_rank):
            return child.pid
    return None


def launcher_command(launcher: str, nprocs: int, script: str, config: Path) -> list[str]:
    """The deepspeed launcher, or torchrun, whose agent hosts the rendezvous store (not rank 0)."""
    port = str(free_port())
    if launcher == "deepspeed":
        head = [str(DEEPSPEED), "--num_gpus", str(nprocs), "--master_port", port]
    else:
        head = [str(TORCHRUN), "--nproc_per_node", str(nprocs), "--master_port", port]
    return [*head, str(ROOT / "launch" / script), "--deepspeed_config", str(config)]


def stop_rank_mid_run(script: str, config: Path, nprocs: int, victim: int, running: Callable[[str], bool],
                      launcher: str = "deepspeed", bound_s: float = BOUND_S) -> tuple[int, float, int, str]:
    """Launch ``script`` on ``nprocs`` local processes, SIGSTOP rank ``victim`` once ``running(output)``.

    Returns (launcher exit status, seconds from the stop to the launcher's return, victim pid,
    output). Whatever happens, nothing is left behind: the launcher's process group is killed and
    the victim gets SIGKILL then SIGCONT.
    """
    cmd = launcher_command(launcher, nprocs, script, config)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read1(4096), b"")), daemon=True)
    reader.start()
    victim_pid = None
    try:
        deadline = time.monotonic() + 300
        while not running(b"".join(chunks).decode(errors="replace")):
            assert proc.poll() is None, b"".join(chunks).decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the run never got going"
            time.sleep(0.2)
        while (victim_pid := rank_pid(proc.pid, script, victim)) is None:
            assert proc.poll() is None and time.monotonic() < deadline, f"rank {victim} never started"
            time.sleep(0.05)
        os.kill(victim_pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            code = proc.wait(timeout=bound_s)
        except subprocess.TimeoutExpired:
            code = None
        elapsed = time.monotonic() - stopped_at
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if victim_pid is not None:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(victim_pid, sig)
                except ProcessLookupError:
                    pass
        proc.wait(timeout=30)
        reader.join(timeout=5)
    out = b"".join(chunks).decode(errors="replace")
    assert code is not None, f"the launcher had not returned {bound_s:.0f} s after the stop:\n{out[-3000:]}"
    print(f"{script}: the launcher returned {code} {elapsed:.1f} s after rank {victim} was stopped",
          *[ln for ln in out.splitlines() if "[megatron_ring] rank" in ln], sep="\n")
    return code, elapsed, victim_pid, out


def check_survivors(out: str, survivors: list[int], victim: int, victim_pid: int, store_host: bool) -> None:
    """One line per surviving rank, each with the same verdict: the stalled rank, killed (not "exited").

    A stopped rank 0 that hosts the store (``store_host``: the deepspeed launcher) takes the store with
    it: its verdict comes from each survivor's store guard, without the store's agreement, and must be
    the same on every survivor all the same. Under torchrun the agent hosts the store, which keeps
    answering, and a stopped rank 0 is found by its heartbeat like any other rank; torchrun's agent
    sends SIGTERM to the workers still running once one has exited, and a survivor it reaches first
    says ``terminated by SIGTERM (after lost rank J (...))`` with the same verdict.
    """
    verdicts = set()
    for rank in survivors:
        lines = [ln for ln in out.splitlines() if f"[megatron_ring] rank {rank}:" in ln]
        assert len(lines) == 1, f"rank {rank} did not say exactly one line:\n{out[-3000:]}"
        why = "hosts the rendezvous store; no answer for " if store_host else "no heartbeat for "
        assert f"lost rank {victim} ({why}" in lines[0] \
            and f"s, stalled; killed pid {victim_pid})" in lines[0], lines[0]
        verdicts.add(re.search(rf"lost rank {victim} \([^()]*\)", lines[0]).group())
    assert len(verdicts) == 1, verdicts


@needs_deepspeed
@pytest.mark.timeout(420)
@pytest.mark.parametrize("launcher, victim", [pytest.param("deepspeed", 2, marks=[pytest.mark.probe, probe_slow]),
                                              ("deepspeed", 0),
                                              pytest.param("torchrun", 2, marks=[pytest.mark.probe, probe_slow]),
                                              ("torchrun", 0)],
                         ids=["rank2", "rank0_store_host", "torchrun-rank2", "torchrun-rank0"])
def test_stopped_rank_stops_inference(tmp_path: Path, launcher: str, victim: int) -> None:
    """SIGSTOP rank ``victim`` of 4 while decoding: the launcher returns non-zero within peer_timeout_s + 15 s.
    Under the deepspeed launcher rank 0 hosts the rendezvous store, which stops with it (Note [Lost
    ranks], the store guard); under torchrun the agent hosts it."""
    model = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
             "ffn_hidden_size": 128, "vocab_size": 128}
    cfg = {"dtype": "fp32", "replace_with_kernel_inject": False,
           "megatron_ring": {"model": {"runner": "toy", "config": model}, "layout": {"cp": 4},
                             "workload": {"batch": 2, "prompt_len": 64, "new_tokens": 400, "warmup": 0, "repeats": 3,
                                          "seed": 3},
                             "peer_timeout_s": PEER_TIMEOUT_S, "output": str(tmp_path / "hung.json")}}
    config = tmp_path / "hung_config.json"
    config.write_text(json.dumps(cfg))
    code, elapsed, victim_pid, out = stop_rank_mid_run("infer.py", config, 4, victim, lambda o: "request 1/3" in o,
                                                       launcher)
    assert code != 0, out[-3000:]
    assert elapsed < BOUND_S
    check_survivors(out, [r for r in range(4) if r != victim], victim, victim_pid,
                    store_host=launcher == "deepspeed" and victim == 0)
    result = tmp_path / "hung.json"
    assert not result.exists() or json.loads(result.read_text())["metrics"], "a half-written result file"
    assert not list(tmp_path.glob(".*.tmp"))


@needs_deepspeed
@needs_megatron
@pytest.mark.timeout(420)
@pytest.mark.parametrize("victim", [1, pytest.param(0, marks=[pytest.mark.probe, probe_slow])],
                         ids=["rank1", "rank0_store_host"])
def test_stopped_rank_stops_training(tmp_path: Path, victim: int) -> None:
    """SIGSTOP rank ``victim`` of cp = 2 mid-training: the launcher returns non-zero within peer_timeout_s + 15 s
    and the latest checkpoint, if any, is a complete one."""
    from megatron_ring.training.checkpoint import COMPLETE, latest_checkpoint

    cfg = {
        "train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1}, "steps_per_print": 10**6,
        "megatron_ring": {
            "name": "hung", "model": str(ROOT / "configs" / "megatron" / "tiny_ring_cp2.yaml"),
            "layout": {"cp": 2, "dp": 1}, "seq_len": 64, "steps": 100000, "peer_timeout_s": PEER_TIMEOUT_S,
            "data": {"kind": "text", "paths": [str(ROOT / "docs")]},
            "checkpoint": {"dir": str(tmp_path / "ckpt"), "save_interval": 2},
            "log": {"jsonl": str(tmp_path / "train.jsonl"), "progress": False},
        },
    }
    config = tmp_path / "hung.json"
    config.write_text(json.dumps(cfg))
    log = tmp_path / "train.jsonl"

    def checkpointed(_: str) -> bool:
        return log.exists() and any('"event": "checkpoint"' in ln for ln in log.read_text().splitlines())

    code, elapsed, victim_pid, out = stop_rank_mid_run("train.py", config, 2, victim, checkpointed)
    assert code != 0, out[-3000:]
    assert elapsed < BOUND_S
    check_survivors(out, [1 - victim], victim, victim_pid, store_host=victim == 0)
    tag = latest_checkpoint(tmp_path / "ckpt")
    assert tag is not None
    assert json.loads((tmp_path / "ckpt" / tag / COMPLETE).read_text())["step"] == int(tag[4:])


@needs_deepspeed
@needs_megatron
@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", [1, 0], ids=["rank1", "rank0_store_host"])
def test_rank_stopped_at_start_up_stops_the_job(tmp_path: Path, victim: int) -> None:
    """SIGSTOP rank ``victim`` of 2 as soon as it exists, before any store (Note [Lost ranks at start-up]):
    the other rank, waiting in the rendezvous, names it and kills it within peer_timeout_s of its own
    monitor starting (after its imports and config check), not after collective_timeout_s (300 s)."""
    cfg = {
        "train_batch_size": 1, "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 0}, "steps_per_print": 10**6,
        "megatron_ring": {"model": str(ROOT / "configs" / "megatron" / "tiny_ring_cp2.yaml"), "layout": {"cp": 2},
                          "seq_len": 64, "steps": 2, "peer_timeout_s": START_UP_TIMEOUT_S,
                          "data": {"kind": "text", "paths": [str(ROOT / "docs")]}, "log": {"progress": False}},
    }
    config = tmp_path / "startup.json"
    config.write_text(json.dumps(cfg))
    code, elapsed, victim_pid, out = stop_rank_mid_run("train.py", config, 2, victim, lambda _: True,
                                                       bound_s=START_UP_TIMEOUT_S + 75)
    assert code != 0, out[-3000:]
    lines = [ln for ln in out.splitlines() if f"[megatron_ring] rank {1 - victim}:" in ln]
    assert len(lines) == 1 and f"lost rank {victim} (stopped during start-up, before the peer monitor attached" \
        in lines[0] and f"killed pid {victim_pid})" in lines[0], out[-3000:]
