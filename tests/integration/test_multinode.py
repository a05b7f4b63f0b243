"""Two "nodes" on localhost: two launcher invocations (node ranks 0 and 1) of one job with
``comm="a2a+p2p"``, the all-to-all inside each node and the ring across them (docs/multinode.md):
torchrun with a fixed node rank, and the deepspeed launcher with a two-host hostfile (``--no_ssh``).

Each launcher runs in its own process group with a hard timeout; on a hang both are killed. The two
jobs do not depend on each other: the module starts both (those of the selected tests) side by side
(:func:`jobs`), and each test waits for its own.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from megatron_ring.runtime.pool import free_port

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240
DEMO = ["--comm", "a2a+p2p", "--seq-len", "64", "--heads", "4", "--heads-kv", "2", "--head-dim", "8"]


class Nodes:
    """The launcher invocations of one job, each in its own session, their output to files."""

    def __init__(self, commands: list[list[str]], env: dict[str, str], folder: Path) -> None:
        self.logs = [folder / f"node{i}.out" for i in range(len(commands))]
        self.procs: list[subprocess.Popen] = []
        try:
            for cmd, log in zip(commands, self.logs):
                with log.open("wb") as sink:
                    self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink,
                                                       stderr=subprocess.STDOUT, start_new_session=True))
        except BaseException:
            self.kill()
            raise
        self.deadline = time.monotonic() + TIMEOUT_S

    def finish(self) -> list[str]:
        """Wait for every launcher (all killed at the hard timeout), return their outputs; each must exit 0."""
        try:
            for p in self.procs:
                p.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        finally:
            self.kill()
        outs = [log.read_text(errors="replace") for log in self.logs]
        for p, out in zip(self.procs, outs):
            assert p.returncode == 0, out[-3000:]
        return outs

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu")


def _check_demo_output(out: str) -> None:
    assert "comm=a2a+p2p (a2a 2 x ring 2)" in out, out[-3000:]
    assert "a2a groups within one node: yes" in out, out[-3000:]
    rows = re.findall(r"^\s+(\d)\s+(\d)\s+\d+\s+([0-9.e+-]+)\s", out, flags=re.M)
    assert sorted((int(r), int(n)) for r, n, _ in rows) == [(0, 0), (1, 0), (2, 1), (3, 1)], out[-3000:]
    assert max(float(e) for _, _, e in rows) < 1e-5, rows


def _torchrun() -> str | None:
    return shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")


def _deepspeed() -> str | None:
    return shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or shutil.which("deepspeed")


def start_torchrun(folder: Path) -> Nodes | None:
    torchrun = _torchrun()
    if torchrun is None:
        return None
    port = str(free_port())
    commands = [[torchrun, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2", "--master-addr",
                 "127.0.0.1", "--master-port", port, "-m", "megatron_ring.demo", *DEMO] for node in (0, 1)]
    return Nodes(commands, _env(), folder)


def start_deepspeed(folder: Path) -> Nodes | None:
    deepspeed = _deepspeed()
    if deepspeed is None:
        return None
    hostfile = folder / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    port = str(free_port())
    commands = [[deepspeed, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node), "--master_addr",
                 "127.0.0.1", "--master_port", port, "--no_local_rank", "launch/ring_demo.py", *DEMO]
                for node in (0, 1)]
    return Nodes(commands, _env(), folder)


STARTS: dict[str, Callable[[Path], Nodes | None]] = {
    "test_torchrun_two_nodes_on_localhost": start_torchrun,
    "test_deepspeed_launcher_two_nodes_from_a_hostfile": start_deepspeed,
}
"""Test name -> what starts its job in a fresh folder (None: its launcher is not installed)."""


@pytest.fixture(scope="module")
def jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Nodes | None]]:
    """Test name -> its running job, for the selected tests of this module, all started on first use."""
    started: dict[str, Nodes | None] = {}
    try:
        for item in request.session.items:
            if item.module is request.module and item.name in STARTS:
                started[item.name] = STARTS[item.name](tmp_path_factory.mktemp(item.name[:30]))
        yield started
    finally:
        for nodes in started.values():
            if nodes is not None:
                nodes.kill()


def test_torchrun_two_nodes_on_localhost(jobs: dict[str, Nodes | None]) -> None:
    nodes = jobs["test_torchrun_two_nodes_on_localhost"]
    if nodes is None:
        pytest.skip("torchrun not found")
    outs = nodes.finish()
    _check_demo_output(outs[0])  # the global rank 0 prints the table


def test_deepspeed_launcher_two_nodes_from_a_hostfile(jobs: dict[str, Nodes | None]) -> None:
    """The hostfile names two hosts of 2 slots; each invocation is told its ``--node_rank`` and runs
    its host's ranks without ssh (DeepSpeed sets ``CROSS_RANK`` and ``LOCAL_SIZE`` for the demo)."""
    nodes = jobs["test_deepspeed_launcher_two_nodes_from_a_hostfile"]
    if nodes is None:
        pytest.skip("the deepspeed launcher is not installed")
    outs = nodes.finish()
    _check_demo_output(outs[0])
