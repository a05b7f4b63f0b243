"""Rank 0's meeting point of the HTTP handlers (asyncio) and the serving loop (its own thread): :class:`Bridge`."""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass
from typing import Optional

from megatron_ring.serving.engine import GenRequest, Plan


class Busy(Exception):
    """The queue is full, or the server is draining: the request gets 503."""


@dataclass
class Event:
    """One token of a request (``token``), or its end (``finish``: stop, length, cancelled, error)."""

    token: Optional[int]
    finish: Optional[str]
    info: dict


class Sink:
    """Where a request's events go: an asyncio queue read by its handler, fed from the loop thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


class Bridge:
    """Requests waiting for the loop, cancellations, and each running request's sink."""

    def __init__(self, *, queue_limit: int, max_batch: int) -> None:
        self.queue_limit, self.max_batch = queue_limit, max_batch
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.pending: deque[GenRequest] = deque()
        self.cancels: list[str] = []
        self.sinks: dict[str, Sink] = {}
        self.draining = False
        self.stats: dict[str, int] = {}
        """The loop's figures after its last round (conversations cached, tokens, evictions, ...), for /health."""

    def submit(self, request: GenRequest, sink: Sink) -> None:
        with self.lock:
            if self.draining:
                raise Busy("the server is shutting down")
            if len(self.pending) >= self.queue_limit:
                raise Busy(f"{len(self.pending)} requests are waiting (queue_limit); try again later")
            self.pending.append(request)
            self.sinks[request.rid] = sink
        self.wake.set()

    def cancel(self, rid: str) -> None:
        """The client is gone: drop a waiting request, or cancel a running one in the next round."""
        with self.lock:
            if rid not in self.sinks:
                return
            waiting = [r for r in self.pending if r.rid == rid]
            if waiting:
                self.pending.remove(waiting[0])
                del self.sinks[rid]
            else:
                self.cancels.append(rid)
        self.wake.set()

    def drain(self) -> None:
        """Refuse new requests; the loop stops once the waiting and running ones are done."""
        with self.lock:
            self.draining = True
        self.wake.set()

    def next_plan(self, running: int, timeout: float) -> Plan:
        """The next round's plan; waits up to ``timeout`` for work when nothing runs."""
        if running == 0:
            self.wake.wait(timeout)
        with self.lock:
            self.wake.clear()
            room = max(0, self.max_batch - running)
            new = [self.pending.popleft() for _ in range(min(room, len(self.pending)))]
            cancels, self.cancels = self.cancels, []
            stop = self.draining and not self.pending and not new and running == 0
        return Plan(new=new, cancel=cancels, stop=stop)

    def emit(self, rid: str, token: Optional[int], finish: Optional[str], info: dict) -> None:
        with self.lock:
            sink = self.sinks.get(rid)
            if finish is not None:
                self.sinks.pop(rid, None)
        if sink is not None:
            sink.put(Event(token, finish, info))
