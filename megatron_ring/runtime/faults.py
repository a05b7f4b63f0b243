"""Lost ranks: every surviving rank stops quickly, non-zero, naming the rank that was lost.

Note [Lost ranks]
~~~~~~~~~~~~~~~~~
When a rank dies mid-run its peers are usually blocked inside a collective or a p2p receive and
would wait for the collective timeout (minutes), or are terminated by the launcher without a word
(the DeepSpeed launcher and torchrun both SIGTERM the survivors). A :class:`PeerMonitor` thread on
every rank avoids both:

* every rank publishes ``host:pid`` and a heartbeat counter in the job's rendezvous store;
* the monitor checks each peer every ``interval_s``: a peer on this host whose process is gone (or
  a zombie) is lost at once; a peer on another host whose heartbeat has not moved for
  ``timeout_s`` is lost; a store that stops answering means rank 0, which hosts it, is lost;
* a terminated rank also says why: SIGTERM gets a Python handler plus ``signal.set_wakeup_fd``,
  whose C-level part writes the signal number to a pipe the monitor thread waits on. The monitor
  wakes at once whichever thread took the signal, even while the main thread is stuck in a C++
  collective (where the Python handler itself would only run after the collective returns);
* on a loss the monitor prints ``lost rank K`` to stderr and ends the process with
  :data:`EXIT_PEER_LOST` (``os._exit``: nothing else runs, in particular no result file is written).

A rank that finishes marks itself done first, so a peer that exits normally is never reported.
The result file is written only by rank 0 after every rank is done, atomically
(:func:`megatron_ring.runtime.reporting.write_json_atomic`): there is no half-written result.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any

EXIT_PEER_LOST = 3
"""Exit status of a rank that stopped because a peer was lost."""
EXIT_TERMINATED = 128 + signal.SIGTERM
"""Exit status of a rank terminated by its launcher (as if killed by SIGTERM)."""

_PREFIX = "megatron_ring/monitor"


def _process_gone(pid: int) -> bool:
    """True when ``pid`` does not exist or is a zombie (dead, not yet reaped by its launcher)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        return state in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            return True
        except PermissionError:
            return False


class PeerMonitor:
    """Watches the other ranks of a job from a daemon thread; see Note [Lost ranks].

    Use: :meth:`start` from the main thread before the run (takes over SIGTERM), :meth:`attach`
    once the process group (and its store) exists, :meth:`done` when this rank's work is over.
    """

    def __init__(self, *, timeout_s: float = 20.0, interval_s: float = 0.25) -> None:
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.rank = -1
        self._store: Any = None
        self._world = 0
        self._peers: dict[int, tuple[str, int]] = {}
        self._beats: dict[int, tuple[bytes, float]] = {}
        self._lost: list[str] = []
        self._attached = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._host = socket.gethostname()
        self._wake_r = self._wake_w = -1
        self._saved: tuple[Any, int] | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> "PeerMonitor":
        """Take over SIGTERM (see the Note) and start the monitor thread; call from the main thread."""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        previous_fd = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        self._saved = (signal.signal(signal.SIGTERM, lambda *_: self._exit_terminated()), previous_fd)
        self._thread = threading.Thread(target=self._loop, name="megatron_ring-peer-monitor", daemon=True)
        self._thread.start()
        return self

    def attach(self, store: Any, rank: int, world_size: int) -> None:
        """Publish this rank and start watching the others (every rank calls it)."""
        self._store, self.rank, self._world = store, rank, world_size
        store.set(f"{_PREFIX}/pid/{rank}", f"{self._host}:{os.getpid()}")
        store.set(f"{_PREFIX}/beat/{rank}", "0")
        keys = [f"{_PREFIX}/pid/{r}" for r in range(world_size)]
        store.wait(keys)
        for r in range(world_size):
            if r != rank:
                host, pid = store.get(keys[r]).decode().rsplit(":", 1)
                self._peers[r] = (host, int(pid))
        now = time.monotonic()
        self._beats = {r: (b"", now) for r in self._peers}
        self._attached.set()

    def done(self) -> None:
        """Mark this rank finished and stop watching; peers then ignore its exit."""
        if self._store is not None:
            try:
                self._store.set(f"{_PREFIX}/beat/{self.rank}", "done")
            except Exception:  # the store's host may already be gone: nothing to tell
                pass
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1)
        if self._saved is not None:
            handler, previous_fd = self._saved
            signal.signal(signal.SIGTERM, handler)
            signal.set_wakeup_fd(previous_fd)
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._saved = None

    def lost(self, wait_s: float = 0.0) -> list[str]:
        """Reasons of the peers found lost so far, waiting up to ``wait_s`` for a verdict."""
        deadline = time.monotonic() + wait_s
        while not self._lost and time.monotonic() < deadline:
            self._check_peers()
            time.sleep(self.interval_s)
        return list(self._lost)

    # -- the thread -------------------------------------------------------------------------------

    def _loop(self) -> None:
        beat = 0
        while not self._stop.is_set():
            ready, _, _ = select.select([self._wake_r], [], [], self.interval_s)
            if ready and signal.SIGTERM in os.read(self._wake_r, 64):
                self._exit_terminated()
            if self._stop.is_set() or not self._attached.is_set():
                continue
            beat += 1
            try:
                self._store.set(f"{_PREFIX}/beat/{self.rank}", str(beat))
            except Exception:  # rank 0 (the store's host) or another peer is gone: _check_peers says which
                pass
            self._check_peers()
            if self._lost:
                self._exit_lost()

    def _check_peers(self) -> None:
        """Record lost peers: processes gone on this host first (exact), then silent heartbeats."""
        if not self._attached.is_set() or self._lost:
            return
        for r, (host, pid) in self._peers.items():
            if host == self._host and _process_gone(pid) and not self._peer_done(r):
                self._lost.append(f"rank {r} (pid {pid} on {host} exited)")
        if self._lost:
            return
        now = time.monotonic()
        for r, (host, _) in self._peers.items():
            if host == self._host:  # the process check above is exact; a slow or loaded peer is not lost
                continue
            try:
                value = self._store.get(f"{_PREFIX}/beat/{r}")
            except Exception as err:
                self._lost.append(f"rank 0 (hosts the rendezvous store, which stopped answering: {err})")
                return
            if value == b"done":
                continue
            last, since = self._beats[r]
            if value != last:
                self._beats[r] = (value, now)
            elif now - since > self.timeout_s:
                self._lost.append(f"rank {r} (no heartbeat for {now - since:.0f}s)")

    def _peer_done(self, rank: int) -> bool:
        try:
            return self._store.get(f"{_PREFIX}/beat/{rank}") == b"done"
        except Exception:
            return False

    def _exit_lost(self) -> None:
        self._say(f"lost {'; '.join(self._lost)}; stopping (exit {EXIT_PEER_LOST}), no result is written")
        os._exit(EXIT_PEER_LOST)

    def _exit_terminated(self) -> None:
        self._check_peers()
        why = f"after lost {'; '.join(self._lost)}" if self._lost else "no lost peer seen"
        self._say(f"terminated by SIGTERM ({why}); stopping (exit {EXIT_TERMINATED}), no result is written")
        os._exit(EXIT_TERMINATED)

    def _say(self, text: str) -> None:
        who = f"rank {self.rank}" if self.rank >= 0 else f"pid {os.getpid()}"
        sys.stderr.write(f"[megatron_ring] {who}: {text}\n")
        sys.stderr.flush()
