"""A launched job (a launcher and every rank it starts) as one process group, stopped whole on a signal.

Note [Stopping a launched job]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``compare``, ``sweep`` and ``calibrate`` start ranks that outlive a parent killed by a signal: the
deepspeed launcher runs ``deepspeed.launcher.launch``, which starts the ranks; a SIGTERM sent to
the command alone once left them running and writing result files after the command had exited.
So each launch runs in a session (process group) of its own, and while the command waits,
SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` in it (:func:`interruptible`). The wait
then sends SIGTERM to the whole group (the ranks' own handlers end them, runtime/faults.py),
gives it :data:`GRACE_S` seconds and kills what is left. Result files are written by a rank with
:func:`~megatron_ring.runtime.reporting.write_json_atomic`, so they are complete or absent.
A launcher that exits on its own leaves nothing behind either: :func:`run_job` ends the rest of its
group. Ctrl-C in a terminal reaches only the command (the job is not in the terminal's foreground
group), which stops the job the same way.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from megatron_ring.runtime.parent_watch import watch_env

GRACE_S = 10.0
"""Seconds a stopped job's processes get after SIGTERM before SIGKILL."""
SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """A signal asked the command to stop (a BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` swallows it). ``exit_code`` is the shell's ``128 + signal``."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise(signum: int, _frame: object) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Inside the block, :data:`SIGNALS` raise :class:`Interrupted` in the main thread."""
    saved = {sig: signal.signal(sig, _raise) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def stop_group(proc: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM to ``proc``'s process group, then SIGKILL to what is left after ``grace_s``; reap ``proc``."""
    _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not _group_alive(proc.pid):
            return
        time.sleep(0.05)
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def run_job(cmd: Sequence[str], *, log: Path, env: Mapping[str, str]) -> int:
    """Run ``cmd`` in a process group of its own, output to ``log``; return its exit status.

    On any exception while waiting (:class:`Interrupted` above all) the whole group is stopped
    (:func:`stop_group`) before it propagates; after a normal exit, processes the launcher left in
    its group are stopped too (Note [Stopping a launched job]).
    """
    with open(log, "w") as fh:
        proc = subprocess.Popen(list(cmd), stdout=fh, stderr=subprocess.STDOUT, env=watch_env(env=dict(env)),
                                start_new_session=True)  # its ranks end with this process: Note [Orphaned ranks]
        try:
            code = proc.wait()
        except BaseException:
            stop_group(proc)
            raise
    if _group_alive(proc.pid):
        stop_group(proc)
    return code
