"""Lost ranks: every surviving rank stops quickly, non-zero, naming the rank that was lost.

Note [Lost ranks]
~~~~~~~~~~~~~~~~~
When a rank dies or hangs mid-run its peers are usually blocked inside a collective or a p2p
receive and would wait for the collective timeout (minutes), or are terminated by the launcher
without a word (the DeepSpeed launcher and torchrun both SIGTERM the survivors). A hung rank is
worse: a stopped process ignores SIGTERM, so the launcher waits on it for ever. A
:class:`PeerMonitor` thread on every rank handles all three:

* every rank publishes ``host:pid`` and a heartbeat counter in the job's rendezvous store, through
  a store connection of its own (a main thread waiting in the store, e.g. while a group is created,
  would otherwise hold up the beats);
* the counter is bumped by the monitor thread, not by the main thread: a rank that is merely slow
  (a long collective, a long kernel: torch releases the GIL in its ops and gloo waits) still beats;
  a stopped or deadlocked process does not;
* the monitor checks each peer every ``interval_s``. A peer on this host whose process is gone (or
  a zombie) is lost at once. A peer, on any host, whose heartbeat has not moved for ``timeout_s``
  is lost as *stalled*; a store that stops answering means rank 0, which hosts it, is gone. Silence
  is counted in *observed* time: each check adds the time since the previous check but at most
  ``max(1 s, 4 * interval_s)``, so an observer that was itself not scheduled (a loaded machine, a
  suspended VM) never blames its peers for its own gap;
* a *stopped* rank 0 stops the store with it: a store call then neither returns nor fails (c10d's
  store client retries a timed-out call), and the monitor thread waits in it. So on every other
  rank a second thread, the store guard, watches the store calls of this rank's monitor
  connection: while one is pending and none has returned since its previous look, it adds the
  observed time (capped the same way); past ``timeout_s`` rank 0 is lost as ``rank 0 (hosts the
  rendezvous store; no answer for Ns, stalled; killed pid P)``, N being ``timeout_s``, and killed
  when on this host (its ``host:pid`` is known from :meth:`PeerMonitor.attach`). There is no store
  left to agree on one verdict, so it is made consistent otherwise: the guard takes this rank's
  exit first (no later SIGTERM or finding speaks instead), then waits ``max(1 s, 4 * interval_s)``
  before the kill while other survivors remain, so that their own guards, which started counting
  at the same stop, conclude too; and a rank whose store call was already pending for more than
  ``timeout_s / 2`` when the store failed or rank 0's process went names the same stall (rank 0
  was killed by a peer's guard);
* a stalled peer on this host is ended with SIGKILL (to the pid it published), so that the
  launcher, which waits for every child, returns. A stalled peer on another host cannot be killed
  from here: the survivors stop, its host's launcher waits;
* one loss sets off others: the killed peer, then each survivor that leaves, is "gone" to the
  ranks that have not concluded yet. So the job has one verdict: a rank's finding goes to the
  store with ``compare_set`` and the first one stored wins; every rank reports that one. The
  stall verdict ``rank J (no heartbeat for Ns, stalled; killed pid P)`` is stored *before* the
  kill. Rank 0 hosts the store: it exits only once its peers on this host are gone (at most
  ``2 * interval_s``), so that they can still read the verdict. Should the store be gone all the
  same, a rank that finds rank 0 gone along with another peer names the other one;
* a terminated rank also says why: SIGTERM gets a Python handler plus ``signal.set_wakeup_fd``,
  whose C-level part writes the signal number to a pipe the monitor thread waits on. The monitor
  wakes at once whichever thread took the signal, even while the main thread is stuck in a C++
  collective (where the Python handler itself would only run after the collective returns);
* on a loss the rank prints one line, ``rank K: lost rank J (...)``, to stderr and ends with
  :data:`EXIT_PEER_LOST` (``os._exit``: nothing else runs, in particular no result file is
  written). Whichever thread gets there first (monitor, main thread after a failed collective,
  SIGTERM) speaks; the others stay silent.

Before :meth:`PeerMonitor.attach` (no store yet) the thread watches this host's peers through
``/proc`` instead: Note [Lost ranks at start-up] in :mod:`megatron_ring.runtime.startup`.

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

from megatron_ring.runtime.startup import StartupWatch

EXIT_PEER_LOST = 3
"""Exit status of a rank that stopped because a peer was lost."""
EXIT_TERMINATED = 128 + signal.SIGTERM
"""Exit status of a rank terminated by its launcher (as if killed by SIGTERM)."""

_PREFIX = "megatron_ring/monitor"
_VERDICT = f"{_PREFIX}/verdict"


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


def _own_connection(store: Any) -> Any:
    """A connection to ``store`` of the monitor's own (``Store.clone``); ``store`` itself where the
    installed torch cannot clone it."""
    return store.clone() if hasattr(store, "clone") else store


class PeerMonitor:
    """Watches the other ranks of a job from a daemon thread; see Note [Lost ranks].

    Use: :meth:`start` from the main thread before the run (takes over SIGTERM), :meth:`attach`
    once the process group (and its store) exists, :meth:`done` when this rank's work is over, and
    :meth:`stop_if_lost` when the main thread caught an error (a peer's loss explains it).
    """

    def __init__(self, *, timeout_s: float = 20.0, interval_s: float = 0.25) -> None:
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.rank = -1
        self.on_sigterm: Any = None
        """A callable that handles SIGTERM instead of the exit (a server that drains first); None: exit."""
        self._store: Any = None
        self._world = 0
        self._peers: dict[int, tuple[str, int]] = {}
        self._beats: dict[int, tuple[bytes, float]] = {}  # peer -> (last heartbeat seen, observed silence s)
        self._checked_at = 0.0
        self._max_gap_s = max(1.0, 4 * interval_s)
        self._lost: str | None = None  # the job's verdict, once there is one
        self._lock = threading.RLock()  # _check_peers runs in the monitor thread and the main thread
        self._exit_lock = threading.Lock()
        self._exiting_thread: int | None = None
        self._attached = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._host = socket.gethostname()
        self._wake_r = self._wake_w = -1
        self._saved: tuple[Any, int] | None = None
        # the store guard (see the Note): store calls of the monitor connection pending / returned
        self._calls_lock = threading.Lock()
        self._pending = 0
        self._returned = 0
        self._store_silent_s = 0.0  # observed time the pending calls have waited with no answer
        self._guard: threading.Thread | None = None
        self._startup = StartupWatch(timeout_s=timeout_s, max_gap_s=self._max_gap_s)

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
        self.rank, self._world = rank, world_size
        store.set(f"{_PREFIX}/pid/{rank}", f"{self._host}:{os.getpid()}")
        store.set(f"{_PREFIX}/beat/{rank}", "0")
        keys = [f"{_PREFIX}/pid/{r}" for r in range(world_size)]
        store.wait(keys)  # under the job's store timeout: peers may still be starting
        self._store = _own_connection(store)
        for r in range(world_size):
            if r != rank:
                host, pid = store.get(keys[r]).decode().rsplit(":", 1)
                self._peers[r] = (host, int(pid))
        self._beats = {r: (b"", 0.0) for r in self._peers}
        self._checked_at = time.monotonic()
        self._attached.set()
        if rank != 0 and 0 in self._peers and self._thread is not None:
            self._guard = threading.Thread(target=self._guard_store, name="megatron_ring-store-guard", daemon=True)
            self._guard.start()

    def done(self) -> None:
        """Mark this rank finished and stop watching; peers then ignore its exit."""
        if self._store is not None:
            try:
                self._call("set", f"{_PREFIX}/beat/{self.rank}", "done")
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

    def stop_if_lost(self, wait_s: float) -> None:
        """Exit with :data:`EXIT_PEER_LOST`, saying why, if a peer is lost or found lost within ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while True:
            self._check_peers()
            if self._lost:
                self._exit_lost()
            if time.monotonic() >= deadline:
                return
            time.sleep(self.interval_s)

    # -- the thread -------------------------------------------------------------------------------

    def _loop(self) -> None:
        beat = 0
        while not self._stop.is_set():
            ready, _, _ = select.select([self._wake_r], [], [], self.interval_s)
            if ready and signal.SIGTERM in os.read(self._wake_r, 64):
                self._exit_terminated()
            if self._stop.is_set():
                continue
            if not self._attached.is_set():
                self._watch_startup()
                continue
            beat += 1
            try:
                self._call("set", f"{_PREFIX}/beat/{self.rank}", str(beat))
            except Exception as err:
                self._store_lost(err)
            self._check_peers()
            if self._lost:
                self._exit_lost()

    def _watch_startup(self) -> None:
        """Before attach: a same-host peer gone or stopped ends this rank (Note [Lost ranks at start-up])."""
        finding = self._startup.check()
        if finding and not self._attached.is_set():
            self.rank = self._startup.rank
            self._lost = self._lost or finding
            self._exit_lost()

    def _check_peers(self) -> None:
        """Find a lost peer: processes gone on this host first (exact), then silent heartbeats."""
        with self._lock:
            if not self._attached.is_set() or self._lost:
                return
            gone = [r for r, (host, pid) in self._peers.items()
                    if host == self._host and _process_gone(pid) and not self._peer_done(r)]
            if gone:
                if 0 in gone and self._store_stalled():  # killed by a peer's store guard: see the Note
                    self._lost = self._lost or self._store_stall_finding()
                    return
                r = min(gone, key=lambda g: (g == 0, g))  # rank 0 gone with others: it left after them
                host, pid = self._peers[r]
                self._conclude(f"rank {r} (pid {pid} on {host} exited)")
                return
            now = time.monotonic()
            gap = min(now - self._checked_at, self._max_gap_s)  # observed time only: see the Note
            self._checked_at = now
            for r in self._peers:
                try:
                    value = self._call("get", f"{_PREFIX}/beat/{r}")
                except Exception as err:
                    self._store_lost(err)
                    return
                if value == b"done":
                    continue
                last, silent = self._beats[r]
                silent = 0.0 if value != last else silent + gap
                self._beats[r] = (value, silent)
                if silent > self.timeout_s:
                    self._declare_stalled(r, silent)
                    return

    def _conclude(self, finding: str) -> None:
        """Record the job's verdict: the first finding any rank stored, else ``finding`` (see the Note)."""
        try:
            first = self._call("compare_set", _VERDICT, "", finding).decode()
        except Exception:  # the store is gone: this rank's own finding is all there is
            first = self._store_stall_finding() if self._store_stalled() else finding
        self._lost = self._lost or first

    def _declare_stalled(self, rank: int, silent_s: float) -> None:
        """Conclude on a stalled peer; one on this host is killed once the verdict is stored."""
        host, pid = self._peers[rank]
        why = f"no heartbeat for {silent_s:.0f}s"
        if host != self._host:
            self._conclude(f"rank {rank} ({why}, stalled on {host}; not killed from {self._host})")
            return
        self._conclude(f"rank {rank} ({why}, stalled; killed pid {pid})")
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _store_lost(self, err: Exception) -> None:
        with self._lock:
            if not self._lost:
                self._lost = self._store_stall_finding() if self._store_stalled() else \
                    f"rank 0 (hosts the rendezvous store, which stopped answering: {err})"

    # -- the store guard (a stopped rank 0; see the Note) ----------------------------------------

    def _call(self, name: str, *args: Any) -> Any:
        """``self._store.<name>(*args)``, counted for the store guard."""
        with self._calls_lock:
            self._pending += 1
        try:
            return getattr(self._store, name)(*args)
        finally:
            with self._calls_lock:
                self._pending -= 1
                self._returned += 1

    def _store_stalled(self) -> bool:
        """A store call had waited, unanswered, for more than half the timeout: rank 0 had stopped."""
        return self._guard is not None and self._store_silent_s > self.timeout_s / 2

    def _store_stall_finding(self) -> str:
        host, pid = self._peers[0]
        why = f"hosts the rendezvous store; no answer for {self.timeout_s:g}s"
        if host != self._host:
            return f"rank 0 ({why}, stalled on {host}; not killed from {self._host})"
        return f"rank 0 ({why}, stalled; killed pid {pid})"

    def _guard_store(self) -> None:
        checked, returned = time.monotonic(), -1
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            gap = min(now - checked, self._max_gap_s)  # observed time only, as for heartbeats
            checked = now
            with self._calls_lock:
                waiting = self._pending > 0 and self._returned == returned
                returned = self._returned
            self._store_silent_s = self._store_silent_s + gap if waiting else 0.0
            if self._store_silent_s > self.timeout_s and not self._stop.is_set():
                self._declare_store_stalled()

    def _declare_store_stalled(self) -> None:
        """Rank 0 stopped with its store: take this rank's exit, let the other survivors conclude too,
        kill rank 0 if on this host, say so and exit (see the Note)."""
        finding = self._store_stall_finding()
        self._lost = self._lost or finding
        host, pid = self._peers[0]

        def kill() -> None:
            if len(self._peers) > 1:  # other survivors: their guards started counting at the same stop
                time.sleep(self._max_gap_s)
            if host == self._host:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

        self._exit_once(f"lost {self._lost}; stopping (exit {EXIT_PEER_LOST}), no result is written", EXIT_PEER_LOST,
                        before=kill)

    def _peer_done(self, rank: int) -> bool:
        try:
            return self._call("get", f"{_PREFIX}/beat/{rank}") == b"done"
        except Exception:
            return False

    # -- leaving --------------------------------------------------------------------------------

    def _exit_lost(self) -> None:
        self._exit_once(f"lost {self._lost}; stopping (exit {EXIT_PEER_LOST}), no result is written", EXIT_PEER_LOST)

    def _exit_terminated(self) -> None:
        if self.on_sigterm is not None:
            self.on_sigterm()
            return
        self._check_peers()
        why = f"after lost {self._lost}" if self._lost else "no lost peer seen"
        self._exit_once(f"terminated by SIGTERM ({why}); stopping (exit {EXIT_TERMINATED}), no result is written",
                        EXIT_TERMINATED)

    def _exit_once(self, text: str, status: int, before: Any = None) -> None:
        """Print ``text`` and ``os._exit(status)``; the first caller does, every later one is silent.

        A later caller in another thread waits for the process to end; in the same thread (the
        SIGTERM handler interrupting the exit) it returns, and the interrupted exit goes on.
        """
        if not self._exit_lock.acquire(blocking=False):
            if self._exiting_thread == threading.get_ident():
                return
            threading.Event().wait()
        self._exiting_thread = threading.get_ident()
        if before is not None:
            before()
        who = f"rank {self.rank}" if self.rank >= 0 else f"pid {os.getpid()}"
        sys.stderr.write(f"[megatron_ring] {who}: {text}\n")
        sys.stderr.flush()
        if self.rank == 0:
            self._keep_store_up()
        os._exit(status)

    def _keep_store_up(self) -> None:
        """Wait until the peers on this host are gone, at most ``2 * interval_s`` (the full time with peers
        on other hosts): they may still have to read the verdict from the store this process hosts."""
        deadline = time.monotonic() + 2 * self.interval_s
        remote = any(host != self._host for host, _ in self._peers.values())
        while time.monotonic() < deadline:
            if not remote and all(_process_gone(pid) for _, pid in self._peers.values()):
                return
            time.sleep(0.01)
