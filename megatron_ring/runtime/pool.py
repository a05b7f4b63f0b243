"""Run functions on N CPU processes joined by a gloo process group on loopback.

:class:`GlooPool` keeps its processes (and their process group) alive between calls, so a test
suite pays the start-up (a torch import per process) once per world size::

    with GlooPool(4) as pool:
        outs = pool.run(my_module.worker_fn, arg)   # one result per rank, in rank order

Functions must be importable module-level callables. Each process sets
``torch.set_num_threads`` so that ranks do not oversubscribe the cores, and every wait has a
timeout: a rank that dies or hangs turns into a :class:`WorkerError`, never a hung test.
"""
from __future__ import annotations

import os
import queue
import random
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from megatron_ring.runtime.parent_watch import die_with_parent


class WorkerError(RuntimeError):
    """One or more ranks raised, died or timed out; the message holds each rank's traceback."""


def free_port() -> int:
    """A TCP port on loopback that is free right now, below the kernel's ephemeral range when it can be.

    Note [Picking a rendezvous port]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    The port is picked here and bound later by a launcher or a rank. A port from the ephemeral range
    (what binding port 0 gives) is also what every outgoing connection of the machine takes, gloo's
    among them, so a job starting beside another one could find its port taken in between:
    ``EADDRINUSE``. Ports below that range are never handed out to connections. So this takes a
    random free one there (checked by binding it), and port 0's answer only if none is found.
    """
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(64 if low > FIRST_PORT + 1024 else 0):
        port = draw.randrange(FIRST_PORT, low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


FIRST_PORT = 10000
"""The lowest port :func:`free_port` draws (above the well-known and most registered services' ports)."""


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux: ip_local_port_range; 32768 elsewhere)."""
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _worker(rank: int, world_size: int, port: int, timeout_s: float, threads: int,
            tasks: Any, results: Any, env: dict[str, str], setup: Callable[[], Any] | None, parent: int) -> None:
    die_with_parent(parent)  # Note [Orphaned ranks]
    os.environ.update(env)
    torch.set_num_threads(threads)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    if setup is not None:
        setup()
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # report everything, the parent decides
            results.put((rank, False, traceback.format_exc()))
    if dist.is_initialized():  # a task may have left torch.distributed itself
        dist.destroy_process_group()
    results.close()
    results.join_thread()  # every result is in the pipe
    os._exit(0)  # Note [A worker's exit]


# Note [A worker's exit]
# ~~~~~~~~~~~~~~~~~~~~~~
# A worker that has imported Megatron-core, DeepSpeed and transformers and trained with them spends
# 5-15 s in the interpreter's finalisation after its last task (in C, no Python frame: module and
# object teardown), so closing a pool of 4 such ranks took 15 s. Once the process group is gone and
# the results are flushed nothing is left to do, so the worker ends at once, as a forked
# multiprocessing child does.


class GlooPool:
    """``world_size`` processes in one gloo group, running submitted functions on every rank."""

    def __init__(self, world_size: int, *, timeout_s: float = 120.0, threads: int | None = None,
                 env: dict[str, str] | None = None, setup: Callable[[], Any] | None = None) -> None:
        """``threads``: torch threads per rank (default: the cores shared out); ``env``: set in each rank
        before anything runs; ``setup``: an importable function each rank calls once, after joining the
        process group and before the first task."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        cores = os.cpu_count() or 1
        threads = threads or max(1, cores // world_size)
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, timeout_s, threads, self._tasks[r], self._results, dict(env or {}),
                      setup, os.getpid()),
                daemon=True,
            )
            for r in range(world_size)
        ]
        try:
            for proc in self._procs:
                proc.start()
        except BaseException:  # a signal while starting: the ranks already started must not run on
            self.close(force=True)
            raise

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        for tasks in self._tasks:
            tasks.put((fn, args, kwargs))
        try:
            got = self._collect(fn.__name__, timeout_s or self.timeout_s)
        except BaseException:  # a timeout, a dead rank, or a signal while the ranks work: none may run on
            self.close(force=True)
            raise
        failed = {r: v for r, (ok, v) in got.items() if not ok}
        if failed:
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
            raise WorkerError(f"{fn.__name__} failed on ranks {sorted(failed)}:\n{text}")
        return [got[r][1] for r in range(self.world_size)]

    def _collect(self, name: str, timeout_s: float) -> dict[int, tuple[bool, Any]]:
        """Every rank's (ok, value) of the running call; WorkerError when a rank dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        got: dict[int, tuple[bool, Any]] = {}
        while len(got) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=0.5)
                got[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
            if dead or time.monotonic() > deadline:
                why = f"ranks {dead} died" if dead else f"timed out after {timeout_s:.0f}s"
                raise WorkerError(f"{name}: {why}; finished ranks: {sorted(got)}")
        return got

    def alive(self) -> bool:
        """Whether every worker process is still running."""
        return all(p.is_alive() for p in self._procs)

    def close(self, force: bool = False) -> None:
        """Stop the workers (``force`` kills them at once)."""
        for proc, tasks in zip(self._procs, self._tasks):
            if proc.is_alive() and not force:
                tasks.put(None)
        deadline = time.monotonic() + (0 if force else 10)
        for proc in self._procs:
            if proc.pid is None:  # never started
                continue
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)

    def __enter__(self) -> "GlooPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_gloo(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0, **kwargs: Any) -> list[Any]:
    """One-shot :class:`GlooPool`: start ``world_size`` ranks, run ``fn`` once, stop them."""
    with GlooPool(world_size, timeout_s=timeout_s) as pool:
        return pool.run(fn, *args, **kwargs)
