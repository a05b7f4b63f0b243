"""PeerMonitor (Note [Lost ranks] in megatron_ring/runtime/faults.py): stalled peers on one host.

Two processes share a TCPStore; one is SIGSTOPped and the other must declare it lost within the
timeout and kill it (a stopped process ignores SIGTERM, so its launcher would wait for ever).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest
import torch

from megatron_ring.runtime import faults
from megatron_ring.runtime.faults import EXIT_PEER_LOST, PeerMonitor

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 1.0
"""Peer timeout of the worker processes: the monitors beat every 0.1 s and cap an observer's own gap
at 1 s, so 1 s of silence is still 10 missed beats."""
DEADLINE_S = 45.0
"""How long a test waits for an event that takes well under a second on an idle machine."""

WORKER = textwrap.dedent("""
    import signal, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from megatron_ring.runtime.faults import PeerMonitor

    def listening(port):  # some process listens on the port: the store's host is up
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as fh:
                for row in fh.read().splitlines()[1:]:
                    local, state = row.split()[1], row.split()[3]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                        return True
        return False

    rank, port, timeout_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    deadline = time.monotonic() + 45
    while rank != 0 and not listening(port):  # a client refused at once would retry only after 1-2 s
        assert time.monotonic() < deadline, "the store's host never listened"
        time.sleep(0.02)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=60))
    monitor = PeerMonitor(timeout_s=timeout_s, interval_s=0.1).start()
    monitor.attach(store, rank, 2)
    while int(store.get(f"megatron_ring/monitor/beat/{1 - rank}")) < 3:  # a few of the peer's beats seen
        assert time.monotonic() < deadline, "the peer's heartbeat never moved"
        time.sleep(0.02)
    print("attached", flush=True)
    while True:  # until killed
        signal.pause()
""")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def end(procs: list[subprocess.Popen]) -> None:
    """SIGKILL, then SIGCONT so that no stopped process is left behind."""
    for proc in procs:
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                pass
        proc.wait(timeout=10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim", [1, 0], ids=["peer", "store_host"])
def test_stopped_peer_on_same_host_is_declared_lost_and_killed(victim: int) -> None:
    """SIGSTOP one rank of 2: the other exits EXIT_PEER_LOST within timeout + 3 s, naming and killing it.

    Rank 0 hosts the store: stopped, it stops the store too and the other rank's monitor waits in a
    store call that never returns; the store guard must catch that.
    """
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(port), str(TIMEOUT_S)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        for proc in procs:  # each has seen a few of the other's heartbeats
            assert proc.stdout.readline().strip() == "attached", proc.stderr.read() if proc.poll() is not None else ""
        os.kill(procs[victim].pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        survivor = procs[1 - victim]
        code = survivor.wait(timeout=TIMEOUT_S + 20)
        elapsed = time.monotonic() - stopped_at
        assert procs[victim].wait(timeout=5) == -signal.SIGKILL, "the stopped rank was not killed"
        err = survivor.stderr.read()
    finally:
        end(procs)
    assert code == EXIT_PEER_LOST, err
    assert elapsed < TIMEOUT_S + 3, f"declared lost only {elapsed:.1f}s after the stop"
    lines = [ln for ln in err.splitlines() if ln.startswith("[megatron_ring]")]
    assert len(lines) == 1, err
    assert f"rank {1 - victim}: lost rank {victim} (" in lines[0], err
    assert f"stalled; killed pid {procs[victim].pid})" in lines[0], err
    if victim == 0:
        assert f"lost rank 0 (hosts the rendezvous store; no answer for {TIMEOUT_S:g}s, stalled; " in lines[0], err


class FakeStore:
    """The part of a c10d store PeerMonitor uses, in memory, recording when each key was set."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.times: dict[str, list[float]] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()
        self.times.setdefault(key, []).append(time.monotonic())

    def get(self, key: str) -> bytes:
        return self.data[key]

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        if self.data.get(key, b"") == expected.encode():
            self.set(key, desired)
        return self.data[key]

    def wait(self, keys: list[str]) -> None:
        assert all(k in self.data for k in keys)


def test_silence_counts_only_observed_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gap in the observer's own checks (it was not scheduled) adds at most max(1 s, 4 intervals)."""
    clock = [0.0]
    monkeypatch.setattr(faults, "time", SimpleNamespace(monotonic=lambda: clock[0], sleep=time.sleep))
    store = FakeStore()
    store.set("megatron_ring/monitor/pid/1", "elsewhere:4242")
    store.set("megatron_ring/monitor/beat/1", "0")
    monitor = PeerMonitor(timeout_s=2.0, interval_s=0.25)
    monitor.attach(store, 0, 2)

    def check_at(t: float) -> str | None:
        clock[0] = t
        monitor._check_peers()
        return monitor._lost

    assert not check_at(0.25)
    assert not check_at(100.0), "the observer's own 100 s gap was blamed on the peer"
    assert not check_at(100.5) and not check_at(101.0)  # 2.0 s of observed silence: not more than timeout
    assert check_at(101.5) == \
        f"rank 1 (no heartbeat for 2s, stalled on elsewhere; not killed from {socket.gethostname()})"


