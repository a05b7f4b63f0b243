"""Start-up: the ranks of this host before the peer monitor attaches (Note [Lost ranks at start-up]).

Note [Lost ranks at start-up]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Until the process group and its store exist, ranks have no heartbeat to watch, and a rank waiting
in the rendezvous for a peer that was stopped (SIGSTOP) or died would wait the whole collective
timeout. The launchers (DeepSpeed's, torchrun) start every rank of a host as a child of one
process, so :class:`StartupWatch` finds this rank's peers on the same host without any store: the
processes with this process's parent whose environment names the same ``MASTER_ADDR`` /
``MASTER_PORT`` and a ``RANK``. A peer gone (or a zombie) is lost at once; a peer stopped
(``/proc`` state ``T``) for ``timeout_s`` of observed time is lost as stalled and killed
(SIGKILL; a stopped process ignores SIGTERM) so that the launcher returns. Observed time caps each
gap between checks at ``max_gap_s``, as the heartbeats do. Not covered: a peer on another host
before it joins (the rendezvous then waits ``collective_timeout_s``), a peer deadlocked but
running (state S) before it joins.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Optional

_JOB_KEYS = (b"MASTER_ADDR", b"MASTER_PORT")
_RESCAN_S = 1.0


def process_stat(pid: int) -> Optional[tuple[str, int]]:
    """``(state, parent pid)`` of ``pid`` from /proc, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def _environment(pid: int) -> dict[bytes, bytes]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)


def launcher_siblings() -> dict[int, int]:
    """``rank -> pid`` of this job's other ranks on this host (same parent, same master address)."""
    me, parent = os.getpid(), os.getppid()
    job = {k: os.environb.get(k) for k in _JOB_KEYS}
    if None in job.values() or not Path("/proc").is_dir():
        return {}
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        stat = process_stat(pid)
        if stat is None or stat[1] != parent:
            continue
        env = _environment(pid)
        if all(env.get(k) == v for k, v in job.items()) and env.get(b"RANK", b"").isdigit():
            found[int(env[b"RANK"])] = pid
    return found


class StartupWatch:
    """Finds a same-host peer lost before the monitor attaches; see Note [Lost ranks at start-up]."""

    def __init__(self, *, timeout_s: float, max_gap_s: float) -> None:
        self.timeout_s, self.max_gap_s = timeout_s, max_gap_s
        self.rank = int(os.environ.get("RANK", "-1"))
        self._expected = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 0) - 1
        self._peers: dict[int, int] = {}
        self._stopped_s: dict[int, float] = {}
        self._scanned = self._checked = 0.0

    def check(self) -> Optional[str]:
        """The finding ``rank J (...)`` of a lost peer (a stalled one killed), or None."""
        now = time.monotonic()
        if len(self._peers) < self._expected and now - self._scanned >= _RESCAN_S:
            self._peers.update(launcher_siblings())
            self._scanned = now
        gap = min(now - self._checked, self.max_gap_s) if self._checked else 0.0
        self._checked = now
        gone = []
        for rank, pid in sorted(self._peers.items()):
            stat = process_stat(pid)
            if stat is None or stat[0] in ("Z", "X"):
                gone.append(rank)
                continue
            self._stopped_s[rank] = self._stopped_s.get(rank, 0.0) + gap if stat[0] == "T" else 0.0
            if self._stopped_s[rank] > self.timeout_s:
                return self._kill(rank)
        if gone:  # a peer killed by another survivor's watch: name the one it found stopped
            stalled = [r for r, s in self._stopped_s.items() if s > self.timeout_s / 2]
            if stalled:
                return self._kill(stalled[0])
            pid = self._peers[gone[0]]
            return f"rank {gone[0]} (pid {pid} exited during start-up, before the peer monitor attached)"
        return None

    def _kill(self, rank: int) -> str:
        pid = self._peers[rank]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return (f"rank {rank} (stopped during start-up, before the peer monitor attached, for "
                f"{self.timeout_s:g}s; killed pid {pid})")
