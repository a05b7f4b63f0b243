"""No rank outlives the command that started it: a watchdog on the parent and on named ancestors.

Note [Orphaned ranks]
~~~~~~~~~~~~~~~~~~~~~
A command killed with SIGKILL runs no handler, so it cannot stop what it started: the ranks of a
``compare`` job kept running and writing into ``--out-dir``, and a gloo pool's ranks lived on after
``perplexity`` or ``bench`` was killed. Two mechanisms close that:

* processes we fork ourselves (the pool's ranks) ask the kernel for SIGKILL when their parent dies
  (:func:`die_with_parent`, Linux ``prctl(PR_SET_PDEATHSIG)``), and end at once if it died before
  they asked (they are told its pid);
* launched ranks sit below launchers we do not control (``deepspeed`` starts ``launch.py``, which
  starts the ranks; DeepSpeed's runner does not forward signals). Their entry points start
  :func:`watch_parent`: a daemon thread that checks every :data:`INTERVAL_S` seconds that the rank's
  parent is still the one it started with and that every pid in :data:`WATCH_ENV` (set by
  :func:`~megatron_ring.runtime.job.run_job` to the command's pid, inherited through the
  launchers) still runs; a rank already adopted by init when the watch begins is an orphan too.
  A rank whose parent is DeepSpeed's per-node ``launch.py`` watches the ``deepspeed`` runner above it
  too (:func:`launcher_ancestors`): SIGTERM to the runner ends the runner alone, and ``launch.py``
  stays, waiting for its ranks, so the parent alone would never be missed.
  When one is gone the rank says so and exits at once (status
  :data:`EXIT_ORPHANED`): a checkpoint being written is left without its ``complete.json``
  (Note [Complete checkpoints]), a result file is written atomically or not at all.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Optional

from megatron_ring.runtime.startup import process_stat

WATCH_ENV = "MEGATRON_RING_WATCH_PIDS"
"""Comma-separated pids whose end ends this process (the command that launched the job)."""
INTERVAL_S = 0.5
EXIT_ORPHANED = 143
"""Exit status of a rank whose parent or watched ancestor is gone (as SIGTERM's)."""
PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, sig: signal.Signals = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent ends (Linux; False elsewhere), and
    end now when the parent, pid ``parent``, already ended before the request (the usual race)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return False
    done = libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    if os.getppid() != parent:
        os._exit(EXIT_ORPHANED)
    return done


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (another user's process counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watched_pids(env: Optional[dict[str, str]] = None) -> list[int]:
    """The pids of :data:`WATCH_ENV` (malformed entries ignored)."""
    raw = (env if env is not None else os.environ).get(WATCH_ENV, "")
    return [int(p) for p in raw.split(",") if p.strip().isdigit()]


def _stop(name: str, gone: int) -> None:
    print(f"[megatron_ring] {name} (pid {os.getpid()}): the process that started it (pid {gone}) is gone; stopping",
          file=sys.stderr, flush=True)
    os._exit(EXIT_ORPHANED)


def _command_line(pid: int) -> str:
    """The command line of process ``pid`` (Linux /proc; "" when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def launcher_ancestors(parent: int) -> list[int]:
    """The ``deepspeed`` runner above a rank whose ``parent`` is DeepSpeed's per-node launcher
    (``deepspeed.launcher.launch``), when that runner runs on this host; else []."""
    if "deepspeed.launcher.launch" not in _command_line(parent):
        return []
    stat = process_stat(parent)
    if stat is None or stat[1] <= 1 or "deepspeed" not in _command_line(stat[1]):
        return []
    return [stat[1]]


_WATCHING: list[threading.Thread] = []
"""The process's watchdog, once started (a pool worker runs many entry points: one thread serves them all)."""


def watch_parent(name: str = "rank", interval_s: float = INTERVAL_S) -> threading.Thread:
    """Start the watchdog of Note [Orphaned ranks] for this process (once; later calls return it);
    ``name`` goes in its message."""
    if _WATCHING:
        return _WATCHING[0]
    parent = os.getppid()
    ancestors = watched_pids() + launcher_ancestors(parent)
    if parent == 1:  # adopted by init before the watch began: whoever started this process is already gone
        _stop(name, parent)

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            gone = [pid for pid in ancestors if not pid_alive(pid)]
            if os.getppid() != parent:
                gone.insert(0, parent)
            if gone:
                _stop(name, gone[0])

    thread = threading.Thread(target=watch, name="megatron_ring-parent-watch", daemon=True)
    thread.start()
    _WATCHING.append(thread)
    return thread


def watch_env(pid: Optional[int] = None, env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """``env`` (default: this process's) with ``pid`` (default: this process) added to :data:`WATCH_ENV`."""
    base = dict(env if env is not None else os.environ)
    pids = watched_pids(base) + [pid if pid is not None else os.getpid()]
    base[WATCH_ENV] = ",".join(str(p) for p in dict.fromkeys(pids))
    return base