@pytest.mark.timeout(60)
def test_heartbeat_moves_while_main_thread_runs_torch_ops() -> None:
    """Torch releases the GIL in its ops: a main thread busy in matmuls does not silence the heartbeat."""
    store = FakeStore()
    store.set("megatron_ring/monitor/pid/1", "elsewhere:4242")
    store.set("megatron_ring/monitor/beat/1", "0")
    monitor = PeerMonitor(timeout_s=60.0, interval_s=0.05).start()
    try:
        monitor.attach(store, 0, 2)
        x = torch.randn(1500, 1500)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            x = torch.tanh(x @ x)
    finally:
        monitor.done()
    beats = store.times["megatron_ring/monitor/beat/0"][:-1]  # the last one is "done"
    assert len(beats) >= 5, beats
    assert max(later - earlier for earlier, later in zip(beats, beats[1:])) < 1.0


STARTUP_WORKER = textwrap.dedent("""
    import os, signal, sys

    rank, victim, how, timeout_s = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    if rank == victim:  # before any store exists (and before the imports, which only the survivor needs)
        if how == "exit":  # once the test says so: a sibling that exits before the survivor's watch found it is not seen
            sys.stdin.readline()
            sys.exit(1)
        os.kill(os.getpid(), signal.SIGSTOP)
    from datetime import timedelta
    import torch.distributed as dist
    from megatron_ring.runtime import startup
    from megatron_ring.runtime.faults import PeerMonitor

    scan = startup.launcher_siblings

    def announced_scan():  # tells the test once the start-up watch has found its sibling
        found = scan()
        if found:
            print("watching", *sorted(found.values()), flush=True)
        return found

    startup.launcher_siblings = announced_scan
    PeerMonitor(timeout_s=timeout_s, interval_s=0.1).start()
    dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 2, rank == 0, timedelta(seconds=60))
    print("the store formed without the victim", flush=True)
""")


def wait_until(condition: Callable[[], bool], what: str, procs: list[subprocess.Popen]) -> None:
    """Return as soon as ``condition()`` holds; fail after DEADLINE_S or once a process has ended."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        ended = [proc.pid for proc in procs if proc.poll() is not None]
        assert not ended, f"{what}: pid {ended} ended first"
        assert time.monotonic() < deadline, f"{what}: not within {DEADLINE_S:.0f} s"
        time.sleep(0.02)


def listening(pid: int, port: int) -> bool:
    """``pid`` listens on ``port``: a rank 0 that did, hosts the store and waits in the rendezvous."""
    import psutil

    return any(conn.status == psutil.CONN_LISTEN and conn.laddr.port == port
               for conn in psutil.Process(pid).net_connections(kind="tcp"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim, how", [(1, "stop"), (0, "stop"), (1, "exit")])
def test_peer_lost_before_the_monitor_attaches_ends_the_rendezvous(victim: int, how: str) -> None:
    """Note [Lost ranks at start-up]: a sibling stopped or gone before any store exists ends the other
    rank, waiting in the rendezvous (60 s timeout), within the peer timeout, naming it.

    The sibling that exits does so once the survivor's start-up watch has found it and the survivor,
    rank 0, listens as the store's host, i.e. waits in the rendezvous for it."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", STARTUP_WORKER, str(r), str(victim), how, str(TIMEOUT_S)],
                              cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    survivor = procs[1 - victim]
    try:
        if how == "exit":
            assert victim == 1, "the exit case waits for the survivor to host the store: it must be rank 0"
            assert survivor.stdout.readline().split() == ["watching", str(procs[victim].pid)], \
                survivor.stderr.read() if survivor.poll() is not None else ""
            wait_until(lambda: listening(survivor.pid, port), "the survivor in the rendezvous", procs)
            procs[victim].stdin.close()  # the victim exits
        code = survivor.wait(timeout=45)
        elapsed = time.monotonic() - started
        victim_code = procs[victim].wait(timeout=5)
        err = survivor.stderr.read()
    finally:
        end(procs)
    assert code == EXIT_PEER_LOST, err
    assert elapsed < TIMEOUT_S + 20, f"the rendezvous ended only after {elapsed:.1f}s"
    lines = [ln for ln in err.splitlines() if ln.startswith("[megatron_ring]")]
    assert len(lines) == 1, err
    if how == "stop":
        assert victim_code == -signal.SIGKILL, "the stopped rank was not killed"
        assert f"rank {1 - victim}: lost rank {victim} (stopped during start-up, before the peer monitor attached, " \
               f"for {TIMEOUT_S:g}s; killed pid {procs[victim].pid})" in lines[0], err
    else:
        assert f"rank {1 - victim}: lost rank {victim} (pid {procs[victim].pid} exited during start-up" in lines[0], err
