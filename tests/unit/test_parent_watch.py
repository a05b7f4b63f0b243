"""No rank outlives what started it (Note [Orphaned ranks]): the watchdog ends a process whose parent or
watched ancestor is gone, on SIGKILL too, and a gloo pool's ranks end with the process that made them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_ring.runtime.parent_watch import EXIT_ORPHANED, WATCH_ENV, watch_env, watched_pids

ROOT = Path(__file__).resolve().parents[2]


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # our own child: reap it, else it lingers as a zombie
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return False


def test_env_names_the_command_and_keeps_earlier_pids() -> None:
    env = watch_env(pid=42, env={WATCH_ENV: "7,x"})
    assert env[WATCH_ENV] == "7,42" and watched_pids(env) == [7, 42]


def wait_for(path: Path, timeout_s: float = 60) -> str:
    """``path``'s text once a process has written it (its readiness signal)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} was never written"
        time.sleep(0.05)
    return path.read_text()


@pytest.mark.probe
def test_a_watched_ancestor_killed_ends_the_rank(tmp_path: Path) -> None:
    ancestor = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    ready = tmp_path / "ready"
    code = ("from megatron_ring.runtime.parent_watch import watch_parent; import signal; watch_parent('rank 3', 0.1); "
            f"open({str(ready)!r}, 'w').write('1'); signal.pause()")
    log = tmp_path / "rank.log"
    with log.open("w") as sink:
        rank = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=sink,
                                env=watch_env(pid=ancestor.pid))
    wait_for(ready)
    ancestor.kill()
    ancestor.wait()
    assert rank.wait(timeout=10) == EXIT_ORPHANED
    assert f"rank 3 (pid {rank.pid}): the process that started it (pid {ancestor.pid}) is gone" in log.read_text()


@pytest.mark.probe
def test_a_parent_killed_ends_its_rank(tmp_path: Path) -> None:
    """The launcher (parent) SIGKILLed: the rank, reparented, stops within a second."""
    pid_file = tmp_path / "rank.pid"
    launcher = textwrap.dedent(f"""
        import signal, subprocess, sys
        code = ("from megatron_ring.runtime.parent_watch import watch_parent; import os, signal; "
                "watch_parent('rank', 0.1); open({str(pid_file)!r}, 'w').write(str(os.getpid())); signal.pause()")
        rank = subprocess.Popen([sys.executable, "-c", code])
        signal.pause()
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher], cwd=ROOT, env={**os.environ, WATCH_ENV: ""})
    rank = int(wait_for(pid_file))
    proc.send_signal(signal.SIGKILL)  # the rank's watchdog is running (it wrote the file)
    proc.wait()
    assert wait_gone(rank, 10), "the rank outlived its killed parent"


@pytest.mark.probe
@pytest.mark.timeout(120)
def test_pool_ranks_end_with_the_process_that_made_them(tmp_path: Path) -> None:
    pid_file = tmp_path / "ranks"
    owner = textwrap.dedent(f"""
        import os, signal
        from megatron_ring.runtime.pool import GlooPool
        pool = GlooPool(2, timeout_s=60)
        pool.run(os.getpid)  # both ranks are up and waiting for work
        open({str(pid_file)!r}, "w").write(" ".join(str(p.pid) for p in pool._procs))
        signal.pause()
    """)
    proc = subprocess.Popen([sys.executable, "-c", owner], cwd=ROOT)
    ranks = wait_for(pid_file, 90)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for pid in map(int, ranks.split()):
        assert wait_gone(pid, 10), f"pool rank {pid} outlived its killed owner"
