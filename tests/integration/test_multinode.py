"""Two "nodes" on localhost: two launcher invocations (node ranks 0 and 1) of one job with
``comm="a2a+p2p"``, the all-to-all inside each node and the ring across them (docs/multinode.md):
torchrun with a fixed node rank, and the deepspeed launcher with a two-host hostfile (``--no_ssh``).

Each launcher runs in its own process group with a hard timeout; on a hang both are killed.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ring.runtime.pool import free_port

pytestmark = pytest.mark.launcher

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240
DEMO = ["--comm", "a2a+p2p", "--seq-len", "64", "--heads", "4", "--heads-kv", "2", "--head-dim", "8"]


def _run_nodes(commands: list[list[str]], env: dict[str, str]) -> list[str]:
    """Start every command in its own session, wait for all (hard timeout), return their outputs."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for cmd in commands]
    try:
        outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu")


def _check_demo_output(out: str) -> None:
    assert "comm=a2a+p2p (a2a 2 x ring 2)" in out, out[-3000:]
    assert "a2a groups within one node: yes" in out, out[-3000:]
    rows = re.findall(r"^\s+(\d)\s+(\d)\s+\d+\s+([0-9.e+-]+)\s", out, flags=re.M)
    assert sorted((int(r), int(n)) for r, n, _ in rows) == [(0, 0), (1, 0), (2, 1), (3, 1)], out[-3000:]
    assert max(float(e) for _, _, e in rows) < 1e-5, rows


def test_torchrun_two_nodes_on_localhost() -> None:
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found")
    port = str(free_port())
    commands = [[torchrun, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2", "--master-addr",
                 "127.0.0.1", "--master-port", port, "-m", "megatron_ring.demo", *DEMO] for node in (0, 1)]
    outs = _run_nodes(commands, _env())
    _check_demo_output(outs[0])  # the global rank 0 prints the table


def test_deepspeed_launcher_two_nodes_from_a_hostfile(tmp_path: Path) -> None:
    """The hostfile names two hosts of 2 slots; each invocation is told its ``--node_rank`` and runs
    its host's ranks without ssh (DeepSpeed sets ``CROSS_RANK`` and ``LOCAL_SIZE`` for the demo)."""
    deepspeed = shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or shutil.which("deepspeed")
    if deepspeed is None:
        pytest.skip("the deepspeed launcher is not installed")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    port = str(free_port())
    commands = [[deepspeed, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node), "--master_addr",
                 "127.0.0.1", "--master_port", port, "--no_local_rank", "launch/ring_demo.py", *DEMO]
                for node in (0, 1)]
    outs = _run_nodes(commands, _env())
    _check_demo_output(outs[0])
